//! ruststream-nats: an HTTP gateway that holds NATS JetStream pull consumers and leases their
//! messages to HTTP clients.
//!
//! The map, top to bottom; each room imports only from rooms below it:
//! - `push`: the gateway as an HTTP client — each push consumer's worker leases through the
//!   core and POSTs to its endpoint, settling as the answer says (it renders a message as a
//!   fetch does, with `http`'s bodies).
//! - [`http`]: routes (one file per resource), bearer-token auth, JSON extraction,
//!   problem+json errors, the accept loop; [`http::openapi`] the spec.
//! - `gateway`: the core the handlers call — the process-wide part (the consumers served,
//!   the one NATS connection, settles routed by lease id) and, under `gateway::consumer`,
//!   each consumer's own: fetch (with idempotency), settle, extend, inspect, and the
//!   supervisor that keeps its binding.
//! - `dispatch`: waiting fetches → pull requests; deliveries → the fetch that asked.
//! - `nats`: the NATS boundary — connect, bind, pulls, confirmed settles, publish,
//!   connection events, [`dead_letter`] copies.
//! - `state`: the lease state shared by the core and the dispatcher.
//! - `domain`: lease ids, the lease table, idempotency records, subject rules, the
//!   delivery values — pure state and time.
//! - [`config`], `error`, `metrics`, `telemetry`, `tls_client`: flags → settings, the one
//!   error a client sees, the Prometheus registry, OpenTelemetry traces and the log lines
//!   joined to them, TLS for the gateway's own HTTPS clients; usable from every room.
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
mod push;
mod state;
mod telemetry;
mod tls_client;

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
pub use telemetry::Telemetry;

/// Start what the process tells of itself: log lines on stderr (`--log-format`, level via
/// `RUST_LOG`) and, when an OTLP endpoint is configured, spans to it. Returns the exporter to
/// stop (flushing what is left) at exit, when one runs; an error for an endpoint it cannot
/// use.
pub fn start_observing(config: &Config) -> anyhow::Result<Option<Telemetry>> {
    let started = telemetry::start(config.otlp_endpoint.as_deref())?;
    let (running, tracer) = started.unzip();
    telemetry::install(config.log_format, tracer);
    Ok(running)
}
use gateway::Gateway;

/// Connections the admin listener serves at once: probes and scrapes need few, and a full
/// main listener must not starve them.
const ADMIN_MAX_CONNECTIONS: usize = 64;

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
    let auth = http::auth::Auth::from_config(&config).await?;
    config.nats_servers().map_err(anyhow::Error::msg)?;
    if !auth.is_on() {
        warn!(
            "HTTP authentication is off (no --auth-tokens-file, --auth-tokens or --auth-jwks-*): \
             anyone who \
             reaches the listen address can fetch, settle and publish"
        );
    }
    let lease_key = match &config.lease_key_file {
        Some(path) => Some(domain::lease_id::LeaseKey::load(path)?),
        None => None,
    };
    let tls_files = match (&config.tls_cert, &config.tls_key) {
        (Some(cert), Some(key)) => Some(http::tls::TlsFiles {
            cert: cert.clone(),
            key: key.clone(),
            client_ca: config.tls_client_ca.clone(),
        }),
        _ => None,
    };
    let tls = tls_files.as_ref().map(http::tls::Tls::load).transpose()?;
    let admin_listener = match config.admin_listen {
        Some(address) => Some(
            TcpListener::bind(address)
                .await
                .with_context(|| format!("cannot listen on --admin-listen {address}"))?,
        ),
        None => None,
    };
    let declared = match &config.consumers_file {
        Some(path) => config::load_consumers_file(path).map_err(anyhow::Error::msg)?,
        None => Vec::new(),
    };
    let (gateway, tasks, mut fatal_rx) = Gateway::start(config, lease_key, declared);
    let app = http::router(gateway.clone(), auth.clone());
    let pushers = Arc::new(push::start(&gateway));
    let reloadable_auth = auth.clone();
    let address = listener
        .local_addr()
        .context("reading the listen address")?;
    info!(%address, "listening");

    let fatal: Arc<Mutex<Option<anyhow::Error>>> = Arc::default();
    let stop_serving = {
        let gateway = gateway.clone();
        let fatal = fatal.clone();
        let pushers = pushers.clone();
        async move {
            tokio::select! {
                () = shutdown => {
                    info!("shutting down: no new fetches or pushes; settles accepted for up to {grace:?}");
                    gateway.begin_shutdown().await;
                    gateway.settle_grace(grace).await;
                    pushers.finish().await;
                }
                Some(err) = fatal_rx.recv() => {
                    if let Ok(mut slot) = fatal.lock() {
                        *slot = Some(err);
                    }
                    // Answer waiting long polls now rather than at their deadlines.
                    gateway.begin_shutdown().await;
                    pushers.finish().await;
                }
            }
        }
    };
    let admin_stop = tokio_util::sync::CancellationToken::new();
    let limits = http::serve::Limits {
        max_connections: gateway.config().max_connections as usize,
        header_read_timeout: gateway.config().header_read_timeout,
        body_read_timeout: gateway.config().body_read_timeout,
        max_body_bytes: gateway.config().max_body_bytes as usize,
    };
    let admin = admin_listener.map(|admin_listener| {
        let app = http::admin_router(gateway.clone(), auth);
        if let Ok(address) = admin_listener.local_addr() {
            info!(%address, "admin listener (/healthz, /readyz, /metrics)");
        }
        let limits = http::serve::Limits {
            max_connections: ADMIN_MAX_CONNECTIONS,
            ..limits
        };
        let stop = admin_stop.clone();
        // Plain HTTP: probes and scrapes stay simple, inside the pod or the cluster.
        tokio::spawn(http::serve::serve(
            admin_listener,
            app,
            limits,
            None,
            async move { stop.cancelled().await },
        ))
    });
    if let (Some(tls), Some(files)) = (&tls, &tls_files) {
        tls.watch(files.clone(), admin_stop.clone());
    }
    tokio::spawn(reload_on_hangup(
        gateway.config().clone(),
        reloadable_auth,
        tls.clone().zip(tls_files),
        admin_stop.clone(),
    ));
    http::serve::serve(listener, app, limits, tls, stop_serving).await;
    // Probes keep answering through the main listener's drain; they stop with it.
    admin_stop.cancel();
    if let Some(admin) = admin {
        let _ = admin.await;
    }
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

