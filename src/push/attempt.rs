//! One request's life, from the leases the worker hands it to their settles: it waits out a
//! `Retry-After` hold keeping its leases alive, sends, keeps the leases alive while the
//! endpoint takes its time, judges the answer ([`crate::domain::push::judge`]), settles each
//! message as judged, and teaches the worker's window, pace and status what the answer said.
//! The worker (`push::worker`) decides what to lease and when; this module what becomes
//! of it.
//!
//! May import: as the rest of `push`.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use time::OffsetDateTime;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, error, info, warn};

use crate::config::PushSpec;
use crate::domain::consumers::ConsumerName;
use crate::domain::delivery::Leased;
use crate::domain::push::{
    Outcome, Pace, Pacer, PushFailure, PushState, PushStatus, RateLimit, Retries, Settle,
    Unreadable, Verdict, Window, cut, judge,
};
use crate::domain::settle::AckCommand;
use crate::gateway::Consumer;
use crate::telemetry;

use super::client::{Endpoint, Failure};
use super::request;

/// A request whose timeout ends this close to half its lease still keeps it alive.
const KEEP_ALIVE_SLACK: Duration = Duration::from_secs(1);
/// A busy window is leased into in steps of at least this part of it.
const LEASE_STEP_PARTS: usize = 8;
/// A failing endpoint (or one whose settle directives cannot be read) is logged at most
/// this often per consumer.
const LOG_FAILURES_EVERY: Duration = Duration::from_secs(60);
/// The most of an endpoint's text (a term reason, a settle directive) a log line shows.
const LOGGED_CHARS: usize = 256;

/// What the worker and its requests in flight share.
pub(super) struct Control {
    pub(super) window: Window,
    pub(super) pacer: Pacer,
    pub(super) rate: RateLimit,
    /// No request before this: a `Retry-After`.
    pub(super) hold_until: Option<Instant>,
    pub(super) requests_in_flight: usize,
    last_success_at: Option<OffsetDateTime>,
    last_failure: Option<PushFailure>,
    failing: bool,
    last_logged: Option<Instant>,
    last_unreadable_logged: Option<Instant>,
}

impl Control {
    pub(super) fn new(spec: &PushSpec) -> Self {
        Self {
            window: Window::new(spec.max_in_flight),
            pacer: Pacer::default(),
            rate: RateLimit::new(f64::from(spec.rate_limit), Instant::now()),
            hold_until: None,
            requests_in_flight: 0,
            last_success_at: None,
            last_failure: None,
            failing: false,
            last_logged: None,
            last_unreadable_logged: None,
        }
    }

    /// Whether a `Retry-After` holds every request back now.
    pub(super) fn held(&self, now: Instant) -> bool {
        self.hold_until.is_some_and(|until| until > now)
    }

    /// Whether the window has room for the next step: while requests are in flight, a step
    /// waits for an eighth of the window to be free, so that one step through the lease
    /// stream brings several leases rather than one per ended request (the window still
    /// fills: what is free now is leased in the step). Not under a hold: no request ends
    /// before it does, and what the stream's open pull may still bring must find room to be
    /// leased rather than wait unleased, spending its delivery.
    pub(super) fn may_lease(&self, now: Instant) -> bool {
        let window = self.window.size();
        let free = window.saturating_sub(self.requests_in_flight);
        free > 0
            && (self.requests_in_flight == 0
                || self.held(now)
                || free >= (window / LEASE_STEP_PARTS).max(1))
    }
}

/// What one request needs, shared by the requests of one worker.
pub(super) struct Attempts {
    pub(super) consumer: Consumer,
    pub(super) name: ConsumerName,
    pub(super) spec: Arc<PushSpec>,
    /// The endpoint as it may be shown (logs, status, spans): made once, not per request.
    pub(super) endpoint: String,
    pub(super) client: Arc<Endpoint>,
    pub(super) control: Arc<Mutex<Control>>,
    /// Rung when a request ends: the worker may lease again.
    pub(super) ended: Arc<Notify>,
    pub(super) abandon: CancellationToken,
}

/// The next tick of `interval`, if there is one; never without.
async fn tick(interval: Option<&mut tokio::time::Interval>) -> Option<Instant> {
    match interval {
        Some(interval) => Some(interval.tick().await),
        None => std::future::pending().await,
    }
}

/// When the first of `leases` ends.
fn first_expiry(leases: &[Leased]) -> Instant {
    leases
        .iter()
        .map(|leased| leased.expires_at)
        .min()
        .unwrap_or_else(Instant::now)
}

