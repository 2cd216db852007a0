//! One push consumer's worker: it leases what its window may send now (through the same
//! lease stream an SSE client uses, so every push is a fenced lease like a fetch's), sends
//! each lease (or batch) to the endpoint, and settles it through the settle path as the
//! answer says. It never retries on its own: a retry is a nak with a delay, and JetStream
//! redelivers.
//!
//! May import: as the rest of `push`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use time::OffsetDateTime;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, error};

use crate::config::PushSpec;
use crate::domain::consumers::ConsumerName;
use crate::domain::delivery::Leased;
use crate::domain::push::{
    Outcome, Pace, Pacer, PushFailure, PushState, PushStatus, RateLimit, Retries, Settle, Verdict,
    Window, judge,
};
use crate::domain::settle::AckCommand;
use crate::gateway::{Consumer, Gateway, LeaseStream, Step};
use crate::http::client::Client;
use crate::telemetry;

use super::client::{Endpoint, Failure, client_for};
use super::request;

/// How long a worker waits before looking again for a consumer that is not served (yet).
const LOOK_AGAIN: Duration = Duration::from_secs(1);
/// A request whose timeout ends this close to half its lease still keeps it alive.
const KEEP_ALIVE_SLACK: Duration = Duration::from_secs(1);
/// A busy window is leased into in steps of at least this part of it.
const LEASE_STEP_PARTS: usize = 8;
/// A failing endpoint is logged at most this often per consumer.
const LOG_FAILURES_EVERY: Duration = Duration::from_secs(60);

/// What the worker and its requests in flight share.
struct Control {
    window: Window,
    pacer: Pacer,
    rate: RateLimit,
    /// No request before this: a `Retry-After`.
    hold_until: Option<Instant>,
    requests_in_flight: usize,
    last_success_at: Option<OffsetDateTime>,
    last_failure: Option<PushFailure>,
    failing: bool,
    last_logged: Option<Instant>,
}

impl Control {
    /// Whether the window has room for the next step: while requests are in flight, a step
    /// waits for an eighth of the window to be free, so that one step through the lease
    /// stream brings several leases rather than one per ended request (the window still
    /// fills: what is free now is leased in the step).
    fn may_lease(&self) -> bool {
        let window = self.window.size();
        let free = window.saturating_sub(self.requests_in_flight);
        free > 0 && (self.requests_in_flight == 0 || free >= (window / LEASE_STEP_PARTS).max(1))
    }
}

/// One push consumer's worker, for as long as its push table is in force.
pub(super) struct Worker {
    pub(super) gateway: Gateway,
    pub(super) name: ConsumerName,
    pub(super) spec: watch::Receiver<Arc<PushSpec>>,
    /// Cancelled when the push table is removed: no new push (requests in flight end as
    /// they would).
    pub(super) retired: CancellationToken,
    /// Cancelled after the shutdown grace: requests still in flight are abandoned and
    /// their messages nak'd.
    pub(super) abandon: CancellationToken,
    pub(super) requests: TaskTracker,
}

/// What one request needs, shared by the requests of one worker.
struct Attempts {
    consumer: Consumer,
    name: ConsumerName,
    spec: Arc<PushSpec>,
    /// The endpoint as it may be shown (logs, status, spans): made once, not per request.
    endpoint: String,
    client: Arc<Endpoint>,
    control: Arc<Mutex<Control>>,
    /// Rung when a request ends: the worker may lease again.
    ended: Arc<Notify>,
    /// Rung when the endpoint asks for a pause (`Retry-After`): the worker stops leasing.
    held: Notify,
    abandon: CancellationToken,
}

impl Worker {
    pub(super) async fn run(mut self) {
        loop {
            if self.retired.is_cancelled() || self.abandon.is_cancelled() {
                break;
            }
            let Some(consumer) = self.gateway.served(&self.name) else {
                tokio::select! {
                    () = tokio::time::sleep(LOOK_AGAIN) => continue,
                    () = self.retired.cancelled() => break,
                    () = self.abandon.cancelled() => break,
                }
            };
            if !self.push_to(&consumer).await {
                break;
            }
        }
        if let Some(consumer) = self.gateway.served(&self.name) {
            consumer.show_push(None);
        }
        self.gateway
            .metrics()
            .push()
            .forget(&self.name.stream, &self.name.consumer);
    }

