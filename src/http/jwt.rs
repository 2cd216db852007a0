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
//! May import: as the rest of `http`.

use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError, RwLock, Weak};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{Request, StatusCode, Uri, header};
use hyper_util::rt::TokioIo;
use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, KeyAlgorithm, PublicKeyUse};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde_json::Value;
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls;
use tracing::{debug, info, warn};

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
/// The whole of one JWKS fetch: connect, TLS, request and body.
const FETCH_TIMEOUT: Duration = Duration::from_secs(3);
/// Largest JWKS read: a set of a few keys is a few KiB.
const MAX_JWKS_BYTES: usize = 1024 * 1024;
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

/// One signing key, usable for exactly one algorithm.
struct Key {
    kid: Option<String>,
    algorithm: Algorithm,
    decoding: DecodingKey,
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

fn read_file(path: &Path) -> Result<Vec<Arc<Key>>, String> {
    let bytes = std::fs::read(path).map_err(|err| err.to_string())?;
    parse_jwks(&bytes)
}

/// The usable keys of a JWKS document. Keys the gateway cannot use (encryption keys, other
/// curves, symmetric keys) are skipped, so an issuer's full set still loads; a set with no
/// usable key at all is an error.
fn parse_jwks(bytes: &[u8]) -> Result<Vec<Arc<Key>>, String> {
    let document: Value =
        serde_json::from_slice(bytes).map_err(|err| format!("not a JWKS: {err}"))?;
    let Some(Value::Array(entries)) = document.get("keys") else {
        return Err("not a JWKS: no \"keys\" array".into());
    };
    let mut keys = Vec::new();
    for (index, entry) in entries.iter().enumerate() {
        let parsed = serde_json::from_value::<Jwk>(entry.clone())
            .map_err(|err| err.to_string())
            .and_then(|jwk| usable_key(&jwk));
        match parsed {
            Ok(key) => keys.push(Arc::new(key)),
            Err(why) => debug!(index, %why, "JWKS key skipped"),
        }
    }
    if keys.is_empty() {
        return Err(format!(
            "no RS256, ES256 or EdDSA signing key among its {} keys",
            entries.len()
        ));
    }
    Ok(keys)
}

/// A JWK as a key for the one algorithm its type implies (and its `alg`, if any, names).
fn usable_key(jwk: &Jwk) -> Result<Key, String> {
    if let Some(usage) = &jwk.common.public_key_use
        && *usage != PublicKeyUse::Signature
    {
        return Err("not a signing key (`use`)".into());
    }
    let algorithm = match &jwk.algorithm {
        AlgorithmParameters::RSA(_) => Algorithm::RS256,
        AlgorithmParameters::EllipticCurve(params) if params.curve == EllipticCurve::P256 => {
            Algorithm::ES256
        }
        AlgorithmParameters::OctetKeyPair(params) if params.curve == EllipticCurve::Ed25519 => {
            Algorithm::EdDSA
        }
        AlgorithmParameters::OctetKey(_) => {
            return Err("a symmetric key: HMAC tokens are not accepted".into());
        }
        _ => return Err("a key type or curve other than RSA, P-256 and Ed25519".into()),
    };
    if let Some(declared) = jwk.common.key_algorithm {
        let agrees = matches!(
            (declared, algorithm),
            (KeyAlgorithm::RS256, Algorithm::RS256)
                | (KeyAlgorithm::ES256, Algorithm::ES256)
                | (KeyAlgorithm::EdDSA, Algorithm::EdDSA)
        );
        if !agrees {
            return Err(format!("a key for {declared:?}"));
        }
    }
    let decoding = DecodingKey::from_jwk(jwk).map_err(|err| format!("unusable key: {err}"))?;
    Ok(Key {
        kid: jwk.common.key_id.clone(),
        algorithm,
        decoding,
    })
}

/// `--auth-jwks-url`, ready to fetch: one GET over a fresh HTTP/1.1 connection per read
/// (every few minutes: no pool needed), TLS for `https` against the system's roots.
/// Redirects are not followed and no proxy is used.
struct JwksUrl {
    shown: String,
    uri: Uri,
    host: String,
    port: u16,
    tls: Option<TlsConnector>,
}

impl JwksUrl {
    fn parse(text: &str) -> anyhow::Result<Self> {
        let refused = |why: &str| anyhow::anyhow!("--auth-jwks-url {text}: {why}");
        let uri: Uri = text.parse().map_err(|_| refused("not a URL"))?;
        let https = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => return Err(refused("must be an http:// or https:// URL")),
        };
        let host = uri
            .host()
            .filter(|host| !host.is_empty())
            .ok_or_else(|| refused("has no host"))?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
        let tls = if https {
            Some(tls_connector().map_err(|why| refused(&why))?)
        } else {
            None
        };
        Ok(Self {
            shown: text.to_owned(),
            uri,
            host,
            port,
            tls,
        })
    }