/// On SIGHUP (a terminal closing, a supervisor's reload), read the files the gateway reads
/// again — bearer tokens, the JWKS file, the TLS certificate — until `stop`; never stop.
async fn reload_on_hangup(
    config: Config,
    auth: http::auth::Auth,
    tls: Option<(http::tls::Tls, http::tls::TlsFiles)>,
    stop: tokio_util::sync::CancellationToken,
) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let Ok(mut hangups) = signal(SignalKind::hangup()) else {
            warn!(
                "cannot listen for SIGHUP; the files are read at start (and TLS when it changes) only"
            );
            return;
        };
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                received = hangups.recv() => if received.is_none() {
                    return;
                },
            }
            info!("SIGHUP: reading the token, JWKS and TLS files again");
            auth.reload(&config).await;
            if let Some((tls, files)) = &tls {
                tls.reload(files);
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = (config, auth, tls, stop);
    }
}

#[cfg(test)]
mod tests {
    //! The map above, checked: every `crate::` path in a room's files names a room below it
    //! (or itself), so the imports cannot drift into a circle unnoticed.

    use std::path::{Path, PathBuf};

    /// Rooms from the bottom up; a room may name only rooms of a lower rank.
    const RANKS: &[(&str, u8)] = &[
        ("domain", 0),
        ("config", 1),
        ("error", 1),
        ("metrics", 1),
        ("state", 2),
        ("nats", 3),
        ("dispatch", 4),
        ("gateway", 5),
        ("http", 6),
        // Renders a pushed message as a fetch does: above `http`, which never names it.
        ("push", 7),
    ];

    fn rank(room: &str) -> Option<u8> {
        RANKS
            .iter()
            .find(|(name, _)| *name == room)
            .map(|(_, rank)| *rank)
    }

    fn rust_files(dir: &Path, into: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("read src") {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                rust_files(&path, into);
            } else if path.extension().is_some_and(|ext| ext == "rs") {
                into.push(path);
            }
        }
    }

    #[test]
    fn imports_only_point_down() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut files = Vec::new();
        rust_files(&src, &mut files);
        let mut upward = Vec::new();
        for file in &files {
            let relative = file.strip_prefix(&src).expect("under src");
            let room = relative
                .components()
                .next()
                .and_then(|first| first.as_os_str().to_str())
                .map(|first| first.trim_end_matches(".rs"))
                .unwrap_or_default();
            let Some(own) = rank(room) else {
                continue; // lib.rs, main.rs, healthcheck.rs: the top, may name anything
            };
            let text = std::fs::read_to_string(file).expect("read source");
            for (line_number, line) in text.lines().enumerate() {
                for (at, _) in line.match_indices("crate::") {
                    let named: String = line[at + "crate::".len()..]
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    if let Some(theirs) = rank(&named)
                        && named != room
                        && theirs >= own
                    {
                        upward.push(format!(
                            "{}:{}: {room} names {named}",
                            relative.display(),
                            line_number + 1
                        ));
                    }
                }
            }
        }
        assert!(
            files.len() > 20,
            "found only {} source files: the walk is broken",
            files.len()
        );
        assert!(
            upward.is_empty(),
            "imports that point up:\n{}",
            upward.join("\n")
        );
    }
}
