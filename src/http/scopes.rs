//! What a bearer token may do: the scopes (`fetch`, `settle`, `publish`, `admin`) as token
//! files and JWT claims name them — `fetch` and `settle` also for named consumers only
//! (`fetch:ORDERS/*`) — and the scope each path requires. Shared by the static tokens and
//! the authentication middleware (`auth`) and the JWTs (`jwt`), which import it; it imports
//! none of them.
//!
//! May import: as the rest of `http`.

use crate::domain::consumers::{ConsumerName, ConsumerPattern};

/// What a token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scope {
    /// `POST /fetch`, `GET /events`, `GET /ws`.
    Fetch,
    /// Every `POST /messages/…` settle and extension.
    Settle,
    /// `POST /publish`.
    Publish,
    /// `GET /consumer` and `GET /metrics`; also `POST /publish`.
    Admin,
}

impl Scope {
    pub(crate) const ALL: [Self; 4] = [Self::Fetch, Self::Settle, Self::Publish, Self::Admin];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Fetch => "fetch",
            Self::Settle => "settle",
            Self::Publish => "publish",
            Self::Admin => "admin",
        }
    }

    /// The scope a name (as in a token file or a JWT's scope claim) stands for.
    pub(crate) fn named(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|scope| scope.as_str() == name)
    }

    fn bit(self) -> u8 {
        1 << (self as u8)
    }

    /// The scopes any one of which grants what this scope guards: `admin` may publish too
    /// (an operator injecting or replaying a message), `publish` alone still suffices.
    pub(crate) fn granted_by(self) -> &'static [Self] {
        match self {
            Self::Publish => &[Self::Publish, Self::Admin],
            Self::Fetch => &[Self::Fetch],
            Self::Settle => &[Self::Settle],
            Self::Admin => &[Self::Admin],
        }
    }
}

/// What a request needs before it reaches its handler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Requirement {
    /// Health, readiness and the API description: nothing secret, and probes carry no token.
    Open,
    /// A valid token with this scope.
    Scope(Scope),
    /// Any valid token: a route outside the map above (none today), protected by default.
    /// A path no route matches answers 404 without a token: it reveals nothing.
    Authenticated,
}

/// The requirement of a path. By path rather than by route, so that a route added later
/// under a protected prefix (e.g. `/metrics`) is protected without touching this module.
pub(crate) fn requirement(path: &str) -> Requirement {
    match path {
        "/healthz" | "/readyz" | "/openapi.json" => Requirement::Open,
        "/docs" => Requirement::Open,
        // The console's page and files: static, nothing secret; what it shows comes from the
        // API under the token the page asks for.
        "/console" => Requirement::Open,
        _ if path.starts_with("/console/") => Requirement::Open,
        _ if path.starts_with("/docs/") => Requirement::Open,
        "/fetch" | "/events" | "/ws" => Requirement::Scope(Scope::Fetch),
        "/messages" => Requirement::Scope(Scope::Settle),
        _ if path.starts_with("/messages/") => Requirement::Scope(Scope::Settle),
        "/publish" | "/publish/batch" => Requirement::Scope(Scope::Publish),
        // Listing them needs `admin` too: checked by the handler (the path is shared).
        "/schedules" => Requirement::Scope(Scope::Publish),
        _ if path.starts_with("/schedules/") => Requirement::Scope(Scope::Publish),
        "/consumer" | "/consumers" | "/metrics" => Requirement::Scope(Scope::Admin),
        // Dead letters: what failed, and sending it back, is an operator's business.
        "/dead-letters" => Requirement::Scope(Scope::Admin),
        _ if path.starts_with("/dead-letters/") => Requirement::Scope(Scope::Admin),
        // The consumer a ticket is for is in the body: checked by the handler.
        "/stream-tickets" => Requirement::Authenticated,
        _ => match path.strip_prefix("/streams/").map(named_route) {
            Some(Some(NamedRoute::Fetch)) => Requirement::Scope(Scope::Fetch),
            Some(Some(NamedRoute::Status)) => Requirement::Scope(Scope::Admin),
            _ => Requirement::Authenticated,
        },
    }
}

/// What a path under `/streams/` asks of its consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NamedRoute {
    /// `…/fetch`, `…/events`, `…/ws`.
    Fetch,
    /// The consumer itself.
    Status,
}

