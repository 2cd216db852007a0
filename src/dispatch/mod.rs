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
//! This file is the pull loop: the commands, the bindings, when to open a pull and when to
//! give one up. What arrives and which fetch it goes to is [`handout`]'s; the bookkeeping of
//! waiting fetches, open pulls and held deliveries is [`book`]'s; ordering per key (fences,
//! pins, the other replicas asked how a message ended) is [`ordered`]'s.
//!
//! May import: `nats`, `state`, `domain`. Never `gateway` or `http`.

mod book;
mod handout;
mod ordered;

use std::sync::Arc;
use std::time::Duration;

use async_nats::Subject;
use futures::FutureExt as _;
use futures::StreamExt as _;
use futures::stream::SelectAll;
use tokio::sync::{Notify, mpsc, watch};
use tokio::time::{Instant, sleep_until};
use tracing::{debug, info};

use crate::domain::delivery::{Delivery, Demand};
use crate::domain::ordering::PIN_GROUP;
use crate::nats::Bound;
use crate::nats::pull::{self, PinRequest, PullEvent, PullHandle, PullInbox};
use crate::state::LeaseState;
use book::{Answer, Book, PULL_GRACE, PullLimits};

/// How long the inbox of a pull given up on is still read before it is dropped: the server's
/// end-of-request status normally comes long before.
const STRAGGLER_READ: Duration = Duration::from_secs(30);
/// How long a settle the gateway repeats on its own waits for the server's confirmation.
const SETTLE_AGAIN_TIMEOUT: Duration = Duration::from_secs(5);
/// How often deliveries waiting for the answer to a settle of their message look again.
const SETTLE_ANSWER_POLL: Duration = Duration::from_millis(20);
/// How long the leader elections are followed after the last pull ended: as long as a
/// consumer takes to fall silent.
const ELECTIONS_KEPT: Duration = Duration::from_secs(10);

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
    /// The bound consumer's leader elections, followed while pulls are open (they may die
    /// with the old leader): an idle consumer keeps no subscription (some 6 KB each).
    leader_elections: Option<async_nats::Subscriber>,
    /// The server refused that subscription under this binding (no permission).
    elections_refused: bool,
    /// When a pull was last seen open: the subscription is let go [`ELECTIONS_KEPT`] later.
    pulled_at: Option<Instant>,
    /// Ordering per key: the epoch whose heads the gate knows, the consumer's max_deliver,
    /// the task that lifts the gate's fence, and when hot keys were last warned of.
    ordered_epoch: Option<u32>,
    max_deliver: Option<u64>,
    fence_watch: Option<tokio::task::JoinHandle<()>>,
    verify_watch: Option<tokio::task::JoinHandle<()>>,
    hot_keys_warned: Option<Instant>,
    /// Deliveries of messages whose ack or term is on its way from this process: leased
    /// before that settle's answer, they would be handed out again after their ack.
    awaiting_settle: Vec<Delivery>,
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
            elections_refused: false,
            pulled_at: None,
            ordered_epoch: None,
            max_deliver: None,
            fence_watch: None,
            verify_watch: None,
            hot_keys_warned: None,
            awaiting_settle: Vec::new(),
        }
    }

    pub(crate) async fn run(
        mut self,
        mut commands: mpsc::Receiver<Command>,
        mut bound: watch::Receiver<Option<Arc<Bound>>>,
        capacity_freed: Arc<Notify>,
    ) {
        // A rebind, and the stop, are rare: boxed, they add nothing to the size of this
        // future, which every served consumer keeps for as long as it is served.
        let initial = bound.borrow_and_update().clone();
        Box::pin(self.rebind(initial)).await;
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
                        // Closed at once: a pull from before the resume that the server still
                        // sees an inbox for is kept there, and stands before every new one
                        // until it expires (a minute).
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
                    Box::pin(self.rebind(next)).await;
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
            self.follow_elections().await;
        }
        self.shutting_down = true;
        Box::pin(async {
            self.pump().await;
            self.drain_open_pulls().await;
        })
        .await;
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
        self.leader_elections = None;
        self.elections_refused = false;
        if let Some(bound) = &bound {
            self.bind_ordering(bound, new_epoch);
        }
        self.bound = bound;
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
        // A settle's answer wakes nobody here: look again soon while deliveries wait for one.
        let settle_answer = (!self.awaiting_settle.is_empty()).then_some(now + SETTLE_ANSWER_POLL);
        let elections_let_go = self
            .pulled_at
            .filter(|_| self.leader_elections.is_some())
            .map(|at| at + ELECTIONS_KEPT);
        book.into_iter()
            .chain(reaps)
            .chain(keep_alive)
            .chain(settle_answer)
            .chain(elections_let_go)
            .min()
            .unwrap_or(far)
    }

    async fn pump(&mut self) {
        let now = Instant::now();
        self.book.withdraw_hung_up();
        self.give_up_on_silent_pulls(now);
        self.settles_answered();
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
            self.state
                .set_dispatcher_holding(self.book.holding() + self.awaiting_settle.len());
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

    /// Follow the consumer's leader elections while pulls are open, and only then.
    async fn follow_elections(&mut self) {
        let now = Instant::now();
        if !self.book.has_open_pulls() {
            // Kept a while: a busy consumer's pulls end and begin again all the time.
            if self.pulled_at.is_none_or(|at| now >= at + ELECTIONS_KEPT) {
                self.leader_elections = None;
                self.pulled_at = None;
            }
            return;
        }
        self.pulled_at = Some(now);
        if self.leader_elections.is_some() || self.elections_refused {
            return;
        }
        let Some(bound) = self.bound.clone() else {
            return;
        };
        // Boxed: a subscription is made once per burst of pulls, and this future lives in
        // every served consumer's task.
        self.leader_elections = Box::pin(pull::leader_elections(&bound)).await;
        self.elections_refused = self.leader_elections.is_none();
    }
}

impl Drop for Dispatcher {
    fn drop(&mut self) {
        let held = self.book.held_len() + self.awaiting_settle.len();
        if held > 0 {
            info!(
                held,
                "dispatcher stopped with unleased deliveries; the server redelivers them after ack_wait"
            );
        }
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
