//! HTTP bearer-token authentication: the configured tokens with their scopes, and the
//! middleware that checks each request against the scope its route needs.
//!
//! Tokens come from `--auth-tokens-file` and/or `--auth-tokens`, one `<token> <scopes>` entry
//! per line (or per `;` inline). Only SHA-256 digests of the tokens are kept, and a presented
//! token is compared with every one of them in constant time, so neither timing nor memory
//! tells which token (or which prefix) came close. Tokens never reach a log or an error.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use subtle::{ConditionallySelectable, ConstantTimeEq};

use crate::config::Config;
use crate::error::Error;

/// What a token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// `POST /fetch`.
    Fetch,
    /// Every `POST /messages/…` settle and extension.
    Settle,
    /// `POST /publish`.
    Publish,
    /// `GET /consumer` and `GET /metrics`.
    Admin,
}

impl Scope {
    const ALL: [Self; 4] = [Self::Fetch, Self::Settle, Self::Publish, Self::Admin];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Fetch => "fetch",
            Self::Settle => "settle",
            Self::Publish => "publish",
            Self::Admin => "admin",
        }
    }

    fn bit(self) -> u8 {
        1 << (self as u8)
    }
}

/// What a request needs before it reaches its handler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Requirement {
    /// Health, readiness and the API description: nothing secret, and probes carry no token.
    Open,
    /// A valid token with this scope.
    Scope(Scope),
    /// Any valid token (paths that name no endpoint: a stranger learns nothing from a 404).
    Authenticated,
}

/// The requirement of a path. By path rather than by route, so that a route added later
/// under a protected prefix (e.g. `/metrics`) is protected without touching this module.
pub fn requirement(path: &str) -> Requirement {
    match path {
        "/healthz" | "/readyz" | "/openapi.json" => Requirement::Open,
        "/docs" => Requirement::Open,
        _ if path.starts_with("/docs/") => Requirement::Open,
        "/fetch" => Requirement::Scope(Scope::Fetch),
        "/messages" => Requirement::Scope(Scope::Settle),
        _ if path.starts_with("/messages/") => Requirement::Scope(Scope::Settle),
        "/publish" => Requirement::Scope(Scope::Publish),
        "/consumer" | "/metrics" => Requirement::Scope(Scope::Admin),
        _ => Requirement::Authenticated,
    }
}

/// One configured token: its digest, scopes, and the fetches it has waiting.
pub struct TokenEntry {
    digest: [u8; 32],
    scopes: u8,
    /// Where it was configured (`file:3`, `inline:2`): names it in logs without revealing it.
    pub origin: String,
    waiting_fetches: AtomicUsize,
}

impl TokenEntry {
    pub fn allows(&self, scope: Scope) -> bool {
        self.scopes & scope.bit() != 0
    }

    /// Count one more waiting fetch for this token, unless it already has `limit`.
    pub fn begin_fetch(self: &Arc<Self>, limit: usize) -> Result<WaitingFetch, Error> {
        let before = self.waiting_fetches.fetch_add(1, Ordering::AcqRel);
        if before >= limit {
            self.waiting_fetches.fetch_sub(1, Ordering::AcqRel);
            return Err(Error::TooManyWaitingFetches {
                limit,
                retry_after: Duration::from_secs(1),
            });
        }
        Ok(WaitingFetch(self.clone()))
    }
}

/// A fetch counted against its token until dropped.
pub struct WaitingFetch(Arc<TokenEntry>);