    /// Push `consumer`'s messages until the push table changes (true: go on with the new
    /// one), or the consumer is no longer served (true), or the worker must stop (false).
    async fn push_to(&mut self, consumer: &Consumer) -> bool {
        let spec = self.spec.borrow_and_update().clone();
        let client = match client_for(&spec) {
            Ok(client) => client,
            Err(why) => {
                error!(consumer = %self.name, error = %why, "cannot push: the endpoint's TLS settings do not work; waiting for the consumers file to change");
                return tokio::select! {
                    changed = self.spec.changed() => changed.is_ok(),
                    () = self.retired.cancelled() => false,
                    () = self.abandon.cancelled() => false,
                };
            }
        };
        let control = Arc::new(Mutex::new(Control {
            window: Window::new(spec.max_in_flight),
            pacer: Pacer::default(),
            rate: RateLimit::new(f64::from(spec.rate_limit), Instant::now()),
            hold_until: None,
            requests_in_flight: 0,
            last_success_at: None,
            last_failure: None,
            failing: false,
            last_logged: None,
        }));
        let attempts = Arc::new(Attempts {
            consumer: consumer.clone(),
            name: self.name.clone(),
            spec: spec.clone(),
            endpoint: spec.shown_url(),
            client,
            control: control.clone(),
            ended: Arc::new(Notify::new()),
            held: Notify::new(),
            abandon: self.abandon.clone(),
        });
        attempts.show();
        let credit = Arc::new(AtomicUsize::new(0));
        let mut stream = LeaseStream::untracked(consumer.clone(), credit.clone());
        loop {
            // Room in the window, and the endpoint's pace.
            let ended = attempts.ended.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            let wait = attempts.room(consumer.live_replicas());
            let room = match wait {
                Ok(room) => room,
                Err(pause) => {
                    tokio::select! {
                        () = ended => {}
                        () = tokio::time::sleep(pause) => {}
                        changed = self.spec.changed() => return changed.is_ok(),
                        () = self.retired.cancelled() => return false,
                        () = self.abandon.cancelled() => return false,
                    }
                    continue;
                }
            };
            credit.store(room, Ordering::Relaxed);
            let step = tokio::select! {
                step = stream.next::<Client>(None) => step,
                // A lease stream's step can be dropped: its pull goes on for the next one.
                () = attempts.held.notified() => continue,
                changed = self.spec.changed() => return changed.is_ok(),
                () = self.retired.cancelled() => return false,
            };
            match step {
                Step::Lease(first) => {
                    let mut leases = vec![*first];
                    while leases.len() < room {
                        match stream.next_ready() {
                            Some(leased) => leases.push(*leased),
                            None => break,
                        }
                    }
                    if spec.batch > 1 && leases.len() < spec.batch.min(room) {
                        self.fill_batch(&mut stream, &mut leases, &spec, room).await;
                    }
                    for request in chunks(leases, spec.batch) {
                        attempts.send(request, &self.requests);
                    }
                }
                // Nothing for a while (or paused): what it shows may have changed.
                Step::Quiet => attempts.show(),
                // No new push; what is in flight is answered within the grace (or nak'd).
                Step::ShuttingDown => return false,
                // No longer served as it was (removed, rebound with new settings): look
                // for it again.
                Step::Ended(_) | Step::Gone => return true,
            }
        }
    }

    /// Wait up to `batch_wait` for a batch to fill.
    async fn fill_batch(
        &mut self,
        stream: &mut LeaseStream,
        leases: &mut Vec<Leased>,
        spec: &PushSpec,
        room: usize,
    ) {
        let until = Instant::now() + spec.batch_wait;
        let wanted = spec.batch.min(room);
        while leases.len() < wanted {
            while leases.len() < wanted {
                match stream.next_ready() {
                    Some(leased) => leases.push(*leased),
                    None => break,
                }
            }
            if leases.len() >= wanted {
                return;
            }
            // A lease stream's step can be dropped: its pull goes on for the next one.
            match tokio::time::timeout_at(until, stream.next::<Client>(None)).await {
                Ok(Step::Lease(leased)) => leases.push(*leased),
                Ok(Step::Quiet) => {}
                Ok(_) | Err(_) => return,
            }
        }
    }
}

