//! One consumer's core: fetch, settle, extend and inspect, over its lease table, its
//! dispatcher and the NATS boundary; everything per consumer lives under this folder, and
//! what the process shares (connection, lease key, trust, metrics registry) comes in as
//! [`Process`].
//!
//! A supervisor task keeps the shared connection bound to the consumer (retrying while NATS
//! is away, rebinding after a reconnect or a deleted consumer) and publishes the binding on a
//! watch channel; the dispatcher and every request read the current binding from there.
//!
//! May import: as the rest of `gateway`.

mod compactor;
mod exchange;
mod fetch;
mod idle;
mod pace;
mod pause;
mod recorder;
mod replicas;
mod seek;
mod settings;
mod settle;
mod shutdown;
mod stream;
mod supervisor;
mod wire;

pub(crate) use fetch::{Caller, Idempotency};
pub(crate) use seek::SeekTarget;
pub(crate) use settings::SettingsChange;
use stream::StreamsEnd;
pub(crate) use stream::{AnswersOwed, EndsWhen, LeaseStream, STREAM_SLICE, Step};

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::dispatch::{Command, Dispatcher};
use crate::domain::consumers::ConsumerName;
use crate::domain::delivery::Leased;
use crate::domain::finals::{Final, MessageKey};
use crate::domain::idempotency::IdempotencyCache;
use crate::domain::push::{PushState, PushStatus};
use crate::domain::settle::AckCommand;
use crate::domain::subject;
use crate::error::Error;
use crate::metrics::{Metrics, Snapshot};
use crate::nats::publish::PublishFailure;
use crate::nats::replicas::{ReplicaRecord, Subjects};
use crate::nats::{self, Bound};
use crate::state::LeaseState;
use supervisor::{Background, supervise};

use super::process::Process;

/// One consumer, as the process-wide gateway hands it to a request. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Consumer {
    state: Arc<LeaseState>,
    /// Which consumer: its stream and name.
    name: Arc<ConsumerName>,
    /// What the process shares with its other consumers.
    process: Arc<Process>,
    commands: mpsc::Sender<Command>,
    bound: watch::Receiver<Option<Arc<Bound>>>,
    /// The binding last made, kept while a rebind is under way: what a publish needs of it
    /// (the stream's subjects, the connection) does not change with a rebind.
    latest_binding: watch::Receiver<Option<Arc<Bound>>>,
    /// Why the consumer cannot be served as it is now (made again as a push consumer, say),
    /// as its requests are answered; `None` while it can.
    cannot_serve: watch::Receiver<Option<Error>>,
    /// Whether the NATS connection is up (from its events) and the binding checked since
    /// the last reconnect; waiting fetches watch it.
    nats_up: watch::Receiver<bool>,
    accepting: Arc<AtomicBool>,
    next_fetch: Arc<AtomicU64>,
    config: Arc<Config>,
    idempotency: Arc<IdempotencyCache>,
    /// What replicas on the consumer send each other.
    subjects: Arc<Subjects>,
    /// The live replicas' last heartbeats (this one's included once it beat).
    replicas: Arc<Mutex<Vec<ReplicaRecord>>>,
    /// True while other replicas are live and, all together, hold max_ack_pending
    /// deliveries: a fetch here would get nothing from the server.
    consumer_full: watch::Receiver<bool>,
    /// What keeps the consumer awake; an idle one does no periodic work.
    activity: Arc<idle::Activity>,
    /// Ends every open stream at once, with why.
    streams_end: Arc<watch::Sender<StreamsEnd>>,
    /// What its push worker says of itself, when it pushes.
    push: Arc<Mutex<Option<PushStatus>>>,
    /// Until when the server has it paused, as last read or changed here.
    paused: Arc<Mutex<pause::PauseView>>,
    /// The mark of the last move (seek) of the consumer this replica knows of; `None`
    /// until its first read of the consumer.
    seek_mark: Arc<Mutex<Option<Option<String>>>>,
    /// The ack_wait and max_ack_pending a changed consumers file applied live.
    live_settings: Arc<settings::LiveSettings>,
    /// Writes the records of confirmed acks and terms every gateway reads back.
    recorder: recorder::Recorder,
}