    async fn fetch(&self) -> Result<Bytes, String> {
        tokio::time::timeout(FETCH_TIMEOUT, self.get())
            .await
            .map_err(|_| format!("no answer within {}s", FETCH_TIMEOUT.as_secs()))?
    }

    async fn get(&self) -> Result<Bytes, String> {
        let tcp = TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(|err| format!("connecting: {err}"))?;
        match &self.tls {
            Some(tls) => {
                let name = rustls::pki_types::ServerName::try_from(self.host.clone())
                    .map_err(|err| format!("TLS server name: {err}"))?;
                let stream = tls
                    .connect(name, tcp)
                    .await
                    .map_err(|err| format!("TLS: {err}"))?;
                self.exchange(TokioIo::new(stream)).await
            }
            None => self.exchange(TokioIo::new(tcp)).await,
        }
    }

    async fn exchange<I>(&self, io: I) -> Result<Bytes, String>
    where
        I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    {
        let (mut sender, connection) = hyper::client::conn::http1::handshake::<_, Body>(io)
            .await
            .map_err(|err| format!("HTTP: {err}"))?;
        // Drives the connection; dropped (and the socket closed) with this read.
        let _connection = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(connection));
        let target = self
            .uri
            .path_and_query()
            .map_or("/", |target| target.as_str());
        let host = match self.uri.port() {
            Some(port) => format!("{}:{port}", self.uri.host().unwrap_or_default()),
            None => self.uri.host().unwrap_or_default().to_owned(),
        };
        let request = Request::get(target)
            .header(header::HOST, host)
            .header(header::ACCEPT, "application/jwk-set+json, application/json")
            .header(
                header::USER_AGENT,
                concat!("ruststream-nats/", env!("CARGO_PKG_VERSION")),
            )
            .body(Body::empty())
            .map_err(|err| format!("building the request: {err}"))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|err| format!("HTTP: {err}"))?;
        if response.status() != StatusCode::OK {
            return Err(format!("answered {}", response.status()));
        }
        axum::body::to_bytes(Body::new(response.into_body()), MAX_JWKS_BYTES)
            .await
            .map_err(|err| format!("reading the answer: {err}"))
    }
}

/// TLS for an `https` JWKS URL: the system's roots ([`crate::tls_client`]); none is an error.
fn tls_connector() -> Result<TlsConnector, String> {
    let (config, roots) = crate::tls_client::config()?;
    if roots == 0 {
        return Err("no system root certificates to verify it with".into());
    }
    Ok(TlsConnector::from(Arc::new(config)))
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

    #[test]
    fn only_asymmetric_signing_keys_load() {
        let jwks = serde_json::json!({"keys": [
            {"kty": "oct", "k": "c2VjcmV0LXNlY3JldC1zZWNyZXQ", "kid": "hmac"},
            {"kty": "RSA", "use": "enc", "kid": "enc", "n": "AQAB", "e": "AQAB"},
            {"kty": "RSA", "alg": "PS256", "kid": "pss", "n": "AQAB", "e": "AQAB"},
            {"kty": "OKP", "crv": "Ed25519", "kid": "ed", "x": "11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"},
            {"kty": "whatever"},
        ]});
        let keys = parse_jwks(jwks.to_string().as_bytes()).expect("one usable key");
        assert_eq!(keys.len(), 1);
        assert_eq!(keys[0].kid.as_deref(), Some("ed"));
        assert_eq!(keys[0].algorithm, Algorithm::EdDSA);
        let none = serde_json::json!({"keys": [{"kty": "oct", "k": "c2VjcmV0"}]});
        assert!(parse_jwks(none.to_string().as_bytes()).is_err());
        assert!(parse_jwks(b"{\"key\": []}").is_err());
        assert!(parse_jwks(b"not json").is_err());
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

    #[test]
    fn jwks_urls_are_http_or_https_with_a_host() {
        let url = JwksUrl::parse("http://127.0.0.1:9000/keys?x=1").expect("parses");
        assert_eq!((url.host.as_str(), url.port), ("127.0.0.1", 9000));
        assert!(url.tls.is_none());
        let url = JwksUrl::parse("http://[::1]/jwks").expect("parses");
        assert_eq!((url.host.as_str(), url.port), ("::1", 80));
        for bad in ["ftp://host/keys", "/keys", "http:///keys", "not a url"] {
            let err = JwksUrl::parse(bad).err().expect("refused").to_string();
            assert!(err.starts_with("--auth-jwks-url"), "{err}");
        }
    }
}
