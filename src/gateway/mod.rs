//! The gateway as the HTTP layer sees it: one process serving many consumers. It finds the
//! consumer a request names (the default one, one of the consumers file, or an existing one
//! bound on first use), routes a settle to the consumer its lease id names, publishes to any
//! stream it serves a consumer of, and drains them all at shutdown.
//!
//! The layout says what is whose: [`consumer`] holds everything per consumer (lease table,
//! dispatcher, binding supervisor, replica view, idempotency); [`process`] and
//! [`connection`] what the process shares; [`fleet`] its one heartbeat and its one
//! subscription for forwarded settles; [`registry`] which consumers are served;
//! [`declared`] the consumers file kept in force; [`settles`] which consumer a settle goes to;
//! [`publishing`] which stream a published message goes to; [`schedules`] delayed and
//! recurring delivery.
//!
//! May import: `dispatch`, `nats`, `state`, `domain`, `config`, `error`, `metrics`. Never `http`.

mod connection;
mod consumer;
mod dead_letters;
mod declared;
mod existing;
mod fleet;
mod process;
mod publishing;
mod redrive;
mod registry;
mod schedules;
mod settles;

pub(crate) use consumer::{
    AnswersOwed, Caller, EndsWhen, Idempotency, LeaseStream, STREAM_SLICE, Step,
};
pub(crate) use consumer::{Consumer, SeekTarget, SettleResult};
pub(crate) use dead_letters::{Cursor, DeadLetterId, Listing as DeadLetterListing};
pub(crate) use redrive::{
    DEFAULT_RATE as REDRIVE_DEFAULT_RATE, MAX_RATE as REDRIVE_MAX_RATE, Redrive, RedriveRequest,
    Selection,
};
pub(crate) use registry::Source;
pub(crate) use schedules::{ScheduleChecks, Scheduled};

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::future::join_all;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::error;

use crate::config::{Config, ConsumerSpec, PushSpec};
use crate::domain::consumers::ConsumerName;
use crate::domain::lease_id::LeaseKey;
use crate::domain::ticket::TicketSigner;
use crate::error::Error;
use crate::metrics::{CONSUMER_SOURCES, ProcessMetrics};
use connection::Connection;
use process::Process;
use registry::{Registry, Served};

/// Which consumer a request is for.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Target<'a> {
    /// `POST /fetch`, `GET /consumer`: `--stream`/`--consumer`.
    Default,
    /// `/streams/{stream}/consumers/{consumer}/…`.
    Named(&'a ConsumerName),
}

/// Whether the caller may settle leases of a consumer (its token's `settle` scopes).
pub(crate) type May<'a> = &'a (dyn Fn(&ConsumerName) -> bool + Sync);

/// One served consumer, as `GET /consumers` lists it.
pub(crate) struct Listing {
    pub(crate) name: ConsumerName,
    pub(crate) source: Source,
    pub(crate) bound: bool,
    pub(crate) leases_in_flight: usize,
}

/// The process-wide gateway. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Gateway(Arc<Inner>);

struct Inner {
    process: Arc<Process>,
    registry: Registry,
    accepting: AtomicBool,
    /// Where the error that stops the process goes (a consumer given at start that cannot
    /// be served as configured, a connection that cannot be made).
    fatal: mpsc::Sender<anyhow::Error>,
    /// Serializes binding consumers on demand, so two first requests bind one.
    binding: tokio::sync::Mutex<()>,
    /// Stops the heartbeat, before the heartbeat is withdrawn.
    beats: CancellationToken,
    stop: CancellationToken,
    /// Stream tickets redeemed here, until they expire: single use where no fleet stream
    /// tells the replicas of each other's.
    tickets_redeemed: std::sync::Mutex<HashMap<String, Instant>>,
    /// The consumers `--serve-existing` names on the server, and when they were listed.
    existing_listed: tokio::sync::Mutex<Option<(Instant, Vec<ConsumerName>)>>,
    /// The push tables of the consumers file in force, by consumer: what the push workers
    /// follow.
    pushes: watch::Sender<Pushes>,
    /// The redrive tasks run here.
    redrives: redrive::Redrives,
    /// Cancelled once the shutdown's settle grace is over (every lease settled, or the grace
    /// spent): the WebSocket sessions then say goodbye (1001).
    grace_over: CancellationToken,
    /// The open WebSocket sessions: a stop waits (bounded) for their close frames to go out.
    websockets: tokio_util::task::TaskTracker,
}

