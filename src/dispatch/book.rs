//! The dispatcher's bookkeeping, pure: which fetches wait (and what they got so far), which
//! pulls are open and for whom, which deliveries are held for the next fetch, and what to do
//! next — which pulls to open, which fetches to answer, which held deliveries to release.
//!
//! No I/O and no clock of its own: the dispatcher's loop ([`super`]) passes `now` in, does
//! the NATS calls the book asks for, and leases what it hands out. A pull's inbox handle is
//! kept here only as an opaque `R`, so that it leaves with its pull. Which pulls to open, and
//! for how much and how long, is planned in [`plan`].
//!
//! May import: `domain`.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::domain::delivery::{Delivery, Demand, Leased};

/// How long a fetch whose pull is still open may outlive its deadline waiting for the
/// server's end-of-request status (which normally arrives right at the deadline).
pub(super) const PULL_GRACE: Duration = Duration::from_millis(500);
/// Pause before a fetch retries a pull the server turned away (408 "Requests Pending",
/// 409 "Exceeded MaxWaiting"); messages keep flowing to the earlier pulls meanwhile.
const PULL_RETRY: Duration = Duration::from_millis(50);
/// How long a pull given up on (no end-of-request status by its give-up time) still counts
/// toward the pull limit: on a machine too busy to read the status in time the server may
/// still hold the pull, and opening another in its place would exceed max_waiting. A status
/// that comes later than this (a pull lives at most 1 s) was lost: the pull no longer counts.
const SILENT_COUNTS_FOR: Duration = Duration::from_secs(5);

/// The answer channel of a waiting fetch.
pub(crate) type Answer = oneshot::Sender<Vec<Leased>>;

struct Waiter {
    id: u64,
    demand: Demand,
    deadline: Instant,
    got: Vec<Delivery>,
    bytes: usize,
    /// The next delivery would exceed max_bytes.
    full: bool,
    pull: Option<u64>,
    retry_at: Option<Instant>,
    /// Its no_wait pull was turned away as behind others: it pulls waiting in line.
    in_line: bool,
    /// A pull was sent for this fetch at least once.
    pulled: bool,
    /// Deliveries of its pull the ordering gate held (their keys were busy) since its last
    /// pull: a fetch short of its batch for that pulls again at once, so that a busy key
    /// never stands between it and other keys' messages.
    diverted: usize,
    /// It took messages the ordering gate released (a key settled) while its pull was open,
    /// and that pull brought nothing, not even to the gate, and the server had nothing more
    /// when it last delivered: it is answered at once rather than when that pull ends. Such
    /// a pull found nothing at the server (an ordered consumer's messages wait in the gate
    /// here, not there), and each step of a key would wait out a pull's expiry. A pull that
    /// is bringing messages is waited for, so that the fetch gets every key they free — and
    /// so is one just sent while the server still had messages (its first ones are on their
    /// way: answered at once, a fetch took only a busy key's head while other keys' messages
    /// were about to come).
    took_released: bool,
    /// Deliveries its pulls brought it.
    from_pull: usize,
    answer: Answer,
}

impl Waiter {
    fn accepts(&self, delivery: &Delivery) -> bool {
        if self.full || self.got.len() >= self.demand.batch {
            return false;
        }
        // The first message always fits: a fetch returns at least one.
        self.got.is_empty()
            || self
                .demand
                .max_bytes
                .is_none_or(|max| self.bytes + delivery.payload.len() <= max)
    }

    fn take(&mut self, delivery: Delivery) {
        self.bytes += delivery.payload.len();
        self.got.push(delivery);
    }

    /// A fetch (not a stream: its pull stays open) whose pull brought deliveries the
    /// ordering gate held, with room and time left: it pulls again rather than answer.
    fn pulls_again(&self, now: Instant) -> bool {
        self.diverted > 0
            && self.demand.stream.is_none()
            && !self.full
            && self.got.len() < self.demand.batch
            && now < self.deadline
    }
}

struct Pull<R> {
    owner: Option<u64>,
    /// The stream it was opened for, whose next demand takes it over.
    stream: Option<u64>,
    /// The patient stream it waits for (see [`Demand::patient`]): it may wait at the server
    /// for a minute, so it is ended here as soon as that stream ends.
    patient_for: Option<u64>,
    remaining: usize,
    /// When to give up on the server's end-of-request status.
    give_up_at: Instant,
    /// The handle of the pull's inbox, which ends by itself when the server ended the pull.
    inbox: R,
}

