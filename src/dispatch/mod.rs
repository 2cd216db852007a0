//! The fetch dispatcher: turns waiting `POST /fetch` calls into pull requests and hands each
//! delivery to the fetch that asked for it.
//!
//! One task owns all pull state. Each waiting fetch gets its own `no_wait` + `expires` pull
//! (the server then answers as soon as it has delivered what is available — a fetch's exact
//! contract), but never more pulls than half the consumer's `max_waiting`, and never more
//! messages requested than the lease capacity left. Fetches beyond that wait their turn, so
//! thousands of long polls never trip "Exceeded MaxWaiting".
//!
//! A long poll is served by a chain of short pulls (at most [`MAX_PULL_EXPIRES`] each), so
//! when a fetch goes away its pull ends at the server within that time: messages published
//! later stay on the server instead of reaching a gateway with no one to give them to. What
//! arrives for nobody (in that window, or beyond a fetch's `max_bytes`) is held for the next
//! fetch while most of its ack_wait is left, then nak'd.
//!
//! Pulls, their inboxes and their readers are the NATS boundary's ([`crate::nats::pull`]);
//! this task decides when to open one and for whom.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use async_nats::Subject;
use tokio::sync::{Notify, mpsc, oneshot, watch};
use tokio::time::{Instant, sleep_until};
use tracing::{debug, info, warn};

use crate::domain::delivery::{Delivery, Demand, Leased};
use crate::nats::Bound;
use crate::nats::pull::{self, PullEvent};
use crate::nats::settle as nats_settle;
use crate::state::LeaseState;

/// How long a fetch whose pull is still open may outlive its deadline waiting for the
/// server's end-of-request status (which normally arrives right at the deadline).
const PULL_GRACE: Duration = Duration::from_millis(500);
/// Pause before a fetch retries a pull the server turned away (408 "Requests Pending",
/// 409 "Exceeded MaxWaiting"); messages keep flowing to the earlier pulls meanwhile.
const PULL_RETRY: Duration = Duration::from_millis(50);
/// Longest single pull: bounds how long an abandoned fetch's pull can still attract messages.
const MAX_PULL_EXPIRES: Duration = Duration::from_secs(1);
/// Shorter waits than this are sent as a plain `no_wait` pull.
const MIN_EXPIRES: Duration = Duration::from_millis(10);
/// How long the reader of a pull given up on keeps forwarding before it is stopped: the
/// server's end-of-request status normally comes long before.
const STRAGGLER_READ: Duration = Duration::from_secs(30);
/// Upper bound on pulls open at once, whatever max_waiting allows.
const MAX_OPEN_PULLS: usize = 256;

pub(crate) enum Command {
    Fetch {
        /// Unique per fetch; chosen by the caller so it can abandon the fetch.
        id: u64,
        demand: Demand,
        answer: oneshot::Sender<Vec<Leased>>,
    },
    /// The fetch's HTTP client went away: free its place at once; what its pull still
    /// brings goes to the next fetch.
    Abandon { id: u64 },
    /// The NATS connection dropped: the server forgot every open pull.
    ConnectionLost,
    /// Deliveries whose leases were withdrawn (the client left): lease them again.
    Return(Vec<Delivery>),
    /// Answer every waiting fetch now, stop pulling, nak whatever arrives.
    Shutdown,
    /// The connection is back. Not a no-op: it wakes the loop, and the pump that follows
    /// every command issues pulls for the fetches that waited through the outage.
    Reconnected,
    /// Release what is held and end the task.
    Stop,
}

struct Waiter {
    demand: Demand,
    deadline: Instant,
    got: Vec<Delivery>,
    bytes: usize,
    /// The next delivery would exceed max_bytes.
    full: bool,
    pull: Option<u64>,
    retry_at: Option<Instant>,
    /// A pull was sent for this fetch at least once.
    pulled: bool,
    answer: oneshot::Sender<Vec<Leased>>,
    id: u64,
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
}

struct Pull {
    owner: Option<u64>,
    remaining: usize,
    /// When to give up on the server's end-of-request status.
    give_up_at: Instant,
    /// Reads the pull's inbox; ends by itself when the server ended the pull.
    reader: tokio::task::JoinHandle<()>,
}

