//! nats-server's monitoring endpoint (`--nats-monitor-url`): the one place that tells how
//! the server syncs its writes to disk (`/varz`, `jetstream.config`), which the JetStream API
//! does not.
//!
//! May import: `domain`. Nothing of the gateway above the boundary.

use std::time::Duration;

use serde::Deserialize;
use tracing::warn;

use crate::domain::durability::ServerSync;

/// How long `/varz` may take.
const TIMEOUT: Duration = Duration::from_secs(2);
/// nats-server's default `sync_interval`, when `/varz` leaves it out.
const DEFAULT_SYNC_INTERVAL: Duration = Duration::from_secs(120);

#[derive(Deserialize)]
struct Varz {
    #[serde(default)]
    jetstream: Option<JetStreamVarz>,
}

#[derive(Deserialize)]
struct JetStreamVarz {
    #[serde(default)]
    config: Option<JetStreamConfig>,
}

#[derive(Deserialize)]
struct JetStreamConfig {
    /// Nanoseconds; absent at the default.
    #[serde(default)]
    sync_interval: u64,
    #[serde(default)]
    sync_always: bool,
}

/// The server's sync policy as its `/varz` at `base` says; `Unknown` when it cannot be read
/// (logged).
pub(crate) async fn server_sync(base: &str) -> ServerSync {
    match read(base).await {
        Ok(sync) => sync,
        Err(err) => {
            warn!(url = %base, error = %format!("{err:#}"), "cannot read the server's sync policy from its monitoring endpoint");
            ServerSync::Unknown
        }
    }
}

async fn read(base: &str) -> anyhow::Result<ServerSync> {
    use anyhow::Context as _;
    let (tls, _roots) = crate::tls_client::config().map_err(anyhow::Error::msg)?;
    let client = reqwest::Client::builder()
        .timeout(TIMEOUT)
        .redirect(reqwest::redirect::Policy::none())
        .tls_backend_preconfigured(tls)
        .build()
        .context("building the monitoring client")?;
    let url = format!("{}/varz", base.trim_end_matches('/'));
    let body = client
        .get(&url)
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .with_context(|| format!("GET {url}"))?
        .bytes()
        .await
        .with_context(|| format!("reading {url}"))?;
    let varz: Varz = serde_json::from_slice(&body).with_context(|| format!("parsing {url}"))?;
    let config = varz
        .jetstream
        .and_then(|jetstream| jetstream.config)
        .context("the server has no JetStream configuration in /varz")?;
    Ok(sync_of(&config))
}

fn sync_of(config: &JetStreamConfig) -> ServerSync {
    if config.sync_always {
        ServerSync::Always
    } else if config.sync_interval == 0 {
        ServerSync::Every(DEFAULT_SYNC_INTERVAL)
    } else {
        ServerSync::Every(Duration::from_nanos(config.sync_interval))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sync_policy_as_varz_tells_it() {
        let parse = |json: &str| {
            let varz: Varz = serde_json::from_str(json).expect("varz");
            sync_of(&varz.jetstream.and_then(|j| j.config).expect("config"))
        };
        assert_eq!(
            parse(r#"{"jetstream": {"config": {"max_memory": 1}}}"#),
            ServerSync::Every(DEFAULT_SYNC_INTERVAL)
        );
        assert_eq!(
            parse(
                r#"{"jetstream": {"config": {"sync_interval": 120000000000, "sync_always": true}}}"#
            ),
            ServerSync::Always
        );
        assert_eq!(
            parse(r#"{"jetstream": {"config": {"sync_interval": 5000000000}}}"#),
            ServerSync::Every(Duration::from_secs(5))
        );
    }
}
