//! The process's one NATS connection, shared by every consumer it serves: made once, its
//! events reported once (unreachable servers, server errors, reconnects counted), and passed
//! on to each consumer's supervisor, which rebinds after a reconnect.
//!
//! May import: as the rest of `gateway`.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{broadcast, mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::config::Config;
use crate::metrics::ProcessMetrics;
use crate::nats::{self, Client, ConnectionEvent};

/// Events a slow supervisor may fall behind by before it hears "lagged" (and rebinds).
const EVENTS_KEPT: usize = 64;

/// How often a NATS server that stays unreachable is reported again.
const UNREACHABLE_REPORT_EVERY: Duration = Duration::from_secs(30);

/// The shared connection. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Connection {
    client: watch::Receiver<Option<Client>>,
    events: broadcast::Sender<ConnectionEvent>,
}

impl Connection {
    /// Start connecting in the background; a connection that cannot be made as configured
    /// (unreadable credentials) is reported on `fatal`.
    pub(crate) fn open(
        config: Arc<Config>,
        metrics: Arc<ProcessMetrics>,
        fatal: oneshot::Sender<anyhow::Error>,
        stop: CancellationToken,
    ) -> Self {
        let (client_tx, client) = watch::channel(None);
        let (events, _) = broadcast::channel(EVENTS_KEPT);
        let connection = Self { client, events };
        let passed_on = connection.events.clone();
        tokio::spawn(async move {
            let (events_tx, events_rx) = mpsc::unbounded_channel();
            let made = tokio::select! {
                made = nats::connect(&config, events_tx) => made,
                () = stop.cancelled() => return,
            };
            match made {
                Ok(client) => {
                    client_tx.send_replace(Some(client));
                    tokio::select! {
                        () = report(&config, &metrics, events_rx, passed_on) => {}
                        () = stop.cancelled() => {}
                    }
                }
                Err(err) => {
                    let _ = fatal.send(err);
                }
            }
        });
        connection
    }

    /// The client, once made (it reconnects by itself).
    pub(crate) fn get(&self) -> Option<Client> {
        self.client.borrow().clone()
    }

    /// The client, waiting until it is made; `None` if it never will be.
    pub(crate) async fn client(&self) -> Option<Client> {
        let mut client = self.client.clone();
        let made = client.wait_for(Option::is_some).await.ok()?;
        made.clone()
    }

    /// Whether the connection is up now.
    pub(crate) fn is_connected(&self) -> bool {
        self.get().is_some_and(|client| nats::is_connected(&client))
    }

    /// The connection's events from now on.
    pub(crate) fn events(&self) -> broadcast::Receiver<ConnectionEvent> {
        self.events.subscribe()
    }
}

/// Report the connection's events once for the process and pass them on to the consumers.
async fn report(
    config: &Config,
    metrics: &ProcessMetrics,
    mut events: mpsc::UnboundedReceiver<ConnectionEvent>,
    passed_on: broadcast::Sender<ConnectionEvent>,
) {
    // A Connected event counts as a reconnect only after a Disconnected one: the first
    // connection is not one, whether or not async-nats reports it as an event.
    let mut connection_lost = false;
    let mut unreachable = Unreachable::default();
    while let Some(event) = events.recv().await {
        match &event {
            ConnectionEvent::Disconnected => {
                connection_lost = true;
                warn!(nats = %config.nats_url_redacted(), "disconnected from NATS; leases stay valid, fetches answer 503 until reconnected");
            }
            ConnectionEvent::Connected => {
                unreachable = Unreachable::default();
                if std::mem::take(&mut connection_lost) {
                    metrics.nats_reconnected();
                    info!("reconnected to NATS");
                }
            }
            ConnectionEvent::ClientError(err) => unreachable.failed(config, err).await,
            ConnectionEvent::ServerError(err) => error!(error = %err, "NATS server error"),
            ConnectionEvent::Other(event) => info!(event, "NATS event"),
        }
        let _ = passed_on.send(event);
    }
}

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