impl Drop for WaitingFetch {
    fn drop(&mut self) {
        self.0.waiting_fetches.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The caller a request was authenticated as; handlers find it in the request extensions.
#[derive(Clone)]
pub struct Principal(pub Arc<TokenEntry>);

/// The configured tokens; `None` inside [`Auth`] means authentication is off.
pub struct Tokens {
    entries: Vec<Arc<TokenEntry>>,
}

impl Tokens {
    /// Parse entries: `<token> <scope>[,<scope>…]` per line (`;` also separates entries),
    /// blank lines and `#` comments ignored. Errors name the entry by `source:number`, never
    /// by its token.
    pub fn parse(text: &str, source: &str, separators: &[char]) -> Result<Self, String> {
        let mut entries = Vec::new();
        for (index, line) in text.split(separators).enumerate() {
            let origin = format!("{source}:{}", index + 1);
            let line = line.split('#').next().unwrap_or_default().trim();
            if line.is_empty() {
                continue;
            }
            let mut words = line.split_whitespace();
            let token = words.next().unwrap_or_default();
            let scopes = words.collect::<Vec<_>>().join("");
            if !is_b64token(token) {
                return Err(format!(
                    "{origin}: a token may hold only letters, digits and -._~+/ (then =)"
                ));
            }
            if scopes.is_empty() {
                return Err(format!(
                    "{origin}: no scopes after the token (expected fetch, settle, publish, admin or *)"
                ));
            }
            let mut bits = 0u8;
            for scope in scopes.split(',').filter(|scope| !scope.is_empty()) {
                bits |= match scope {
                    "*" => Scope::ALL.iter().fold(0, |bits, scope| bits | scope.bit()),
                    _ => Scope::ALL
                        .iter()
                        .find(|known| known.as_str() == scope)
                        .map(|known| known.bit())
                        .ok_or_else(|| {
                            format!(
                                "{origin}: unknown scope {scope:?} (expected fetch, settle, publish, admin or *)"
                            )
                        })?,
                };
            }
            entries.push(Arc::new(TokenEntry {
                digest: Sha256::digest(token.as_bytes()).into(),
                scopes: bits,
                origin,
                waiting_fetches: AtomicUsize::new(0),
            }));
        }
        Ok(Self { entries })
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The entry of a presented token. Looks at every entry whatever matches, comparing
    /// fixed-size digests in constant time.
    pub fn authenticate(&self, presented: &str) -> Option<Arc<TokenEntry>> {
        let digest: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
        let mut found = u32::MAX;
        for (index, entry) in self.entries.iter().enumerate() {
            let index = u32::try_from(index).unwrap_or(u32::MAX);
            found.conditional_assign(&index, digest.ct_eq(&entry.digest));
        }
        self.entries.get(found as usize).cloned()
    }
}

/// RFC 6750 `b64token`: what may follow `Bearer ` in an Authorization header.
fn is_b64token(token: &str) -> bool {
    let body = token.trim_end_matches('=');
    !body.is_empty()
        && body
            .bytes()
            .all(|byte| byte.is_ascii_alphanumeric() || b"-._~+/".contains(&byte))
}

/// Authentication settings for the HTTP layer.
#[derive(Clone)]
pub struct Auth {
    tokens: Option<Arc<Tokens>>,
}

impl Auth {
    /// No authentication: every request is let through.
    pub fn off() -> Self {
        Self { tokens: None }
    }

    pub fn with_tokens(tokens: Tokens) -> Self {
        Self {
            tokens: Some(Arc::new(tokens)),
        }
    }

    pub fn is_on(&self) -> bool {
        self.tokens.is_some()
    }

    /// Load the token sources the configuration names; off when it names none.
    pub fn from_config(config: &Config) -> anyhow::Result<Self> {
        if config.auth_tokens_file.is_none() && config.auth_tokens.is_none() {
            return Ok(Self::off());
        }
        let mut entries = Vec::new();
        if let Some(path) = &config.auth_tokens_file {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading --auth-tokens-file {}", path.display()))?;
            let tokens = Tokens::parse(&text, &path.display().to_string(), &['\n'])
                .map_err(|why| anyhow::anyhow!("--auth-tokens-file {why}"))?;
            entries.extend(tokens.entries);
        }
        if let Some(inline) = &config.auth_tokens {
            let tokens = Tokens::parse(inline.expose(), "RUSTSTREAM_AUTH_TOKENS", &[';', '\n'])
                .map_err(|why| anyhow::anyhow!("--auth-tokens {why}"))?;
            entries.extend(tokens.entries);
        }
        if entries.is_empty() {
            anyhow::bail!(
                "authentication is configured but names no token: every request would be refused"
            );
        }
        Ok(Self::with_tokens(Tokens { entries }))
    }

    /// Check a request's token against what its path requires.
    fn check(&self, request: &Request) -> Result<Option<Principal>, Error> {
        let Some(tokens) = &self.tokens else {
            return Ok(None);
        };
        let needed = requirement(request.uri().path());
        if needed == Requirement::Open {
            return Ok(None);
        }
        let mut values = request.headers().get_all(header::AUTHORIZATION).iter();
        let (Some(value), None) = (values.next(), values.next()) else {
            // None, or several (ambiguous: refuse rather than pick one).
            let several = request.headers().contains_key(header::AUTHORIZATION);
            return Err(Error::Unauthorized { invalid: several });
        };
        let presented = value
            .to_str()
            .ok()
            .and_then(|value| value.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim());
        let Some(presented) = presented else {
            return Err(Error::Unauthorized { invalid: false });
        };
        let entry = tokens
            .authenticate(presented)
            .ok_or(Error::Unauthorized { invalid: true })?;
        if let Requirement::Scope(scope) = needed
            && !entry.allows(scope)
        {
            return Err(Error::Forbidden {
                scope: scope.as_str(),
            });
        }
        Ok(Some(Principal(entry)))
    }
}

/// Middleware: refuse (401/403) before the handler or the body is touched; hand the
/// authenticated caller to the handler as a [`Principal`] extension.
pub async fn authenticate(State(auth): State<Auth>, mut request: Request, next: Next) -> Response {
    match auth.check(&request) {
        Ok(principal) => {
            if let Some(principal) = principal {
                request.extensions_mut().insert(principal);
            }
            next.run(request).await
        }
        Err(err) => err.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(text: &str) -> Tokens {
        Tokens::parse(text, "test", &['\n', ';']).expect("parses")
    }

    #[test]
    fn parses_entries_comments_and_wildcards() {
        let tokens = tokens(
            "# operators\nworker-token-1 fetch,settle\n\n ops-token admin # dashboards\nroot *; pub publish",
        );
        assert_eq!(tokens.len(), 4);
        let worker = tokens.authenticate("worker-token-1").expect("known");
        assert!(worker.allows(Scope::Fetch) && worker.allows(Scope::Settle));
        assert!(!worker.allows(Scope::Admin) && !worker.allows(Scope::Publish));
        let ops = tokens.authenticate("ops-token").expect("known");
        assert!(ops.allows(Scope::Admin) && !ops.allows(Scope::Fetch));
        let root = tokens.authenticate("root").expect("known");
        assert!(Scope::ALL.iter().all(|scope| root.allows(*scope)));
        assert!(
            tokens
                .authenticate("pub")
                .expect("known")
                .allows(Scope::Publish)
        );
        assert!(
            tokens.authenticate("worker-token").is_none(),
            "a prefix is not the token"
        );
        assert!(tokens.authenticate("").is_none());
    }

    #[test]
    fn errors_name_the_line_never_the_token() {
        for (text, line) in [
            ("good fetch\nsecret-one fech", "test:2"),
            ("secret-two", "test:1"),
            ("secret\"three fetch", "test:1"),
        ] {
            let err = Tokens::parse(text, "test", &['\n']).err().expect("refused");
            assert!(err.starts_with(line), "{err}");
            assert!(!err.contains("secret"), "the error shows the token: {err}");
        }
    }

    #[test]
    fn paths_map_to_scopes() {
        assert_eq!(requirement("/healthz"), Requirement::Open);
        assert_eq!(requirement("/docs/index.html"), Requirement::Open);
        assert_eq!(requirement("/fetch"), Requirement::Scope(Scope::Fetch));
        assert_eq!(
            requirement("/messages/abc/ack"),
            Requirement::Scope(Scope::Settle)
        );
        assert_eq!(
            requirement("/messages/ack"),
            Requirement::Scope(Scope::Settle)
        );
        assert_eq!(requirement("/publish"), Requirement::Scope(Scope::Publish));
        assert_eq!(requirement("/metrics"), Requirement::Scope(Scope::Admin));
        assert_eq!(requirement("/consumer"), Requirement::Scope(Scope::Admin));
        assert_eq!(requirement("/healthz/x"), Requirement::Authenticated);
        assert_eq!(requirement("/docsx"), Requirement::Authenticated);
    }
}