/// The consumers that push, with their push settings.
pub(crate) type Pushes = Arc<HashMap<ConsumerName, PushSpec>>;

/// The push tables of `declared`, by consumer.
fn pushes_of(declared: &[ConsumerSpec]) -> Pushes {
    Arc::new(
        declared
            .iter()
            .filter_map(|spec| {
                let push = spec.push.clone()?;
                Some((ConsumerName::new(&spec.stream, &spec.name), push))
            })
            .collect(),
    )
}

/// How long `GET /consumers` uses a listing of the existing consumers before reading it anew.
const EXISTING_LISTED_FOR: Duration = Duration::from_secs(10);
/// How long a stop waits for the WebSocket sessions' close frames: a client that reads
/// nothing is not waited for.
const WEBSOCKETS_CLOSE_AT_MOST: Duration = Duration::from_secs(1);

/// What [`Gateway::stop`] stops.
pub(crate) struct Tasks {
    stop: CancellationToken,
}

impl Gateway {
    /// Start serving the default consumer (unless `--no-default-consumer`) and `declared`,
    /// signing lease ids with `lease_key` (random when `None`). Returns at once; NATS is
    /// reached in the background. The receiver gets the error that makes the gateway unable
    /// to work as configured, if one comes.
    pub(crate) fn start(
        config: Config,
        lease_key: Option<LeaseKey>,
        declared: Vec<ConsumerSpec>,
    ) -> (Self, Tasks, mpsc::Receiver<anyhow::Error>) {
        let config = Arc::new(config);
        let stop = CancellationToken::new();
        let metrics = Arc::new(ProcessMetrics::new());
        let (fatal_tx, fatal_rx) = mpsc::channel(4);
        let (connection_fatal_tx, connection_fatal) = tokio::sync::oneshot::channel();
        let connection = Connection::open(
            config.clone(),
            metrics.clone(),
            connection_fatal_tx,
            stop.clone(),
        );
        tokio::spawn({
            let fatal = fatal_tx.clone();
            async move {
                if let Ok(err) = connection_fatal.await {
                    let _ = fatal.send(err).await;
                }
            }
        });
        let default = (!config.no_default_consumer)
            .then(|| ConsumerName::new(&config.stream, &config.consumer));
        let process = Arc::new(Process::new(config.clone(), lease_key, metrics, connection));
        let gateway = Self(Arc::new(Inner {
            process,
            registry: Registry::new(default.clone()),
            accepting: AtomicBool::new(true),
            fatal: fatal_tx,
            binding: tokio::sync::Mutex::new(()),
            beats: stop.child_token(),
            stop: stop.clone(),
            tickets_redeemed: std::sync::Mutex::default(),
            existing_listed: tokio::sync::Mutex::default(),
            pushes: watch::channel(pushes_of(&declared)).0,
            redrives: redrive::Redrives::default(),
            grace_over: CancellationToken::new(),
            websockets: tokio_util::task::TaskTracker::new(),
        }));
        tokio::spawn(gateway.clone().keep_redriving(stop.clone()));
        tokio::spawn(gateway.clone().keep_beating(gateway.0.beats.clone()));
        tokio::spawn(gateway.clone().serve_forwarded(stop.clone()));
        if let Some(name) = default {
            gateway.serve(name, (*config).clone(), Source::Default, true);
        }
        for spec in &declared {
            gateway.serve_declared(spec, true);
        }
        if let Some(path) = &config.consumers_file {
            tokio::spawn(declared::keep_in_force(
                gateway.clone(),
                path.clone(),
                declared,
                stop.clone(),
            ));
        }
        if config.serve_existing.is_some() {
            tokio::spawn(gateway.clone().unbind_idle(stop.clone()));
        }
        (gateway, Tasks { stop }, fatal_rx)
    }