/// `{stream}/consumers/{consumer}[/fetch|/events|/ws|/push/pause|/push/resume|/seek|/history]` (the path
/// after `/streams/`), as the route and
/// its OpenAPI template (`{stream}` literally) write it.
fn named_route(rest: &str) -> Option<NamedRoute> {
    let mut segments = rest.split('/');
    let (_stream, "consumers", _consumer) = (segments.next()?, segments.next()?, segments.next()?)
    else {
        return None;
    };
    match (segments.next(), segments.next(), segments.next()) {
        (None, _, _) => Some(NamedRoute::Status),
        (Some("fetch" | "events" | "ws"), None, _) => Some(NamedRoute::Fetch),
        // Pausing and resuming a push consumer: an operator's act, as its status is.
        (Some("push"), Some("pause" | "resume"), None) => Some(NamedRoute::Status),
        // Moving a consumer: an operator's act; its recent activity, as its status.
        (Some("seek" | "history"), None, _) => Some(NamedRoute::Status),
        _ => None,
    }
}

/// A set of scopes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Scopes(u8);

impl Scopes {
    pub(crate) const NONE: Self = Self(0);
    pub(crate) const ALL: Self = Self(1 | 2 | 4 | 8);

    #[must_use]
    pub(crate) fn with(self, scope: Scope) -> Self {
        Self(self.0 | scope.bit())
    }

    /// Whether these scopes grant what `scope` guards (see [`Scope::granted_by`]).
    pub(crate) fn allows(self, scope: Scope) -> bool {
        scope
            .granted_by()
            .iter()
            .any(|granting| self.0 & granting.bit() != 0)
    }
}

/// Everything a token was granted: scopes on every consumer, and `fetch`/`settle` on the
/// consumers patterns name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Grants {
    everywhere: Scopes,
    on: Vec<(Scope, ConsumerPattern)>,
}

impl Default for Grants {
    fn default() -> Self {
        Self {
            everywhere: Scopes::NONE,
            on: Vec::new(),
        }
    }
}

impl Grants {
    /// Add what `value` names: `*`, a scope, or `fetch:`/`settle:` and a `STREAM/CONSUMER`
    /// pattern. An error says why in words fit for the operator.
    pub(crate) fn grant(&mut self, value: &str) -> Result<(), String> {
        if value == "*" {
            self.everywhere = Scopes::ALL;
            return Ok(());
        }
        let (name, pattern) = match value.split_once(':') {
            Some((name, pattern)) => (name, Some(pattern)),
            None => (value, None),
        };
        let scope = Scope::named(name).ok_or_else(|| {
            format!(
                "unknown scope {value:?} (expected fetch, settle, publish, admin, *, or fetch:/settle: with STREAM/CONSUMER)"
            )
        })?;
        match pattern {
            None => self.everywhere = self.everywhere.with(scope),
            Some(pattern) if matches!(scope, Scope::Fetch | Scope::Settle) => {
                let pattern = ConsumerPattern::parse(pattern)
                    .map_err(|why| format!("scope {value:?}: {why}"))?;
                self.on.push((scope, pattern));
            }
            Some(_) => {
                return Err(format!(
                    "scope {value:?}: only fetch and settle may name consumers"
                ));
            }
        }
        Ok(())
    }

    /// Whether these grants allow `scope` on every consumer.
    pub(crate) fn allows(&self, scope: Scope) -> bool {
        self.everywhere.allows(scope)
    }

    /// Whether these grants allow `scope` on the consumer `name`.
    pub(crate) fn allows_on(&self, scope: Scope, name: &ConsumerName) -> bool {
        self.allows(scope)
            || self
                .on
                .iter()
                .any(|(granted, pattern)| *granted == scope && pattern.matches(name))
    }

    /// Whether these grants allow `scope` on some consumer (a settle route is let through,
    /// and each lease then checked against the consumer its id names).
    pub(crate) fn reaches(&self, scope: Scope) -> bool {
        self.allows(scope) || self.on.iter().any(|(granted, _)| *granted == scope)
    }
}

/// The consumer a path names: `/streams/{stream}/consumers/{consumer}/…`, its segments
/// percent-decoded as the route's handler reads them.
pub(crate) fn consumer_of(path: &str) -> Option<ConsumerName> {
    let mut segments = path.strip_prefix("/streams/")?.split('/');
    let (stream, "consumers", consumer) = (segments.next()?, segments.next()?, segments.next()?)
    else {
        return None;
    };
    let decoded = |segment: &str| {
        percent_encoding::percent_decode_str(segment)
            .decode_utf8()
            .ok()
            .map(|text| text.into_owned())
    };
    Some(ConsumerName::new(&decoded(stream)?, &decoded(consumer)?))
}