pub(crate) struct Dispatcher {
    shared: Arc<LeaseState>,
    bound: Option<Arc<Bound>>,
    inbound: mpsc::UnboundedReceiver<PullEvent>,
    inbound_sender: mpsc::UnboundedSender<PullEvent>,
    waiters: VecDeque<Waiter>,
    held: VecDeque<Delivery>,
    pulls: HashMap<u64, Pull>,
    next_pull_id: u64,
    shutting_down: bool,
    /// Readers of pulls given up on, still forwarding until the server ends them.
    stragglers: Vec<(Instant, tokio::task::JoinHandle<()>)>,
    /// A rebind was asked for and has not happened yet.
    rebind_requested: bool,
    /// Reply subjects of messages that were no usable delivery, to nak.
    unusable: Vec<Subject>,
}

impl Dispatcher {
    pub(crate) fn new(shared: Arc<LeaseState>) -> Self {
        let (inbound_sender, inbound) = mpsc::unbounded_channel();
        Self {
            shared,
            bound: None,
            inbound,
            inbound_sender,
            waiters: VecDeque::new(),
            held: VecDeque::new(),
            pulls: HashMap::new(),
            next_pull_id: 0,
            shutting_down: false,
            stragglers: Vec::new(),
            rebind_requested: false,
            unusable: Vec::new(),
        }
    }

    pub(crate) async fn run(
        mut self,
        mut commands: mpsc::Receiver<Command>,
        mut bound: watch::Receiver<Option<Arc<Bound>>>,
        capacity_freed: Arc<Notify>,
    ) {
        let initial = bound.borrow_and_update().clone();
        self.rebind(initial).await;
        loop {
            let wake = self.next_wake();
            tokio::select! {
                command = commands.recv() => match command {
                    Some(Command::Fetch { id, demand, answer }) => self.enqueue(id, demand, answer),
                    Some(Command::Abandon { id }) => self.abandon(id),
                    Some(Command::Return(deliveries)) => self.orphan(None, deliveries),
                    Some(Command::ConnectionLost) => self.forget_pulls(),
                    Some(Command::Shutdown) => self.shutting_down = true,
                    Some(Command::Reconnected) => {}
                    Some(Command::Stop) | None => break,
                },
                Some(inbound) = self.inbound.recv() => {
                    self.on_inbound(inbound);
                    // A pull's batch arrives in a burst: take all of it before one pump.
                    while let Ok(inbound) = self.inbound.try_recv() {
                        self.on_inbound(inbound);
                    }
                }
                changed = bound.changed() => {
                    if changed.is_err() {
                        break;
                    }
                    let next = bound.borrow_and_update().clone();
                    self.rebind(next).await;
                }
                () = capacity_freed.notified() => {}
                () = sleep_until(wake) => {}
            }
            self.pump().await;
        }
        self.shutting_down = true;
        self.pump().await;
        self.drain_open_pulls().await;
    }

    /// Before stopping, let the open pulls end (they are short) and nak what they bring, so
    /// that nothing sent to the gateway waits out its ack_wait.
    async fn drain_open_pulls(&mut self) {
        let now = Instant::now();
        self.stragglers.retain(|(_, reader)| !reader.is_finished());
        let open_until = self.pulls.values().map(|pull| pull.give_up_at).max();
        let stragglers_until = (!self.stragglers.is_empty()).then_some(now + PULL_GRACE);
        let Some(until) = open_until.into_iter().chain(stragglers_until).max() else {
            return;
        };
        loop {
            self.stragglers.retain(|(_, reader)| !reader.is_finished());
            if (self.pulls.is_empty() && self.stragglers.is_empty()) || Instant::now() >= until {
                break;
            }
            tokio::select! {
                Some(inbound) = self.inbound.recv() => self.on_inbound(inbound),
                () = sleep_until(until) => break,
            }
            self.release_held(|_| true).await;
        }
        self.release_held(|_| true).await;
        for (_, reader) in self.stragglers.drain(..) {
            reader.abort();
        }
        for (_, pull) in self.pulls.drain() {
            pull.reader.abort();
        }
    }

    fn enqueue(&mut self, id: u64, demand: Demand, answer: oneshot::Sender<Vec<Leased>>) {
        self.waiters.push_back(Waiter {
            deadline: Instant::now() + demand.wait,
            demand,
            got: Vec::new(),
            bytes: 0,
            full: false,
            pull: None,
            retry_at: None,
            pulled: false,
            answer,
            id,
        });
    }

