//! The lease table: which client-held deliveries are valid, until when, and how each ended.
//!
//! Pure state and time — no HTTP, no NATS. It fences stale leases (expired, or superseded by a
//! newer delivery of the same message) because nats-server accepts acks from old deliveries,
//! and it remembers settled outcomes so that a retried settle answers as the first one did.
//!
//! May import: the rest of `domain` only.

use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::SequenceMap;
use super::delivery::MessageNote;
pub(crate) use super::lease_id::DeliveryKey;
use super::settle::SettleKind;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Active,
    /// A settle of this kind is on its way to the server.
    Settling(SettleKind),
    /// An in-progress extension is on its way to the server.
    Extending,
    Settled(SettleKind),
    Expired,
    Superseded,
}

#[derive(Debug)]
struct Record {
    /// The delivery's ack subject; only ever taken from NATS, never from HTTP input.
    reply: Arc<str>,
    expires_at: Instant,
    state: State,
    /// For the settle's trace span; only while tracing is on.
    note: Option<Arc<MessageNote>>,
}

/// Why a lease cannot be acted on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Never issued here, or forgotten long ago.
    Unknown,
    /// Past its expiry, or a newer delivery of the message exists.
    Gone,
    /// Settled (or being settled) with a different outcome.
    Conflict(SettleKind),
    /// Settled (or being settled) already; an extension makes no sense.
    Settled(SettleKind),
}

/// What a settle should do next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SettleStart {
    /// Send the settle on this ack subject, then call [`LeaseTable::finish_settle`].
    Send(Arc<str>),
    /// Already settled this way: answer as the first time, send nothing.
    AlreadyDone,
}

/// The lease table. Kept behind a `std::sync::Mutex`: every operation is short and never
/// awaits, so an async mutex would only add cost (the mini-redis reasoning).
#[derive(Debug)]
pub(crate) struct LeaseTable {
    records: SequenceMap<DeliveryKey, Record>,
    /// Newest delivery count seen per stream sequence: anything older is superseded.
    newest: SequenceMap<u64, u64>,
    /// Live leases by expiry, earliest first.
    expiries: BTreeSet<(Instant, DeliveryKey)>,
    /// Leases no longer live, in the order they stopped being live, to be forgotten.
    retired: VecDeque<(Instant, DeliveryKey)>,
    /// Messages nak'd with a delay, by stream sequence: until redelivered the server still
    /// counts them against max_ack_pending, so the gateway must too.
    parked: SequenceMap<u64, Instant>,
    parked_until: BTreeSet<(Instant, u64)>,
    retention: Duration,
    max_retired: usize,
    /// Leases found expired since [`LeaseTable::take_expired`] last asked (for the metrics).
    expired: u64,
    /// Acks and terms on their way to the server, by stream sequence: how many (retries of
    /// one settle may overlap). A new delivery of such a message waits for the answer — the
    /// server redelivered it (a leader change, ack_wait running out under the settle) while
    /// the settle that may end it was in motion.
    ending: SequenceMap<u64, u32>,
}

impl LeaseTable {
    /// `retention`: how long the outcome of a settled or expired lease is remembered.
    pub(crate) fn new(retention: Duration, max_retired: usize) -> Self {
        Self {
            records: SequenceMap::default(),
            newest: SequenceMap::default(),
            expiries: BTreeSet::new(),
            retired: VecDeque::new(),
            parked: SequenceMap::default(),
            parked_until: BTreeSet::new(),
            retention,
            max_retired,
            expired: 0,
            ending: SequenceMap::default(),
        }
    }

    /// The table of a new epoch: no lease of this one carries over, but the acks and terms
    /// still in motion do — their answers may still end messages the new epoch delivers.
    pub(crate) fn successor(&mut self) -> Self {
        let mut next = Self::new(self.retention, self.max_retired);
        next.ending = std::mem::take(&mut self.ending);
        next
    }

    /// Leases that are live (issued, not settled, not expired) at `now`.
    pub(crate) fn in_flight(&mut self, now: Instant) -> usize {
        self.expire(now);
        self.expiries.len()
    }

    /// Whether a lease is live: issued, and not settled, expired, superseded or given back.
    /// One with a settle or extension on its way counts as live (the answer may be "no").
    pub(crate) fn is_live(&self, key: DeliveryKey, now: Instant) -> bool {
        let superseded = self
            .newest
            .get(&key.stream_sequence)
            .is_some_and(|newest| *newest > key.delivered);
        !superseded
            && self
                .records
                .get(&key)
                .is_some_and(|record| match record.state {
                    State::Active => record.expires_at > now,
                    State::Extending | State::Settling(_) => true,
                    State::Settled(_) | State::Expired | State::Superseded => false,
                })
    }

