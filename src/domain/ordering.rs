//! Ordering per key: which part of a message is its key, and the gate that lets at most one
//! message of a key be out (leased, or on its way back to be leased again) at a time, in
//! stream order.
//!
//! JetStream has no per-key limit on ack-pending messages, so the gateway keeps one. What
//! arrives for a busy key is held here (the dispatcher keeps it alive with `+WPI`) and
//! becomes ready the moment its key's head is acked or terminated. A head that was nak'd,
//! expired or given back stays its key's head: the server delivers it again, and only that
//! delivery is let through.
//!
//! Pure state: no clock of its own, no I/O. May import: the rest of `domain` only.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use tokio::time::Instant;

use super::SequenceMap;
use super::delivery::Delivery;
use super::finals::MessageKey;

/// The header `POST /publish` writes a message's `ordering_key` to, and the one
/// `ordering_key = "header"` reads.
pub(crate) const ORDERING_KEY_HEADER: &str = "Ruststream-Ordering-Key";
/// The priority group an ordered consumer is made with (policy `pinned_client`): one
/// replica at a time is pinned and pulls, so one gate sees every message.
pub(crate) const PIN_GROUP: &str = "ruststream";
/// How long the server keeps a replica pinned that stopped pulling: when it dies, another
/// is pinned this much later.
pub(crate) const PIN_TIMEOUT: Duration = Duration::from_secs(5);
/// A longer key is no key: the message is leased unordered (and counted).
pub(crate) const MAX_KEY_BYTES: usize = 1024;

/// Where a consumer's messages carry their ordering key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OrderingKeySpec {
    /// The n-th token of the subject, 1-based (`orders.<customer>.created` → 2).
    SubjectToken(usize),
    /// A message header, by name.
    Header(String),
}

impl FromStr for OrderingKeySpec {
    type Err = String;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        const EXPECTED: &str = "expected `subject:<n>` (the n-th subject token, from 1), \
                                `header:<Name>`, or `header` (Ruststream-Ordering-Key)";
        if value == "header" {
            return Ok(Self::Header(ORDERING_KEY_HEADER.to_owned()));
        }
        if let Some(token) = value.strip_prefix("subject:") {
            return match token.parse::<usize>() {
                Ok(n) if n >= 1 => Ok(Self::SubjectToken(n)),
                _ => Err(format!(
                    "`{value}`: the subject token must be a number from 1 ({EXPECTED})"
                )),
            };
        }
        if let Some(name) = value.strip_prefix("header:") {
            let valid = !name.is_empty()
                && name
                    .bytes()
                    .all(|byte| byte.is_ascii_graphic() && byte != b':');
            return if valid {
                Ok(Self::Header(name.to_owned()))
            } else {
                Err(format!(
                    "`{value}`: a header name is printable ASCII without `:` or spaces ({EXPECTED})"
                ))
            };
        }
        Err(format!("`{value}`: {EXPECTED}"))
    }
}

impl fmt::Display for OrderingKeySpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::SubjectToken(n) => write!(f, "subject:{n}"),
            // As it is written in a consumers file.
            Self::Header(name) if name == ORDERING_KEY_HEADER => f.write_str("header"),
            Self::Header(name) => write!(f, "header:{name}"),
        }
    }
}

/// A message's ordering key, as its consumer's spec finds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum KeyOf {
    /// No key (the token or header is missing): leased unordered.
    Unordered,
    /// A key longer than [`MAX_KEY_BYTES`]: leased unordered, and counted.
    TooLong,
    Key(Arc<str>),
}

impl OrderingKeySpec {
    pub(crate) fn key_of(&self, subject: &str, headers: Option<&HeaderMap>) -> KeyOf {
        let key = match self {
            Self::SubjectToken(n) => subject.split('.').nth(n - 1),
            Self::Header(name) => headers
                .and_then(|headers| headers.get(name.as_str()))
                .map(async_nats::HeaderValue::as_str),
        };
        match key {
            None | Some("") => KeyOf::Unordered,
            Some(key) if key.len() > MAX_KEY_BYTES => KeyOf::TooLong,
            Some(key) => KeyOf::Key(key.into()),
        }
    }
}

