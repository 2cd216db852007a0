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
//! Pulls and their inboxes are the NATS boundary's ([`crate::nats::pull`]); this task decides
//! when to open one and for whom, and reads every open pull's inbox itself: a task per pull
//! in between cost each fetch a spawn and one more wake-up on its way back to the client.
//!
//! May import: `nats`, `state`, `domain`. Never `gateway` or `http`.

mod book;

use std::sync::Arc;
use std::time::Duration;

use async_nats::Subject;
use futures::FutureExt as _;
use futures::StreamExt as _;
use futures::stream::SelectAll;
use tokio::sync::{Notify, mpsc, watch};
use tokio::time::{Instant, sleep_until};
use tracing::{debug, info, warn};

use crate::domain::delivery::{Delivery, Demand};
use crate::domain::finals::{Final, MessageKey};
use crate::domain::ordering::PIN_GROUP;
use crate::nats::Bound;
use crate::nats::pull::{self, PinRequest, PullEvent, PullHandle, PullInbox};
use crate::nats::settle as nats_settle;
use crate::state::LeaseState;
use book::{Answer, Book, PULL_GRACE, PullLimits};

/// How long the inbox of a pull given up on is still read before it is dropped: the server's
/// end-of-request status normally comes long before.
const STRAGGLER_READ: Duration = Duration::from_secs(30);
/// How long a settle the gateway repeats on its own waits for the server's confirmation.
const SETTLE_AGAIN_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a fenced ordered consumer reads the server's count of pending messages (see
/// [`watch_fence`]).
const FENCE_POLL: Duration = Duration::from_millis(100);
/// The header in which the server names the pin of a priority-group consumer's delivery.
const PIN_HEADER: &str = "Nats-Pin-Id";
/// How often at most the WARN about hot ordering keys is logged.
const HOT_KEYS_WARN_EVERY: Duration = Duration::from_secs(60);
/// How many of the hottest keys that WARN names.
const HOT_KEYS_NAMED: usize = 5;

pub(crate) enum Command {
    Fetch {
        /// Unique per fetch; chosen by the caller so it can withdraw the fetch.
        id: u64,
        demand: Demand,
        answer: Answer,
    },
    /// The fetch's HTTP client went away: free its place at once; what its pull still
    /// brings goes to the next fetch.
    Withdraw { id: u64 },
    /// A patient stream (a push worker's) ended: end its long pull now.
    EndStream { id: u64 },
    /// The consumer was resumed: nats-server serves no pull made while it was paused (such
    /// a pull waits out its expiry, seen on 2.15), so the patient pulls — open for up to a
    /// minute — are ended and made anew.
    Resumed,
    /// The NATS connection dropped: the server forgot every open pull.
    ConnectionLost,
    /// Deliveries whose leases were given back (the client left): lease them again.
    GiveBack(Vec<Delivery>),
    /// Answer every waiting fetch now, stop pulling, nak whatever arrives.
    Shutdown,
    /// The connection is back. Not a no-op: it wakes the loop, and the pump that follows
    /// every command issues pulls for the fetches that waited through the outage.
    Reconnected,
    /// Release what is held and end the task.
    Stop,
}

/// Every pull's inbox still read: the open pulls' and the stragglers'. Made with the first
/// pull and let go after the last, so that an idle consumer keeps no set of them.
#[derive(Default)]
struct Inboxes(Option<SelectAll<PullInbox>>);

impl Inboxes {
    fn push(&mut self, inbox: PullInbox) {
        self.0.get_or_insert_with(SelectAll::new).push(inbox);
    }

    /// What the next inbox yields; `None` at once while there is none to read.
    async fn next(&mut self) -> Option<PullEvent> {
        self.0.as_mut()?.next().await
    }

    /// What an inbox yields without waiting, if anything is there.
    fn next_ready(&mut self) -> Option<PullEvent> {
        self.0.as_mut()?.next().now_or_never().flatten()
    }

    fn let_go_if_empty(&mut self) {
        if self.0.as_ref().is_some_and(SelectAll::is_empty) {
            self.0 = None;
        }
    }
}

