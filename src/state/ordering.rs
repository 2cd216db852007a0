//! Ordering per key, in the shared lease state: the gate between what arrives and what is
//! leased (see [`OrderingGate`]), its fence while another process may still hold keyed
//! messages, the window of messages to ask the other replicas about, and this process's pin
//! to the ordered consumer. Without an ordering key every call is a no-op.
//!
//! May import: as the rest of `state`.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::Instant;

use super::{Elsewhere, LeaseState};
use crate::domain::delivery::Delivery;
use crate::domain::finals::MessageKey;
use crate::domain::lease_id::DeliveryKey;
use crate::domain::ordering::{KeyOf, OrderingGate, OrderingKeySpec};

impl LeaseState {
    /// The consumer's ordering key, if it has one.
    pub(crate) fn ordering_key(&self) -> Option<&OrderingKeySpec> {
        self.ordering.as_ref().map(|ordering| &ordering.spec)
    }

    /// Run `act` on the gate (when there is one), then publish its figures; when it made
    /// messages ready, wake the dispatcher to lease them.
    pub(super) fn with_gate<T: Default>(&self, act: impl FnOnce(&mut OrderingGate) -> T) -> T {
        let Some(ordering) = &self.ordering else {
            return T::default();
        };
        let mut gate = ordering
            .gate
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let result = act(&mut gate);
        self.metrics.ordering(gate.held(), gate.busy_keys());
        if gate.has_ready() {
            self.capacity_freed.notify_one();
        }
        result
    }

    /// A delivery arrived: `Some` to lease it now, `None` when the gate holds it for its key.
    pub(crate) fn admit(&self, delivery: Delivery) -> Option<Delivery> {
        let Some(ordering) = &self.ordering else {
            return Some(delivery);
        };
        match ordering
            .spec
            .key_of(delivery.subject.as_str(), delivery.headers.as_ref())
        {
            KeyOf::Unordered => Some(delivery),
            KeyOf::TooLong => {
                self.metrics.ordering_key_rejected();
                Some(delivery)
            }
            KeyOf::Key(key) => self.with_gate(|gate| gate.admit(key, delivery)),
        }
    }

    /// Held messages whose key became free, to lease now.
    pub(crate) fn take_ready(&self) -> Vec<Delivery> {
        self.with_gate(OrderingGate::take_ready)
    }

    /// How often a held message is kept alive: well within ack_wait.
    fn keep_alive_every(&self) -> Duration {
        self.ack_wait() / 3
    }

    /// Reply subjects of held messages due a `+WPI` now.
    pub(crate) fn keep_alive_due(&self, now: Instant) -> Vec<Arc<str>> {
        let every = self.keep_alive_every();
        self.with_gate(|gate| gate.keep_alive_due(now, every))
    }

    /// When the next held message is due a `+WPI`.
    pub(crate) fn next_keep_alive(&self) -> Option<Instant> {
        let every = self.keep_alive_every();
        self.with_gate(|gate| gate.next_keep_alive(every))
    }

    /// Messages held for a busy key (they count against max_ack_pending).
    pub(crate) fn ordering_held(&self) -> usize {
        self.with_gate(|gate| gate.held())
    }

    /// Keys with a message out.
    pub(crate) fn busy_keys(&self) -> usize {
        self.with_gate(|gate| gate.busy_keys())
    }

    /// The keys holding the most messages, most first.
    pub(crate) fn hottest_keys(&self, n: usize) -> Vec<(Arc<str>, usize)> {
        self.with_gate(|gate| gate.hottest(n))
    }

    /// Heads the server will not deliver again (their `max_deliver`-th lease ended) free
    /// their keys, as a dead-lettered message does.
    pub(crate) fn free_sidelined(&self, max_deliver: u64) {
        let now = Instant::now();
        self.with_gate(|gate| {
            let sidelined = gate.sidelined(max_deliver, |stream_sequence, delivered| {
                self.leases().is_live(
                    DeliveryKey {
                        stream_sequence,
                        delivered,
                    },
                    now,
                )
            });
            for stream_sequence in sidelined {
                gate.finished(stream_sequence);
            }
        });
    }