/// The next tick of `interval`, if there is one; never without.
async fn tick(interval: Option<&mut tokio::time::Interval>) -> Option<Instant> {
    match interval {
        Some(interval) => Some(interval.tick().await),
        None => std::future::pending().await,
    }
}

/// Split `leases` into requests of at most `batch`.
fn chunks(mut leases: Vec<Leased>, batch: usize) -> Vec<Vec<Leased>> {
    let mut requests = Vec::new();
    while !leases.is_empty() {
        let rest = leases.split_off(batch.min(leases.len()));
        requests.push(std::mem::replace(&mut leases, rest));
    }
    requests
}

impl Attempts {
    /// How many messages may be leased now, or how long until some may.
    fn room(&self, replicas: usize) -> Result<usize, Duration> {
        let now = Instant::now();
        let Ok(mut control) = self.control.lock() else {
            return Err(LOOK_AGAIN);
        };
        // The fleet shares max_in_flight and rate_limit, as it shares max_waiting.
        let share = self.spec.max_in_flight.div_ceil(replicas).max(1);
        control.window.limit(share);
        if self.spec.rate_limit > 0 {
            let rate = f64::from(self.spec.rate_limit) / replicas as f64;
            control.rate.set(rate);
        }
        if let Some(until) = control.hold_until {
            if until > now {
                return Err(until - now);
            }
            control.hold_until = None;
        }
        if !control.may_lease() {
            return Err(LOOK_AGAIN);
        }
        let requests = control.window.size();
        let gap = control.pacer.gap();
        if !gap.is_zero() && control.requests_in_flight > 0 {
            // Paced: one request at a time, the gap between them.
            return Err(gap);
        }
        let batch = self.spec.batch;
        let mut room = (requests - control.requests_in_flight) * batch;
        if !gap.is_zero() {
            room = batch;
        }
        if self.spec.rate_limit > 0 {
            room = room.min(batch);
            control.rate.take(room, now)?;
        }
        Ok(room)
    }

    /// Send one request in the background.
    fn send(self: &Arc<Self>, leases: Vec<Leased>, requests: &TaskTracker) {
        let epoch = {
            let Ok(mut control) = self.control.lock() else {
                return;
            };
            control.requests_in_flight += 1;
            control.window.epoch()
        };
        let attempts = self.clone();
        // Boxed: a task's future is moved whole when the task starts and again when it ends,
        // and an attempt's is large (the HTTP exchange, the settles).
        requests.spawn(Box::pin(async move {
            attempts.attempt(leases, epoch).await;
            let lease_again = attempts.control.lock().is_ok_and(|mut control| {
                control.requests_in_flight -= 1;
                control.may_lease()
            });
            attempts.show();
            if lease_again {
                attempts.ended.notify_one();
            }
        }));
    }

    /// Wait out a `Retry-After` that came after these leases were taken, keeping them
    /// alive; false when the worker must abandon them (they were nak'd).
    async fn wait_out_hold(&self, leases: &[Leased]) -> bool {
        let lease = self.consumer.lease_lifetime();
        loop {
            let held = self
                .control
                .lock()
                .ok()
                .and_then(|control| control.hold_until)
                .filter(|until| *until > Instant::now());
            let Some(until) = held else {
                return true;
            };
            tokio::select! {
                () = tokio::time::sleep_until(until.min(Instant::now() + lease / 2)) => {}
                () = self.abandon.cancelled() => {
                    self.nak_all(leases).await;
                    return false;
                }
            }
            if until > Instant::now() {
                self.extend_all(leases).await;
            }
        }
    }

    /// Keep every lease of a request alive for another lease lifetime.
    async fn extend_all(&self, leases: &[Leased]) {
        for leased in leases {
            let _ = self.consumer.extend(&leased.id).await;
        }
    }

    /// Back to the server at once, for another replica (or this one, restarted) to push.
    async fn nak_all(&self, leases: &[Leased]) {
        for leased in leases {
            let _ = self
                .consumer
                .settle(&leased.id, &AckCommand::Nak { delay: None })
                .await;
        }
    }

