//! Ordering per key, as the dispatcher sees it: binding an ordered consumer, fencing keyed
//! messages while another process may still hold some, asking the other replicas how
//! messages redelivered after a change of pin ended, keeping the ordering gate's held
//! messages alive and warning of hot keys. The gate itself (which key is free) is
//! [`LeaseState`]'s; this is the part that talks to NATS and to the other replicas.
//!
//! May import: as the rest of `dispatch`.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tracing::{info, warn};

use super::{Dispatcher, SETTLE_AGAIN_TIMEOUT};
use crate::domain::delivery::Delivery;
use crate::domain::finals::{Final, MessageKey};
use crate::nats::Bound;
use crate::nats::pull;
use crate::nats::settle as nats_settle;
use crate::state::LeaseState;

/// How often a fenced ordered consumer reads the server's count of pending messages (see
/// [`watch_fence`]).
const FENCE_POLL: Duration = Duration::from_millis(100);
/// The header in which the server names the pin of a priority-group consumer's delivery.
const PIN_HEADER: &str = "Nats-Pin-Id";
/// How often at most the WARN about hot ordering keys is logged.
const HOT_KEYS_WARN_EVERY: Duration = Duration::from_secs(60);
/// How many of the hottest keys that WARN names.
const HOT_KEYS_NAMED: usize = 5;

impl Dispatcher {
    /// An ordered consumer was bound. Under a new epoch (the first binding, a recreated
    /// consumer) the gate knows nothing of what is out: if the server counts messages
    /// pending, another process (an earlier run, another replica) may still hold some, so
    /// keyed messages wait until nothing is out elsewhere.
    pub(super) fn bind_ordering(&mut self, bound: &Arc<Bound>, new_epoch: bool) {
        if self.state.ordering_key().is_none() {
            return;
        }
        let info = bound.consumer.cached_info();
        self.max_deliver = u64::try_from(info.config.max_deliver)
            .ok()
            .filter(|max| *max > 0);
        if !new_epoch {
            return;
        }
        self.ordered_epoch = Some(bound.epoch);
        if let Some(watch) = self.fence_watch.take() {
            watch.abort();
        }
        if info.num_ack_pending == 0 {
            self.state.lift_ordering_fence();
            return;
        }
        info!(
            pending = info.num_ack_pending,
            "ordered consumer bound with messages pending elsewhere: keyed messages wait until nothing is out with another process"
        );
        self.fence_ordered(bound);
    }

    /// Ask the other replicas about what the server delivers anew (see [`verify_window`]).
    pub(super) fn verify_after_pin(&mut self) {
        if let Some(watch) = self.verify_watch.take() {
            watch.abort();
        }
        if let Some(bound) = self.bound.clone() {
            // Everything until the window is known (one round trip to the others).
            self.state.verify_below(u64::MAX);
            self.verify_watch = Some(tokio::spawn(verify_window(self.state.clone(), bound)));
        }
    }

    /// [`Dispatcher::fence_ordered`] under the current binding.
    pub(super) fn fence_ordered_now(&mut self) {
        if let Some(bound) = self.bound.clone() {
            self.fence_ordered(&bound);
        }
    }

    /// Hold every keyed message until nothing is out with another process (see
    /// [`watch_fence`]).
    fn fence_ordered(&mut self, bound: &Arc<Bound>) {
        if let Some(watch) = self.fence_watch.take() {
            watch.abort();
        }
        self.state.fence_ordered();
        self.fence_watch = Some(tokio::spawn(watch_fence(self.state.clone(), bound.clone())));
    }

    /// Nak back what the ordering gate holds (see [`LeaseState::release_ordered`]).
    pub(super) async fn release_ordered(&mut self, forget_heads: bool) {
        let released = self.state.release_ordered(forget_heads);
        if let Some(bound) = &self.bound {
            for delivery in &released {
                nats_settle::release(bound, &delivery.reply).await;
            }
        }
        for delivery in released {
            self.state.released(delivery.coordinates.key);
        }
    }

    /// Keep the ordering gate's held messages alive, and lease those whose key is free.
    pub(super) async fn tend_ordered(&mut self, now: Instant) {
        if self.state.ordering_key().is_none() {
            return;
        }
        if let Some(max_deliver) = self.max_deliver {
            self.state.free_sidelined(max_deliver);
        }
        let Some(bound) = self.bound.clone() else {
            return;
        };
        for reply in self.state.keep_alive_due(now) {
            nats_settle::keep_alive(&bound, &reply).await;
        }
        let mut ready = self.state.take_ready();
        for delivery in &mut ready {
            // Its last `+WPI` may be a while ago: restart its timer, so that it is held for
            // the next fetch as long as any delivery, and leased with most of its ack_wait.
            nats_settle::keep_alive(&bound, &delivery.reply).await;
            delivery.received_at = now;
        }
        if !ready.is_empty() {
            self.book.hand_out_released(ready);
        }
    }