/// Where a key's head (its one message out) is.
#[derive(Debug)]
struct Head {
    key: Arc<str>,
    delivered: u64,
    at: HeadAt,
}

/// Who has a key's head now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HeadAt {
    /// The dispatcher, to lease to the next fetch.
    Dispatcher,
    /// A client, leased (its lease may have expired since).
    Client,
    /// The server: nak'd back, to be delivered again unless it was the last delivery.
    Server,
}

#[derive(Debug, Default)]
struct Key {
    /// The stream sequence of the message of this key that is out.
    head: Option<u64>,
    /// Its later messages the gateway received, by stream sequence.
    held: BTreeMap<u64, Delivery>,
}

/// The gate: each key's head and held messages.
#[derive(Debug, Default)]
pub(crate) struct OrderingGate {
    keys: HashMap<Arc<str>, Key>,
    heads: SequenceMap<u64, Head>,
    held: usize,
    /// Held messages whose key became free: to be leased next.
    ready: Vec<Delivery>,
    /// After a start or a change of pinned replica: every message waits, since one of its
    /// key may still be out with another process; lifted once nothing is.
    fenced: bool,
    /// When the oldest held message needs its next `+WPI`.
    next_keep_alive: Option<Instant>,
    /// After a change of pinned replica: messages up to this stream sequence may have ended
    /// through another replica, the server having lost that; each is held until the others
    /// were asked ([`OrderingGate::verified`]).
    verify_below: Option<u64>,
    /// Held messages not asked about yet, and those being asked about.
    unverified: std::collections::BTreeSet<u64>,
    to_verify: Vec<MessageKey>,
}

impl OrderingGate {
    /// A delivery of key `key` arrived: `Some` to lease it now (it is its key's head),
    /// `None` when it is held until its key is free.
    pub(crate) fn admit(&mut self, key: Arc<str>, delivery: Delivery) -> Option<Delivery> {
        let sequence = delivery.coordinates.key.stream_sequence;
        let entry = self.keys.entry(key.clone()).or_default();
        let first_held = entry.held.keys().next().copied();
        let unverified = self.verify_below.is_some_and(|below| sequence <= below)
            && !self.heads.contains_key(&sequence);
        if unverified {
            if self.unverified.insert(sequence) {
                self.to_verify.push(MessageKey::of(&delivery.coordinates));
            }
        } else if self.fenced {
            // Its head came back while fenced: held like the rest, and first of its key
            // once the fence is lifted.
            if entry.head == Some(sequence) {
                entry.head = None;
                self.heads.remove(&sequence);
            }
        } else {
            let is_head = match entry.head {
                Some(head) => head == sequence,
                None => first_held.is_none_or(|first| sequence < first),
            };
            if is_head {
                entry.head = Some(sequence);
                self.heads.insert(
                    sequence,
                    Head {
                        key,
                        delivered: delivery.coordinates.key.delivered,
                        at: HeadAt::Dispatcher,
                    },
                );
                return Some(delivery);
            }
        }
        let received_at = delivery.received_at;
        // Delivered again while held (a `+WPI` lost): the newer delivery replaces it.
        if entry.held.insert(sequence, delivery).is_none() {
            self.held += 1;
        }
        self.next_keep_alive = Some(
            self.next_keep_alive
                .map_or(received_at, |at| at.min(received_at)),
        );
        None
    }

    /// The head `stream_sequence` was handed to a client.
    pub(crate) fn leased(&mut self, stream_sequence: u64) {
        self.head_at(stream_sequence, HeadAt::Client);
    }

    /// The head `stream_sequence` was given back by its client (it went away): the
    /// dispatcher holds it for the next fetch.
    pub(crate) fn given_back(&mut self, stream_sequence: u64) {
        self.head_at(stream_sequence, HeadAt::Dispatcher);
    }

    /// The head `stream_sequence` was nak'd back to the server: it stays its key's head,
    /// to be delivered again.
    pub(crate) fn returned(&mut self, stream_sequence: u64) {
        self.head_at(stream_sequence, HeadAt::Server);
    }