/// A pull given up on that may still be waiting at the server: it counts toward the pull
/// limit until its status comes, its batch is filled, or `until`.
struct SilentPull {
    id: u64,
    remaining: usize,
    until: Instant,
}

/// A pull the book wants opened for a waiting fetch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PlannedPull {
    pub(super) fetch: u64,
    pub(super) batch: usize,
    /// `None`: a plain `no_wait` pull.
    pub(super) expires: Option<Duration>,
    /// Waits at the server until its batch is delivered or it expires (a stream's pull),
    /// rather than ending once it delivered what there was (`no_wait`). Only with `expires`.
    pub(super) keep_open: bool,
    /// A patient stream's long wait for its first message (see [`Demand::patient`]); never
    /// kept open after it delivered, so nothing it catches is caught twice.
    pub(super) patient: bool,
    pub(super) give_up_at: Instant,
}

/// The consumer's limits on pulls, as bound.
#[derive(Debug, Clone, Copy)]
pub(super) struct PullLimits {
    pub(super) max_waiting: usize,
    pub(super) max_batch: Option<usize>,
    pub(super) max_expires: Option<Duration>,
}

/// A fetch that is done waiting: lease `got` and send it on `answer`.
pub(super) struct Finished {
    pub(super) answer: Answer,
    pub(super) got: Vec<Delivery>,
    pub(super) pull: Option<u64>,
}

pub(super) struct Book<R> {
    waiters: VecDeque<Waiter>,
    held: VecDeque<Delivery>,
    pulls: HashMap<u64, Pull<R>>,
    silent: Vec<SilentPull>,
    next_pull_id: u64,
    /// Whether the last planning had capacity and pull slots left: a fetch waits to pull
    /// again (see [`Waiter::pulls_again`]) only then.
    pull_room: bool,
    /// How many messages the server still had for the consumer after its latest delivery
    /// (the delivery's own count): none, and an open pull that brought nothing found
    /// nothing.
    server_pending: u64,
}

impl<R> Book<R> {
    pub(super) fn new() -> Self {
        Self {
            waiters: VecDeque::new(),
            held: VecDeque::new(),
            pulls: HashMap::new(),
            silent: Vec::new(),
            next_pull_id: 0,
            pull_room: false,
            server_pending: 0,
        }
    }

    pub(super) fn enqueue(&mut self, id: u64, demand: Demand, answer: Answer, now: Instant) {
        // A stream's pull still open at the server is its next demand's. It asks for no more
        // than the stream's credit, which only grew by what it settled since — unless the
        // stream took held deliveries meanwhile; then the demand's batch still caps what it
        // takes, and the rest is held for the next fetch.
        let pull = demand.stream.and_then(|stream| {
            let (pull_id, pull) = self
                .pulls
                .iter_mut()
                .find(|(_, pull)| pull.stream == Some(stream) && pull.owner.is_none())?;
            pull.owner = Some(id);
            Some(*pull_id)
        });
        self.waiters.push_back(Waiter {
            id,
            deadline: now + demand.wait,
            demand,
            got: Vec::new(),
            bytes: 0,
            full: false,
            pull,
            retry_at: None,
            in_line: false,
            pulled: pull.is_some(),
            diverted: 0,
            took_released: false,
            from_pull: 0,
            answer,
        });
    }

    /// The fetch's client went away: what it got goes to the next fetch.
    pub(super) fn withdraw(&mut self, id: u64) {
        if let Some(index) = self.waiters.iter().position(|waiter| waiter.id == id)
            && let Some(waiter) = self.waiters.remove(index)
        {
            self.give_back(waiter.pull, waiter.got);
        }
    }

    /// A fetch left: what it received, and whatever its pull still brings before it ends
    /// (within [`plan::MAX_PULL_EXPIRES`]), goes to the next fetch, ahead of anything held.
    pub(super) fn give_back(&mut self, pull: Option<u64>, got: Vec<Delivery>) {
        self.detach_pull(pull);
        for delivery in got.into_iter().rev() {
            self.held.push_front(delivery);
        }
    }

    /// What the pull still brings goes to whoever comes next.
    pub(super) fn detach_pull(&mut self, pull: Option<u64>) {
        if let Some(pull) = pull.and_then(|pull| self.pulls.get_mut(&pull)) {
            pull.owner = None;
        }
    }