pub(crate) struct Dispatcher {
    state: Arc<LeaseState>,
    bound: Option<Arc<Bound>>,
    book: Book<PullHandle>,
    inboxes: Inboxes,
    shutting_down: bool,
    /// Pulls given up on, whose inboxes are still read until the server ends them.
    stragglers: Vec<(Instant, PullHandle)>,
    /// A rebind was asked for and has not happened yet.
    rebind_requested: bool,
    /// Reply subjects of messages that were no usable delivery, to nak.
    unusable: Vec<Subject>,
    /// The bound consumer's leader elections: its open pulls may have died with the old
    /// leader.
    leader_elections: Option<async_nats::Subscriber>,
    /// Ordering per key: the epoch whose heads the gate knows, the consumer's max_deliver,
    /// the task that lifts the gate's fence, and when hot keys were last warned of.
    ordered_epoch: Option<u32>,
    max_deliver: Option<u64>,
    fence_watch: Option<tokio::task::JoinHandle<()>>,
    verify_watch: Option<tokio::task::JoinHandle<()>>,
    hot_keys_warned: Option<Instant>,
}

impl Dispatcher {
    pub(crate) fn new(state: Arc<LeaseState>) -> Self {
        Self {
            state,
            bound: None,
            book: Book::new(),
            inboxes: Inboxes::default(),
            shutting_down: false,
            stragglers: Vec::new(),
            rebind_requested: false,
            unusable: Vec::new(),
            leader_elections: None,
            ordered_epoch: None,
            max_deliver: None,
            fence_watch: None,
            verify_watch: None,
            hot_keys_warned: None,
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
                    Some(Command::Fetch { id, demand, answer }) => {
                        self.book.enqueue(id, demand, answer, Instant::now());
                    }
                    Some(Command::Withdraw { id }) => {
                        debug!(fetch = id, "fetch withdrawn: its client hung up");
                        self.book.withdraw(id);
                    }
                    Some(Command::EndStream { id }) => {
                        for inbox in self.book.end_patient_pulls(Some(id), Instant::now()) {
                            inbox.abort();
                        }
                    }
                    Some(Command::Resumed) => {
                        for inbox in self.book.end_patient_pulls(None, Instant::now()) {
                            inbox.abort();
                        }
                    }
                    Some(Command::GiveBack(deliveries)) => self.book.give_back(None, deliveries),
                    Some(Command::ConnectionLost) => self.book.forget_pulls(),
                    Some(Command::Shutdown) => self.shutting_down = true,
                    Some(Command::Reconnected) => {}
                    Some(Command::Stop) | None => break,
                },
                Some(inbound) = self.inboxes.next() => {
                    // Stamped here, on arrival: the loop never waits long for anything else
                    // while messages come in (every NATS call it makes is bounded).
                    self.on_inbound(inbound);
                    // A pull's batch arrives in a burst: take all of it before one pump.
                    while let Some(inbound) = self.inboxes.next_ready() {
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
                Some(_) = next_election(&mut self.leader_elections) => {
                    info!("a new consumer leader was elected: pulling again, since the open pulls may have died with the old one");
                    self.book.forget_pulls();
                }
                () = sleep_until(wake) => {}
            }
            self.pump().await;
            self.inboxes.let_go_if_empty();
        }
        self.shutting_down = true;
        self.pump().await;
        self.drain_open_pulls().await;
    }

    /// Before stopping, let the open pulls end (they are short) and nak what they bring, so
    /// that nothing sent to the gateway waits out its ack_wait.
    async fn drain_open_pulls(&mut self) {
        let now = Instant::now();
        // Patient pulls are not short: not waited for (what they caught is nak'd below).
        for inbox in self.book.end_patient_pulls(None, now) {
            inbox.abort();
        }
        self.stragglers.retain(|(_, inbox)| !inbox.is_finished());
        let open_until = self.book.last_give_up();
        let stragglers_until = (!self.stragglers.is_empty()).then_some(now + PULL_GRACE);
        let Some(until) = open_until.into_iter().chain(stragglers_until).max() else {
            return;
        };
        loop {
            self.stragglers.retain(|(_, inbox)| !inbox.is_finished());
            if (!self.book.has_open_pulls() && self.stragglers.is_empty())
                || Instant::now() >= until
            {
                break;
            }
            tokio::select! {
                Some(inbound) = self.inboxes.next() => self.on_inbound(inbound),
                () = sleep_until(until) => break,
            }
            self.release_held(|_| true).await;
        }
        self.release_held(|_| true).await;
        self.release_ordered(false).await;
        for (_, inbox) in self.stragglers.drain(..) {
            inbox.abort();
        }
        for inbox in self.book.drain_inboxes() {
            inbox.abort();
        }
    }