    fn head_at(&mut self, stream_sequence: u64, at: HeadAt) {
        if let Some(head) = self.heads.get_mut(&stream_sequence) {
            head.at = at;
        }
    }

    /// The message `stream_sequence` ended (acked or terminated, confirmed; or sidelined by
    /// max_deliver): if it was a head, its key's next held message is ready.
    pub(crate) fn finished(&mut self, stream_sequence: u64) {
        let Some(head) = self.heads.remove(&stream_sequence) else {
            return;
        };
        if let Some(entry) = self.keys.get_mut(&head.key) {
            entry.head = None;
        }
        self.promote(&head.key);
    }

    /// Make `key`'s first held message its head, if it has none and the fence allows.
    fn promote(&mut self, key: &Arc<str>) {
        let Some(entry) = self.keys.get_mut(key) else {
            return;
        };
        if entry.head.is_some() {
            return;
        }
        let Some(first) = entry.held.keys().next().copied() else {
            self.keys.remove(key);
            return;
        };
        if self.fenced || self.unverified.contains(&first) {
            return;
        }
        let Some(delivery) = entry.held.remove(&first) else {
            return;
        };
        self.held -= 1;
        entry.head = Some(first);
        self.heads.insert(
            first,
            Head {
                key: key.clone(),
                delivered: delivery.coordinates.key.delivered,
                at: HeadAt::Dispatcher,
            },
        );
        self.ready.push(delivery);
    }

    /// Hold every message that comes until [`OrderingGate::lift_fence`]: another process
    /// may still have one of its key out. What this process has out stays its key's head.
    pub(crate) fn fence(&mut self) {
        self.fenced = true;
    }

    pub(crate) fn is_fenced(&self) -> bool {
        self.fenced
    }

    /// Nothing of any key is out with another process any more: each key goes on from its
    /// oldest held message.
    pub(crate) fn lift_fence(&mut self) {
        if !std::mem::take(&mut self.fenced) {
            return;
        }
        let waiting: Vec<Arc<str>> = self
            .keys
            .iter()
            .filter(|(_, entry)| entry.head.is_none())
            .map(|(key, _)| key.clone())
            .collect();
        for key in waiting {
            self.promote(&key);
        }
    }

    /// Whether held messages wait to be leased since their key became free.
    pub(crate) fn has_ready(&self) -> bool {
        !self.ready.is_empty()
    }

    /// Held messages whose key became free, to lease.
    pub(crate) fn take_ready(&mut self) -> Vec<Delivery> {
        std::mem::take(&mut self.ready)
    }

    /// Reply subjects of held messages whose last `+WPI` (or delivery) is `every` old;
    /// each counts as kept alive from `now` on.
    pub(crate) fn keep_alive_due(&mut self, now: Instant, every: Duration) -> Vec<Arc<str>> {
        if self.next_keep_alive.is_none_or(|at| at + every > now) {
            return Vec::new();
        }
        let mut due = Vec::new();
        let mut oldest: Option<Instant> = None;
        for entry in self.keys.values_mut() {
            for delivery in entry.held.values_mut() {
                if delivery.received_at + every <= now {
                    // The server restarts its ack timer when the `+WPI` arrives, after now:
                    // a lease of it counted from now ends early, never late.
                    delivery.received_at = now;
                    due.push(delivery.reply.clone());
                }
                oldest =
                    Some(oldest.map_or(delivery.received_at, |at| at.min(delivery.received_at)));
            }
        }
        self.next_keep_alive = oldest;
        due
    }

    /// When the next `+WPI` is due, given `every`.
    pub(crate) fn next_keep_alive(&self, every: Duration) -> Option<Instant> {
        self.next_keep_alive.map(|at| at + every)
    }

    /// Heads that are back at the server after their `max_deliver`-th delivery (nak'd, or
    /// their lease expired): the server will not deliver them again. `live` says whether
    /// the lease of a leased head still lives.
    pub(crate) fn sidelined(&self, max_deliver: u64, live: impl Fn(u64, u64) -> bool) -> Vec<u64> {
        self.heads
            .iter()
            .filter(|(sequence, head)| {
                head.delivered >= max_deliver
                    && match head.at {
                        HeadAt::Server => true,
                        HeadAt::Client => !live(**sequence, head.delivered),
                        HeadAt::Dispatcher => false,
                    }
            })
            .map(|(sequence, _)| *sequence)
            .collect()
    }