    fn abandon(&mut self, id: u64) {
        debug!(fetch = id, "fetch abandoned by its client");
        if let Some(index) = self.waiters.iter().position(|waiter| waiter.id == id)
            && let Some(waiter) = self.waiters.remove(index)
        {
            self.orphan(waiter.pull, waiter.got);
        }
    }

    async fn rebind(&mut self, bound: Option<Arc<Bound>>) {
        // Readers of the old binding's pulls keep forwarding what they still get: deliveries
        // of an older epoch are nak'd, never leased or dropped.
        let now = Instant::now();
        for (_, pull) in self.pulls.drain() {
            self.stragglers.push((now + STRAGGLER_READ, pull.reader));
        }
        self.forget_pulls();
        self.rebind_requested = false;
        // Deliveries of a previous binding cannot be leased any more: let the server have them.
        self.release_held(|_| true).await;
        self.bound = bound;
    }

    /// The server forgot the open pulls (the connection dropped). Their readers stay until
    /// they give up, so what the pulls already sent still arrives and is held.
    fn forget_pulls(&mut self) {
        for pull in self.pulls.values_mut() {
            pull.owner = None;
            pull.remaining = 0;
        }
        for waiter in &mut self.waiters {
            waiter.pull = None;
        }
    }

    fn on_inbound(&mut self, inbound: PullEvent) {
        let (pull_id, delivery) = match inbound {
            PullEvent::Delivery { pull_id, delivery } => (pull_id, delivery),
            PullEvent::Unusable { pull_id, reply } => {
                self.count_delivery(pull_id);
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
                let refused = matches!(status, 408 | 409) && description != "Request Timeout";
                // Only a pull of the current binding says anything about it.
                let current = self.pulls.contains_key(&pull_id);
                if current && status == 409 && description.contains("Consumer Deleted") {
                    warn!("the consumer was deleted; waiting to rebind");
                    self.request_rebind();
                }
                if current && status == 503 {
                    self.request_rebind();
                }
                self.end_pull(pull_id, refused);
                return;
            }
        };
        let owner = self.count_delivery(pull_id);
        if delivery.coordinates.epoch != self.shared.epoch() {
            // From a consumer since recreated: only ever nak'd (by release_held).
            self.held.push_back(delivery);
            return;
        }
        self.shared.note_delivery(&delivery.coordinates);
        let waiter = owner.and_then(|owner| self.waiters.iter_mut().find(|w| w.id == owner));
        match waiter {
            Some(waiter) if waiter.accepts(&delivery) && !waiter.answer.is_closed() => {
                waiter.take(delivery)
            }
            Some(waiter) => {
                waiter.full = !waiter.got.is_empty();
                self.held.push_back(delivery);
            }
            None => self.held.push_back(delivery),
        }
    }

    /// One more message of `pull_id` arrived; returns the fetch it is for.
    fn count_delivery(&mut self, pull_id: u64) -> Option<u64> {
        let pull = self.pulls.get_mut(&pull_id)?;
        pull.remaining = pull.remaining.saturating_sub(1);
        let owner = pull.owner;
        if pull.remaining == 0 {
            self.end_pull(pull_id, false);
        }
        owner
    }

    /// Ask the supervisor to rebind, once per binding (every open pull reports a deleted
    /// consumer; a second rebind would cut off the pulls made under the new one).
    fn request_rebind(&mut self) {
        if !self.rebind_requested {
            self.rebind_requested = true;
            self.shared.request_rebind();
        }
    }

    fn end_pull(&mut self, pull_id: u64, refused: bool) {
        if let Some(pull) = self.pulls.remove(&pull_id) {
            self.end_pull_of(pull.owner, refused);
        }
    }

    fn end_pull_of(&mut self, owner: Option<u64>, refused: bool) {
        let Some(owner) = owner else {
            return;
        };
        if let Some(waiter) = self.waiters.iter_mut().find(|w| w.id == owner) {
            waiter.pull = None;
            if refused {
                waiter.retry_at = Some(Instant::now() + PULL_RETRY);
            }
        }
    }