    /// One attempt: send, keep the leases alive while it lasts, settle as the answer says.
    ///
    /// What is rare (a hold, a keep-alive, the shutdown) and what is large (the exchange, the
    /// settles) is boxed: this future is moved whole when its task is made, so it stays small.
    async fn attempt(&self, leases: Vec<Leased>, epoch: u64) {
        let held = self
            .control
            .lock()
            .ok()
            .and_then(|control| control.hold_until)
            .is_some_and(|until| until > Instant::now());
        if held && !Box::pin(self.wait_out_hold(&leases)).await {
            return;
        }
        let started = Instant::now();
        let mut request = request::build(&self.spec, &leases, SystemTime::now());
        let mut span =
            telemetry::spans::push_span(&self.endpoint, &leases[0], &mut request.headers);
        let mut answered = Box::pin(self.client.post(request.headers, request.body));
        // A request longer than half the lease keeps its leases alive; one that ends (is
        // answered or times out) well before needs no timer for that.
        let lease = self.consumer.lease_lifetime();
        let outlives_half_lease = self.spec.timeout + KEEP_ALIVE_SLACK >= lease / 2;
        let mut keep_alive =
            outlives_half_lease.then(|| tokio::time::interval_at(started + lease / 2, lease / 2));
        let answer = loop {
            tokio::select! {
                answer = &mut answered => break answer,
                Some(_) = tick(keep_alive.as_mut()) => Box::pin(self.extend_all(&leases)).await,
                () = self.abandon.cancelled() => {
                    // The shutdown grace is over.
                    Box::pin(self.nak_all(&leases)).await;
                    return;
                }
            }
        };
        let took = started.elapsed();
        telemetry::spans::pushed(&mut span, answer.as_ref().ok().map(|answer| answer.status));
        drop(span);
        let retries = Retries {
            initial: self.spec.retry_initial,
            max: self.spec.retry_max,
            after_max: self.spec.retry_after_max,
        };
        let now = SystemTime::now();
        let (outcome, per_message, failure) = match &answer {
            Ok(answer) => {
                let status = answer.status;
                let per_message = if leases.len() > 1 && (200..300).contains(&status) {
                    request::batch_results(&answer.body)
                } else {
                    None
                };
                let failure = (!(200..300).contains(&status)).then(|| PushFailure {
                    at: OffsetDateTime::now_utc(),
                    status: Some(status),
                    error: None,
                });
                (
                    Outcome::Answered {
                        status,
                        settle: answer.settle.as_deref(),
                        retry_after: answer.retry_after.as_deref(),
                    },
                    per_message,
                    failure,
                )
            }
            Err(failure) => {
                let outcome = match failure {
                    Failure::TimedOut => Outcome::TimedOut,
                    Failure::Connect(_) => Outcome::ConnectFailed,
                    Failure::Broken(_) => Outcome::Failed,
                };
                // Never the URL: its query may hold a secret.
                let error = failure.describe();
                (
                    outcome,
                    None,
                    Some(PushFailure {
                        at: OffsetDateTime::now_utc(),
                        status: None,
                        error: Some(error),
                    }),
                )
            }
        };
        let mut verdicts: Vec<Verdict> = leases
            .iter()
            .map(|leased| {
                judge(
                    outcome,
                    leased.delivery.coordinates.key.delivered,
                    &retries,
                    now,
                    rand::random::<f64>(),
                )
            })
            .collect();
        if let Some(results) = per_message {
            for (verdict, asked) in verdicts.iter_mut().zip(results) {
                if let Some(settle) = asked {
                    verdict.settle = settle;
                }
            }
        }
        self.learn(&verdicts[0], epoch, failure);
        Box::pin(self.settle_as_judged(&leases, &verdicts, took)).await;
    }