    /// End every live lease now (the gateway is stopping: nobody can settle them any more)
    /// and return their ack subjects, so the messages can be nak'd back at once. Leases with
    /// a settle or extension on its way are left alone.
    pub(crate) fn revoke_live(&mut self, now: Instant) -> Vec<Arc<str>> {
        self.expire(now);
        let live: Vec<DeliveryKey> = self.expiries.iter().map(|(_, key)| *key).collect();
        let mut replies = Vec::with_capacity(live.len());
        for key in live {
            if let Some(record) = self.records.get(&key)
                && record.state == State::Active
            {
                replies.push(record.reply.clone());
                self.retire(key, State::Expired, now);
            }
        }
        replies
    }

    /// Messages nak'd with a delay whose delay is not over (see [`LeaseTable::park`]).
    pub(crate) fn delayed_naks(&self) -> usize {
        self.parked.len()
    }

    /// How many leases expired since the last call (expiry is noticed lazily, by any call
    /// that takes `now`).
    pub(crate) fn take_expired(&mut self) -> u64 {
        std::mem::take(&mut self.expired)
    }

    /// When the earliest live lease expires.
    pub(crate) fn next_expiry(&self) -> Option<Instant> {
        self.expiries.first().map(|(at, _)| *at)
    }

    /// Slots of max_ack_pending taken at `now`: live leases plus delayed naks not yet due.
    pub(crate) fn taken(&mut self, now: Instant) -> usize {
        self.expire(now);
        self.expiries.len() + self.parked.len()
    }

    /// When a slot frees by itself: the earliest lease expiry or delayed nak coming due.
    pub(crate) fn next_release(&self) -> Option<Instant> {
        let parked = self.parked_until.first().map(|(at, _)| *at);
        self.next_expiry().into_iter().chain(parked).min()
    }

    /// A nak with a delay was confirmed: the server keeps the message pending until then.
    pub(crate) fn park(&mut self, stream_sequence: u64, until: Instant) {
        if let Some(previous) = self.parked.insert(stream_sequence, until) {
            self.parked_until.remove(&(previous, stream_sequence));
        }
        self.parked_until.insert((until, stream_sequence));
    }

    fn unpark(&mut self, stream_sequence: u64) {
        if let Some(until) = self.parked.remove(&stream_sequence) {
            self.parked_until.remove(&(until, stream_sequence));
        }
    }

    /// A delivery arrived from the server: every older delivery of the same message is stale
    /// from now on, whether or not it was ever leased.
    /// A delivery arrived. Returns `true` when it is one this table already leased (same
    /// message, same delivery count): the server forgot that it had made it (a crash before
    /// its state was on disk) and made it again, so an id issued for the first would also
    /// name this one.
    pub(crate) fn note_delivery(&mut self, key: DeliveryKey, now: Instant) -> bool {
        self.unpark(key.stream_sequence);
        if self.records.contains_key(&key) {
            return true;
        }
        let newest = self.newest.entry(key.stream_sequence).or_insert(0);
        if key.delivered <= *newest {
            return false;
        }
        let previous = std::mem::replace(newest, key.delivered);
        if previous == 0 {
            return false;
        }
        let old = DeliveryKey {
            stream_sequence: key.stream_sequence,
            delivered: previous,
        };
        if let Some(record) = self.records.get(&old)
            && matches!(
                record.state,
                State::Active | State::Extending | State::Settling(_)
            )
        {
            self.retire(old, State::Superseded, now);
        }
        false
    }

    /// Issue a lease for a delivery received from the server.
    pub(crate) fn issue(&mut self, key: DeliveryKey, reply: Arc<str>, expires_at: Instant) {
        self.newest
            .entry(key.stream_sequence)
            .and_modify(|newest| *newest = (*newest).max(key.delivered))
            .or_insert(key.delivered);
        if let Some(old) = self.records.insert(
            key,
            Record {
                reply,
                expires_at,
                state: State::Active,
                note: None,
            },
        ) && old.state == State::Active
        {
            self.expiries.remove(&(old.expires_at, key));
        }
        self.expiries.insert((expires_at, key));
    }

    /// Keep `note` with the lease `key` (issued just before), for its settle's trace span.
    pub(crate) fn annotate(&mut self, key: DeliveryKey, note: Arc<MessageNote>) {
        if let Some(record) = self.records.get_mut(&key) {
            record.note = Some(note);
        }
    }

