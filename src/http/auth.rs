//! HTTP bearer-token authentication: the configured static tokens with their scopes (read in
//! [`super::tokens`]), JWTs (see [`super::jwt`]), stream tickets presented on a stream's
//! opening (issued by `POST /stream-tickets`), and the middleware that checks each request
//! against the scope its route needs — and what ends an open stream once its token no
//! longer allows it. Who a request turns out to be is a [`Principal`].
//!
//! Only SHA-256 digests of the static tokens are kept, and a presented token is compared
//! with every one of them in constant time, so neither timing nor memory tells which token
//! (or which prefix) came close. A token that is none of them is checked as a JWT when a
//! JWKS is configured. Tokens never reach a log or an error; a JWT's
//! subject (`sub`) goes into the request's log line instead. SIGHUP re-reads the token file
//! ([`Auth::reload`]).
//!
//! May import: as the rest of `http`.

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use axum::extract::{MatchedPath, Request};
use axum::http::header;
use tokio::sync::watch;

use super::jwt::Jwt;
pub(crate) use super::principal::{Principal, Revocation};
use super::principal::{Subject, SubjectAccounts};
use super::scopes::{Grants, Requirement, Scope, consumer_of, requirement};
use super::tokens::{TokenEntry, Tokens, load_tokens};
use crate::config::Config;
use crate::domain::consumers::ConsumerName;
use crate::domain::ticket::{Ticket, TicketSigner};
use crate::error::Error;
use crate::gateway::Gateway;
use tracing::{error, info};

/// Authentication settings for the HTTP layer.
#[derive(Clone)]
pub(crate) struct Auth {
    /// Swapped whole when SIGHUP re-reads the token file.
    tokens: Option<Arc<RwLock<Arc<Tokens>>>>,
    /// Bumped after each re-read of the tokens: open streams look whether theirs still
    /// allows them.
    reloaded: Arc<watch::Sender<u64>>,
    jwt: Option<Arc<Jwt>>,
    /// The account of each JWT subject with a request in progress: entries whose last
    /// principal is gone are dropped as the map grows.
    subjects: Arc<Mutex<SubjectAccounts>>,
    /// The default consumer, which `/fetch`, `/events` and `/ws` name without saying so.
    default_consumer: Option<ConsumerName>,
}

impl Auth {
    /// No authentication: every request is let through.
    pub(crate) fn off() -> Self {
        Self {
            tokens: None,
            reloaded: Arc::new(watch::channel(0).0),
            jwt: None,
            subjects: Arc::default(),
            default_consumer: None,
        }
    }

    pub(crate) fn with_tokens(tokens: Tokens) -> Self {
        Self {
            tokens: Some(Arc::new(RwLock::new(Arc::new(tokens)))),
            ..Self::off()
        }
    }

    pub(crate) fn is_on(&self) -> bool {
        self.tokens.is_some() || self.jwt.is_some()
    }

    /// Load the token sources and JWKS the configuration names; off when it names none.
    pub(crate) async fn from_config(config: &Config) -> anyhow::Result<Self> {
        let jwt = Jwt::from_config(config).await?;
        let default_consumer = (!config.no_default_consumer)
            .then(|| ConsumerName::new(&config.stream, &config.consumer));
        match load_tokens(config)? {
            None => Ok(Self {
                jwt,
                default_consumer,
                ..Self::off()
            }),
            Some(tokens) => Ok(Self {
                jwt,
                default_consumer,
                ..Self::with_tokens(tokens)
            }),
        }
    }

