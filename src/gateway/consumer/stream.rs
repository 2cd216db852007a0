//! Leases for an open stream (Server-Sent Events, WebSocket): a client that keeps one
//! connection open is sent leases as they come, at most `max_in_flight` of them live at once.
//! Each step leases what the stream's credit allows — the same path, fencing and limits as a
//! fetch — from one pull that stays open at the server from step to step, so a message
//! published to a quiet stream goes out at once rather than after a new pull; a lease counts
//! in flight until it is settled (over any transport, at any replica: a settle elsewhere is
//! forwarded here), expires or is superseded.
//!
//! May import: as the rest of `gateway`.

use std::collections::VecDeque;
use std::future::Future;
use std::hash::BuildHasher as _;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use super::pace::Pace;
use super::{Caller, Consumer};
use crate::dispatch::Command;
use crate::domain::SequenceMap;
use crate::domain::delivery::{Demand, Leased};
use crate::domain::lease_id::DeliveryKey;
use crate::error::Error;
use crate::telemetry;

/// The longest a stream waits for messages (or for credit) before it says it is alive: well
/// inside the 15 s a client may expect between two lines.
pub(crate) const QUIET_AT_MOST: Duration = Duration::from_secs(10);
/// The same for an idle push worker, which has no client to reassure: as long as its pull
/// may wait.
const PATIENT_QUIET_AT_MOST: Duration = Duration::from_secs(60);
/// A push worker that got messages waits this long for more before it counts as idle and
/// waits patiently: while busy its pull is an ordinary stream's, kept open between steps.
const BUSY_QUIET_AFTER: Duration = Duration::from_secs(1);
/// How long a stream waits before asking again while NATS is away or the consumer is full.
const RETRY_EVERY: Duration = Duration::from_secs(1);
/// The first of those waits when the consumer cannot be served yet (just started: bound but
/// not yet announced to the other replicas; rebinding): doubled up to [`RETRY_EVERY`], so
/// that a stream opened at start serves its first message within a few milliseconds.
const RETRY_FIRST: Duration = Duration::from_millis(25);
/// The most a stream leases in one step, whatever its credit: a client that stops reading
/// strands at most this many (besides what its connection buffers).
pub(crate) const STREAM_SLICE: usize = 100;

/// How often a stream out of credit asks whether the leases the replica pinned to its
/// ordered consumer issued for it are still live there.
const ELSEWHERE_POLL: Duration = Duration::from_millis(250);

/// The last stream id handed out: unique in the process, so that a stream's pull is only
/// ever taken over by the same stream.
static LAST_STREAM_ID: AtomicU64 = AtomicU64::new(0);

/// What a stream sends next.
pub(crate) enum Step {
    /// One lease, to write to the client.
    Lease(Box<Leased>),
    /// Nothing for a while: a keep-alive line.
    Quiet,
    /// The gateway is stopping: the last thing the stream says.
    ShuttingDown,
    /// The stream may not go on (its consumer is no longer served, its token no longer
    /// allows it): the last thing it says, with why.
    Ended(Arc<str>),
    /// The client is gone.
    Gone,
}

/// Why every open stream of a consumer ends, told to them all at once: the gateway stopping,
/// the consumer no longer served as it was. A stream ends when the count moves past the one
/// it opened under; a stream opened later is not ended by an earlier reason.
#[derive(Debug, Clone, Default)]
pub(crate) struct StreamsEnd {
    count: u64,
    reason: Option<Arc<str>>,
}

impl StreamsEnd {
    pub(super) fn bumped(&self, reason: &str) -> Self {
        Self {
            count: self.count + 1,
            reason: Some(Arc::from(reason)),
        }
    }
}

/// Something outside the consumer that ends one stream (its token revoked), with why.
pub(crate) type EndsWhen = Pin<Box<dyn Future<Output = String> + Send>>;

/// What ends a stream: its consumer's [`StreamsEnd`], and its own [`EndsWhen`].
struct Ends {
    consumer: watch::Receiver<StreamsEnd>,
    opened_at: u64,
    own: Option<EndsWhen>,
}