    pub(crate) fn config(&self) -> &Config {
        &self.0.process.config
    }

    pub(crate) fn metrics(&self) -> &ProcessMetrics {
        &self.0.process.metrics
    }

    /// Issues and verifies stream tickets.
    pub(crate) fn tickets(&self) -> &TicketSigner {
        &self.0.process.tickets
    }

    /// Redeem the ticket whose nonce is `nonce`, valid until `until`: `Ok(true)` the first
    /// time at any replica, `Ok(false)` after. Across replicas through the fleet stream
    /// (one JetStream publish); where there is none, at this replica alone.
    pub(crate) async fn redeem_ticket(&self, nonce: &str, until: Instant) -> Result<bool, Error> {
        {
            let mut redeemed = self
                .0
                .tickets_redeemed
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let now = Instant::now();
            redeemed.retain(|_, expires| *expires > now);
            if redeemed.insert(nonce.to_owned(), until).is_some() {
                return Ok(false);
            }
        }
        let Some(fleet) = self.0.process.fleet.stream.get() else {
            return Ok(true);
        };
        let valid_for = until.saturating_duration_since(Instant::now());
        fleet
            .claim_once(nonce, valid_for)
            .await
            .map_err(|err| Error::Unavailable(format!("cannot redeem the ticket now: {err:#}")))
    }

    /// Start serving `name` with `config`; `at_start`: an error that makes it unusable stops
    /// the process (else it is logged and the consumer no longer served).
    fn serve(
        &self,
        name: ConsumerName,
        config: Config,
        source: Source,
        at_start: bool,
    ) -> Arc<Served> {
        // The default consumer's ids stay version 2, which releases before this one read.
        let names_in_ids = source != Source::Default;
        let (consumer, tasks, fatal) =
            Consumer::start(config, self.0.process.clone(), names_in_ids, at_start);
        let started = Arc::new(Served::new(consumer, source, tasks));
        let served = self.0.registry.insert(name.clone(), started.clone());
        if !Arc::ptr_eq(&served, &started) {
            // Served already (a race of two first requests): the one in force stays.
            if let Some(tasks) = started.take_tasks() {
                let consumer = started.consumer.clone();
                tokio::spawn(async move { consumer.stop(tasks).await });
            }
            return served;
        }
        self.count_consumers();
        let gateway = self.clone();
        tokio::spawn(async move {
            let Ok(err) = fatal.await else { return };
            if at_start {
                let _ = gateway.0.fatal.send(err).await;
            } else {
                error!(consumer = %name, error = %format!("{err:#}"), "cannot serve this consumer; it is no longer served");
                gateway.unserve(&name).await;
            }
        });
        served
    }

    /// Serve a consumer of the consumers file.
    fn serve_declared(&self, spec: &ConsumerSpec, at_start: bool) {
        let name = ConsumerName::new(&spec.stream, &spec.name);
        let config = self.config().for_declared(spec);
        self.serve(name, config, Source::File, at_start);
    }

    /// Stop serving `name` now: its tasks stop, its memory and series go.
    async fn unserve(&self, name: &ConsumerName) {
        if let Some(served) = self.0.registry.remove(name) {
            self.count_consumers();
            // A stream still open has nothing left to lease (a retired consumer's streams
            // were told why already, and no stream opens on it since).
            if !served.is_retired() {
                served
                    .consumer
                    .end_streams("the consumer is no longer served here");
            }
            if let Some(tasks) = served.take_tasks() {
                served.consumer.stop(tasks).await;
            }
            served.consumer.forget_metrics();
        }
    }