    /// When held messages fill max_ack_pending, say which keys hold them (once a minute).
    pub(super) fn warn_of_hot_keys(&mut self, now: Instant, capacity: usize) {
        let held = self.state.ordering_held();
        // While fenced everything is held, behind no key in particular.
        if capacity > 0
            || held == 0
            || held < self.state.max_ack_pending() / 2
            || self.state.ordering_fenced()
        {
            return;
        }
        if self
            .hot_keys_warned
            .is_some_and(|at| now < at + HOT_KEYS_WARN_EVERY)
        {
            return;
        }
        self.hot_keys_warned = Some(now);
        let hottest: Vec<String> = self
            .state
            .hottest_keys(HOT_KEYS_NAMED)
            .into_iter()
            .map(|(key, held)| format!("{key} ({held} held)"))
            .collect();
        warn!(
            held,
            max_ack_pending = self.state.max_ack_pending(),
            hottest = hottest.join(", "),
            "messages held behind busy ordering keys fill max_ack_pending: every other key waits until these keys' heads are settled"
        );
    }
}

/// The pin a delivery of a priority-group consumer carries, taken out of its headers: it
/// is the server's word to this process, not part of the message.
pub(super) fn take_pin(delivery: &mut Delivery) -> Option<String> {
    let headers = delivery.headers.as_ref()?;
    let pin = headers.get(PIN_HEADER)?.as_str().to_owned();
    let mut kept = async_nats::HeaderMap::new();
    for (name, values) in headers.iter() {
        if AsRef::<str>::as_ref(name) != PIN_HEADER {
            for value in values {
                kept.append(name.clone(), value.clone());
            }
        }
    }
    delivery.headers = (!kept.is_empty()).then_some(kept);
    Some(pin)
}

/// Lift the ordering gate's fence once nothing is out with another process: the server
/// counts no more messages pending than this process holds (a killed process's leases came
/// back after their ack_wait; a replica that lost its pin settled or gave back what it had).
/// Counted only between two reads that saw no delivery arrive here, so that a delivery on
/// its way in is never taken for one of this process's.
async fn watch_fence(state: Arc<LeaseState>, bound: Arc<Bound>) {
    loop {
        let arrived_before = state.highest_consumer_sequence();
        if let Some(pending) = pull::ack_pending(&bound).await {
            let holding = state.holding();
            if state.highest_consumer_sequence() == arrived_before && pending <= holding {
                break;
            }
        }
        tokio::time::sleep(FENCE_POLL).await;
    }
    if state.ordering_fenced() {
        settle_what_ended_elsewhere(&state, &bound).await;
        info!(
            "ordered consumer: nothing is out with another process any more; leasing by key again"
        );
        state.lift_ordering_fence();
    }
}

/// Before the fence is lifted, every message the server counts pending is in this
/// process's hands. Some may have ended through another replica, the server having lost
/// that (killed before its consumer state was on disk): asked of the other replicas, those
/// are settled again rather than leased a second time — to a key's workers that would look
/// like the key going back.
async fn settle_what_ended_elsewhere(state: &Arc<LeaseState>, bound: &Arc<Bound>) {
    let held = state.held_messages();
    settle_if_ended_elsewhere(state, bound, held).await;
}

/// Ask the other replicas how `messages` (held here) ended; settle again those that ended
/// there, and let the others go out in their turn.
async fn settle_if_ended_elsewhere(
    state: &Arc<LeaseState>,
    bound: &Arc<Bound>,
    messages: Vec<MessageKey>,
) {
    let Some(ask) = state.elsewhere() else {
        return;
    };
    if messages.is_empty() {
        return;
    }
    let answers = (ask.finals)(messages.clone()).await;
    for (message, outcome) in messages.into_iter().zip(answers) {
        let Some(outcome) = outcome else {
            state.verified(message.stream_sequence);
            continue;
        };
        let Some(delivery) = state.take_ended(message.stream_sequence) else {
            continue;
        };
        state.ended_elsewhere(message, outcome.clone());
        state
            .metrics
            .settled_again(matches!(outcome, Final::Terminated { .. }), true);
        info!(
            stream_sequence = message.stream_sequence,
            "a message that ended through another replica was delivered again (the server lost that); settling it again"
        );
        let deadline = tokio::time::sleep(SETTLE_AGAIN_TIMEOUT);
        if nats_settle::confirm(bound, &delivery.reply, &outcome.command(), deadline)
            .await
            .is_err()
        {
            warn!(
                stream_sequence = message.stream_sequence,
                "settling a redelivered message again was not confirmed; the server redelivers it after ack_wait"
            );
        }
    }
}

/// After a change of pinned replica: the server may have lost the deliveries (and acks) of
/// a while (killed before its consumer state was on disk) and delivers those messages anew,
/// as if for the first time. Up to the highest stream sequence any other replica was
/// delivered, each keyed message is held until the others were asked how it ended, and
/// settled again if it did; the window closes once the server delivered past it.
async fn verify_window(state: Arc<LeaseState>, bound: Arc<Bound>) {
    let Some(ask) = state.elsewhere() else {
        return;
    };
    let below = (ask.highest)().await;
    state.verify_below(below);
    loop {
        let batch = state.take_to_verify();
        let asked = !batch.is_empty();
        settle_if_ended_elsewhere(&state, &bound, batch).await;
        if !asked {
            let past = below == 0
                || pull::delivered_stream_sequence(&bound)
                    .await
                    .is_some_and(|delivered| delivered >= below);
            if past && state.stop_verifying() {
                return;
            }
        }
        tokio::time::sleep(FENCE_POLL).await;
    }
}