    /// Everything held and ready, out of the gate (to nak back); with `forget_heads`, the
    /// heads too (every lease was voided).
    pub(crate) fn release(&mut self, forget_heads: bool) -> Vec<Delivery> {
        let mut released: Vec<Delivery> = std::mem::take(&mut self.ready);
        for entry in self.keys.values_mut() {
            released.extend(std::mem::take(&mut entry.held).into_values());
        }
        self.held = 0;
        self.next_keep_alive = None;
        self.unverified.clear();
        self.to_verify.clear();
        // A ready message was a head not yet leased: back at the server it stays the head.
        for delivery in &released {
            self.returned(delivery.coordinates.key.stream_sequence);
        }
        if forget_heads {
            self.heads.clear();
            self.keys.clear();
        } else {
            self.keys.retain(|_, entry| entry.head.is_some());
        }
        released
    }

    /// The messages held, by stream sequence and publish time.
    pub(crate) fn held_messages(&self) -> Vec<MessageKey> {
        self.keys
            .values()
            .flat_map(|entry| entry.held.values())
            .map(|delivery| MessageKey::of(&delivery.coordinates))
            .collect()
    }

    /// Take held message `stream_sequence` out: it ended elsewhere (the server lost that).
    pub(crate) fn take_ended(&mut self, stream_sequence: u64) -> Option<Delivery> {
        let key = self
            .keys
            .iter()
            .find(|(_, entry)| entry.held.contains_key(&stream_sequence))
            .map(|(key, _)| key.clone())?;
        let entry = self.keys.get_mut(&key)?;
        let delivery = entry.held.remove(&stream_sequence)?;
        self.held -= 1;
        self.unverified.remove(&stream_sequence);
        if entry.head.is_none() && entry.held.is_empty() {
            self.keys.remove(&key);
        } else {
            self.promote(&key);
        }
        Some(delivery)
    }

    /// Hold what comes up to `stream_sequence` until it was asked about (see
    /// [`OrderingGate::verify_below`]).
    pub(crate) fn verify_below(&mut self, stream_sequence: u64) {
        self.verify_below = Some(stream_sequence);
    }

    /// The held messages to ask the other replicas about now.
    pub(crate) fn take_to_verify(&mut self) -> Vec<MessageKey> {
        std::mem::take(&mut self.to_verify)
    }

    /// Held message `stream_sequence` did not end elsewhere: it may go out in its turn.
    pub(crate) fn verified(&mut self, stream_sequence: u64) {
        if !self.unverified.remove(&stream_sequence) {
            return;
        }
        let key = self
            .keys
            .iter()
            .find(|(_, entry)| entry.held.contains_key(&stream_sequence))
            .map(|(key, _)| key.clone());
        if let Some(key) = key {
            self.promote(&key);
        }
    }

    /// Whether messages wait to be asked about, and up to which stream sequence.
    pub(crate) fn verifying(&self) -> Option<u64> {
        self.verify_below
    }

    /// Nothing more can need asking about: the server delivered past the window again.
    pub(crate) fn stop_verifying(&mut self) {
        if self.unverified.is_empty() {
            self.verify_below = None;
        }
    }

    /// Messages held for a busy key.
    pub(crate) fn held(&self) -> usize {
        self.held + self.ready.len()
    }

    /// Keys with a message out.
    pub(crate) fn busy_keys(&self) -> usize {
        self.heads.len()
    }

    /// The `n` keys with the most held messages, most first.
    pub(crate) fn hottest(&self, n: usize) -> Vec<(Arc<str>, usize)> {
        let mut keys: Vec<(Arc<str>, usize)> = self
            .keys
            .iter()
            .filter(|(_, entry)| !entry.held.is_empty())
            .map(|(key, entry)| (key.clone(), entry.held.len()))
            .collect();
        keys.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        keys.truncate(n);
        keys
    }
}

#[cfg(test)]
mod tests;