    /// Settle each pushed message as its verdict says (and count the attempt).
    async fn settle_as_judged(&self, leases: &[Leased], verdicts: &[Verdict], took: Duration) {
        let metrics = self.consumer.metrics_of_process();
        // Acks go together (one batch settle: about one round trip for all of them), the
        // rest alongside, each with its own delay or reason.
        let mut acks: Vec<(&Leased, String)> = Vec::new();
        let mut others: Vec<(&Leased, AckCommand)> = Vec::new();
        for (leased, verdict) in leases.iter().zip(verdicts) {
            metrics
                .push()
                .attempt(&self.name.stream, &self.name.consumer, verdict.result, took);
            match &verdict.settle {
                Settle::Ack => acks.push((leased, leased.id.clone())),
                // Left to the endpoint: nothing to do.
                Settle::Later => {}
                Settle::Nak(delay) => others.push((
                    leased,
                    AckCommand::Nak {
                        delay: (!delay.is_zero()).then_some(*delay),
                    },
                )),
                Settle::Term(reason) => others.push((
                    leased,
                    AckCommand::Term {
                        reason: Some(reason.clone()),
                    },
                )),
            }
        }
        let ids: Vec<String> = acks.iter().map(|(_, id)| id.clone()).collect();
        let acked = async {
            match ids.as_slice() {
                [] => Vec::new(),
                // One alone takes the single settle's shorter path.
                [id] => vec![self.consumer.settle_issued(id, &AckCommand::Ack).await],
                _ => {
                    self.consumer
                        .settle_many_issued(&ids, &AckCommand::Ack)
                        .await
                }
            }
        };
        let settled_others = futures::future::join_all(
            others
                .iter()
                .map(|(leased, command)| self.consumer.settle_issued(&leased.id, command)),
        );
        let (acked, settled_others) = futures::join!(acked, settled_others);
        let ack = AckCommand::Ack;
        let outcomes = acks
            .iter()
            .map(|(leased, _)| (*leased, &ack))
            .zip(acked)
            .chain(
                others
                    .iter()
                    .map(|(leased, command)| (*leased, command))
                    .zip(settled_others),
            );
        for ((leased, command), outcome) in outcomes {
            if let Err(err) = outcome {
                debug!(consumer = %self.name, error = %err, "a push's settle did not land; its redelivery is settled again from memory");
                // The endpoint has it: what comes back is settled again, never pushed again
                // by this process.
                self.consumer.remember_ended(leased, command);
            }
        }
    }

    /// What one request's answer teaches the window, the pace and the status.
    fn learn(&self, verdict: &Verdict, epoch: u64, failure: Option<PushFailure>) {
        let Ok(mut control) = self.control.lock() else {
            return;
        };
        control.window.learn(verdict.pace, epoch);
        let window = control.window.size();
        control.pacer.learn(verdict.pace, window);
        if let Some(hold) = verdict.hold {
            let until = Instant::now() + hold;
            control.hold_until = Some(control.hold_until.map_or(until, |held| held.max(until)));
            self.held.notify_waiters();
        }
        match failure {
            None if verdict.pace == Pace::Took => {
                control.last_success_at = Some(OffsetDateTime::now_utc());
                control.failing = false;
            }
            None => {}
            Some(failure) => {
                let now = Instant::now();
                let log = control
                    .last_logged
                    .is_none_or(|last| now.duration_since(last) >= LOG_FAILURES_EVERY);
                if log {
                    control.last_logged = Some(now);
                    let endpoint = &self.endpoint;
                    match (&failure.status, &failure.error) {
                        (Some(status), _) => {
                            error!(consumer = %self.name, %endpoint, status, "the push endpoint refuses messages (logged at most once a minute)");
                        }
                        (None, Some(why)) => {
                            error!(consumer = %self.name, %endpoint, error = %why, "the push endpoint cannot be reached (logged at most once a minute)");
                        }
                        (None, None) => {}
                    }
                }
                control.failing = true;
                control.last_failure = Some(failure);
            }
        }
    }

    /// Tell the consumer (and the metrics) how the push stands.
    fn show(&self) {
        let Ok(control) = self.control.lock() else {
            return;
        };
        let held = control
            .hold_until
            .is_some_and(|until| until > Instant::now());
        let state = if self.consumer.paused().is_some() {
            PushState::Paused
        } else if held || control.failing {
            PushState::BackingOff
        } else {
            PushState::Running
        };
        let status = PushStatus {
            url: self.endpoint.clone(),
            state,
            window: control.window.size(),
            in_flight: control.requests_in_flight,
            last_success_at: control.last_success_at,
            last_failure: control.last_failure.clone(),
        };
        self.consumer.metrics_of_process().push().state(
            &self.name.stream,
            &self.name.consumer,
            status.window,
            status.in_flight,
        );
        self.consumer.show_push(Some(status));
    }
}
