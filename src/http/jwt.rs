//! JWT bearer tokens (OIDC): the issuer's signing keys from a JWKS file and/or URL, kept
//! fresh, and the check of a presented token — algorithm, signature, time, issuer,
//! audience — into the caller's subject and scopes.
//!
//! Only RS256, ES256 and EdDSA are accepted, each key for the one algorithm its type implies,
//! so neither `alg: none` nor an HMAC token "signed" with a public key can pass. Keys are
//! re-read every 5 minutes, and when a token names a key id the set lacks (the issuer rotated
//! its keys) — that at most once per 30 s, so tokens with made-up key ids cannot turn the
//! gateway into a flood against the identity provider. Tokens never reach a log.
//!
//! Reading and vetting a JWKS document, from a file or a URL, is [`jwks`]'s.
//!
//! May import: as the rest of `http`.

mod jwks;

use std::path::PathBuf;
use std::sync::{Arc, PoisonError, RwLock, Weak};
use std::time::Duration;

use jsonwebtoken::{Algorithm, Validation};
use serde_json::Value;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use jwks::{JwksUrl, Key, parse_jwks, read_file};

use super::scopes::Grants;
use crate::config::Config;

/// How often the keys are re-read.
const REFRESH_EVERY: Duration = Duration::from_secs(5 * 60);
/// After a failed read, the next one comes sooner: the keys may be missing a new one.
const RETRY_AFTER_FAILURE: Duration = Duration::from_secs(30);
/// Least time between two reads caused by tokens naming an unknown key id.
pub(crate) const UNKNOWN_KID_INTERVAL: Duration = Duration::from_secs(30);
/// The longest a request waits for the JWKS to be read again.
const REQUEST_WAIT_MAX: Duration = Duration::from_secs(1);
/// Clock skew tolerated on `exp` and `nbf`, in seconds.
const LEEWAY_SECS: u64 = 30;
/// The algorithms a token may use; HMAC (a shared secret) has no place beside public keys.
const ACCEPTED: [Algorithm; 3] = [Algorithm::RS256, Algorithm::ES256, Algorithm::EdDSA];

/// What a valid token says about its caller.
pub(crate) struct Verified {
    pub(crate) subject: String,
    pub(crate) issuer: Option<String>,
    pub(crate) grants: Grants,
    /// `exp`, in Unix seconds: what it allows ends then (an open stream too).
    pub(crate) expires_at: Option<i64>,
}

/// The keys in use, per source: a failed read of one source keeps that source's keys.
#[derive(Default)]
struct Keys {
    file: Vec<Arc<Key>>,
    url: Vec<Arc<Key>>,
}

/// JWT verification: the key sources, the keys read from them, and what a token must claim.
pub(crate) struct Jwt {
    file: Option<PathBuf>,
    url: Option<JwksUrl>,
    /// A std lock: held only to copy out or swap key lists, never across an await.
    keys: RwLock<Keys>,
    /// When a token with an unknown key id last caused a read. An async lock, so requests
    /// that meet the same new key id while its read runs wait for that one read.
    unknown_kid_read: tokio::sync::Mutex<Option<Instant>>,
    issuer: Option<String>,
    audience: String,
    scope_claim: String,
    scope_prefix: Option<String>,
}