    fn count_consumers(&self) {
        let all = self.0.registry.all();
        for source in CONSUMER_SOURCES {
            let count = all
                .iter()
                .filter(|(_, served)| served.source.as_str() == source)
                .count();
            self.metrics().consumers(source, count);
        }
    }

    /// The push tables in force, as they change.
    pub(crate) fn pushes(&self) -> watch::Receiver<Pushes> {
        self.0.pushes.subscribe()
    }

    /// Make `declared`'s push tables the ones in force (a push table changes without the
    /// consumer being bound anew).
    pub(super) fn declare_pushes(&self, declared: &[ConsumerSpec]) {
        let pushes = pushes_of(declared);
        self.0.pushes.send_if_modified(|now| {
            let changed = **now != *pushes;
            if changed {
                *now = pushes;
            }
            changed
        });
    }

    /// A consumer served now, as it is (never bound on demand; `None` once it is retired).
    pub(crate) fn served(&self, name: &ConsumerName) -> Option<Consumer> {
        self.0
            .registry
            .get(name)
            .filter(|served| !served.is_retired())
            .map(|served| served.consumer.clone())
    }

    /// The consumer a fetch, a stream or a status request is for.
    pub(crate) async fn consumer(&self, target: Target<'_>) -> Result<Consumer, Error> {
        let served = match target {
            Target::Default => self.0.registry.default_consumer().ok_or_else(|| {
                Error::NotFound(
                    "this gateway serves no default consumer (--no-default-consumer); name one: /streams/{stream}/consumers/{consumer}/fetch".into(),
                )
            })?,
            Target::Named(name) => match self.0.registry.get(name) {
                Some(served) if !served.is_retired() => served,
                Some(served) if served.awaits_rebind() => {
                    return Err(Error::Rebinding(format!(
                        "consumer {name} is bound anew with the settings the consumers file now gives it once its live leases have ended; they still settle"
                    )));
                }
                Some(_) => {
                    return Err(Error::ConsumerNotFound(format!(
                        "consumer {name} takes no fetches now (removed from the consumers file); its live leases still settle"
                    )));
                }
                // Boxed, here and for a settle: binding is rare, and its state (some 5 KB)
                // would otherwise be part of every request's future — copied whenever one
                // moves into a task (each WebSocket operation), held by every long poll.
                None => Box::pin(self.bind_existing(name)).await?,
            },
        };
        served.touch();
        Ok(served.consumer.clone())
    }

    /// What `GET /consumers` lists: the served consumers, and with `--serve-existing` the
    /// consumers on the server its patterns name that are not bound now (`bound: false`; the
    /// server's list is read at most every [`EXISTING_LISTED_FOR`]).
    pub(crate) async fn list(&self) -> Vec<Listing> {
        let mut listed: Vec<Listing> = self
            .0
            .registry
            .all()
            .into_iter()
            .filter(|(_, served)| !served.is_retired())
            .map(|(name, served)| Listing {
                name,
                source: served.source,
                bound: served.consumer.is_bound(),
                leases_in_flight: served.consumer.leases_in_flight(),
            })
            .collect();
        for name in self.existing_consumers().await {
            if !listed.iter().any(|listing| listing.name == name) {
                listed.push(Listing {
                    name,
                    source: Source::Existing,
                    bound: false,
                    leases_in_flight: 0,
                });
            }
        }
        listed.sort_by(|a, b| a.name.cmp(&b.name));
        listed
    }

