//! Retry-safe fetches: `POST /fetch` with an `Idempotency-Key` header, repeated while any of
//! the leases it handed out is live, answers with the first answer instead of leasing more.
//!
//! A key is scoped by the SHA-256 of the caller's credential — the request's `Authorization`
//! header, or a JWT's verified subject, so that a subject's renewed tokens share its keys —
//! so one credential cannot read another's leases by guessing keys. It is remembered while at
//! least one of its leases is live (not settled, expired or superseded) — so the table never
//! holds more entries than there are live leases plus fetches in progress. A repeat that
//! arrives while the first is still waiting waits for its answer. The same key with a
//! different request is refused (422).
//!
//! May import: the rest of `domain` only.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use sha2::{Digest as _, Sha256};
use tokio::sync::watch;

use super::lease_id::DeliveryKey;

/// The longest key accepted (the IETF draft suggests UUIDs; 255 leaves room for others).
pub(crate) const MAX_KEY_LEN: usize = 255;

/// A key within its credential's scope.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Scope {
    credential: Option<[u8; 32]>,
    key: String,
}

impl Scope {
    /// `key` is the header value (already validated with [`validate_key`]); `credential`
    /// what names the caller (the raw `Authorization` header value, or a JWT's subject), if any.
    pub(crate) fn new(key: &str, credential: Option<&[u8]>) -> Self {
        Self {
            credential: credential.map(|value| Sha256::digest(value).into()),
            key: key.to_owned(),
        }
    }
}

impl Scope {
    /// A name for the scope that reveals neither key nor credential (hex SHA-256): what
    /// replicas sharing answers file them under.
    pub(crate) fn digest(&self) -> String {
        let mut hasher = Sha256::new();
        if let Some(credential) = &self.credential {
            hasher.update([1]);
            hasher.update(credential);
        } else {
            hasher.update([0]);
        }
        hasher.update(self.key.as_bytes());
        super::hex(&hasher.finalize())
    }
}

/// Check an `Idempotency-Key` value: 1 to 255 printable ASCII characters.
pub(crate) fn validate_key(key: &[u8]) -> Result<&str, String> {
    if key.is_empty() || key.len() > MAX_KEY_LEN {
        return Err(format!(
            "Idempotency-Key: must be 1 to {MAX_KEY_LEN} characters, got {}",
            key.len()
        ));
    }
    if !key.iter().all(|byte| (0x20..0x7f).contains(byte)) {
        return Err("Idempotency-Key: must be printable ASCII".into());
    }
    std::str::from_utf8(key).map_err(|_| "Idempotency-Key: must be printable ASCII".into())
}

/// What identifies "the same request" under one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// From a canonical rendering of the request's effective values (defaults applied, so
    /// `{}` and `{"batch": 10}` are the same request).
    pub(crate) fn of(canonical: &str) -> Self {
        Self(Sha256::digest(canonical.as_bytes()).into())
    }

    /// Hex, as replicas compare it.
    pub(crate) fn to_hex(self) -> String {
        super::hex(&self.0)
    }
}

enum Entry {
    /// The first request is still working; its claim's sender drops when it ends.
    Pending {
        fingerprint: Fingerprint,
        done: watch::Receiver<()>,
    },
    Answered {
        fingerprint: Fingerprint,
        body: Bytes,
        leases: Vec<DeliveryKey>,
    },
}

/// What to do with a request carrying a key.
pub(crate) enum Begin {
    /// The first answer, to send again.
    Replay(Bytes),
    /// The key was used with a different request.
    Mismatch,
    /// The first request is still working: wait on this, then ask again.
    Wait(watch::Receiver<()>),
    /// This request is the first: do the fetch, then [`Claim::answer`].
    First(Claim),
}

/// Remembered fetch answers by key.
#[derive(Default)]
pub(crate) struct IdempotencyCache {
    entries: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    entries: HashMap<Scope, Entry>,
    /// Purge answers without live leases when the table reaches this size (amortized O(1)).
    purge_at: usize,
}

/// Purges start once this many keys are held.
const MIN_PURGE_AT: usize = 1024;

impl IdempotencyCache {
    fn inner(&self) -> MutexGuard<'_, Inner> {
        // Entries are replaced whole; a panic elsewhere cannot leave one half-written.
        self.entries
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Look `scope` up. `live` says whether a lease is still live (asked only of answers).
    pub(crate) fn begin(
        self: &Arc<Self>,
        scope: &Scope,
        fingerprint: Fingerprint,
        live: impl Fn(DeliveryKey) -> bool,
    ) -> Begin {
        let mut inner = self.inner();
        if inner.entries.len() >= inner.purge_at.max(MIN_PURGE_AT) {
            inner.entries.retain(|_, entry| match entry {
                Entry::Pending { .. } => true,
                Entry::Answered { leases, .. } => leases.iter().any(|key| live(*key)),
            });
            inner.purge_at = (inner.entries.len() * 2).max(MIN_PURGE_AT);
        }
        match inner.entries.get(scope) {
            Some(Entry::Pending {
                fingerprint: first,
                done,
            }) => {
                if *first != fingerprint {
                    return Begin::Mismatch;
                }
                return Begin::Wait(done.clone());
            }
            Some(Entry::Answered {
                fingerprint: first,
                body,
                leases,
            }) if leases.iter().any(|key| live(*key)) => {
                if *first != fingerprint {
                    return Begin::Mismatch;
                }
                return Begin::Replay(body.clone());
            }
            // Every lease of the first answer ended: the key is free again.
            Some(Entry::Answered { .. }) | None => {}
        }
        let (sender, done) = watch::channel(());
        inner
            .entries
            .insert(scope.clone(), Entry::Pending { fingerprint, done });
        Begin::First(Claim {
            cache: self.clone(),
            scope: scope.clone(),
            fingerprint,
            _done: sender,
            answered: false,
        })
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.inner().entries.len()
    }
}

