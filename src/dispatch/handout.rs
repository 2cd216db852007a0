//! The hand-out: what arrives by the pulls and what becomes of it — placed with the fetch
//! that asked, held for the next one, settled again when it had ended here before, or
//! released to the server — and answering the fetches that are done with their leases.
//!
//! May import: as the rest of `dispatch`.

use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::ordered::take_pin;
use super::{Dispatcher, SETTLE_AGAIN_TIMEOUT};
use crate::domain::delivery::Delivery;
use crate::domain::finals::{Final, Source};
use crate::nats::pull::PullEvent;
use crate::nats::settle as nats_settle;

impl Dispatcher {
    pub(super) fn on_inbound(&mut self, inbound: PullEvent) {
        let now = Instant::now();
        let (pull_id, delivery) = match inbound {
            PullEvent::Delivery { pull_id, delivery } => (pull_id, delivery),
            PullEvent::Unusable { pull_id, reply } => {
                self.book.count_delivery(pull_id, now);
                if let Some(reply) = reply {
                    self.unusable.push(reply);
                }
                return;
            }
            PullEvent::Ended {
                pull_id,
                status,
                description,
            } => {
                debug!(status, description, "pull request ended");
                let refused = matches!(status, 408 | 409 | 423) && description != "Request Timeout";
                if status == 423 && self.book.is_open(pull_id) && self.state.pin().is_some() {
                    info!(
                        description,
                        "another replica is pinned to the ordered consumer: this one stops pulling it"
                    );
                    self.state.unpinned();
                }
                // Only a pull of the current binding says anything about it.
                let current = self.book.is_open(pull_id);
                if current && status == 409 && description.contains("Consumer Deleted") {
                    warn!("the consumer was deleted; waiting to rebind");
                    self.request_rebind();
                }
                if current && status == 503 {
                    self.request_rebind();
                }
                if status == 408 && description == "Requests Pending" {
                    self.book.end_pull_behind_others(pull_id, now);
                } else {
                    self.book.end_pull(pull_id, refused, now);
                }
                return;
            }
        };
        let owner = self
            .book
            .count_delivery_from(pull_id, now, delivery.pending);
        // First of all: a message that ended through this gateway is settled again, never
        // leased nor released, whatever its delivery count and whichever binding it came by
        // (the server can lose a confirmed settle, and lose it again after the next crash).
        if let Some(outcome) = self.state.final_of(&delivery.coordinates) {
            if delivery.coordinates.epoch == self.state.epoch() {
                self.void_if_made_again(&delivery);
            }
            self.settle_again(delivery, outcome);
            return;
        }
        if delivery.coordinates.epoch != self.state.epoch() {
            // From a consumer since recreated: only ever nak'd (by release_held).
            self.book.hold(delivery);
            return;
        }
        if self.void_if_made_again(&delivery) {
            // This delivery, of the old epoch now, is released and comes back.
            self.book.hold(delivery);
            return;
        }
        let mut delivery = delivery;
        if self.state.ordering_key().is_some()
            && let Some(pin) = take_pin(&mut delivery)
            && self.state.pinned(&pin)
        {
            // Pinned (again): another replica may have had the pin meanwhile, and may
            // still have messages of some keys out.
            info!(
                "pinned to the ordered consumer: keyed messages wait until nothing is out with another replica"
            );
            self.fence_ordered_now();
            self.verify_after_pin();
        }
        // An ordered consumer's gate holds what comes for a busy key.
        let Some(delivery) = self.state.admit(delivery) else {
            self.book.diverted(owner);
            return;
        };
        if self.state.is_ending(&delivery.coordinates) {
            // An ack or term of this message is on its way: leased now, it would be handed
            // out twice should that settle be confirmed.
            self.book.diverted(owner);
            self.await_settle(delivery);
            return;
        }
        self.book.place(owner, delivery);
    }

    /// Note `delivery`; `true` when the server made it before with the same numbers. Then
    /// the server lost deliveries it had made (its consumer state was not on disk when it
    /// died) and makes them again, so ids issued before would name them too (the position
    /// the server reported at rebind does not always show it; this does): every earlier
    /// lease is void, and the consumer is bound again under a new epoch.
    fn void_if_made_again(&mut self, delivery: &Delivery) -> bool {
        if !self.state.note_delivery(&delivery.coordinates) {
            return false;
        }
        warn!(
            stream_sequence = delivery.coordinates.key.stream_sequence,
            delivered = delivery.coordinates.key.delivered,
            "the server delivered a message again with the same delivery count; every earlier lease is void"
        );
        self.state.new_epoch();
        self.request_rebind();
        true
    }

