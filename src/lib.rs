//! ruststream-nats: an HTTP gateway that holds a NATS JetStream pull consumer and leases its
//! messages to HTTP clients.
//!
//! The map:
//! - [`auth`]: HTTP bearer tokens with scopes, checked before any handler runs.
//! - [`config`]: flags and environment variables → validated settings.
//! - [`consumer`]: the NATS boundary — connect, create/bind the consumer, pull, confirmed settle.
//! - [`dispatch`]: turns waiting fetches into pull requests and hands out deliveries.
//! - [`leases`]: the lease table (issue, fence, expire, settle) — pure state and time.
//! - [`lease_id`]: signed, self-describing lease ids.
//! - [`dead_letter`]: republishes exhausted or terminated messages to a dead-letter subject.
//! - [`gateway`]: the core the handlers call; supervises the NATS binding.
//! - [`idempotency`]: `Idempotency-Key` on fetch — a repeat gets the first answer.
//! - [`http`]: routes, JSON extraction, problem+json errors; [`http::openapi`] the spec.
//! - [`metrics`]: Prometheus metric names and one-line recording helpers (`GET /metrics`).
//! - [`healthcheck`]: `--healthcheck <URL>`, the container HEALTHCHECK without curl.
//! - [`error`]: the one error type a client can see.
//! - [`subject`]: NATS subject rules for `POST /publish`.
//!
//! [`run`] serves until a shutdown signal, then drains: new fetches get 503, waiting ones
//! return, settles are accepted for a grace period, unleased deliveries are nak'd.

pub mod auth;
pub mod config;
pub mod consumer;
pub mod dead_letter;
pub mod dispatch;
pub mod error;
pub mod gateway;
pub mod healthcheck;
pub mod http;
pub mod idempotency;
pub mod lease_id;
pub mod leases;
pub mod metrics;
pub mod subject;

use std::future::Future;
use std::sync::{Arc, Mutex};

use anyhow::Context as _;
use tokio::net::TcpListener;
use tracing::{info, warn};

pub use config::Config;
use gateway::Gateway;

/// Serve the gateway on `listener` until `shutdown` resolves, then drain and return.
///
/// HTTP is served at once; NATS is reached in the background (`/readyz` says when). Returns
/// an error, without waiting for `shutdown`, when the gateway cannot work as configured:
/// the stream is missing or the consumer differs in a field that cannot change.
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let grace = config.shutdown_grace;
    let auth = auth::Auth::from_config(&config)?;
    config.nats_servers().map_err(anyhow::Error::msg)?;
    if !auth.is_on() {
        warn!(
            "HTTP authentication is off (no --auth-tokens-file or --auth-tokens): anyone who \
             reaches the listen address can fetch, settle and publish"
        );
    }
    let lease_key = match &config.lease_key_file {
        Some(path) => Some(lease_id::LeaseKey::load(path)?),
        None => None,
    };
    let (gateway, tasks, fatal_rx) = Gateway::start_with_lease_key(config, lease_key);
    let app = http::router(gateway.clone(), auth);
    let address = listener
        .local_addr()
        .context("reading the listen address")?;
    info!(%address, "listening");

    let fatal: Arc<Mutex<Option<anyhow::Error>>> = Arc::default();
    let stop_serving = {
        let gateway = gateway.clone();
        let fatal = fatal.clone();
        async move {
            tokio::select! {
                () = shutdown => {
                    info!("shutting down: no new fetches; settles accepted for up to {grace:?}");
                    gateway.begin_shutdown().await;
                    gateway.settle_grace(grace).await;
                }
                Ok(err) = fatal_rx => {
                    if let Ok(mut slot) = fatal.lock() {
                        *slot = Some(err);
                    }
                    // Answer waiting long polls now rather than at their deadlines.
                    gateway.begin_shutdown().await;
                }
            }
        }
    };
    let limits = http::serve::Limits {
        max_connections: gateway.config().max_connections as usize,
        header_read_timeout: gateway.config().header_read_timeout,
        body_read_timeout: gateway.config().body_read_timeout,
        max_body_bytes: gateway.config().max_body_bytes as usize,
    };
    http::serve::serve(listener, app, limits, stop_serving).await;
    gateway.stop(tasks).await;
    let fatal = fatal.lock().ok().and_then(|mut slot| slot.take());
    match fatal {
        Some(err) => Err(err),
        None => {
            info!("stopped");
            Ok(())
        }
    }
}