impl Jwt {
    /// The JWT settings of `config`, keys read; `None` when no JWKS is configured. A JWKS
    /// file that cannot be read, or holds no usable key, refuses the start; an unreachable
    /// URL does not (the identity provider may be starting too): its keys are retried.
    pub(crate) async fn from_config(config: &Config) -> anyhow::Result<Option<Arc<Self>>> {
        if config.auth_jwks_file.is_none() && config.auth_jwks_url.is_none() {
            if config.auth_jwt_issuer.is_some()
                || config.auth_jwt_audience.is_some()
                || config.auth_jwt_scope_prefix.is_some()
            {
                anyhow::bail!(
                    "--auth-jwt-issuer, --auth-jwt-audience and --auth-jwt-scope-prefix need \
                     --auth-jwks-file or --auth-jwks-url"
                );
            }
            return Ok(None);
        }
        let Some(audience) = config.auth_jwt_audience.clone() else {
            anyhow::bail!(
                "--auth-jwks-file/--auth-jwks-url need --auth-jwt-audience: without it a token \
                 the issuer made for any other service would be accepted"
            );
        };
        let url = config
            .auth_jwks_url
            .as_deref()
            .map(JwksUrl::parse)
            .transpose()?;
        let jwt = Self {
            file: config.auth_jwks_file.clone(),
            url,
            keys: RwLock::default(),
            unknown_kid_read: tokio::sync::Mutex::new(None),
            issuer: config.auth_jwt_issuer.clone(),
            audience,
            scope_claim: config.auth_jwt_scope_claim.clone(),
            scope_prefix: config.auth_jwt_scope_prefix.clone(),
        };
        if let Some(path) = &jwt.file {
            let keys = read_file(path)
                .map_err(|why| anyhow::anyhow!("--auth-jwks-file {}: {why}", path.display()))?;
            info!(path = %path.display(), keys = keys.len(), "JWKS file read");
            jwt.keys_mut().file = keys;
        }
        // The URL is read in the background, the first time at once: a JWKS server that
        // accepts and never answers must not hold the gateway's start (nor its readiness).
        let jwt = Arc::new(jwt);
        tokio::spawn(refresh(Arc::downgrade(&jwt)));
        Ok(Some(jwt))
    }

    /// Check a presented token. The error says why for the debug log; it never holds the
    /// token (nor anything the token's unverified parts say).
    pub(crate) async fn verify(&self, token: &str) -> Result<Verified, String> {
        let header =
            jsonwebtoken::decode_header(token).map_err(|err| format!("unreadable JWT: {err}"))?;
        // `alg: none` does not get here: the crate knows no such algorithm.
        if !ACCEPTED.contains(&header.alg) {
            return Err(format!("algorithm {:?} is not accepted", header.alg));
        }
        let kid = header.kid.as_deref();
        let mut candidates = self.candidates(kid, header.alg);
        if candidates.is_empty() && self.read_for_unknown_kid(kid, header.alg).await {
            candidates = self.candidates(kid, header.alg);
        }
        if candidates.is_empty() {
            return Err(format!(
                "no {:?} key{} in the JWKS",
                header.alg,
                if kid.is_some() {
                    " with its key id"
                } else {
                    ""
                }
            ));
        }
        let mut refusal = String::new();
        for key in candidates {
            match jsonwebtoken::decode::<Value>(
                token,
                &key.decoding,
                &self.validation(key.algorithm),
            ) {
                Ok(data) => return self.claims(&data.claims),
                Err(err) => refusal = err.to_string(),
            }
        }
        Err(refusal)
    }

    /// What every token must satisfy, for the algorithm of the key that checks it.
    fn validation(&self, algorithm: Algorithm) -> Validation {
        let mut validation = Validation::new(algorithm);
        validation.leeway = LEEWAY_SECS;
        validation.validate_nbf = true;
        validation.set_audience(&[&self.audience]);
        let mut required = vec!["exp", "aud", "sub"];
        if let Some(issuer) = &self.issuer {
            validation.set_issuer(&[issuer]);
            required.push("iss");
        }
        validation.set_required_spec_claims(&required);
        validation
    }

    fn claims(&self, claims: &Value) -> Result<Verified, String> {
        let subject = claims
            .get("sub")
            .and_then(Value::as_str)
            .filter(|subject| !subject.is_empty())
            .ok_or("the token has no `sub`")?;
        Ok(Verified {
            subject: subject.to_owned(),
            issuer: claims.get("iss").and_then(Value::as_str).map(str::to_owned),
            grants: self.scopes(claims.get(&self.scope_claim)),
            expires_at: claims.get("exp").and_then(Value::as_i64),
        })
    }