    /// The server forgot the open pulls (the connection dropped). Their inboxes are read
    /// until they are given up on, so what the pulls already sent still arrives and is held.
    pub(super) fn forget_pulls(&mut self) {
        self.silent.clear();
        for pull in self.pulls.values_mut() {
            pull.owner = None;
            pull.remaining = 0;
        }
        for waiter in &mut self.waiters {
            waiter.pull = None;
        }
    }

    /// Every open pull is of an old binding: forget them, returning their inboxes.
    pub(super) fn close_pulls(&mut self) -> Vec<R> {
        let inboxes = self.pulls.drain().map(|(_, pull)| pull.inbox).collect();
        self.forget_pulls();
        inboxes
    }

    /// Patient stream `stream` ended (`None`: every patient stream's pull, at shutdown or
    /// once the consumer was resumed). Its pull
    /// would wait at the server for up to a minute, and what it caught would be held, nak'd,
    /// and redelivered into it again: it is forgotten here and its inbox returned, to be
    /// aborted (unsubscribed), so that the server drops it.
    pub(super) fn end_patient_pulls(&mut self, stream: Option<u64>, now: Instant) -> Vec<R> {
        let ended: Vec<u64> = self
            .pulls
            .iter()
            .filter(|(_, pull)| {
                pull.patient_for
                    .is_some_and(|of| stream.is_none_or(|id| id == of))
            })
            .map(|(id, _)| *id)
            .collect();
        let mut inboxes = Vec::with_capacity(ended.len());
        for pull_id in ended {
            if let Some(pull) = self.pulls.remove(&pull_id) {
                self.pull_ended_for(pull.owner, false, now);
                inboxes.push(pull.inbox);
            }
        }
        inboxes
    }

    /// Whether `pull_id` is an open pull (of the current binding).
    pub(super) fn is_open(&self, pull_id: u64) -> bool {
        self.pulls.contains_key(&pull_id)
    }

    /// Whether any pull is open.
    pub(super) fn has_open_pulls(&self) -> bool {
        !self.pulls.is_empty()
    }

    /// When the last open pull is given up on.
    pub(super) fn last_give_up(&self) -> Option<Instant> {
        self.pulls.values().map(|pull| pull.give_up_at).max()
    }

    /// [`Book::count_delivery`] of a delivery after which the server still had `pending`
    /// messages for the consumer.
    pub(super) fn count_delivery_from(
        &mut self,
        pull_id: u64,
        now: Instant,
        pending: u64,
    ) -> Option<u64> {
        self.server_pending = pending;
        self.count_delivery(pull_id, now)
    }

    /// One more message of `pull_id` arrived; returns the fetch it is for.
    pub(super) fn count_delivery(&mut self, pull_id: u64, now: Instant) -> Option<u64> {
        if let Some(at) = self.silent.iter().position(|silent| silent.id == pull_id) {
            let silent = &mut self.silent[at];
            silent.remaining = silent.remaining.saturating_sub(1);
            if silent.remaining == 0 {
                self.silent.swap_remove(at);
            }
            return None;
        }
        let pull = self.pulls.get_mut(&pull_id)?;
        pull.remaining = pull.remaining.saturating_sub(1);
        let owner = pull.owner;
        if pull.remaining == 0 {
            self.end_pull(pull_id, false, now);
        }
        owner
    }

    /// The server ended `pull_id`; `refused`: it turned the pull away, retry a little later.
    pub(super) fn end_pull(&mut self, pull_id: u64, refused: bool, now: Instant) {
        if let Some(pull) = self.pulls.remove(&pull_id) {
            self.pull_ended_for(pull.owner, refused, now);
        } else {
            // A pull given up on ended after all: it no longer counts.
            self.silent.retain(|silent| silent.id != pull_id);
        }
    }

    /// Pulls that count toward the limit: open ones and those given up on lately.
    fn counted_pulls(&self) -> usize {
        self.pulls.len() + self.silent.len()
    }

    fn pull_ended_for(&mut self, owner: Option<u64>, refused: bool, now: Instant) {
        let Some(owner) = owner else {
            return;
        };
        if let Some(waiter) = self.waiters.iter_mut().find(|w| w.id == owner) {
            waiter.pull = None;
            if refused {
                waiter.retry_at = Some(now + PULL_RETRY);
            }
        }
    }