impl Ends {
    /// Why the stream must end now, if it must.
    fn now(&self) -> Option<Arc<str>> {
        let end = self.consumer.borrow();
        (end.count != self.opened_at).then(|| end.reason.clone().unwrap_or_else(|| Arc::from("")))
    }

    /// Resolves with why the stream must end, when it must.
    async fn wait(&mut self) -> Arc<str> {
        let opened_at = self.opened_at;
        let consumer = async {
            match self.consumer.wait_for(|end| end.count != opened_at).await {
                Ok(end) => end.reason.clone().unwrap_or_else(|| Arc::from("")),
                // The consumer is gone altogether.
                Err(_) => Arc::from("the consumer is no longer served"),
            }
        };
        match self.own.as_mut() {
            Some(own) => tokio::select! {
                reason = consumer => reason,
                reason = own => Arc::from(reason),
            },
            None => consumer.await,
        }
    }
}

/// The leases a WebSocket client is settling in band and has not yet been answered about.
/// They keep counting against its credit after they end, until the `settled` frame saying so
/// is queued: a lease they make room for is written after that frame, so a client counting
/// what it holds until each answer never counts more than its credit.
///
/// Ids are kept as 64-bit fingerprints (seeded per session, so a client cannot choose a
/// collision): no copy of an id per lease or operation. A collision only keeps a lease
/// counted until the other id's answer is queued.
#[derive(Default)]
pub(crate) struct AnswersOwed {
    fingerprints: foldhash::fast::RandomState,
    /// Each id's fingerprint, with how many operations under way name it.
    owed: Mutex<SequenceMap<u64, u32>>,
    answered: Notify,
}

impl AnswersOwed {
    fn fingerprint(&self, id: &str) -> u64 {
        self.fingerprints.hash_one(id)
    }

    /// An operation naming `ids` is under way: call before it settles anything.
    pub(crate) fn owe(&self, ids: &[String]) {
        let mut owed = self.owed.lock().unwrap_or_else(PoisonError::into_inner);
        for id in ids {
            *owed.entry(self.fingerprint(id)).or_default() += 1;
        }
    }

    /// The answer about `ids` is queued: they count no longer, and the stream looks again.
    pub(crate) fn answered(&self, ids: &[String]) {
        let mut owed = self.owed.lock().unwrap_or_else(PoisonError::into_inner);
        for id in ids {
            let fingerprint = self.fingerprint(id);
            if let Some(count) = owed.get_mut(&fingerprint) {
                *count -= 1;
                if *count == 0 {
                    owed.remove(&fingerprint);
                }
            }
        }
        drop(owed);
        // One waiter (the stream); a permit is kept if it is not waiting yet.
        self.answered.notify_one();
    }

    fn owes(&self, fingerprint: u64) -> bool {
        self.owed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains_key(&fingerprint)
    }
}

/// Resolves when an answer `owed` waited for is queued; never without answers owed.
async fn answer_queued(owed: Option<&AnswersOwed>) {
    match owed {
        Some(owed) => owed.answered.notified().await,
        None => std::future::pending().await,
    }
}

/// A lease written to a stream and issued here.
struct Written {
    key: DeliveryKey,
    expires_at: Instant,
    /// Its id's fingerprint, kept only where answers may be owed about it.
    id: Option<u64>,
}

/// One open stream's leases: those written to it and still live, and those leased for it
/// and not yet written (given back if the stream ends first).
pub(crate) struct LeaseStream {
    /// Names the stream to the dispatcher: its pull outlives one demand.
    id: u64,
    gateway: Consumer,
    /// An open stream keeps its consumer awake; a push worker's does not (its live leases
    /// do).
    _awake: Option<super::idle::Held>,
    /// Its credit: shared with whoever may change it while the stream is open (a push
    /// worker's window).
    max_in_flight: Arc<AtomicUsize>,
    written: Vec<Written>,
    /// Of those, the ones the replica pinned to an ordered consumer issued (this one
    /// forwarded the stream's demands there): their ids, since only it knows when they end.
    written_elsewhere: Vec<(String, Instant)>,
    /// Whether `written` counts against the credit: not for a push worker, which keeps
    /// its own count of what is in flight.
    tracks_written: bool,
    /// A push worker's: it takes what comes as it comes, so its pull may wait long at the
    /// server (see [`Demand::patient`]) once it is idle.
    patient: bool,
    /// Whether its last demand got nothing (or there was none yet).
    idle: bool,
    /// How long it waits before asking again after its last demand failed.
    retry_in: Duration,
    unwritten: VecDeque<Leased>,
    /// A WebSocket's in-band settles not yet answered: what they name keeps counting.
    answers_owed: Option<Arc<AnswersOwed>>,
    /// How fast its client settles: what its pull may ask beyond the slice it leases.
    pace: Pace,
    ends: Ends,
    /// The span of the request that opened the stream: each batch's receive span is its
    /// child (a disabled span when tracing is off).
    origin: tracing::Span,
}