    /// The scopes a claim grants: a space-separated string or an array of strings. Values
    /// that are not ours (`openid`, another API's scopes) are ignored, not refused.
    fn scopes(&self, claim: Option<&Value>) -> Grants {
        let values: Vec<&str> = match claim {
            Some(Value::String(text)) => text.split_whitespace().collect(),
            Some(Value::Array(items)) => items.iter().filter_map(Value::as_str).collect(),
            _ => Vec::new(),
        };
        let mut grants = Grants::default();
        for value in values {
            let value = match &self.scope_prefix {
                Some(prefix) => match value.strip_prefix(prefix.as_str()) {
                    Some(value) => value,
                    None => continue,
                },
                None => value,
            };
            // Not ours (or malformed): ignored, as a foreign scope is.
            let _ = grants.grant(value);
        }
        grants
    }

    /// The keys that may have signed a token of `algorithm` naming `kid` (any such key
    /// when it names none).
    fn candidates(&self, kid: Option<&str>, algorithm: Algorithm) -> Vec<Arc<Key>> {
        let keys = self.keys.read().unwrap_or_else(PoisonError::into_inner);
        keys.file
            .iter()
            .chain(&keys.url)
            .filter(|key| key.algorithm == algorithm)
            .filter(|key| kid.is_none() || key.kid.as_deref() == kid)
            .cloned()
            .collect()
    }

    fn keys_mut(&self) -> std::sync::RwLockWriteGuard<'_, Keys> {
        self.keys.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// Re-read the keys for a token naming a key id they lack (or, naming none, finding
    /// no key at all), unless such a read happened in the last [`UNKNOWN_KID_INTERVAL`]; the
    /// request waits for it [`REQUEST_WAIT_MAX`] at most. True when a key is known now.
    async fn read_for_unknown_kid(&self, kid: Option<&str>, algorithm: Algorithm) -> bool {
        let read = async {
            let mut last = self.unknown_kid_read.lock().await;
            // A read that ran while this request waited for the lock may have brought it.
            if !self.candidates(kid, algorithm).is_empty() {
                return;
            }
            if last.is_some_and(|at| at.elapsed() < UNKNOWN_KID_INTERVAL) {
                return;
            }
            *last = Some(Instant::now());
            debug!("a token names a key the JWKS lacks: reading it again");
            self.reload().await;
        };
        // Given up after that: the background refresh goes on reading.
        let _ = tokio::time::timeout(REQUEST_WAIT_MAX, read).await;
        !self.candidates(kid, algorithm).is_empty()
    }

    /// Read every source again; a source that fails keeps its keys. True when all succeeded.
    pub(crate) async fn reload(&self) -> bool {
        let mut healthy = true;
        if let Some(path) = &self.file {
            match read_file(path) {
                Ok(keys) => self.keys_mut().file = keys,
                Err(why) => {
                    healthy = false;
                    warn!(path = %path.display(), %why, "cannot re-read the JWKS file; keeping its previous keys");
                }
            }
        }
        if let Some(url) = &self.url {
            healthy &= self.read_url(url).await;
        }
        healthy
    }

    async fn read_url(&self, url: &JwksUrl) -> bool {
        match url.fetch().await.and_then(|body| parse_jwks(&body)) {
            Ok(keys) => {
                debug!(url = %url.shown, keys = keys.len(), "JWKS fetched");
                self.keys_mut().url = keys;
                true
            }
            Err(why) => {
                let kept = self.keys.read().map_or(0, |keys| keys.url.len());
                warn!(url = %url.shown, %why, kept, "cannot fetch the JWKS; keeping the keys read before (retrying in 30s)");
                false
            }
        }
    }
}