    /// Read the files again (on SIGHUP): the token file and the JWKS file. A file that no
    /// longer loads is an error logged, and what was read before stays in force.
    pub(crate) async fn reload(&self, config: &Config) {
        if let Some(current) = &self.tokens {
            match load_tokens(config) {
                Ok(Some(mut fresh)) => {
                    let mut current = current.write().unwrap_or_else(PoisonError::into_inner);
                    // A token kept keeps its account (its waiting fetches count on).
                    for entry in &mut fresh.entries {
                        if let Some(kept) = current
                            .entries
                            .iter()
                            .find(|old| old.digest == entry.digest)
                        {
                            *entry = Arc::new(TokenEntry {
                                digest: entry.digest,
                                grants: entry.grants.clone(),
                                account: kept.account.clone(),
                            });
                        }
                    }
                    let added = fresh
                        .entries
                        .iter()
                        .filter(|new| !current.entries.iter().any(|old| old.digest == new.digest))
                        .count();
                    let removed = current
                        .entries
                        .iter()
                        .filter(|old| !fresh.entries.iter().any(|new| new.digest == old.digest))
                        .count();
                    let rescoped = fresh
                        .entries
                        .iter()
                        .filter(|new| {
                            current
                                .entries
                                .iter()
                                .any(|old| old.digest == new.digest && old.grants != new.grants)
                        })
                        .count();
                    info!(
                        tokens = fresh.entries.len(),
                        added, removed, rescoped, "re-read the bearer tokens"
                    );
                    *current = Arc::new(fresh);
                    drop(current);
                    self.reloaded.send_modify(|count| *count += 1);
                }
                Ok(None) => {}
                Err(err) => error!(
                    error = %format!("{err:#}"),
                    "cannot re-read the bearer tokens; the ones read before stay in force"
                ),
            }
        }
        if let Some(jwt) = &self.jwt
            && jwt.reload().await
        {
            info!("re-read the JWKS");
        }
    }

    /// The caller a ticket presented on a stream opening of `consumer` stands for, with
    /// what ends the stream should its token lose the right; 401 for a ticket forged,
    /// expired, used already, issued for another consumer, or whose token is gone.
    async fn redeem(
        &self,
        gateway: &Gateway,
        text: &str,
        consumer: &ConsumerName,
    ) -> Result<(Principal, Revocation), Error> {
        let refused = || Error::Unauthorized { invalid: true };
        let tickets = gateway.tickets();
        let ticket = tickets.verify(text).ok_or_else(refused)?;
        let now_ms =
            i64::try_from(time::OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000)
                .unwrap_or(i64::MAX);
        if ticket.expires_unix_ms <= now_ms
            || ticket.stream != consumer.stream
            || ticket.consumer != consumer.consumer
        {
            return Err(refused());
        }
        let principal = self
            .ticket_principal(&ticket, tickets)
            .ok_or_else(refused)?;
        let left =
            Duration::from_millis(u64::try_from(ticket.expires_unix_ms - now_ms).unwrap_or(0));
        if !gateway
            .redeem_ticket(&ticket.nonce, tokio::time::Instant::now() + left)
            .await?
        {
            return Err(refused());
        }
        let revocation = Revocation::new(Box::pin(self.no_longer_allows(
            Some(&principal),
            Scope::Fetch,
            consumer,
        )));
        Ok((principal, revocation))
    }

    /// The caller a stream ticket stands for: the ticket's consumer with what it allows
    /// there (`fetch`, and `settle` if the token had it), and nothing else; `None` when the
    /// static token it was issued for is no longer configured.
    fn ticket_principal(&self, ticket: &Ticket, tickets: &TicketSigner) -> Option<Principal> {
        let consumer = format!("{}/{}", ticket.stream, ticket.consumer);
        let mut grants = Grants::default();
        grants.grant(&format!("fetch:{consumer}")).ok()?;
        if ticket.settle {
            grants.grant(&format!("settle:{consumer}")).ok()?;
        }
        let grants = Arc::new(grants);
        match &ticket.token {
            Some(token) => {
                let tokens = self.current_tokens()?;
                let entry = tokens
                    .entries
                    .iter()
                    .find(|entry| tickets.token_ref(&entry.digest) == *token)?;
                Some(Principal {
                    account: entry.account.clone(),
                    grants,
                    subject: None,
                    token: Some(entry.digest),
                    expires_at: None,
                })
            }
            // Issued for a JWT (its expiry goes with it), or by a gateway without tokens.
            None => ticket.jwt_expires_at.map(|expires_at| Principal {
                account: Arc::default(),
                grants,
                subject: None,
                token: None,
                expires_at: Some(expires_at),
            }),
        }
    }

