//! What a bearer token may do: the scopes (`fetch`, `settle`, `publish`, `admin`) as token
//! files and JWT claims name them, and the scope each path requires. Shared by the static
//! tokens ([`super::auth`]) and the JWTs ([`super::jwt`]), which both import it and not
//! each other.
//!
//! May import: as the rest of `http`.

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
        _ if path.starts_with("/docs/") => Requirement::Open,
        "/fetch" | "/events" | "/ws" => Requirement::Scope(Scope::Fetch),
        "/messages" => Requirement::Scope(Scope::Settle),
        _ if path.starts_with("/messages/") => Requirement::Scope(Scope::Settle),
        "/publish" => Requirement::Scope(Scope::Publish),
        "/consumer" | "/metrics" => Requirement::Scope(Scope::Admin),
        _ => Requirement::Authenticated,
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