    /// A delivery of the current binding for fetch `owner`: it takes it if it still can,
    /// otherwise it is held for the next fetch.
    pub(super) fn place(&mut self, owner: Option<u64>, delivery: Delivery) {
        let waiter = owner.and_then(|owner| self.waiters.iter_mut().find(|w| w.id == owner));
        match waiter {
            Some(waiter) if waiter.accepts(&delivery) && !waiter.answer.is_closed() => {
                waiter.take(delivery);
                waiter.from_pull += 1;
            }
            Some(waiter) => {
                waiter.full = !waiter.got.is_empty();
                self.held.push_back(delivery);
            }
            None => self.held.push_back(delivery),
        }
    }

    /// A delivery of fetch `owner`'s pull was held by the ordering gate.
    pub(super) fn diverted(&mut self, owner: Option<u64>) {
        if let Some(waiter) =
            owner.and_then(|owner| self.waiters.iter_mut().find(|w| w.id == owner))
        {
            waiter.diverted += 1;
        }
    }

    /// Hold a delivery nobody may take (one of an earlier binding): only ever released.
    pub(super) fn hold(&mut self, delivery: Delivery) {
        self.held.push_back(delivery);
    }

    /// The earliest moment something needs doing without an outside event. `hold`: how long
    /// a delivery is held; `next_release`: when a max_ack_pending slot frees by itself
    /// (asked only while fetches wait).
    pub(super) fn next_wake(
        &self,
        now: Instant,
        hold: Duration,
        next_release: impl FnOnce() -> Option<Instant>,
    ) -> Option<Instant> {
        let waiters = self.waiters.iter().flat_map(|waiter| {
            let deadline = if waiter.pull.is_some() {
                waiter.deadline + PULL_GRACE
            } else {
                waiter.deadline
            };
            // A retry time already past waits for an event (a pull ending, capacity freed)
            // instead of spinning.
            let retry_at = waiter.retry_at.filter(|at| *at > now);
            [Some(deadline), retry_at].into_iter().flatten()
        });
        let held = self
            .held
            .front()
            .map(|delivery| delivery.received_at + hold);
        let pulls = self.pulls.values().map(|pull| pull.give_up_at);
        // A silent pull that stops counting may let a waiting fetch pull.
        let silent = (!self.waiters.is_empty())
            .then(|| self.silent.iter().map(|silent| silent.until).min())
            .flatten();
        // An expiring lease frees capacity for waiting fetches.
        let lease_expiry = (!self.waiters.is_empty())
            .then(|| next_release().filter(|at| *at > now))
            .flatten();
        waiters
            .chain(held)
            .chain(pulls)
            .chain(silent)
            .chain(lease_expiry)
            .min()
    }

    /// Fetches whose HTTP client went away give their deliveries back.
    pub(super) fn withdraw_hung_up(&mut self) {
        let mut index = 0;
        while index < self.waiters.len() {
            if self.waiters[index].answer.is_closed() {
                if let Some(waiter) = self.waiters.remove(index) {
                    self.give_back(waiter.pull, waiter.got);
                }
            } else {
                index += 1;
            }
        }
    }

    /// Pulls past their give-up time without an end-of-request status (a busy machine or a
    /// lost connection) free their fetches, and keep counting toward the pull limit for
    /// [`SILENT_COUNTS_FOR`] (unless their status or their batch comes first); their inboxes
    /// are returned, to be read for whatever still arrives: dropping them could strand
    /// deliveries for a whole ack_wait.
    pub(super) fn give_up_silent_pulls(&mut self, now: Instant) -> Vec<R> {
        self.silent.retain(|silent| silent.until > now);
        let silent: Vec<u64> = self
            .pulls
            .iter()
            .filter(|(_, pull)| pull.give_up_at <= now)
            .map(|(id, _)| *id)
            .collect();
        let mut inboxes = Vec::with_capacity(silent.len());
        for pull_id in silent {
            if let Some(pull) = self.pulls.remove(&pull_id) {
                inboxes.push(pull.inbox);
                self.pull_ended_for(pull.owner, false, now);
                if pull.remaining > 0 {
                    self.silent.push(SilentPull {
                        id: pull_id,
                        remaining: pull.remaining,
                        until: now + SILENT_COUNTS_FOR,
                    });
                }
            }
        }
        inboxes
    }