    /// Resolves, with why, once `principal` no longer allows `scope` on `name`: a reload
    /// removed its token or took that scope away, or its JWT expired. Never for a caller
    /// with nothing to lose (authentication off).
    pub(crate) fn no_longer_allows(
        &self,
        principal: Option<&Principal>,
        scope: Scope,
        name: &ConsumerName,
    ) -> impl Future<Output = String> + Send + 'static {
        let token = principal.and_then(|principal| principal.token);
        let expires_at = principal.and_then(|principal| principal.expires_at);
        let tokens = self.tokens.clone();
        let mut reloaded = self.reloaded.subscribe();
        let name = name.clone();
        async move {
            let expired = async move {
                let Some(expires_at) = expires_at else {
                    return std::future::pending().await;
                };
                let now = time::OffsetDateTime::now_utc().unix_timestamp();
                let left = u64::try_from(expires_at.saturating_sub(now)).unwrap_or(0);
                tokio::time::sleep(std::time::Duration::from_secs(left)).await;
                "the token expired".to_owned()
            };
            let revoked = async move {
                let (Some(token), Some(tokens)) = (token, tokens) else {
                    return std::future::pending().await;
                };
                loop {
                    if reloaded.changed().await.is_err() {
                        return std::future::pending().await;
                    }
                    let current = tokens
                        .read()
                        .unwrap_or_else(PoisonError::into_inner)
                        .clone();
                    match current.entries.iter().find(|entry| entry.digest == token) {
                        None => return "the token was revoked".to_owned(),
                        Some(entry) if !entry.grants.allows_on(scope, &name) => {
                            return format!(
                                "the token no longer has the {} scope on {name}",
                                scope.as_str()
                            );
                        }
                        Some(_) => {}
                    }
                }
            };
            tokio::select! {
                why = expired => why,
                why = revoked => why,
            }
        }
    }

    /// The tokens in force now.
    fn current_tokens(&self) -> Option<Arc<Tokens>> {
        self.tokens.as_ref().map(|tokens| {
            tokens
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .clone()
        })
    }

    /// Check a presented token against what the request's path requires; for a stream,
    /// also what ends it should the token lose that right.
    async fn check_presented(
        &self,
        gateway: &Gateway,
        presented: Option<Presented>,
        stream: bool,
    ) -> Result<Option<(Principal, Option<Revocation>)>, Error> {
        let Some(presented) = presented else {
            return Ok(None);
        };
        if presented.ticket {
            let Some(consumer) = &presented.consumer else {
                return Err(Error::Unauthorized { invalid: true });
            };
            let (principal, revocation) = self.redeem(gateway, &presented.token, consumer).await?;
            return Ok(Some((principal, Some(revocation))));
        }
        let principal = self.authenticate(&presented.token).await?;
        if let Requirement::Scope(scope) = presented.needed
            && !allowed(&principal.grants, scope, presented.consumer.as_ref())
        {
            return Err(Error::Forbidden {
                scope: scope.as_str(),
            });
        }
        let revocation = match (stream, presented.needed, &presented.consumer) {
            (true, Requirement::Scope(scope), Some(name)) => Some(Revocation::new(Box::pin(
                self.no_longer_allows(Some(&principal), scope, name),
            ))),
            _ => None,
        };
        Ok(Some((principal, revocation)))
    }

    /// What the request's path requires and the bearer token it presents; `None` when it
    /// needs none.
    fn presented(&self, request: &Request) -> Result<Option<Presented>, Error> {
        if !self.is_on() {
            return Ok(None);
        }
        let needed = requirement(request.uri().path());
        // No route matched (this runs inside the router): the answer is a 404 either way.
        let unmatched = request.extensions().get::<MatchedPath>().is_none();
        if needed == Requirement::Open || (needed == Requirement::Authenticated && unmatched) {
            return Ok(None);
        }
        let path = request.uri().path();
        let consumer = match path {
            "/fetch" | "/events" | "/ws" => self.default_consumer.clone(),
            _ => consumer_of(path),
        };
        // A browser's stream: a ticket instead of the header it cannot set.
        if !request.headers().contains_key(header::AUTHORIZATION)
            && is_stream_path(path)
            && let Some(ticket) = ticket_of(request.uri().query())
        {
            return Ok(Some(Presented {
                needed,
                consumer,
                token: ticket,
                ticket: true,
            }));
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
        Ok(Some(Presented {
            needed,
            consumer,
            token: presented.to_owned(),
            ticket: false,
        }))
    }

    /// The caller a token stands for: a static token first (constant time over all of
    /// them), then a JWT.
    async fn authenticate(&self, presented: &str) -> Result<Principal, Error> {
        if let Some(entry) = self
            .current_tokens()
            .and_then(|tokens| tokens.authenticate(presented))
        {
            return Ok(Principal {
                account: entry.account.clone(),
                grants: entry.grants.clone(),
                subject: None,
                token: Some(entry.digest),
                expires_at: None,
            });
        }
        let Some(jwt) = &self.jwt else {
            return Err(Error::Unauthorized { invalid: true });
        };
        let verified = jwt.verify(presented).await.map_err(|why| {
            // Why, for the operator; the client hears only `invalid_token`.
            tracing::debug!(%why, "JWT refused");
            Error::Unauthorized { invalid: true }
        })?;
        // The request's log line names the caller (never the token).
        tracing::Span::current().record("subject", verified.subject.as_str());
        let subject = Arc::new(Subject {
            issuer: verified.issuer,
            subject: verified.subject,
        });
        let account = self
            .subjects
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .account(&subject);
        Ok(Principal {
            account,
            grants: Arc::new(verified.grants),
            subject: Some(subject),
            token: None,
            expires_at: verified.expires_at,
        })
    }
}