impl Attempts {
    /// Send one request in the background.
    pub(super) fn send(self: &Arc<Self>, leases: Vec<Leased>, requests: &TaskTracker) {
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
                control.may_lease(Instant::now())
            });
            attempts.show();
            if lease_again {
                attempts.ended.notify_one();
            }
        }));
    }

    /// When the hold in force ends, if one is.
    fn held_until(&self) -> Option<Instant> {
        self.control
            .lock()
            .ok()
            .and_then(|control| control.hold_until)
            .filter(|until| *until > Instant::now())
    }

    /// Wait out a `Retry-After`, keeping the leases alive (extended halfway through what is
    /// left of them, however old they were when the request got them): the endpoint never
    /// got these deliveries, so they must not be spent. When the first of them ends now;
    /// `None` when the worker must abandon them (they were nak'd).
    async fn wait_out_hold(&self, leases: &[Leased]) -> Option<Instant> {
        let lease = self.consumer.lease_lifetime();
        let mut expires_at = first_expiry(leases);
        while let Some(until) = self.held_until() {
            let extend_at = expires_at.checked_sub(lease / 2).unwrap_or(expires_at);
            tokio::select! {
                () = tokio::time::sleep_until(until.min(extend_at)) => {}
                () = self.abandon.cancelled() => {
                    self.nak_all(leases).await;
                    return None;
                }
            }
            if until > Instant::now() {
                let sent_at = Instant::now();
                self.extend_all(leases).await;
                expires_at = sent_at + lease;
            }
        }
        Some(expires_at)
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
        let mut expires_at = first_expiry(&leases);
        if self.held_until().is_some() {
            match Box::pin(self.wait_out_hold(&leases)).await {
                Some(extended_to) => expires_at = extended_to,
                None => return,
            }
        }
        let started = Instant::now();
        let mut request = request::build(&self.spec, &leases, SystemTime::now());
        let mut span =
            telemetry::spans::push_span(&self.endpoint, &leases[0], &mut request.headers);
        let mut answered = Box::pin(self.client.post(request.headers, request.body));
        // A request that may outlast half of what is left of its leases keeps them alive;
        // one that ends (is answered or times out) well before needs no timer for that.
        let lease = self.consumer.lease_lifetime();
        let keep_alive_at = expires_at.checked_sub(lease / 2).unwrap_or(started);
        let outlives_half_lease = started + self.spec.timeout + KEEP_ALIVE_SLACK >= keep_alive_at;
        let mut keep_alive = outlives_half_lease
            .then(|| tokio::time::interval_at(keep_alive_at.max(started), lease / 2));
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
                    request::batch_results(&answer.body, leases.len())
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
        let mut unreadable_result = false;
        if let Some(results) = per_message {
            for ((verdict, leased), asked) in verdicts.iter_mut().zip(&leases).zip(results) {
                match asked {
                    Ok(settle) => verdict.settle = settle,
                    // Never taken for an ack: the backoff's nak.
                    Err(Unreadable) => {
                        unreadable_result = true;
                        let delivered = leased.delivery.coordinates.key.delivered;
                        verdict.settle =
                            Settle::Nak(retries.backoff(delivered, rand::random::<f64>()));
                        verdict.result = "nak";
                    }
                }
            }
        }
        let unreadable = match &answer {
            Ok(answer) if verdicts[0].unreadable => answer.settle.as_deref(),
            Ok(_) if unreadable_result => Some("(a result of the batch's answer body)"),
            _ => None,
        };
        self.learn(&verdicts[0], epoch, failure, unreadable);
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
                Settle::Term(reason) => {
                    info!(consumer = %self.name, stream_sequence = leased.delivery.coordinates.key.stream_sequence, reason = %cut(reason, LOGGED_CHARS), "the push endpoint's answer terminates a message");
                    others.push((
                        leased,
                        AckCommand::Term {
                            reason: Some(reason.clone()),
                        },
                    ));
                }
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

    /// What one request's answer teaches the window, the pace and the status; `unreadable`:
    /// the settle directive it could not read, if so.
    fn learn(
        &self,
        verdict: &Verdict,
        epoch: u64,
        failure: Option<PushFailure>,
        unreadable: Option<&str>,
    ) {
        let Ok(mut control) = self.control.lock() else {
            return;
        };
        control.window.learn(verdict.pace, epoch);
        let window = control.window.size();
        control.pacer.learn(verdict.pace, window);
        if let Some(hold) = verdict.hold {
            let until = Instant::now() + hold;
            control.hold_until = Some(control.hold_until.map_or(until, |held| held.max(until)));
        }
        let now = Instant::now();
        let due = |last: Option<Instant>| {
            last.is_none_or(|last| now.duration_since(last) >= LOG_FAILURES_EVERY)
        };
        if let Some(value) = unreadable
            && due(control.last_unreadable_logged)
        {
            control.last_unreadable_logged = Some(now);
            warn!(consumer = %self.name, endpoint = %self.endpoint, settle = ?cut(value, LOGGED_CHARS), "the push endpoint's Ruststream-Settle cannot be read; the message is nak'd with the backoff, not acked (logged at most once a minute)");
        }
        match failure {
            None if verdict.pace == Pace::Took => {
                control.last_success_at = Some(OffsetDateTime::now_utc());
                control.failing = false;
            }
            None => {}
            Some(failure) => {
                if due(control.last_logged) {
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
    pub(super) fn show(&self) {
        let Ok(control) = self.control.lock() else {
            return;
        };
        let state = if self.consumer.paused().is_some() {
            PushState::Paused
        } else if control.held(Instant::now()) || control.failing {
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