impl LeaseStream {
    /// A stream of `gateway`'s leases; `ends_when`, if given, ends it too (with its reason).
    pub(crate) fn new(
        gateway: Consumer,
        max_in_flight: usize,
        ends_when: Option<EndsWhen>,
    ) -> Self {
        Self::with_credit(
            gateway,
            Arc::new(AtomicUsize::new(max_in_flight)),
            ends_when,
        )
    }

    /// A stream whose `max_in_flight` may change while it is open: the new value counts
    /// from its next step (a lower one strands nothing: it only leases less).
    pub(crate) fn with_credit(
        gateway: Consumer,
        max_in_flight: Arc<AtomicUsize>,
        ends_when: Option<EndsWhen>,
    ) -> Self {
        let consumer = gateway.streams_end.subscribe();
        let opened_at = consumer.borrow().count;
        Self {
            id: LAST_STREAM_ID.fetch_add(1, Ordering::Relaxed) + 1,
            _awake: Some(gateway.activity.hold()),
            gateway,
            max_in_flight,
            written: Vec::new(),
            written_elsewhere: Vec::new(),
            tracks_written: true,
            patient: false,
            idle: true,
            retry_in: RETRY_FIRST,
            unwritten: VecDeque::new(),
            answers_owed: None,
            pace: Pace::default(),
            ends: Ends {
                consumer,
                opened_at,
                own: ends_when,
            },
            origin: tracing::Span::current(),
        }
    }

    /// A stream that leases up to `credit` at each step, whatever it leased before: its
    /// owner (a push worker) counts what it still holds and sets the credit before each.
    pub(crate) fn untracked(gateway: Consumer, credit: Arc<AtomicUsize>) -> Self {
        let mut stream = Self::with_credit(gateway, credit, None);
        stream.tracks_written = false;
        stream.patient = true;
        stream._awake = None;
        stream
    }

    /// The same stream, whose leases named by in-band settles not yet answered keep
    /// counting against its credit (see [`AnswersOwed`]).
    pub(crate) fn answering(mut self, owed: Arc<AnswersOwed>) -> Self {
        self.answers_owed = Some(owed);
        self
    }

    /// The step that ends the stream for `reason`.
    fn ended(&self, reason: Arc<str>) -> Step {
        if self.gateway.accepting.load(Ordering::Relaxed) {
            Step::Ended(reason)
        } else {
            Step::ShuttingDown
        }
    }

    /// The next thing to send; `caller` is the client, noticed when it hangs up mid-wait.
    pub(crate) async fn next<C: Caller>(&mut self, caller: Option<&C>) -> Step {
        self.next_within(caller, STREAM_SLICE).await
    }