/// The right to answer a key first. Dropped without an answer (the fetch failed or its
/// client left before any lease), the key is released and a waiting repeat goes ahead.
pub(crate) struct Claim {
    cache: Arc<IdempotencyCache>,
    scope: Scope,
    fingerprint: Fingerprint,
    /// Dropping it wakes the repeats waiting on this key.
    _done: watch::Sender<()>,
    answered: bool,
}

impl Claim {
    /// Remember `body` as the answer while any of `leases` is live (not at all when empty:
    /// an empty answer leased nothing, so a repeat may fetch afresh).
    pub(crate) fn answer(mut self, body: Bytes, leases: Vec<DeliveryKey>) {
        if leases.is_empty() {
            return;
        }
        self.answered = true;
        self.cache.inner().entries.insert(
            self.scope.clone(),
            Entry::Answered {
                fingerprint: self.fingerprint,
                body,
                leases,
            },
        );
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if !self.answered {
            let mut inner = self.cache.inner();
            if matches!(inner.entries.get(&self.scope), Some(Entry::Pending { .. })) {
                inner.entries.remove(&self.scope);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(sequence: u64) -> DeliveryKey {
        DeliveryKey {
            stream_sequence: sequence,
            delivered: 1,
        }
    }

    #[test]
    fn scope_digests_differ_by_key_and_credential_and_hide_both() {
        let anonymous = Scope::new("k1", None).digest();
        let alice = Scope::new("k1", Some(b"Bearer alice")).digest();
        assert_eq!(anonymous, Scope::new("k1", None).digest());
        assert_ne!(anonymous, alice);
        assert_ne!(anonymous, Scope::new("k2", None).digest());
        assert_ne!(alice, Scope::new("k1", Some(b"Bearer bob")).digest());
        assert_eq!(alice.len(), 64);
        assert!(!alice.contains("k1") && alice.bytes().all(|b| b.is_ascii_hexdigit()));
    }

    #[test]
    fn a_repeat_replays_while_a_lease_is_live_and_not_after() {
        let cache = Arc::new(IdempotencyCache::default());
        let scope = Scope::new("k1", None);
        let request = Fingerprint::of("batch=1");
        let Begin::First(claim) = cache.begin(&scope, request, |_| true) else {
            panic!("the first request goes first");
        };
        assert!(matches!(
            cache.begin(&scope, request, |_| true),
            Begin::Wait(_)
        ));
        claim.answer(Bytes::from_static(b"answer"), vec![key(1), key(2)]);
        match cache.begin(&scope, request, |k| k == key(2)) {
            Begin::Replay(body) => assert_eq!(body.as_ref(), b"answer"),
            _ => panic!("one lease is live: replay"),
        }
        assert!(matches!(
            cache.begin(&scope, Fingerprint::of("batch=2"), |_| true),
            Begin::Mismatch
        ));
        assert!(matches!(
            cache.begin(&scope, request, |_| false),
            Begin::First(_)
        ));
    }

    #[test]
    fn keys_are_scoped_by_credential_and_released_when_the_first_fails() {
        let cache = Arc::new(IdempotencyCache::default());
        let request = Fingerprint::of("batch=1");
        let alice = Scope::new("k", Some(b"Bearer alice"));
        let bob = Scope::new("k", Some(b"Bearer bob"));
        let Begin::First(claim) = cache.begin(&alice, request, |_| true) else {
            panic!("first");
        };
        claim.answer(Bytes::from_static(b"alice's"), vec![key(1)]);
        assert!(matches!(
            cache.begin(&bob, request, |_| true),
            Begin::First(_)
        ));
        // Bob's claim was dropped unanswered: the key is free again.
        assert!(matches!(
            cache.begin(&bob, request, |_| true),
            Begin::First(_)
        ));
        assert_eq!(cache.len(), 1);
    }

    #[test]
    fn a_waiting_repeat_wakes_when_the_first_ends() {
        let cache = Arc::new(IdempotencyCache::default());
        let scope = Scope::new("k", None);
        let request = Fingerprint::of("x");
        let Begin::First(claim) = cache.begin(&scope, request, |_| true) else {
            panic!("first");
        };
        let Begin::Wait(done) = cache.begin(&scope, request, |_| true) else {
            panic!("wait");
        };
        drop(claim);
        assert!(done.has_changed().is_err(), "the sender is gone: wake up");
    }

    #[test]
    fn keys_are_validated() {
        assert!(validate_key(b"3f1c-uuid").is_ok());
        assert!(validate_key(b"").is_err());
        assert!(validate_key(&[b'a'; 256]).is_err());
        assert!(validate_key(b"tab\there").is_err());
        assert!(validate_key("caf\u{e9}".as_bytes()).is_err());
    }

    #[test]
    fn answers_without_live_leases_are_purged() {
        let cache = Arc::new(IdempotencyCache::default());
        let request = Fingerprint::of("x");
        for n in 0..MIN_PURGE_AT as u64 {
            let Begin::First(claim) =
                cache.begin(&Scope::new(&n.to_string(), None), request, |_| true)
            else {
                panic!("first");
            };
            claim.answer(Bytes::new(), vec![key(n)]);
        }
        assert_eq!(cache.len(), MIN_PURGE_AT);
        let _claim = cache.begin(&Scope::new("new", None), request, |k| k == key(7));
        assert_eq!(cache.len(), 2, "the live one and the new one remain");
    }
}