    /// The earliest moment something needs doing without an outside event.
    fn next_wake(&self) -> Instant {
        let now = Instant::now();
        let far = now + Duration::from_secs(3600);
        let hold = self.shared.hold();
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
        // An expiring lease frees capacity for waiting fetches.
        let lease_expiry = (!self.waiters.is_empty())
            .then(|| self.shared.next_release().filter(|at| *at > now))
            .flatten();
        let reaps = self.stragglers.iter().map(|(reap_at, _)| *reap_at);
        waiters
            .chain(held)
            .chain(pulls)
            .chain(lease_expiry)
            .chain(reaps)
            .min()
            .unwrap_or(far)
    }

    async fn pump(&mut self) {
        let now = Instant::now();
        self.drop_abandoned_waiters();
        self.give_up_on_silent_pulls(now);
        let hold = self.shared.hold();
        let shutting_down = self.shutting_down;
        self.release_held(|delivery| shutting_down || delivery.received_at + hold <= now)
            .await;
        self.hand_out_held();
        if !self.shutting_down {
            self.issue_pulls(now).await;
        }
        self.answer_finished(now);
        if self.shutting_down {
            // Anything answered just now went back to `held` if its fetch vanished.
            self.release_held(|_| true).await;
        }
    }

    /// Fetches whose HTTP client went away give their deliveries back.
    fn drop_abandoned_waiters(&mut self) {
        let mut index = 0;
        while index < self.waiters.len() {
            if self.waiters[index].answer.is_closed() {
                if let Some(waiter) = self.waiters.remove(index) {
                    self.orphan(waiter.pull, waiter.got);
                }
            } else {
                index += 1;
            }
        }
    }

    /// A fetch left: what it received, and whatever its pull still brings before it ends
    /// (within [`MAX_PULL_EXPIRES`]), goes to the next fetch.
    fn orphan(&mut self, pull: Option<u64>, got: Vec<Delivery>) {
        self.disown(pull);
        for delivery in got.into_iter().rev() {
            self.held.push_front(delivery);
        }
    }

    fn disown(&mut self, pull: Option<u64>) {
        if let Some(pull) = pull.and_then(|pull| self.pulls.get_mut(&pull)) {
            pull.owner = None;
        }
    }

    fn give_up_on_silent_pulls(&mut self, now: Instant) {
        let silent: Vec<u64> = self
            .pulls
            .iter()
            .filter(|(_, pull)| pull.give_up_at <= now)
            .map(|(id, _)| *id)
            .collect();
        for pull_id in silent {
            if let Some(pull) = self.pulls.remove(&pull_id) {
                // No end-of-request status yet: a busy machine or a lost connection. The pull
                // no longer counts, but its reader keeps forwarding whatever still arrives
                // (to `held`); dropping it could strand deliveries for a whole ack_wait.
                self.stragglers.push((now + STRAGGLER_READ, pull.reader));
                self.end_pull_of(pull.owner, false);
            }
        }
        self.stragglers.retain(|(reap_at, reader)| {
            if reader.is_finished() {
                return false;
            }
            if *reap_at <= now {
                reader.abort();
                return false;
            }
            true
        });
    }

    /// Nak held deliveries that match `release`: the server redelivers them to the next pull.
    async fn release_held(&mut self, release: impl Fn(&Delivery) -> bool) {
        let epoch = self.shared.epoch();
        let release =
            |delivery: &Delivery| delivery.coordinates.epoch != epoch || release(delivery);
        let Some(bound) = &self.bound else {
            self.held.retain(|delivery| !release(delivery));
            self.unusable.clear();
            return;
        };
        for reply in self.unusable.drain(..) {
            nats_settle::release(bound, &reply).await;
        }
        let mut kept = VecDeque::with_capacity(self.held.len());
        for delivery in self.held.drain(..) {
            if release(&delivery) {
                debug!(
                    stream_sequence = delivery.coordinates.key.stream_sequence,
                    "releasing an unleased delivery"
                );
                nats_settle::release(bound, &delivery.reply).await;
                self.shared.released(delivery.coordinates.key);
            } else {
                kept.push_back(delivery);
            }
        }
        self.held = kept;
    }