/// What a request presents to be let through.
struct Presented {
    needed: Requirement,
    /// The consumer the path names (the default one for `/fetch`, `/events`, `/ws`).
    consumer: Option<ConsumerName>,
    token: String,
    /// `token` is a stream ticket (`?ticket=`), not a bearer token.
    ticket: bool,
}

/// Whether `grants` let a request needing `scope` through: on the consumer the path names;
/// for a settle path (whose consumers the lease ids name) when `settle` reaches any
/// consumer — each lease is checked against its own by the handler.
fn allowed(grants: &Grants, scope: Scope, consumer: Option<&ConsumerName>) -> bool {
    match (scope, consumer) {
        (Scope::Fetch | Scope::Settle, Some(name)) => grants.allows_on(scope, name),
        (Scope::Settle, None) => grants.reaches(scope),
        _ => grants.allows(scope),
    }
}

/// For the router's middleware: refuse (401/403) before the handler or the body is touched;
/// hand the authenticated caller to the handler as a [`Principal`] extension.
pub(crate) async fn admit(
    auth: &Auth,
    gateway: &Gateway,
    request: &mut Request,
) -> Result<(), Error> {
    let presented = auth.presented(request)?;
    if presented.is_none() {
        return Ok(());
    }
    let stream = is_stream_path(request.uri().path());
    // Boxed: a check may wait for a JWT key set, and that state, unboxed, would be part of
    // every request's future for the request's whole life (an idle long poll's too).
    if let Some((principal, revocation)) =
        Box::pin(auth.check_presented(gateway, presented, stream)).await?
    {
        request.extensions_mut().insert(principal);
        if let Some(revocation) = revocation {
            request.extensions_mut().insert(revocation);
        }
    }
    Ok(())
}

/// The `ticket` a stream's query string carries, if any.
fn ticket_of(query: Option<&str>) -> Option<String> {
    query?
        .split('&')
        .find_map(|pair| pair.strip_prefix("ticket="))
        .map(|value| {
            percent_encoding::percent_decode_str(value)
                .decode_utf8_lossy()
                .into_owned()
        })
}

/// Whether `path` opens a stream (SSE or WebSocket), which outlives the check made at its
/// start: it is ended when its token loses the right.
pub(crate) fn is_stream_path(path: &str) -> bool {
    matches!(path, "/events" | "/ws")
        || (path.starts_with("/streams/") && (path.ends_with("/events") || path.ends_with("/ws")))
}

#[cfg(test)]
mod tests {
    use super::*;

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
