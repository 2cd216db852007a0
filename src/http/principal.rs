//! Who a request was authenticated as, once the authentication middleware has checked it:
//! the caller's scopes, what its waiting fetches are counted against (an account per static
//! token, one per JWT subject), and what ends its open stream should the token lose the
//! right. The middleware, the static tokens, the stream tickets and the handlers all need
//! these values; they sit here, below all of them, so that none of those modules has to
//! import another to reach them.
//!
//! May import: as the rest of `http`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use super::scopes::{Grants, Scope};
use crate::domain::consumers::ConsumerName;
use crate::error::Error;
use crate::gateway::EndsWhen;

/// A caller's share of waiting fetches: one per static token, one per JWT subject (however
/// many tokens the issuer hands that subject).
#[derive(Default)]
pub(crate) struct Account {
    waiting_fetches: AtomicUsize,
}

/// A fetch counted against its caller until dropped.
pub(crate) struct WaitingFetch(Arc<Account>);

impl Drop for WaitingFetch {
    fn drop(&mut self) {
        self.0.waiting_fetches.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The caller a request was authenticated as; handlers find it in the request extensions.
#[derive(Clone)]
pub(crate) struct Principal {
    pub(super) account: Arc<Account>,
    pub(super) grants: Arc<Grants>,
    /// A JWT's verified issuer and subject; `None` for a static token.
    pub(super) subject: Option<Arc<Subject>>,
    /// A static token's digest: what a reload is checked against.
    pub(super) token: Option<[u8; 32]>,
    /// A JWT's `exp` (Unix seconds).
    pub(super) expires_at: Option<i64>,
}

/// Who a JWT speaks for.
#[derive(PartialEq, Eq, Hash)]
pub(super) struct Subject {
    pub(super) issuer: Option<String>,
    pub(super) subject: String,
}

impl Principal {
    /// A static token's digest: what a stream ticket issued for it refers to (never in the
    /// clear: see [`crate::domain::ticket`]).
    pub(crate) fn token_digest(&self) -> Option<&[u8; 32]> {
        self.token.as_ref()
    }

    /// A JWT's `exp` (Unix seconds).
    pub(crate) fn expires_at(&self) -> Option<i64> {
        self.expires_at
    }

    /// Whether the caller's scopes grant `scope` on some consumer.
    pub(crate) fn reaches(&self, scope: Scope) -> bool {
        self.grants.reaches(scope)
    }

    /// Whether the caller's scopes grant what `scope` guards, on the consumer `name`.
    pub(crate) fn allows_on(&self, scope: Scope, name: &ConsumerName) -> bool {
        self.grants.allows_on(scope, name)
    }

    /// Count one more waiting fetch for this caller, unless it already has `limit`.
    pub(crate) fn begin_fetch(&self, limit: usize) -> Result<WaitingFetch, Error> {
        let before = self.account.waiting_fetches.fetch_add(1, Ordering::AcqRel);
        if before >= limit {
            self.account.waiting_fetches.fetch_sub(1, Ordering::AcqRel);
            return Err(Error::TooManyWaitingFetches {
                limit,
                retry_after: Duration::from_secs(1),
            });
        }
        Ok(WaitingFetch(self.account.clone()))
    }

    /// What scopes an `Idempotency-Key` for this caller: a JWT's issuer and subject, so the
    /// caller's next token (a refresh) reaches the same answers and another subject does
    /// not. `None` for a static token: its Authorization header already names it for good.
    pub(crate) fn idempotency_credential(&self) -> Option<Vec<u8>> {
        self.subject.as_ref().map(|subject| {
            // A static token's credential is its Authorization header, which starts with
            // the scheme (`Bearer `), never with `jwt:`; `\0` keeps issuer and subject apart.
            format!(
                "jwt:{}\0{}",
                subject.issuer.as_deref().unwrap_or_default(),
                subject.subject
            )
            .into_bytes()
        })
    }
}

/// The account of each JWT subject with a request in progress: entries whose last
/// principal is gone are dropped as the map grows.
#[derive(Default)]
pub(super) struct SubjectAccounts {
    accounts: HashMap<Arc<Subject>, Weak<Account>>,
    /// Size after the last sweep of dead entries; the next sweep comes at twice that.
    swept_at: usize,
}

impl SubjectAccounts {
    /// The account of `subject`: the one its requests in progress share, or a new one.
    pub(super) fn account(&mut self, subject: &Arc<Subject>) -> Arc<Account> {
        if let Some(account) = self.accounts.get(subject).and_then(Weak::upgrade) {
            return account;
        }
        if self.accounts.len() >= (2 * self.swept_at).max(64) {
            self.accounts
                .retain(|_, account| account.strong_count() > 0);
            self.swept_at = self.accounts.len();
        }
        let account = Arc::new(Account::default());
        self.accounts
            .insert(subject.clone(), Arc::downgrade(&account));
        account
    }
}

/// What ends a stream once its token no longer allows it (the middleware makes it), handed
/// to the stream's handler in the request's extensions; taken once.
#[derive(Clone)]
pub(crate) struct Revocation(Arc<Mutex<Option<EndsWhen>>>);

impl Revocation {
    pub(super) fn new(ends_when: EndsWhen) -> Self {
        Self(Arc::new(Mutex::new(Some(ends_when))))
    }

    pub(crate) fn take(&self) -> Option<EndsWhen> {
        self.0.lock().ok()?.take()
    }
}