/// Handles to the background tasks, for an orderly stop.
pub(crate) struct Tasks {
    stop: CancellationToken,
    dispatcher: tokio::task::JoinHandle<()>,
}

/// How often [`Consumer::wait_ready`] looks again between changes of the binding.
const READY_POLL: Duration = Duration::from_millis(2);

/// What a settle of one lease came to.
pub(crate) type SettleResult = Result<(), Error>;

/// What a client hears of a publish the stream did not store.
pub(crate) fn publish_refusal(failure: PublishFailure) -> Error {
    match failure {
        PublishFailure::Expectation {
            detail,
            last_sequence,
        } => Error::PublishPrecondition {
            detail,
            last_sequence,
            by_header: true,
        },
        PublishFailure::AlreadyStored(detail) => Error::BatchAlreadyStored(detail),
        PublishFailure::Disallowed { setting, detail } => Error::StreamDisallows {
            setting,
            detail: format!("{detail}; set `{setting}: true` in the stream's configuration"),
        },
        PublishFailure::Refused(detail) => Error::invalid("headers", detail),
        PublishFailure::Unavailable(detail) => Error::Unavailable(detail),
    }
}

/// What a successful settle sent to the server.
enum Sent {
    /// The settle, confirmed by the server.
    Confirmed,
    /// Nothing: the lease was already settled this way.
    Nothing,
}

/// Consumer state for `GET /consumer`.
pub(crate) struct ConsumerStatus {
    pub(crate) info: async_nats::jetstream::consumer::Info,
    pub(crate) leases_in_flight: usize,
    /// Its ordering key, when it is ordered per key.
    pub(crate) ordering_key: Option<String>,
    /// Messages held until their key is free.
    pub(crate) held: usize,
    /// Keys with a message out.
    pub(crate) busy_keys: usize,
}