    /// A message acked or terminated through this gateway came back: the server confirmed
    /// that settle, then lost it (killed before its state was on disk). Settle it again,
    /// confirmed, instead of leasing it a second time; should that fail, the server
    /// redelivers it after ack_wait and it comes here again.
    fn settle_again(&self, delivery: Delivery, outcome: Final) {
        let Some(bound) = self.bound.clone() else {
            return;
        };
        let command = outcome.command();
        let by_fleet = self.state.final_source(&delivery.coordinates) == Some(Source::Fleet);
        self.state
            .metrics
            .settled_again(matches!(outcome, Final::Terminated { .. }), by_fleet);
        info!(
            stream_sequence = delivery.coordinates.key.stream_sequence,
            delivered = delivery.coordinates.key.delivered,
            ?command,
            "a message settled before was delivered again (the server lost the settle); settling it again"
        );
        tokio::spawn(async move {
            let deadline = tokio::time::sleep(SETTLE_AGAIN_TIMEOUT);
            if nats_settle::confirm(&bound, &delivery.reply, &command, deadline)
                .await
                .is_err()
            {
                warn!(
                    stream_sequence = delivery.coordinates.key.stream_sequence,
                    "settling a redelivered message again was not confirmed; the server redelivers it after ack_wait"
                );
            }
        });
    }

    fn await_settle(&mut self, delivery: Delivery) {
        debug!(
            stream_sequence = delivery.coordinates.key.stream_sequence,
            delivered = delivery.coordinates.key.delivered,
            "a message came again while its ack or term is on its way; it waits for the answer"
        );
        self.awaiting_settle.push(delivery);
    }

    /// The deliveries waiting for a settle of their message whose answer came: settled
    /// again if it ended the message, else held for the next fetch.
    pub(super) fn settles_answered(&mut self) {
        if self.awaiting_settle.is_empty() {
            return;
        }
        let (answered, waiting): (Vec<Delivery>, Vec<Delivery>) =
            std::mem::take(&mut self.awaiting_settle)
                .into_iter()
                .partition(|delivery| !self.state.is_ending(&delivery.coordinates));
        self.awaiting_settle = waiting;
        for delivery in answered {
            match self.state.final_of(&delivery.coordinates) {
                Some(outcome) => self.settle_again(delivery, outcome),
                None => self.book.hold(delivery),
            }
        }
    }

    /// Nak held deliveries that match `release` (those waiting for a settle's answer too):
    /// the server redelivers them to the next pull.
    pub(super) async fn release_held(&mut self, release: impl Fn(&Delivery) -> bool) {
        let epoch = self.state.epoch();
        let releases =
            |delivery: &Delivery| delivery.coordinates.epoch != epoch || release(delivery);
        let (mut released, waiting): (Vec<Delivery>, Vec<Delivery>) =
            std::mem::take(&mut self.awaiting_settle)
                .into_iter()
                .partition(|delivery| releases(delivery));
        self.awaiting_settle = waiting;
        released.extend(self.book.take_held(releases));
        let Some(bound) = &self.bound else {
            self.unusable.clear();
            return;
        };
        for reply in self.unusable.drain(..) {
            nats_settle::release(bound, &reply).await;
        }
        for delivery in released {
            debug!(
                stream_sequence = delivery.coordinates.key.stream_sequence,
                "releasing an unleased delivery"
            );
            nats_settle::release(bound, &delivery.reply).await;
            self.state.released(delivery.coordinates.key);
        }
    }

    pub(super) fn answer_finished(&mut self, now: Instant) {
        let finished = self
            .book
            .take_finished(now, self.shutting_down, self.state.epoch());
        for mut fetch in finished {
            // A settle confirmed after its message was delivered again (and held or placed
            // meanwhile) ends that delivery too: settled again, not leased.
            // One whose ack or term began meanwhile waits for that settle's answer.
            // While the fleet's settled records are not all read, none is leased: it may
            // be one another gateway (or this one's earlier life) settled. Held, it is
            // checked again when a fetch takes it, or released after the hold.
            let fleet_behind = self.state.fleet_behind();
            let (mut ending, mut unchecked) = (Vec::new(), Vec::new());
            fetch.got.retain(
                |delivery| match self.state.final_of(&delivery.coordinates) {
                    Some(outcome) => {
                        self.settle_again(delivery.clone(), outcome);
                        false
                    }
                    None if self.state.is_ending(&delivery.coordinates) => {
                        ending.push(delivery.clone());
                        false
                    }
                    None if fleet_behind => {
                        unchecked.push(delivery.clone());
                        false
                    }
                    None => true,
                },
            );
            for delivery in ending {
                self.await_settle(delivery);
            }
            for delivery in unchecked {
                self.book.hold(delivery);
            }
            let leased = self.state.lease(fetch.got);
            if let Err(unanswered) = fetch.answer.send(leased) {
                // The client went away in the meantime: take the leases back.
                let got = self.state.give_back(unanswered);
                self.book.give_back(fetch.pull, got);
            } else {
                // Answered before its pull ended (max_bytes, deadline, shutdown): what the
                // pull still brings is held for the next fetch.
                self.book.detach_pull(fetch.pull);
            }
        }
    }
}