    /// Everything the gate holds, to nak back; `forget_heads` when every lease was voided.
    pub(crate) fn release_ordered(&self, forget_heads: bool) -> Vec<Delivery> {
        self.with_gate(|gate| gate.release(forget_heads))
    }

    /// Hold every keyed message until nothing is out elsewhere (see [`OrderingGate::fence`]).
    pub(crate) fn fence_ordered(&self) {
        self.with_gate(OrderingGate::fence);
    }

    pub(crate) fn ordering_fenced(&self) -> bool {
        self.with_gate(|gate| gate.is_fenced())
    }

    pub(crate) fn lift_ordering_fence(&self) {
        self.with_gate(OrderingGate::lift_fence);
    }

    /// How to ask the other replicas.
    pub(crate) fn set_elsewhere(&self, ask: Elsewhere) {
        let _ = self.elsewhere.set(ask);
    }

    pub(crate) fn elsewhere(&self) -> Option<Elsewhere> {
        self.elsewhere.get().cloned()
    }

    /// The highest stream sequence ever delivered to this process.
    pub(crate) fn highest_stream_sequence(&self) -> u64 {
        self.highest_stream_sequence.load(Ordering::Relaxed)
    }

    /// Hold keyed messages up to `stream_sequence` until the other replicas were asked.
    pub(crate) fn verify_below(&self, stream_sequence: u64) {
        self.with_gate(|gate| gate.verify_below(stream_sequence));
    }

    pub(crate) fn take_to_verify(&self) -> Vec<MessageKey> {
        self.with_gate(OrderingGate::take_to_verify)
    }

    pub(crate) fn verified(&self, stream_sequence: u64) {
        self.with_gate(|gate| gate.verified(stream_sequence));
    }

    /// Close the window of messages to ask about, once none is left to ask about.
    pub(crate) fn stop_verifying(&self) -> bool {
        self.with_gate(|gate| {
            gate.stop_verifying();
            gate.verifying().is_none()
        })
    }

    /// The messages the ordering gate holds.
    pub(crate) fn held_messages(&self) -> Vec<MessageKey> {
        self.with_gate(|gate| gate.held_messages())
    }

    /// Take held message `stream_sequence` out of the gate: it ended elsewhere.
    pub(crate) fn take_ended(&self, stream_sequence: u64) -> Option<Delivery> {
        self.with_gate(|gate| gate.take_ended(stream_sequence))
    }

    /// The pin the server gave this process, to name in its pulls.
    pub(crate) fn pin(&self) -> Option<Arc<str>> {
        self.pin.lock().ok().and_then(|pin| pin.clone())
    }

    /// A delivery carried pin `id`: `true` when this process did not have it (it was just
    /// pinned, or pinned anew).
    pub(crate) fn pinned(&self, id: &str) -> bool {
        let Ok(mut pin) = self.pin.lock() else {
            return false;
        };
        if pin.as_deref() == Some(id) {
            return false;
        }
        *pin = Some(id.into());
        true
    }

    /// The server refused this process's pull: another is pinned.
    pub(crate) fn unpinned(&self) {
        if let Ok(mut pin) = self.pin.lock() {
            *pin = None;
        }
    }

    /// Deliveries the dispatcher holds outside the gate (for fetches, or for the next one),
    /// as it last counted.
    pub(crate) fn set_dispatcher_holding(&self, count: usize) {
        self.dispatcher_holding.store(count, Ordering::Relaxed);
    }

    /// Messages this process has out of the server's hands: leased (delayed naks included),
    /// held by the ordering gate, or held by the dispatcher.
    pub(crate) fn holding(&self) -> usize {
        self.taken() + self.ordering_held() + self.dispatcher_holding.load(Ordering::Relaxed)
    }
}
