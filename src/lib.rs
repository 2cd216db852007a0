//! ruststream-nats: an HTTP gateway that holds a NATS JetStream pull consumer and leases its
//! messages to HTTP clients.
//!
//! The map, top to bottom; each room imports only from rooms below it:
//! - [`http`]: routes (one file per resource), bearer-token auth, JSON extraction,
//!   problem+json errors, the accept loop; [`http::openapi`] the spec.
//! - `gateway`: the core the handlers call — fetch (with idempotency), settle, extend,
//!   inspect, publish, shutdown — and the supervisor that keeps the NATS binding.
//! - `dispatch`: waiting fetches → pull requests; deliveries → the fetch that asked.
//! - `nats`: the NATS boundary — connect, bind, pulls, confirmed settles, publish,
//!   connection events, [`dead_letter`] copies.
//! - `state`: the lease state shared by the core and the dispatcher.
//! - `domain`: lease ids, the lease table, idempotency records, subject rules, the
//!   delivery values — pure state and time.
//! - [`config`], `error`, `metrics`: flags → settings, the one error a client sees, the
//!   Prometheus registry; usable from every room.
//! - [`healthcheck`]: `--healthcheck <URL>`, the container HEALTHCHECK without curl.
//!
//! [`run`] serves until a shutdown signal, then drains: new fetches get 503, waiting ones
//! return, settles are accepted for a grace period, unleased deliveries are nak'd.

pub mod config;
mod dispatch;
mod domain;
mod error;
mod gateway;
pub mod healthcheck;
pub mod http;
mod metrics;
mod nats;
mod state;

/// Dead-letter copies, as their readers see them.
pub mod dead_letter {
    pub use crate::nats::dead_letter::headers;
}

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
    let auth = http::auth::Auth::from_config(&config)?;
    config.nats_servers().map_err(anyhow::Error::msg)?;
    if !auth.is_on() {
        warn!(
            "HTTP authentication is off (no --auth-tokens-file or --auth-tokens): anyone who \
             reaches the listen address can fetch, settle and publish"
        );
    }
    let lease_key = match &config.lease_key_file {
        Some(path) => Some(domain::lease_id::LeaseKey::load(path)?),
        None => None,
    };
    let (gateway, tasks, fatal_rx) = Gateway::start(config, lease_key);
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