    /// The note kept with the lease `key`, if any.
    pub(crate) fn note(&self, key: DeliveryKey) -> Option<Arc<MessageNote>> {
        self.records
            .get(&key)
            .and_then(|record| record.note.clone())
    }

    /// Give back a lease that never reached its client (the fetch went away before the
    /// answer was handed over). The message goes back to the gateway's hands.
    pub(crate) fn give_back(&mut self, key: DeliveryKey) {
        if let Some(record) = self.records.remove(&key)
            && record.state == State::Active
        {
            self.expiries.remove(&(record.expires_at, key));
        }
    }

    /// Start settling a lease.
    pub(crate) fn begin_settle(
        &mut self,
        key: DeliveryKey,
        kind: SettleKind,
        now: Instant,
    ) -> Result<SettleStart, Refusal> {
        self.expire(now);
        let newest = self.newest.get(&key.stream_sequence).copied();
        let record = self.records.get_mut(&key).ok_or(Refusal::Unknown)?;
        match record.state {
            State::Settled(done) | State::Settling(done) if done != kind => {
                Err(Refusal::Conflict(done))
            }
            State::Settled(_) => Ok(SettleStart::AlreadyDone),
            // A concurrent retry of the same settle: sending it twice is harmless, and this
            // answer then reflects the server's confirmation too.
            State::Settling(_) => {
                let reply = record.reply.clone();
                self.sending(key, kind);
                Ok(SettleStart::Send(reply))
            }
            State::Expired | State::Superseded => Err(Refusal::Gone),
            // A settle overtakes an extension still on its way; the extension then reports
            // that the lease was settled meanwhile.
            State::Active | State::Extending => {
                let superseded = newest.is_some_and(|newest| newest > key.delivered);
                // An extension in motion keeps a lease out of expiry; it does not make it live.
                if superseded || record.expires_at <= now {
                    return Err(Refusal::Gone);
                }
                record.state = State::Settling(kind);
                let reply = record.reply.clone();
                self.sending(key, kind);
                Ok(SettleStart::Send(reply))
            }
        }
    }

    /// A settle of `key` is sent: an ack or term is counted as ending its message until
    /// [`LeaseTable::finish_settle`].
    fn sending(&mut self, key: DeliveryKey, kind: SettleKind) {
        if kind != SettleKind::Nak {
            *self.ending.entry(key.stream_sequence).or_insert(0) += 1;
        }
    }

    /// Whether an ack or term of the message at `stream_sequence` is on its way to the
    /// server: a delivery of it may not be leased before that settle's answer.
    pub(crate) fn is_ending(&self, stream_sequence: u64) -> bool {
        self.ending.contains_key(&stream_sequence)
    }

    /// The server confirmed (`confirmed`) or did not confirm the settle begun earlier (once
    /// for every [`SettleStart::Send`]). Unconfirmed, the lease stays valid so the client can
    /// retry.
    pub(crate) fn finish_settle(
        &mut self,
        key: DeliveryKey,
        kind: SettleKind,
        confirmed: bool,
        now: Instant,
    ) {
        if kind != SettleKind::Nak
            && let Some(count) = self.ending.get_mut(&key.stream_sequence)
        {
            *count = count.saturating_sub(1);
            if *count == 0 {
                self.ending.remove(&key.stream_sequence);
            }
        }
        let Some(record) = self.records.get_mut(&key) else {
            return;
        };
        match (record.state, confirmed) {
            // A concurrent attempt may have failed and reset the state meanwhile: the server
            // confirmed, so the lease is settled all the same.
            (State::Settling(settling), true) if settling == kind => {
                self.retire(key, State::Settled(kind), now)
            }
            (State::Active | State::Extending, true) => self.retire(key, State::Settled(kind), now),
            (State::Settling(settling), false) if settling == kind => record.state = State::Active,
            _ => {}
        }
    }

    /// Start extending a live lease (in-progress).
    pub(crate) fn begin_extend(
        &mut self,
        key: DeliveryKey,
        now: Instant,
    ) -> Result<Arc<str>, Refusal> {
        self.expire(now);
        let newest = self.newest.get(&key.stream_sequence).copied();
        let record = self.records.get_mut(&key).ok_or(Refusal::Unknown)?;
        match record.state {
            State::Settled(kind) | State::Settling(kind) => Err(Refusal::Settled(kind)),
            State::Expired | State::Superseded => Err(Refusal::Gone),
            State::Active | State::Extending => {
                if newest.is_some_and(|newest| newest > key.delivered) {
                    return Err(Refusal::Gone);
                }
                record.state = State::Extending;
                Ok(record.reply.clone())
            }
        }
    }

