//! The binding supervisor: keeps the gateway connected to NATS and bound to the consumer —
//! retrying while NATS is away, rebinding after a reconnect or a deleted consumer, starting a
//! new lease epoch when the consumer was recreated — and publishes the binding in force on a
//! watch channel that the dispatcher and every request read.
//!
//! May import: as the rest of `gateway`.

use std::sync::Arc;
use std::time::Duration;

use time::OffsetDateTime;
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::config::Config;
use crate::dispatch::Command;
use crate::domain::subject;
use crate::error::Error;
use crate::metrics::Metrics;
use crate::nats::bind::Recheck;
use crate::nats::{self, BindError, Bound, ConnectionEvent};
use crate::state::LeaseState;

use super::super::process::Process;
use super::recorder::Reader;

/// How soon a consumer that cannot be served as it is (see [`BindError::Unsuitable`]) is
/// tried again, doubling to [`HELD_RETRY_AT_MOST`].
const HELD_RETRY_FIRST: Duration = Duration::from_secs(1);
const HELD_RETRY_AT_MOST: Duration = Duration::from_secs(60);
/// How long a binding waits for the settled records to be read before it tries again.
const CATCH_UP_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest wait between two checks of the consumer after a reconnect.
const RECHECK_RETRY_AT_MOST: Duration = Duration::from_millis(250);

/// The gateway's metrics, for a task that outlives a borrow of [`LeaseState`].
#[derive(Clone)]
struct StateMetrics(Arc<LeaseState>);

impl AsRef<Metrics> for StateMetrics {
    fn as_ref(&self) -> &Metrics {
        &self.0.metrics
    }
}

/// What the supervisor starts next to the binding, on the same connection.
pub(super) struct Background {
    pub(super) stop: CancellationToken,
    pub(super) state: Arc<LeaseState>,
    /// Whether the connection is up, as its events tell: waiting fetches give up on a loss.
    pub(super) connected: watch::Sender<bool>,
    /// The binding last made, kept through a rebind (see [`super::Consumer::publishable`]).
    pub(super) latest: watch::Sender<Option<Arc<Bound>>>,
    /// The process: its connection to NATS, the seal on what replicas share, the fleet
    /// stream.
    pub(super) process: Arc<Process>,
    /// The default consumer, which an earlier release may have served.
    pub(super) served_by_earlier_releases: bool,
    /// Served from the start: a first bind that cannot succeed stops the process.
    pub(super) exit_on_fatal: bool,
    /// Why the consumer cannot be served now, for its requests; `None` while it can.
    pub(super) cannot_serve: watch::Sender<Option<Error>>,
    /// The settings a changed consumers file applied live: a full bind makes the consumer
    /// with them.
    pub(super) live_settings: Arc<super::settings::LiveSettings>,
}