    /// The consumers on the server `--serve-existing` names, as last listed (again once the
    /// list is [`EXISTING_LISTED_FOR`] old); none where it cannot be read.
    async fn existing_consumers(&self) -> Vec<ConsumerName> {
        let Some(patterns) = &self.config().serve_existing else {
            return Vec::new();
        };
        let mut cached = self.0.existing_listed.lock().await;
        if let Some((at, names)) = cached.as_ref()
            && at.elapsed() < EXISTING_LISTED_FOR
        {
            return names.clone();
        }
        let Some(client) = self.0.process.connection.get() else {
            return Vec::new();
        };
        match crate::nats::reconcile::existing_consumers(&client, patterns).await {
            Ok(names) => {
                *cached = Some((Instant::now(), names.clone()));
                names
            }
            Err(err) => {
                tracing::debug!(error = %format!("{err:#}"), "cannot list the existing consumers");
                cached
                    .as_ref()
                    .map(|(_, names)| names.clone())
                    .unwrap_or_default()
            }
        }
    }

    /// Why the gateway is not ready, in words safe for anyone: the consumers it serves from
    /// the start (default and file) must be bound and announced; with none, NATS reached.
    pub(crate) fn readiness(&self) -> Result<(), Error> {
        if !self.0.accepting.load(Ordering::Relaxed) {
            return Err(Error::ShuttingDown);
        }
        let mut any = false;
        for (_, served) in self.0.registry.all() {
            if served.source != Source::Existing && !served.is_retired() {
                served.consumer.readiness()?;
                any = true;
            }
        }
        if !any && !self.0.process.connection.is_connected() {
            return Err(Error::Unavailable("not connected to NATS".into()));
        }
        Ok(())
    }

    /// The Prometheus text exposition, with the state-mirroring gauges read now.
    pub(crate) fn render_metrics(&self) -> String {
        for (_, served) in self.0.registry.all() {
            served.consumer.take_in_metrics();
        }
        self.metrics().render(
            self.0.process.connection.is_connected(),
            crate::metrics::SpanCounts {
                dropped: crate::telemetry::spans_dropped(),
                exported: crate::telemetry::spans_exported(),
            },
        )
    }

    /// Stop taking fetches and answer the waiting ones now.
    pub(crate) async fn begin_shutdown(&self) {
        self.0.accepting.store(false, Ordering::Relaxed);
        let all = self.0.registry.all();
        join_all(
            all.iter()
                .map(|(_, served)| served.consumer.begin_shutdown()),
        )
        .await;
    }

    /// Wait until no lease is in flight on any consumer, or `grace` has passed; then let the
    /// WebSocket sessions close (1001) and wait, bounded, until their close frames are out,
    /// so that none sees the connection drop without one when the process exits.
    pub(crate) async fn settle_grace(&self, grace: Duration) {
        let all = self.0.registry.all();
        join_all(
            all.iter()
                .map(|(_, served)| served.consumer.settle_grace(grace)),
        )
        .await;
        self.0.grace_over.cancel();
        self.0.websockets.close();
        let _ = tokio::time::timeout(WEBSOCKETS_CLOSE_AT_MOST, self.0.websockets.wait()).await;
    }

    /// Resolves once the shutdown's settle grace is over.
    pub(crate) async fn grace_over(&self) {
        self.0.grace_over.cancelled().await;
    }

    /// The tracker of the open WebSocket sessions.
    pub(crate) fn websockets(&self) -> &tokio_util::task::TaskTracker {
        &self.0.websockets
    }

    /// Stop every consumer (naking what is still out) and the shared tasks.
    pub(crate) async fn stop(&self, tasks: Tasks) {
        let all = self.0.registry.all();
        join_all(all.iter().map(|(_, served)| async move {
            if let Some(tasks) = served.take_tasks() {
                served.consumer.stop(tasks).await;
            }
        }))
        .await;
        self.0.redrives.stop().await;
        self.0.beats.cancel();
        self.withdraw().await;
        tasks.stop.cancel();
        self.0.stop.cancel();
        if let Some(client) = self.0.process.connection.get() {
            let _ = tokio::time::timeout(Duration::from_secs(2), client.flush()).await;
        }
    }
}