    /// The same, leasing at most `room` when it must lease: a writer with room for fewer
    /// than a slice (its client reading slowly) has no more leased for it than it can take,
    /// so what is leased and not yet flushed stays one slice in all.
    pub(crate) async fn next_within<C: Caller>(&mut self, caller: Option<&C>, room: usize) -> Step {
        loop {
            if let Some(leased) = self.next_ready() {
                return Step::Lease(leased);
            }
            if !self.gateway.accepting.load(Ordering::Relaxed) {
                return Step::ShuttingDown;
            }
            if let Some(reason) = self.ends.now() {
                return self.ended(reason);
            }
            // Listening before looking: a settle landing in between still wakes the wait.
            let state = self.gateway.state.clone();
            let settled = state.settled();
            tokio::pin!(settled);
            settled.as_mut().enable();
            self.forget_ended();
            self.forget_ended_elsewhere().await;
            let max_in_flight = self.max_in_flight.load(Ordering::Relaxed);
            let in_flight = self.written.len() + self.written_elsewhere.len();
            let credit = max_in_flight.saturating_sub(in_flight);
            if credit == 0 {
                let quiet_at = Instant::now() + QUIET_AT_MOST;
                loop {
                    let expiry = self
                        .written
                        .iter()
                        .map(|written| written.expires_at)
                        .chain(self.written_elsewhere.iter().map(|(_, at)| *at))
                        .min()
                        .unwrap_or_else(Instant::now);
                    // A settle of a lease issued elsewhere wakes nothing here: asked again
                    // every little while.
                    let ask_again = (!self.written_elsewhere.is_empty())
                        .then(|| Instant::now() + ELSEWHERE_POLL);
                    let until = ask_again
                        .into_iter()
                        .chain([expiry, quiet_at])
                        .min()
                        .unwrap_or(quiet_at);
                    tokio::select! {
                        () = settled.as_mut() => break,
                        () = answer_queued(self.answers_owed.as_deref()) => break,
                        () = tokio::time::sleep_until(until) => {
                            self.forget_ended();
                            self.forget_ended_elsewhere().await;
                            let in_flight = self.written.len() + self.written_elsewhere.len();
                            if in_flight < max_in_flight {
                                break;
                            }
                            if Instant::now() >= quiet_at || until == expiry {
                                return Step::Quiet;
                            }
                        }
                        () = hung_up(caller) => return Step::Gone,
                        reason = self.ends.wait() => return self.ended(reason),
                    }
                }
                continue;
            }
            let patient = self.patient && self.idle;
            let batch = credit.min(STREAM_SLICE).min(room.max(1));
            let demand = Demand {
                // In slices: what a stuck client is sent and never reads is at most one.
                batch,
                credit: self.pace.pull_credit(credit, batch),
                wait: match (self.patient, patient) {
                    (_, true) => PATIENT_QUIET_AT_MOST,
                    (true, false) => BUSY_QUIET_AFTER,
                    (false, _) => QUIET_AT_MOST,
                },
                max_bytes: None,
                stream: Some(self.id),
                patient,
            };
            let leased = tokio::select! {
                leased = self.gateway.lease_for(demand, caller) => leased,
                // The fetch dropped is withdrawn: what its pull brings goes to the next.
                reason = self.ends.wait() => return self.ended(reason),
            };
            // The client may have left while these were on their way, its hang-up and the
            // leases ready at once (and `select!` takes either): written into the closed
            // connection nobody would read them, and they would wait out their expiry. Asked
            // of the socket itself, as a fetch does before answering.
            let leased = match leased {
                Ok(got) if !got.is_empty() && caller.is_some_and(Caller::has_hung_up) => {
                    self.gateway.give_back(got).await;
                    return Step::Gone;
                }
                leased => leased,
            };
            self.idle = leased.as_ref().is_ok_and(Vec::is_empty);
            let retry_in = self.retry_in;
            self.retry_in = if leased.is_ok() {
                RETRY_FIRST
            } else {
                (retry_in * 2).min(RETRY_EVERY)
            };
            return match leased {
                Ok(leased) if leased.is_empty() => Step::Quiet,
                Ok(leased) => {
                    // A span only for a batch that came: an idle stream exports nothing.
                    if telemetry::on() {
                        let name = self.gateway.name();
                        let mut span = self.origin.in_scope(|| {
                            telemetry::spans::receive_span(&name.stream, &name.consumer)
                        });
                        telemetry::spans::received(&mut span, &leased);
                    }
                    self.unwritten.extend(leased);
                    continue;
                }
                Err(Error::ShuttingDown) => Step::ShuttingDown,
                Err(Error::ClientGone) => Step::Gone,
                // The consumer full, NATS away, this replica not yet announced: the stream
                // stays open and asks again.
                Err(Error::AtCapacity { retry_after, .. }) => {
                    let pause = retry_after.clamp(RETRY_EVERY, QUIET_AT_MOST);
                    tokio::select! {
                        () = tokio::time::sleep(pause) => Step::Quiet,
                        reason = self.ends.wait() => self.ended(reason),
                    }
                }
                // Not bound yet (just started, rebinding) or NATS away: asks again as soon as
                // that changes, or in a while.
                Err(_) => tokio::select! {
                    () = tokio::time::sleep(retry_in) => Step::Quiet,
                    () = self.gateway.binding_or_connection_changed() => Step::Quiet,
                    reason = self.ends.wait() => self.ended(reason),
                },
            };
        }
    }

