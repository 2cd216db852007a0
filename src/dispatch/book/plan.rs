//! Planning pulls: which waiting fetches get a pull now, how many messages each asks for
//! and how long it may wait at the server, within the consumer's limits and the lease
//! capacity left — and recording the pulls the dispatcher then opened.
//!
//! May import: as the rest of `dispatch::book`.

use std::time::Duration;

use tokio::time::Instant;

use super::{Book, PULL_GRACE, PlannedPull, Pull, PullLimits};

/// Longest single pull: bounds how long a withdrawn fetch's pull can still attract messages.
pub(super) const MAX_PULL_EXPIRES: Duration = Duration::from_secs(1);
/// Longest single pull of a patient stream (an idle push worker), which reads what comes
/// as long as it is open: an idle one costs the server a request and its timeout status a
/// minute. It waits for a first message and ends once it delivered what there was (it is
/// not kept open: a message it caught after its worker stepped back and that is nak'd
/// cannot come back into it); when the worker goes, it is ended with it.
pub(super) const MAX_PATIENT_PULL_EXPIRES: Duration = Duration::from_secs(60);
/// Shorter waits than this are sent as a plain `no_wait` pull.
const MIN_EXPIRES: Duration = Duration::from_millis(10);
/// Upper bound on pulls open at once, whatever max_waiting allows.
const MAX_OPEN_PULLS: usize = 256;

impl<R> Book<R> {
    /// Pull `pull_id` was turned away as behind others at the server (408 "Requests
    /// Pending": a no_wait pull gets it while older pulls wait there — this gateway's own,
    /// from before a resume, which the server keeps until it sees them gone, up to a
    /// minute). Its fetch pulls again after [`super::PULL_RETRY`], waiting in line this
    /// time (a stream's; a plain fetch's pull stays no_wait).
    pub(in crate::dispatch) fn end_pull_behind_others(&mut self, pull_id: u64, now: Instant) {
        let owner = self.pulls.get(&pull_id).and_then(|pull| pull.owner);
        self.end_pull(pull_id, true, now);
        if let Some(waiter) =
            owner.and_then(|owner| self.waiters.iter_mut().find(|waiter| waiter.id == owner))
        {
            waiter.in_line = true;
        }
    }

    /// The pulls to open now, in order: one per waiting fetch that has none, never more
    /// than half the consumer's max_waiting open at once, and never more messages asked
    /// for than `capacity` (free max_ack_pending slots). Open them in order and report each
    /// with [`Book::pull_opened`]; stop at the first that fails.
    pub(in crate::dispatch) fn plan_pulls(
        &mut self,
        now: Instant,
        mut capacity: usize,
        limits: PullLimits,
    ) -> Vec<PlannedPull> {
        let max_pulls = Self::max_pulls(limits);
        let mut open = self.counted_pulls();
        self.pull_room = capacity > 0 && open < max_pulls;
        let mut planned = Vec::new();
        for waiter in &self.waiters {
            if open >= max_pulls || capacity == 0 {
                break;
            }
            let ready = waiter.pull.is_none()
                && (waiter.got.is_empty() || waiter.pulls_again(now))
                && waiter.retry_at.is_none_or(|at| at <= now)
                // A zero-wait fetch still gets one no_wait pull: "what is there right now".
                && (waiter.deadline > now || (waiter.demand.wait.is_zero() && !waiter.pulled));
            if !ready {
                continue;
            }
            let patient = waiter.demand.patient && waiter.demand.stream.is_some();
            let longest = if patient {
                MAX_PATIENT_PULL_EXPIRES
            } else {
                MAX_PULL_EXPIRES
            };
            let mut left = waiter.deadline.saturating_duration_since(now).min(longest);
            if let Some(max_expires) = limits.max_expires {
                left = left.min(max_expires);
            }
            // Pulling again with something in hand: only what is there right now.
            let expires = (left >= MIN_EXPIRES && waiter.got.is_empty()).then_some(left);
            let keep_open =
                waiter.demand.stream.is_some() && expires.is_some() && (!patient || waiter.in_line);
            // A pull kept open asks for the stream's credit: its next demands take the rest.
            let wanted = if keep_open && !patient {
                waiter.demand.credit.max(waiter.demand.batch)
            } else {
                waiter.demand.batch
            };
            let mut batch = (wanted - waiter.got.len()).min(capacity);
            if let Some(max_batch) = limits.max_batch {
                batch = batch.min(max_batch);
            }
            planned.push(PlannedPull {
                fetch: waiter.id,
                batch,
                expires,
                keep_open,
                patient: patient && expires.is_some() && !waiter.in_line,
                give_up_at: now + left + PULL_GRACE,
            });
            capacity -= batch;
            open += 1;
        }
        planned
    }

    /// No pull can be opened now (no binding, no connection).
    pub(in crate::dispatch) fn no_pull_room(&mut self) {
        self.pull_room = false;
    }

    /// Whether fetches wait while the pull limit is reached.
    pub(in crate::dispatch) fn at_pull_limit(&self, limits: PullLimits) -> bool {
        !self.waiters.is_empty() && self.counted_pulls() >= Self::max_pulls(limits)
    }

    fn max_pulls(limits: PullLimits) -> usize {
        (limits.max_waiting / 2).clamp(1, MAX_OPEN_PULLS)
    }

    /// A fresh pull id.
    pub(in crate::dispatch) fn next_pull_id(&mut self) -> u64 {
        self.next_pull_id += 1;
        self.next_pull_id
    }

    /// A planned pull was opened as `pull_id`, read through `inbox`.
    pub(in crate::dispatch) fn pull_opened(
        &mut self,
        planned: PlannedPull,
        pull_id: u64,
        inbox: R,
    ) {
        let waiter = self.waiters.iter_mut().find(|w| w.id == planned.fetch);
        let stream = waiter.as_ref().and_then(|waiter| waiter.demand.stream);
        if let Some(waiter) = waiter {
            waiter.pull = Some(pull_id);
            waiter.pulled = true;
            waiter.retry_at = None;
            waiter.diverted = 0;
        }
        self.pulls.insert(
            pull_id,
            Pull {
                owner: Some(planned.fetch),
                stream: stream.filter(|_| planned.keep_open),
                patient_for: planned.patient.then_some(stream).flatten(),
                remaining: planned.batch,
                give_up_at: planned.give_up_at,
                inbox,
            },
        );
    }
}