/// Keep the gateway bound: connect, bind, and rebind after reconnects or when asked.
/// Returns only on a fatal error (missing stream, immutable field differs).
pub(super) async fn supervise(
    config: &Config,
    state: &LeaseState,
    bound_tx: watch::Sender<Option<Arc<Bound>>>,
    commands: mpsc::Sender<Command>,
    background: Background,
) -> anyhow::Result<()> {
    // Subscribed before looking at the connection, so no event in between is missed.
    let mut events = background.process.connection.events();
    let Some(client) = background.process.connection.client().await else {
        anyhow::bail!("the NATS client stopped");
    };
    let ephemeral_name = format!("{}-{:016x}", config.consumer, rand::random::<u64>());
    if let Some(subject) = &config.dead_letter_subject {
        let target = nats::dead_letter::Target {
            stream: config.stream.clone(),
            consumer: if config.ephemeral {
                ephemeral_name.clone()
            } else {
                config.consumer.clone()
            },
            subject: subject.clone(),
        };
        let metrics = StateMetrics(background.state.clone());
        let stop = background.stop.child_token();
        if config.ephemeral {
            // An ephemeral consumer lives as long as this process, and so would an advisory
            // stream named after it: listen instead. Subscribed once: async-nats renews
            // subscriptions after every reconnect.
            tokio::spawn(nats::dead_letter::listen(
                client.clone(),
                target,
                metrics,
                stop,
            ));
        } else {
            tokio::spawn(nats::advisories::run(client.clone(), target, metrics, stop));
        }
    }
    let mut identity_seen: Option<(String, OffsetDateTime)> = None;
    let mut published = false;
    let mut backoff = Duration::from_millis(100);
    // A consumer held (it cannot be served as it is): why, and when it is tried again.
    let mut held_for: Option<String> = None;
    let mut held_backoff = HELD_RETRY_FIRST;
    // Reads the consumer's settled records from its first binding with some on.
    let mut records_reader: Option<Reader> = None;
    // The weakest link of its durability is logged once.
    let mut durability_told = false;
    loop {
        // Until the binding is checked and the fleet's records read, nothing is leased: the
        // server may have forgotten settles that other gateways recorded meanwhile.
        state.set_fleet_behind(true);
        // Wait for the connection; async-nats reconnects on its own.
        while !nats::is_connected(&client) {
            match tokio::time::timeout(Duration::from_secs(1), events.recv()).await {
                Ok(Ok(ConnectionEvent::Disconnected)) => {
                    background.connected.send_replace(false);
                    let _ = commands.send(Command::ConnectionLost).await;
                }
                Ok(Err(RecvError::Closed)) => anyhow::bail!("the NATS client stopped"),
                _ => {}
            }
        }
        // What had been delivered before the server is asked what it delivered: a pull still
        // open meanwhile (the binding in force serves on while it is checked) brings deliveries
        // the answer may predate, which a server that forgot nothing knows all the same.
        let highest_before_asking = state.highest_consumer_sequence();
        // A scope of its own: the binding (some 5 KB) must not stay in this task's state
        // while it waits for the next event below.
        {
            let binder = nats::bind::Binder {
                instance: state.signer().owner(),
                ephemeral_name: &ephemeral_name,
                first: identity_seen.is_none(),
                trust: &background.process.trust,
                fleet: &background.process.fleet.stream,
                served_by_earlier_releases: background.served_by_earlier_releases,
            };
            // Once bound, a rebind (after a reconnect, or asked for by a pull the server
            // ended) only needs the consumer's state read back; a first bind, or a consumer
            // found deleted or made again, goes through everything.
            let previous = background.latest.borrow().clone();
            let rechecked = match &previous {
                Some(previous) => Box::pin(nats::bind::recheck(previous)).await,
                None => Ok(Recheck::Changed),
            };
            // Boxed, the future and its result: binding is a deep future and the binding
            // some 5 KB, and held inline they would make this task, which lives as long as
            // the consumer, that large for good (some 25 KB per consumer).
            let binding = match rechecked {
                Ok(Recheck::Same(bound)) => Ok(bound),
                Ok(Recheck::Changed) => {
                    let config = background.live_settings.applied_to(config);
                    Box::pin(nats::bind(&config, &client, &binder))
                        .await
                        .map(Box::new)
                }
                Err(err) => Err(err),
            };
            drop(previous);
            let binding = binding.and_then(|bound| durable_enough(config, bound));
            let bound = match binding {
                Ok(bound) => bound,
                // At start, what the operator must fix stops the process (exit 2).
                Err(
                    BindError::Fatal(message)
                    | BindError::Unsuitable(message)
                    | BindError::Insufficient {
                        detail: message, ..
                    },
                ) if background.exit_on_fatal && identity_seen.is_none() => {
                    anyhow::bail!(message)
                }
                // Later (the consumer made again as something else, a stream deleted, a
                // consumer declared since), it is held, not served: requests hear why (409 or
                // 503), and it is tried again with a backoff, logged once per reason.
                Err(
                    err @ (BindError::Fatal(_)
                    | BindError::Unsuitable(_)
                    | BindError::Insufficient { .. }),
                ) => {
                    let why = err.to_string();
                    let refusal = match err {
                        BindError::Unsuitable(_) => Error::ConsumerUnsuitable(why.clone()),
                        BindError::Insufficient { field, detail } => {
                            Error::DurabilityInsufficient { field, detail }
                        }
                        _ => {
                            Error::Unavailable(format!("the consumer cannot be served now: {why}"))
                        }
                    };
                    if background
                        .cannot_serve
                        .send_replace(Some(refusal))
                        .is_none()
                        || held_for.as_deref() != Some(why.as_str())
                    {
                        error!(consumer = %config.consumer, stream = %config.stream, reason = %why, retry_in = ?held_backoff, "cannot serve this consumer; trying again with a backoff");
                    }
                    held_for = Some(why);
                    if bound_tx.borrow().is_some() {
                        bound_tx.send_replace(None);
                        published = false;
                    }
                    tokio::time::sleep(held_backoff).await;
                    held_backoff = (held_backoff * 2).min(HELD_RETRY_AT_MOST);
                    continue;
                }
                Err(BindError::Transient(err)) => {
                    // A check after a reconnect is one quick request: asked again soon, so
                    // that serving resumes within a second of the cluster having leaders.
                    let retry_in = if background.latest.borrow().is_some() {
                        backoff.min(RECHECK_RETRY_AT_MOST)
                    } else {
                        backoff
                    };
                    warn!(error = %format!("{err:#}"), ?retry_in, "cannot bind the consumer yet");
                    tokio::time::sleep(retry_in).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    continue;
                }
            };
            if let Some(records) = &bound.settled_records {
                let reader = records_reader.get_or_insert_with(|| {
                    Reader::start(
                        records.clone(),
                        background.state.clone(),
                        bound.ack_floor_stream_sequence,
                        background.stop.child_token(),
                    )
                });
                let caught_up = reader
                    .catch_up(records, bound.ack_floor_stream_sequence, CATCH_UP_TIMEOUT)
                    .await;
                if let Err(err) = caught_up {
                    warn!(error = %format!("{err:#}"), retry_in = ?backoff, "cannot read the settled records yet; nothing is leased until they are");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    continue;
                }
            }
            state
                .metrics
                .durability_promise(bound.durability.promise().level());
            if !durability_told {
                durability_told = true;
                if let Some(weakest) = bound.durability.warnings().first() {
                    warn!(stream = %config.stream, consumer = %config.consumer, promise = bound.durability.promise().as_str(), weakest_link = %weakest, "how durable this consumer's settles are (its durability in GET /consumer lists every warning)");
                }
            }
            state.set_fleet_behind(false);
            backoff = Duration::from_millis(100);
            held_backoff = HELD_RETRY_FIRST;
            if let Some(why) = held_for.take() {
                info!(consumer = %config.consumer, stream = %config.stream, was = %why, "the consumer can be served again");
            }
            background.cannot_serve.send_replace(None);
            if let Some(subject) = &config.dead_letter_subject
                && bound
                    .stream_subjects
                    .iter()
                    .any(|filter| subject::matches(filter, subject))
            {
                warn!(%subject, stream = %config.stream, "the consumed stream captures the dead-letter subject: dead letters come back to this consumer");
            }
            let identity = (bound.consumer_name.clone(), bound.created);
            // A server that lost deliveries in a crash (state not yet on disk) sends them again
            // with the same sequences and delivery counts, so the ids handed out before would
            // name the new deliveries too: start a new epoch.
            let forgot_deliveries = bound.delivered_consumer_sequence < highest_before_asking;
            state.apply_settings(bound.ack_wait, bound.max_ack_pending);
            state
                .signer()
                .issue_expiring(bound.everyone_reads_expiring_ids);
            let recreated = identity_seen.as_ref() != Some(&identity);
            if recreated || forgot_deliveries {
                if identity_seen.is_some() {
                    // What ended through this gateway is kept: a recreated consumer (or one a
                    // restarted server recovered as new) delivers those messages again, and
                    // they are settled again, never leased.
                    warn!(consumer = %identity.0, recreated, forgot_deliveries, "the consumer was recreated or lost deliveries; every earlier lease is void");
                    state.new_epoch();
                }
                identity_seen = Some(identity);
                published = false;
            }
            if !published {
                let mut bound = bound;
                bound.epoch = state.epoch();
                let bound: Arc<Bound> = Arc::from(bound);
                background.latest.send_replace(Some(bound.clone()));
                bound_tx.send_replace(Some(bound));
                published = true;
            }
            // Usable only now that the binding is checked against what the server kept: a
            // settle sent between the reconnect and this check could name a delivery the server
            // forgot (504 where the lease is void, 410).
            background.connected.send_replace(true);
        }
        // Stay bound until the connection comes back after a drop, or a rebind is asked for.
        loop {
            tokio::select! {
                event = events.recv() => match event {
                    Ok(ConnectionEvent::Disconnected) => {
                        background.connected.send_replace(false);
                        state.set_fleet_behind(true);
                        let _ = commands.send(Command::ConnectionLost).await;
                    }
                    // Events missed: whatever they were, bind again once connected.
                    Ok(ConnectionEvent::Connected) | Err(RecvError::Lagged(_)) => {
                        let _ = commands.send(Command::Reconnected).await;
                        break;
                    }
                    Ok(_) => {}
                    Err(RecvError::Closed) => anyhow::bail!("the NATS client stopped"),
                },
                () = state.rebind_requested() => {
                    state.set_fleet_behind(true);
                    bound_tx.send_replace(None);
                    published = false;
                    break;
                }
            }
        }
    }
}

/// `bound`, unless its settles are less durable than `--require-durability` asks.
fn durable_enough(config: &Config, bound: Box<Bound>) -> Result<Box<Bound>, BindError> {
    let Some(required) = config.require_durability else {
        return Ok(bound);
    };
    match bound.durability.shortfall(required.requirement()) {
        None => Ok(bound),
        Some((field, why)) => Err(BindError::Insufficient {
            field,
            detail: format!(
                "consumer {}/{} is not served: --require-durability {} is not met: {why}",
                config.stream,
                config.consumer,
                required.as_str()
            ),
        }),
    }
}
