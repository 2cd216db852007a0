//! The binding supervisor: keeps the gateway connected to NATS and bound to the consumer —
//! retrying while NATS is away, rebinding after a reconnect or a deleted consumer, starting a
//! new lease epoch when the consumer was recreated — and publishes the binding in force on a
//! watch channel that the dispatcher and every request read.
//!
//! May import: as the rest of `gateway`.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use time::OffsetDateTime;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::config::Config;
use crate::dispatch::Command;
use crate::domain::subject;
use crate::metrics::Metrics;
use crate::nats::trust::Trust;
use crate::nats::{self, BindError, Bound, Client, ConnectionEvent};
use crate::state::LeaseState;

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
    /// Where the connection goes once made, for the connection gauge.
    pub(super) client: Arc<OnceLock<Client>>,
    /// Whether the connection is up, as its events tell: waiting fetches give up on a loss.
    pub(super) connected: watch::Sender<bool>,
    /// Seals what the binding's shared stream holds.
    pub(super) trust: Arc<Trust>,
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
    let (events_tx, mut events) = mpsc::unbounded_channel();
    let client = nats::connect(config, events_tx).await?;
    let _ = background.client.set(client.clone());
    // A Connected event counts as a reconnect only after a Disconnected one: the first
    // connection is not one, whether or not async-nats reports it as an event.
    let mut connection_lost = false;
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
    let mut unreachable = Unreachable::default();
    loop {
        // Wait for the connection; async-nats reconnects on its own.
        while !nats::is_connected(&client) {
            match tokio::time::timeout(Duration::from_secs(1), events.recv()).await {
                Ok(Some(ConnectionEvent::Disconnected)) => {
                    connection_lost = true;
                    background.connected.send_replace(false);
                    let _ = commands.send(Command::ConnectionLost).await;
                }
                Ok(Some(ConnectionEvent::Connected)) => {
                    unreachable = Unreachable::default();
                    if std::mem::take(&mut connection_lost) {
                        state.metrics.nats_reconnected();
                    }
                }
                Ok(Some(ConnectionEvent::ClientError(err))) => {
                    unreachable.failed(config, &err).await;
                }
                Ok(None) => anyhow::bail!("the NATS client stopped"),
                _ => {}
            }
        }
        let binder = nats::bind::Binder {
            instance: state.signer().owner(),
            ephemeral_name: &ephemeral_name,
            first: identity_seen.is_none(),
            trust: &background.trust,
        };
        let bound = match nats::bind(config, &client, &binder).await {
            Ok(bound) => bound,
            Err(BindError::Fatal(message)) => anyhow::bail!(message),
            Err(BindError::Transient(err)) => {
                warn!(error = %format!("{err:#}"), retry_in = ?backoff, "cannot bind the consumer yet");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        backoff = Duration::from_millis(100);
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
        let forgot_deliveries =
            bound.delivered_consumer_sequence < state.highest_consumer_sequence();
        state.apply_settings(bound.ack_wait, bound.max_ack_pending);
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
            bound_tx.send_replace(Some(Arc::new(bound)));
            published = true;
        }
        // Usable only now that the binding is checked against what the server kept: a
        // settle sent between the reconnect and this check could name a delivery the server
        // forgot (504 where the lease is void, 410).
        background.connected.send_replace(true);
        // Stay bound until the connection comes back after a drop, or a rebind is asked for.
        loop {
            tokio::select! {
                event = events.recv() => match event {
                    Some(ConnectionEvent::Disconnected) => {
                        connection_lost = true;
                        background.connected.send_replace(false);
                        warn!(nats = %config.nats_url_redacted(), "disconnected from NATS; leases stay valid, fetches answer 503 until reconnected");
                        let _ = commands.send(Command::ConnectionLost).await;
                    }
                    Some(ConnectionEvent::ClientError(err)) => unreachable.failed(config, &err).await,
                    Some(ConnectionEvent::Connected) => {
                        unreachable = Unreachable::default();
                        if std::mem::take(&mut connection_lost) {
                            state.metrics.nats_reconnected();
                        }
                        info!("reconnected to NATS");
                        let _ = commands.send(Command::Reconnected).await;
                        break;
                    }
                    Some(ConnectionEvent::ServerError(err)) => error!(error = %err, "NATS server error"),
                    Some(ConnectionEvent::Other(event)) => info!(event, "NATS event"),
                    None => anyhow::bail!("the NATS client stopped"),
                },
                () = state.rebind_requested() => {
                    bound_tx.send_replace(None);
                    published = false;
                    break;
                }
            }
        }
    }
}

/// How often a NATS server that stays unreachable is reported again.
const UNREACHABLE_REPORT_EVERY: Duration = Duration::from_secs(30);

/// Failed connection attempts, reported at warn with the server and the reason — the first
/// one, then at most every [`UNREACHABLE_REPORT_EVERY`] — instead of one line per attempt.
#[derive(Default)]
struct Unreachable {
    reported_at: Option<tokio::time::Instant>,
    attempts: u64,
}

impl Unreachable {
    async fn failed(&mut self, config: &Config, err: &str) {
        self.attempts += 1;
        if self
            .reported_at
            .is_some_and(|at| at.elapsed() < UNREACHABLE_REPORT_EVERY)
        {
            return;
        }
        self.reported_at = Some(tokio::time::Instant::now());
        let reason = nats::connect::unreachable_because(config).await;
        warn!(
            nats = %config.nats_url_redacted(),
            reason,
            client_error = err,
            attempts = self.attempts,
            "cannot reach NATS; retrying (fetches answer 503 meanwhile)"
        );
    }
}