impl Consumer {
    /// Start the supervisor and the dispatcher of the consumer `config` names (its
    /// `stream`, `consumer` and consumer settings; the rest as the process's). Returns at
    /// once; NATS is reached in the background. The receiver gets the error that makes the
    /// consumer unusable as configured (missing stream, immutable consumer field differs),
    /// if one comes.
    pub(crate) fn start(
        config: Config,
        process: Arc<Process>,
        names_in_ids: bool,
        at_start: bool,
    ) -> (Self, Tasks, oneshot::Receiver<anyhow::Error>) {
        let mut signer = process.signer(&config.stream, &config.consumer);
        if names_in_ids {
            signer = signer.naming();
        }
        let state = Arc::new(LeaseState::new(
            signer,
            config.ack_wait,
            config.max_ack_pending as usize,
            config.ordering_key.clone(),
            process
                .metrics
                .for_consumer(&config.stream, &config.consumer),
        ));
        let config = Arc::new(config);
        let (commands_tx, commands_rx) = mpsc::channel(1024);
        let (bound_tx, bound_rx) = watch::channel(None);
        let (connected_tx, nats_up) = watch::channel(false);
        let (latest_tx, latest_binding) = watch::channel(None);
        let (cannot_serve_tx, cannot_serve) = watch::channel(None);
        let (fatal_tx, fatal_rx) = oneshot::channel();
        let stop = CancellationToken::new();
        let live_settings = Arc::new(settings::LiveSettings::default());

        let dispatcher = Dispatcher::new(state.clone());
        let dispatcher = tokio::spawn({
            let bound_rx = bound_rx.clone();
            let capacity_freed = state.capacity_freed();
            let stop = stop.clone();
            async move {
                tokio::select! {
                    () = dispatcher.run(commands_rx, bound_rx, capacity_freed) => {}
                    () = stop.cancelled() => {}
                }
            }
        });
        tokio::spawn({
            let config = config.clone();
            let state = state.clone();
            let process = process.clone();
            let commands = commands_tx.clone();
            let stop = stop.clone();
            let live_settings = live_settings.clone();
            async move {
                let background = Background {
                    stop: stop.clone(),
                    state: state.clone(),
                    connected: connected_tx,
                    latest: latest_tx,
                    process: process.clone(),
                    served_by_earlier_releases: !names_in_ids,
                    exit_on_fatal: at_start,
                    cannot_serve: cannot_serve_tx,
                    live_settings,
                };
                tokio::select! {
                    result = supervise(&config, &state, bound_tx, commands, background) => {
                        if let Err(err) = result {
                            let _ = fatal_tx.send(err);
                        }
                    }
                    () = stop.cancelled() => {}
                }
            }
        });
        let recorder = recorder::Recorder::start(latest_binding.clone(), stop.clone());
        let (consumer_full_tx, consumer_full) = watch::channel(false);
        let subjects = Arc::new(Subjects::new(
            &config.internal_prefix,
            &config.stream,
            &config.consumer,
        ));
        let gateway = Self {
            state,
            name: Arc::new(ConsumerName::new(&config.stream, &config.consumer)),
            process,
            commands: commands_tx,
            bound: bound_rx,
            latest_binding,
            cannot_serve,
            nats_up,
            accepting: Arc::new(AtomicBool::new(true)),
            next_fetch: Arc::new(AtomicU64::new(1)),
            config,
            idempotency: Arc::default(),
            subjects,
            replicas: Arc::default(),
            consumer_full,
            activity: Arc::default(),
            streams_end: Arc::new(watch::channel(StreamsEnd::default()).0),
            push: Arc::default(),
            paused: Arc::default(),
            seek_mark: Arc::default(),
            live_settings,
            recorder,
        };
        if gateway.config.ordering_key.is_some() {
            let (finals, highest) = (gateway.clone(), gateway.clone());
            gateway.state.set_elsewhere(crate::state::Elsewhere {
                finals: Arc::new(move |messages| {
                    let asking = finals.clone();
                    Box::pin(async move { asking.finals_elsewhere(messages).await })
                }),
                highest: Arc::new(move || {
                    let asking = highest.clone();
                    Box::pin(async move { asking.highest_elsewhere().await })
                }),
            });
        }
        tokio::spawn(gateway.clone().keep_in_step(consumer_full_tx, stop.clone()));
        let tasks = Tasks { stop, dispatcher };
        (gateway, tasks, fatal_rx)
    }

    pub(crate) fn config(&self) -> &Config {
        &self.config
    }

    /// Which consumer this is.
    pub(crate) fn name(&self) -> &ConsumerName {
        &self.name
    }

    /// Whether `id` is a genuine lease id of this consumer (any replica's).
    pub(crate) fn signed(&self, id: &str) -> bool {
        self.state.signer().decode(id).is_some()
    }

    /// Whether the consumer is bound now.
    pub(crate) fn is_bound(&self) -> bool {
        self.bound.borrow().is_some()
    }

    /// Whether the consumer's stream captures `subject`; an error while unbound.
    pub(crate) fn captures(&self, subject: &str) -> Result<bool, Error> {
        let bound = self.publishable()?;
        Ok(bound
            .stream_subjects
            .iter()
            .any(|filter| subject::matches(filter, subject)))
    }

    /// Take this consumer's series out of `/metrics` (it is no longer served).
    pub(crate) fn forget_metrics(&self) {
        self.state.metrics.forget();
    }

    /// Wait until the consumer can lease (bound, listening for forwarded settles,
    /// announced), at most `within`; the reason it cannot, after that.
    pub(crate) async fn wait_ready(&self, within: Duration) -> Result<(), Error> {
        let deadline = Instant::now() + within;
        let mut bindings = self.bound.clone();
        loop {
            let ready = self.readiness();
            if ready.is_ok() || Instant::now() >= deadline {
                return ready;
            }
            // Bound comes on the watch; listening and announcing follow within moments.
            let _ = tokio::time::timeout_at(
                deadline.min(Instant::now() + READY_POLL),
                bindings.changed(),
            )
            .await;
        }
    }