    /// Take the held deliveries that match `release` out of the book, in order.
    pub(super) fn take_held(&mut self, release: impl Fn(&Delivery) -> bool) -> Vec<Delivery> {
        let mut released = Vec::new();
        let mut kept = VecDeque::with_capacity(self.held.len());
        for delivery in self.held.drain(..) {
            if release(&delivery) {
                released.push(delivery);
            } else {
                kept.push_back(delivery);
            }
        }
        self.held = kept;
        released
    }

    /// Messages the ordering gate released are handed to waiting fetches ahead of anything
    /// held, and those fetches answered without waiting for their pulls to end.
    pub(super) fn hand_out_released(&mut self, released: Vec<Delivery>) {
        self.give_back(None, released);
        self.hand_out(true);
    }

    /// Deliveries held are handed to waiting fetches, first come first served.
    pub(super) fn hand_out_held(&mut self) {
        self.hand_out(false);
    }

    fn hand_out(&mut self, released: bool) {
        for waiter in &mut self.waiters {
            while let Some(delivery) = self.held.front() {
                if !waiter.accepts(delivery) {
                    if !waiter.got.is_empty() && waiter.got.len() < waiter.demand.batch {
                        waiter.full = true;
                    }
                    break;
                }
                if let Some(delivery) = self.held.pop_front() {
                    waiter.take(delivery);
                    waiter.took_released |= released;
                }
            }
            if self.held.is_empty() {
                break;
            }
        }
    }

    /// Some fetch waits with nothing and no pull: it needs capacity to be freed.
    pub(super) fn is_starving(&self) -> bool {
        self.waiters
            .iter()
            .any(|waiter| waiter.pull.is_none() && waiter.got.is_empty())
    }

    /// Messages that will need a lease slot: held, taken by fetches, or asked of open pulls.
    pub(super) fn reserved(&self) -> usize {
        self.held.len()
            + self.waiters.iter().map(|w| w.got.len()).sum::<usize>()
            + self.pulls.values().map(|p| p.remaining).sum::<usize>()
    }

    /// The fetches done waiting (all answered at once when `shutting_down`), out of the
    /// book. Deliveries of an epoch other than `epoch` stay held, to be released.
    pub(super) fn take_finished(
        &mut self,
        now: Instant,
        shutting_down: bool,
        epoch: u32,
    ) -> Vec<Finished> {
        let mut finished = Vec::new();
        let mut index = 0;
        while index < self.waiters.len() {
            let waiter = &self.waiters[index];
            let done = shutting_down
                || waiter.got.len() >= waiter.demand.batch
                || waiter.full
                // A stream writes what came at once; its pull stays open for its next step.
                || (!waiter.got.is_empty()
                    && (waiter.pull.is_none() || waiter.demand.stream.is_some())
                    && !(self.pull_room && waiter.pulls_again(now)))
                || (!waiter.got.is_empty()
                    && waiter.pull.is_some()
                    && waiter.took_released
                    && waiter.from_pull == 0
                    && waiter.diverted == 0
                    && self.server_pending == 0)
                || (waiter.pull.is_none() && now >= waiter.deadline)
                || now >= waiter.deadline + PULL_GRACE;
            if !done {
                index += 1;
                continue;
            }
            let Some(waiter) = self.waiters.remove(index) else {
                break;
            };
            let (got, stale): (Vec<Delivery>, Vec<Delivery>) = waiter
                .got
                .into_iter()
                .partition(|delivery| delivery.coordinates.epoch == epoch);
            self.held.extend(stale);
            finished.push(Finished {
                answer: waiter.answer,
                got,
                pull: waiter.pull,
            });
        }
        finished
    }

    /// Every pull's inbox, for a stop.
    pub(super) fn drain_inboxes(&mut self) -> Vec<R> {
        self.pulls.drain().map(|(_, pull)| pull.inbox).collect()
    }

    /// Deliveries held or taken by waiting fetches: out of the server's hands, not leased.
    pub(super) fn holding(&self) -> usize {
        self.held.len() + self.waiters.iter().map(|w| w.got.len()).sum::<usize>()
    }

    /// Deliveries held now.
    pub(super) fn held_len(&self) -> usize {
        self.held.len()
    }
}

mod plan;
#[cfg(test)]
mod tests;