    async fn rebind(&mut self, bound: Option<Arc<Bound>>) {
        // The old binding's pulls are still read for what they bring: deliveries of an older
        // epoch are nak'd, never leased or dropped.
        let reap_at = Instant::now() + STRAGGLER_READ;
        for inbox in self.book.close_pulls() {
            self.stragglers.push((reap_at, inbox));
        }
        self.rebind_requested = false;
        // Deliveries of a previous binding cannot be leased any more: let the server have them.
        self.release_held(|_| true).await;
        let new_epoch = bound
            .as_ref()
            .is_some_and(|bound| self.ordered_epoch != Some(bound.epoch));
        self.release_ordered(new_epoch).await;
        self.leader_elections = match &bound {
            Some(bound) => pull::leader_elections(bound).await,
            None => None,
        };
        if let Some(bound) = &bound {
            self.bind_ordering(bound, new_epoch);
        }
        self.bound = bound;
    }

    /// An ordered consumer was bound. Under a new epoch (the first binding, a recreated
    /// consumer) the gate knows nothing of what is out: if the server counts messages
    /// pending, another process (an earlier run, another replica) may still hold some, so
    /// keyed messages wait until nothing is out elsewhere.
    fn bind_ordering(&mut self, bound: &Arc<Bound>, new_epoch: bool) {
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
    fn verify_after_pin(&mut self) {
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
    fn fence_ordered_now(&mut self) {
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
    async fn release_ordered(&mut self, forget_heads: bool) {
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
    async fn tend_ordered(&mut self, now: Instant) {
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
            self.book.give_back(None, ready);
        }
    }

    /// When held messages fill max_ack_pending, say which keys hold them (once a minute).
    fn warn_of_hot_keys(&mut self, now: Instant, capacity: usize) {
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

    fn on_inbound(&mut self, inbound: PullEvent) {
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
                self.book.end_pull(pull_id, refused, now);
                return;
            }
        };
        let owner = self.book.count_delivery(pull_id, now);
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
        self.state
            .metrics
            .settled_again(matches!(outcome, Final::Terminated { .. }));
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

    /// Ask the supervisor to rebind, once per binding (every open pull reports a deleted
    /// consumer; a second rebind would cut off the pulls made under the new one).
    fn request_rebind(&mut self) {
        if !self.rebind_requested {
            self.rebind_requested = true;
            self.state.request_rebind();
        }
    }

    /// The earliest moment something needs doing without an outside event.
    fn next_wake(&self) -> Instant {
        let now = Instant::now();
        let far = now + Duration::from_secs(3600);
        let book = self
            .book
            .next_wake(now, self.state.hold(), || self.state.next_release());
        let reaps = self.stragglers.iter().map(|(reap_at, _)| *reap_at);
        let keep_alive = self.state.next_keep_alive();
        book.into_iter()
            .chain(reaps)
            .chain(keep_alive)
            .min()
            .unwrap_or(far)
    }

    async fn pump(&mut self) {
        let now = Instant::now();
        self.book.withdraw_hung_up();
        self.give_up_on_silent_pulls(now);
        let hold = self.state.hold();
        let shutting_down = self.shutting_down;
        self.release_held(|delivery| shutting_down || delivery.received_at + hold <= now)
            .await;
        if shutting_down {
            self.release_ordered(false).await;
        } else {
            self.tend_ordered(now).await;
        }
        self.book.hand_out_held();
        if self.state.ordering_key().is_some() {
            self.state.set_dispatcher_holding(self.book.holding());
        }
        if !self.shutting_down {
            self.issue_pulls(now).await;
        }
        self.answer_finished(now);
        if self.shutting_down {
            // Anything answered just now went back to `held` if its fetch vanished.
            self.release_held(|_| true).await;
        }
    }

    fn give_up_on_silent_pulls(&mut self, now: Instant) {
        for inbox in self.book.give_up_silent_pulls(now) {
            self.stragglers.push((now + STRAGGLER_READ, inbox));
        }
        self.stragglers.retain(|(reap_at, inbox)| {
            if inbox.is_finished() {
                return false;
            }
            if *reap_at <= now {
                inbox.abort();
                return false;
            }
            true
        });
    }

    /// Nak held deliveries that match `release`: the server redelivers them to the next pull.
    async fn release_held(&mut self, release: impl Fn(&Delivery) -> bool) {
        let epoch = self.state.epoch();
        let released = self
            .book
            .take_held(|delivery| delivery.coordinates.epoch != epoch || release(delivery));
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

    fn answer_finished(&mut self, now: Instant) {
        let finished = self
            .book
            .take_finished(now, self.shutting_down, self.state.epoch());
        for mut fetch in finished {
            // A settle confirmed after its message was delivered again (and held or placed
            // meanwhile) ends that delivery too: settled again, not leased.
            fetch.got.retain(
                |delivery| match self.state.final_of(&delivery.coordinates) {
                    Some(outcome) => {
                        self.settle_again(delivery.clone(), outcome);
                        false
                    }
                    None => true,
                },
            );
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

    async fn issue_pulls(&mut self, now: Instant) {
        let Some(bound) = self.bound.clone() else {
            self.book.no_pull_room();
            return;
        };
        if !bound.is_connected() {
            self.book.no_pull_room();
            return;
        }
        // Ask to be woken by the next settle while fetches wait for a pull; flagged before
        // capacity is read, so a settle in between is not missed.
        if self.book.is_starving() {
            self.state.starving();
        }
        // Messages the ordering gate holds are out of the server's hands too.
        let capacity = self
            .state
            .max_ack_pending()
            .saturating_sub(self.state.taken() + self.book.reserved() + self.state.ordering_held());
        if self.state.ordering_key().is_some() {
            self.warn_of_hot_keys(now, capacity);
        }
        let limits = PullLimits {
            // The consumer's max_waiting counts every replica's pulls together.
            max_waiting: bound.max_waiting / self.state.sharing_replicas(),
            max_batch: bound.max_batch,
            max_expires: bound.max_expires,
        };
        // An ordered consumer's pulls name its priority group, and this process's pin.
        let ordered = self.state.ordering_key().is_some();
        let pin_id = if ordered { self.state.pin() } else { None };
        let pin = ordered.then_some(PinRequest {
            group: PIN_GROUP,
            id: pin_id.as_deref(),
        });
        for planned in self.book.plan_pulls(now, capacity, limits) {
            let pull_id = self.book.next_pull_id();
            let Some((inbox, handle)) = pull::open(
                &bound,
                pull_id,
                planned.batch,
                planned.expires,
                planned.keep_open,
                pin.as_ref(),
            )
            .await
            else {
                return;
            };
            self.inboxes.push(inbox);
            self.book.pull_opened(planned, pull_id, handle);
        }
        if self.book.at_pull_limit(limits) {
            debug!("pull limit reached; fetches wait their turn");
        }
    }
}

impl Drop for Dispatcher {
    fn drop(&mut self) {
        let held = self.book.held_len();
        if held > 0 {
            info!(
                held,
                "dispatcher stopped with unleased deliveries; the server redelivers them after ack_wait"
            );
        }
    }
}

/// The pin a delivery of a priority-group consumer carries, taken out of its headers: it
/// is the server's word to this process, not part of the message.
fn take_pin(delivery: &mut Delivery) -> Option<String> {
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
            .settled_again(matches!(outcome, Final::Terminated { .. }));
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

/// The next leader election, or never (no subscription, or it ended).
async fn next_election(elections: &mut Option<async_nats::Subscriber>) -> Option<()> {
    match elections {
        Some(subscriber) => match subscriber.next().await {
            Some(_) => Some(()),
            None => {
                *elections = None;
                std::future::pending().await
            }
        },
        None => std::future::pending().await,
    }
}