    fn bound(&self) -> Result<Arc<Bound>, Error> {
        self.bound.borrow().clone().ok_or_else(|| {
            if let Some(refusal) = self.cannot_serve.borrow().clone() {
                return refusal;
            }
            // No NATS address here: anyone may read /readyz, and the address is no one's business.
            Error::Unavailable(if self.process.connection.is_connected() {
                "connected to NATS; binding the consumer (looking up its stream and consumer)"
                    .into()
            } else {
                "consumer not bound (NATS unreachable or starting)".into()
            })
        })
    }

    /// Wait until the consumer may be served again after a refusal for want of a binding
    /// or a connection: its binding or the connection changed.
    pub(crate) async fn binding_or_connection_changed(&self) {
        // From now on: a clone remembers what its original last saw, which may be old.
        let mut bound = self.bound.clone();
        bound.mark_unchanged();
        let mut nats_up = self.nats_up.clone();
        nats_up.mark_unchanged();
        tokio::select! {
            changed = bound.changed() => if changed.is_err() { std::future::pending::<()>().await },
            changed = nats_up.changed() => if changed.is_err() { std::future::pending::<()>().await },
        }
    }

    /// The binding, once connected and checked since the last reconnect; the 503 names
    /// what is awaited.
    fn connected(&self) -> Result<Arc<Bound>, Error> {
        let bound = self.bound()?;
        if !bound.is_connected() {
            return Err(Error::Unavailable(
                "the connection to NATS is down; retrying".into(),
            ));
        }
        if !*self.nats_up.borrow() {
            return Err(Error::Unavailable(
                "reconnected to NATS; reading the consumer's state back before serving it again"
                    .into(),
            ));
        }
        Ok(bound)
    }

    /// The binding a publish goes through: the last one made, whether or not the consumer
    /// is being bound again (a publish needs the stream's subjects and a connection, not the
    /// consumer's state).
    fn publishable(&self) -> Result<Arc<Bound>, Error> {
        let bound = self.latest_binding.borrow().clone().ok_or_else(|| {
            Error::Unavailable("the stream is not known yet (NATS unreachable or starting)".into())
        })?;
        if !bound.is_connected() {
            return Err(Error::Unavailable(
                "the connection to NATS is down; retrying".into(),
            ));
        }
        Ok(bound)
    }

    /// Why the gateway is not ready, in words safe for anyone (no address, no names).
    pub(crate) fn readiness(&self) -> Result<(), Error> {
        if !self.accepting.load(Ordering::Relaxed) {
            return Err(Error::ShuttingDown);
        }
        self.connected().map(drop).map_err(|err| match err {
            Error::Unavailable(_) if self.bound.borrow().is_some() => {
                Error::Unavailable("not connected to NATS".into())
            }
            other => other,
        })?;
        self.known_to_replicas()
    }

    /// Whether the other replicas can tell this one's leases from a dead owner's: the
    /// process listens for the settles they forward and its heartbeat is in the fleet
    /// stream. Until then another replica could take its leases for a dead owner's, so it
    /// issues none.
    fn known_to_replicas(&self) -> Result<(), Error> {
        let fleet = &self.process.fleet;
        if !fleet.listening() {
            return Err(Error::Unavailable(
                "not yet listening for settles forwarded by other replicas".into(),
            ));
        }
        if !fleet.announced() {
            return Err(Error::Unavailable(
                "not yet announced to the other replicas".into(),
            ));
        }
        Ok(())
    }

    /// Whether the process's heartbeat lists this consumer: bound and not fallen silent.
    pub(crate) fn is_busy(&self) -> bool {
        self.activity.is_awake() && self.is_bound()
    }

    /// Whether this replica is pinned to the consumer (ordered per key): it leases it.
    pub(crate) fn is_pinned(&self) -> bool {
        self.state.pin().is_some() && self.is_bound()
    }

    pub(crate) fn leases_in_flight(&self) -> usize {
        self.state.in_flight()
    }

    /// How long a lease issued now lasts: ack_wait less the margin before the server's own
    /// redelivery.
    pub(crate) fn lease_lifetime(&self) -> Duration {
        self.state.ack_wait().saturating_sub(self.state.margin())
    }