    fn hand_out_held(&mut self) {
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
                }
            }
            if self.held.is_empty() {
                break;
            }
        }
    }

    fn answer_finished(&mut self, now: Instant) {
        let mut index = 0;
        while index < self.waiters.len() {
            let waiter = &self.waiters[index];
            let finished = self.shutting_down
                || waiter.got.len() >= waiter.demand.batch
                || waiter.full
                || (!waiter.got.is_empty() && waiter.pull.is_none())
                || (waiter.pull.is_none() && now >= waiter.deadline)
                || now >= waiter.deadline + PULL_GRACE;
            if !finished {
                index += 1;
                continue;
            }
            let Some(waiter) = self.waiters.remove(index) else {
                break;
            };
            let epoch = self.shared.epoch();
            let (got, stale): (Vec<Delivery>, Vec<Delivery>) = waiter
                .got
                .into_iter()
                .partition(|delivery| delivery.coordinates.epoch == epoch);
            // Released by the next pump.
            self.held.extend(stale);
            let leased = self.shared.lease(got);
            if let Err(unanswered) = waiter.answer.send(leased) {
                // The client went away in the meantime: take the leases back.
                let got = self.shared.withdraw(unanswered);
                self.orphan(waiter.pull, got);
            } else {
                // Answered before its pull ended (max_bytes, deadline, shutdown): what the
                // pull still brings is held for the next fetch.
                self.disown(waiter.pull);
            }
        }
    }

    async fn issue_pulls(&mut self, now: Instant) {
        let Some(bound) = self.bound.clone() else {
            return;
        };
        if !bound.is_connected() {
            return;
        }
        let max_pulls = (bound.max_waiting / 2).clamp(1, MAX_OPEN_PULLS);
        // Ask to be woken by the next settle while fetches wait for a pull; flagged before
        // capacity is read, so a settle in between is not missed.
        if self
            .waiters
            .iter()
            .any(|waiter| waiter.pull.is_none() && waiter.got.is_empty())
        {
            self.shared.starving();
        }
        let reserved: usize = self.held.len()
            + self.waiters.iter().map(|w| w.got.len()).sum::<usize>()
            + self.pulls.values().map(|p| p.remaining).sum::<usize>();
        let mut capacity = self
            .shared
            .max_ack_pending()
            .saturating_sub(self.shared.taken() + reserved);
        for index in 0..self.waiters.len() {
            if self.pulls.len() >= max_pulls || capacity == 0 {
                break;
            }
            let waiter = &self.waiters[index];
            let ready = waiter.pull.is_none()
                && waiter.got.is_empty()
                && waiter.retry_at.is_none_or(|at| at <= now)
                // A zero-wait fetch still gets one no_wait pull: "what is there right now".
                && (waiter.deadline > now || (waiter.demand.wait.is_zero() && !waiter.pulled));
            if !ready {
                continue;
            }
            let mut batch = waiter.demand.batch.min(capacity);
            if let Some(max_batch) = bound.max_batch {
                batch = batch.min(max_batch);
            }
            let mut left = waiter
                .deadline
                .saturating_duration_since(now)
                .min(MAX_PULL_EXPIRES);
            if let Some(max_expires) = bound.max_expires {
                left = left.min(max_expires);
            }
            let expires = (left >= MIN_EXPIRES).then_some(left);
            self.next_pull_id += 1;
            let pull_id = self.next_pull_id;
            let Some(reader) =
                pull::open(&bound, pull_id, batch, expires, self.inbound_sender.clone()).await
            else {
                return;
            };
            capacity -= batch;
            self.pulls.insert(
                pull_id,
                Pull {
                    owner: Some(self.waiters[index].id),
                    remaining: batch,
                    give_up_at: now + left + PULL_GRACE,
                    reader,
                },
            );
            let waiter = &mut self.waiters[index];
            waiter.pull = Some(pull_id);
            waiter.pulled = true;
            waiter.retry_at = None;
        }
        if !self.waiters.is_empty() && self.pulls.len() >= max_pulls {
            debug!(
                open = self.pulls.len(),
                "pull limit reached; fetches wait their turn"
            );
        }
    }
}

impl Drop for Dispatcher {
    fn drop(&mut self) {
        if !self.held.is_empty() {
            info!(
                held = self.held.len(),
                "dispatcher stopped with unleased deliveries; the server redelivers them after ack_wait"
            );
        }
    }
}