/// Re-read the keys every [`REFRESH_EVERY`] (sooner after a failure) while the gateway
/// that owns them lives.
async fn refresh(jwt: Weak<Jwt>) {
    // The first read at once, under the lock of reads for unknown key ids: the first
    // requests wait for it (a second at most) instead of reading again beside it.
    let Some(first) = jwt.upgrade() else { return };
    let mut wait = {
        let _reading = first.unknown_kid_read.lock().await;
        if first.reload().await {
            REFRESH_EVERY
        } else {
            RETRY_AFTER_FAILURE
        }
    };
    drop(first);
    loop {
        tokio::time::sleep(wait).await;
        let Some(jwt) = jwt.upgrade() else { return };
        wait = if jwt.reload().await {
            REFRESH_EVERY
        } else {
            RETRY_AFTER_FAILURE
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::consumers::ConsumerName;
    use crate::http::scopes::Scope;

    fn jwt(prefix: Option<&str>) -> Jwt {
        Jwt {
            file: None,
            url: None,
            keys: RwLock::default(),
            unknown_kid_read: tokio::sync::Mutex::new(None),
            issuer: None,
            audience: "gateway".into(),
            scope_claim: "scope".into(),
            scope_prefix: prefix.map(str::to_owned),
        }
    }

    #[test]
    fn scopes_come_from_a_string_or_an_array_and_ignore_foreign_values() {
        let plain = jwt(None);
        let scopes = plain.scopes(Some(&Value::from("openid fetch  settle profile")));
        assert!(scopes.allows(Scope::Fetch) && scopes.allows(Scope::Settle));
        assert!(!scopes.allows(Scope::Admin) && !scopes.allows(Scope::Publish));
        let scopes = plain.scopes(Some(&serde_json::json!(["admin", 7, "email"])));
        assert!(scopes.allows(Scope::Admin) && scopes.allows(Scope::Publish));
        assert!(!scopes.allows(Scope::Fetch));
        assert!(!plain.scopes(Some(&Value::from(5))).allows(Scope::Fetch));
        assert!(!plain.scopes(None).allows(Scope::Fetch));

        let prefixed = jwt(Some("ruststream:"));
        let scopes = prefixed.scopes(Some(&Value::from("fetch ruststream:settle")));
        assert!(scopes.allows(Scope::Settle) && !scopes.allows(Scope::Fetch));
        let scopes = prefixed.scopes(Some(&Value::from("ruststream:*")));
        assert!(
            [Scope::Fetch, Scope::Settle, Scope::Publish, Scope::Admin]
                .iter()
                .all(|scope| scopes.allows(*scope))
        );

        // Scoped to consumers, after the prefix; a malformed one is ignored like a foreign one.
        let scopes = prefixed.scopes(Some(&Value::from(
            "ruststream:fetch:ORDERS/* ruststream:settle:ORDERS/shipping ruststream:fetch:bad",
        )));
        let shipping = ConsumerName::new("ORDERS", "shipping");
        let other = ConsumerName::new("EVENTS", "shipping");
        assert!(scopes.allows_on(Scope::Fetch, &shipping));
        assert!(!scopes.allows_on(Scope::Fetch, &other));
        assert!(scopes.allows_on(Scope::Settle, &shipping));
        assert!(!scopes.allows_on(Scope::Settle, &ConsumerName::new("ORDERS", "billing")));
        assert!(!scopes.allows(Scope::Fetch), "not on every consumer");
    }

    #[tokio::test(start_paused = true)]
    async fn unknown_key_ids_cause_at_most_one_read_per_interval() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("jwks.json");
        std::fs::write(&path, r#"{"keys": []}"#).expect("write");
        let mut jwt = jwt(None);
        jwt.file = Some(path.clone());
        let ed = |kid: &str| {
            serde_json::json!({"kty": "OKP", "crv": "Ed25519", "kid": kid,
                "x": "11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"})
        };
        let write = |kids: &[&str]| {
            let keys: Vec<Value> = kids.iter().map(|kid| ed(kid)).collect();
            std::fs::write(&path, serde_json::json!({ "keys": keys }).to_string()).expect("write");
        };
        write(&["a"]);
        assert!(
            jwt.read_for_unknown_kid(Some("a"), Algorithm::EdDSA).await,
            "read"
        );
        write(&["a", "b"]);
        assert!(
            !jwt.read_for_unknown_kid(Some("b"), Algorithm::EdDSA).await,
            "within the interval: no read"
        );
        tokio::time::advance(UNKNOWN_KID_INTERVAL).await;
        assert!(
            jwt.read_for_unknown_kid(Some("b"), Algorithm::EdDSA).await,
            "read again"
        );
        assert!(!jwt.read_for_unknown_kid(Some("c"), Algorithm::EdDSA).await);
    }
}