    /// The process's metrics (the push series live there).
    pub(crate) fn metrics_of_process(&self) -> &crate::metrics::ProcessMetrics {
        &self.process.metrics
    }

    /// Remember that `leased`'s message ended (`command`: ack or term) although its settle
    /// did not land: a push the endpoint took whose ack the server never confirmed. Its
    /// redelivery is then settled again from memory, never pushed again by this process.
    pub(crate) fn remember_ended(&self, leased: &Leased, command: &AckCommand) {
        let message = MessageKey::of(&leased.delivery.coordinates);
        self.state.confirmed(message, command);
        if let Some(outcome) = Final::of(command) {
            self.recorder.record_later((message, outcome));
        }
    }

    /// How durable its settles are, as its binding found; `None` before the first.
    pub(crate) fn durability(&self) -> Option<crate::domain::durability::Facts> {
        self.latest_binding
            .borrow()
            .as_ref()
            .map(|bound| bound.durability.clone())
    }

    /// The state of its push, when it pushes.
    pub(crate) fn push_status(&self) -> Option<PushStatus> {
        let mut status = self.push.lock().ok().and_then(|status| status.clone())?;
        // The pause as of now: the worker's own view lags by up to a step.
        if self.paused().is_some() {
            status.state = PushState::Paused;
        } else if status.state == PushState::Paused {
            status.state = PushState::Running;
        }
        Some(status)
    }

    /// What its push worker says now (`None`: it no longer pushes).
    pub(crate) fn show_push(&self, status: Option<PushStatus>) {
        if let Ok(mut shown) = self.push.lock() {
            *shown = status;
        }
    }

    /// The live replicas serving this consumer, this one included, as max_waiting is shared
    /// among them: a fleet-wide push limit is shared the same way.
    pub(crate) fn live_replicas(&self) -> usize {
        self.state.replicas()
    }

    /// The gateway's metrics, for recording from the HTTP layer.
    pub(crate) fn metrics(&self) -> &Metrics {
        &self.state.metrics
    }

    /// Set the gauges that mirror this consumer's state, before a scrape.
    pub(crate) fn take_in_metrics(&self) {
        let (leases_in_flight, delayed_naks, expired) = {
            let mut leases = self.state.leases();
            let in_flight = leases.in_flight(Instant::now());
            (in_flight, leases.delayed_naks(), leases.take_expired())
        };
        let metrics = &self.state.metrics;
        metrics.leases_expired(expired);
        metrics.take_in(Snapshot {
            leases_in_flight,
            delayed_naks,
            max_ack_pending: self.state.max_ack_pending(),
            ack_wait: self.state.ack_wait(),
        });
    }

    /// The server's view of the consumer plus the gateway's leases.
    pub(crate) async fn status(&self) -> Result<ConsumerStatus, Error> {
        let bound = self.connected()?;
        // The replicas' view of a consumer that fell silent is stale: one step first.
        let _awake = self.activity.hold();
        self.activity.wake_up().await;
        let info = nats::publish::consumer_info(&bound)
            .await
            .map_err(|err| Error::Unavailable(format!("{err:#}")))?;
        Ok(ConsumerStatus {
            info,
            leases_in_flight: self.leases_in_flight(),
            ordering_key: self.state.ordering_key().map(ToString::to_string),
            held: self.state.ordering_held(),
            busy_keys: self.state.busy_keys(),
        })
    }

    /// Where a message to `subject` goes: this consumer's stream, if it captures it.
    pub(crate) fn publish_route(&self, subject: &str) -> Result<nats::publish::Route, Error> {
        let bound = self.publishable()?;
        if !bound
            .stream_subjects
            .iter()
            .any(|filter| subject::matches(filter, subject))
        {
            return Err(Error::invalid(
                "subject",
                format!(
                    "stream {} does not capture subject {subject:?}; it captures {}",
                    self.config.stream,
                    bound.stream_subjects.join(", ")
                ),
            ));
        }
        Ok(nats::publish::Route::bound(
            &bound,
            &self.config.stream,
            self.config.settle_timeout,
        ))
    }
}