    /// The next lease already leased for the stream, without waiting: a writer adds these
    /// to what [`LeaseStream::next`] gave, to write them all at once.
    pub(crate) fn next_ready(&mut self) -> Option<Box<Leased>> {
        let leased = self.unwritten.pop_front()?;
        if self.tracks_written {
            if leased.delivery.reply.is_empty() {
                self.written_elsewhere
                    .push((leased.id.clone(), leased.expires_at));
            } else {
                self.written.push(Written {
                    key: leased.delivery.coordinates.key,
                    expires_at: leased.expires_at,
                    id: self
                        .answers_owed
                        .as_deref()
                        .map(|owed| owed.fingerprint(&leased.id)),
                });
            }
        }
        Some(Box::new(leased))
    }

    /// Drop the written leases issued elsewhere that are no longer live there (asked of
    /// the replica that issued them; one that cannot be asked keeps them to their expiry).
    async fn forget_ended_elsewhere(&mut self) {
        let now = Instant::now();
        self.written_elsewhere
            .retain(|(_, expires_at)| *expires_at > now);
        if self.written_elsewhere.is_empty() {
            return;
        }
        let ids: Vec<String> = self
            .written_elsewhere
            .iter()
            .map(|(id, _)| id.clone())
            .collect();
        let owed = self.answers_owed.as_deref();
        let owes = |id: &str| owed.is_some_and(|owed| owed.owes(owed.fingerprint(id)));
        match self.gateway.live_where_issued(ids).await {
            // Its replica is gone, and its leases with it.
            Some(live) if live.is_empty() => self.written_elsewhere.retain(|(id, _)| owes(id)),
            Some(live) => {
                let mut live = live.into_iter();
                self.written_elsewhere
                    .retain(|(id, _)| live.next().unwrap_or(true) || owes(id));
            }
            None => {}
        }
    }

    /// Drop the written leases that are no longer live (settled, and answered where an answer
    /// is owed; expired; superseded).
    fn forget_ended(&mut self) {
        let now = Instant::now();
        let leases = self.gateway.state.leases();
        let owed = self.answers_owed.as_deref();
        let before = self.written.len();
        let mut expired = 0;
        self.written.retain(|written| {
            if written.expires_at <= now {
                expired += 1;
                return false;
            }
            leases.is_live(written.key, now)
                || owed.zip(written.id).is_some_and(|(owed, id)| owed.owes(id))
        });
        let settled = before - self.written.len() - expired;
        self.pace
            .settled(settled, now, self.gateway.state.hold() / 2);
    }
}

/// Resolves when `caller` hangs up; never without one.
async fn hung_up<C: Caller>(caller: Option<&C>) {
    match caller {
        Some(caller) => caller.hung_up().await,
        None => std::future::pending().await,
    }
}

impl Consumer {
    /// Leases taken for a stream whose client went before they were written: back to the
    /// next fetch, as a withdrawn fetch's are.
    pub(crate) async fn give_back_unwritten(&self, leased: Vec<Leased>) {
        self.give_back(leased).await;
    }
}

impl Drop for LeaseStream {
    /// Leases taken for the stream and never written go back, as a withdrawn fetch's do. A
    /// patient stream's long pull ends with it.
    fn drop(&mut self) {
        if self.patient {
            self.gateway
                .tell_from_drop(Command::EndStream { id: self.id });
        }
        if self.unwritten.is_empty() {
            return;
        }
        let unwritten: Vec<Leased> = self.unwritten.drain(..).collect();
        let gateway = self.gateway.clone();
        tokio::spawn(async move { gateway.give_back(unwritten).await });
    }
}