    /// The extension was confirmed (`Some(new expiry)`) or not (`None`). Returns the expiry
    /// in force afterwards, or `None` when the lease stopped being live meanwhile.
    pub(crate) fn finish_extend(
        &mut self,
        key: DeliveryKey,
        extended_to: Option<Instant>,
    ) -> Option<Instant> {
        let record = self.records.get_mut(&key)?;
        // Active: a concurrent extension finished first; this one was confirmed too.
        if !matches!(record.state, State::Extending | State::Active) {
            return None;
        }
        record.state = State::Active;
        if let Some(expires_at) = extended_to
            && expires_at > record.expires_at
        {
            self.expiries.remove(&(record.expires_at, key));
            record.expires_at = expires_at;
            self.expiries.insert((expires_at, key));
        }
        Some(record.expires_at)
    }

    /// The server's ack_wait was lowered by `by` (someone edited the consumer): every live
    /// lease now ends that much earlier, at the server's new deadline for its delivery, so
    /// that no id outlives the delivery it names. Returns how many leases were shortened.
    pub(crate) fn shorten_live(&mut self, by: Duration, now: Instant) -> usize {
        self.expire(now);
        let live: Vec<(Instant, DeliveryKey)> =
            std::mem::take(&mut self.expiries).into_iter().collect();
        let shortened = live.len();
        for (expires_at, key) in live {
            let earlier = expires_at.checked_sub(by).unwrap_or(now);
            if let Some(record) = self.records.get_mut(&key) {
                record.expires_at = earlier;
            }
            self.expiries.insert((earlier, key));
        }
        self.expire(now);
        shortened
    }

    /// Move leases past their expiry out of the live set, and forget old outcomes.
    pub(crate) fn expire(&mut self, now: Instant) {
        // The common case on every settle: nothing is due.
        let lease_due = self.expiries.first().is_some_and(|(at, _)| *at <= now);
        let parked_due = self.parked_until.first().is_some_and(|(at, _)| *at <= now);
        let forget_due = self.retired.front().is_some_and(|(at, _)| {
            *at + self.retention <= now || self.retired.len() > self.max_retired
        });
        if !(lease_due || parked_due || forget_due) {
            return;
        }
        let due: Vec<DeliveryKey> = self
            .expiries
            .iter()
            .take_while(|(at, _)| *at <= now)
            .map(|(_, key)| *key)
            .collect();
        while let Some(&(until, stream_sequence)) = self.parked_until.first() {
            if until > now {
                break;
            }
            self.unpark(stream_sequence);
        }
        for key in due {
            // A lease whose settle or extension is on its way stays until that answer: the
            // command left before expiry, inside the server's own ack window.
            let in_motion = self.records.get(&key).is_some_and(|record| {
                matches!(record.state, State::Settling(_) | State::Extending)
            });
            if !in_motion {
                self.retire(key, State::Expired, now);
                self.expired += 1;
            }
        }
        while let Some(&(retired_at, key)) = self.retired.front() {
            if retired_at + self.retention > now && self.retired.len() <= self.max_retired {
                break;
            }
            self.retired.pop_front();
            self.forget(key);
        }
    }

    fn retire(&mut self, key: DeliveryKey, state: State, now: Instant) {
        if let Some(record) = self.records.get_mut(&key) {
            self.expiries.remove(&(record.expires_at, key));
            record.state = state;
            self.retired.push_back((now, key));
        }
    }

    /// A delivery that arrived but was never leased (it was nak'd back): remember its
    /// delivery count only as long as a retired lease's, so `newest` does not grow forever.
    pub(crate) fn note_unleased(&mut self, key: DeliveryKey, now: Instant) {
        self.retired.push_back((now, key));
    }

    fn forget(&mut self, key: DeliveryKey) {
        let Some(record) = self.records.get(&key) else {
            if self.newest.get(&key.stream_sequence) == Some(&key.delivered) {
                self.newest.remove(&key.stream_sequence);
            }
            return;
        };
        // A record may have been re-issued since it was retired; only forget retired ones.
        if matches!(
            record.state,
            State::Active | State::Extending | State::Settling(_)
        ) {
            return;
        }
        self.records.remove(&key);
        if self.newest.get(&key.stream_sequence) == Some(&key.delivered) {
            self.newest.remove(&key.stream_sequence);
        }
    }
}

/// How long before the server's own redelivery a lease ends: the server starts its timer
/// when it sends, a little before the gateway receives.
pub(crate) fn lease_margin(ack_wait: Duration) -> Duration {
    (ack_wait / 20).min(Duration::from_secs(1))
}

#[cfg(test)]
mod tests;
