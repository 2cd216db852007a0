//! `--serve-existing`: consumers that exist on the server, bound on the first request that
//! names one (after the checks that decide 404 or 409), and unbound again after
//! `--idle-unbind` with no live lease and no request (an open stream and a waiting fetch are
//! requests), so an idle consumer costs nothing.
//!
//! May import: as the rest of `gateway`.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::domain::consumers::ConsumerName;
use crate::domain::subject;
use crate::error::Error;
use crate::nats::reconcile::{Existing, inspect_existing};

use super::Gateway;
use super::registry::{Served, Source};

/// How long a first request waits for its consumer to be bound and ready.
const BIND_WAIT: Duration = Duration::from_secs(5);

impl Gateway {
    /// Bind `name` for `--serve-existing`, when a pattern matches and the server has it as
    /// a durable pull consumer with explicit ack.
    pub(super) async fn bind_existing(&self, name: &ConsumerName) -> Result<Arc<Served>, Error> {
        for (what, value) in [("stream", &name.stream), ("consumer", &name.consumer)] {
            subject::validate_name(value).map_err(|rule| {
                Error::ConsumerNotFound(format!("the {what} name {value:?} {rule}"))
            })?;
        }
        let matched = self
            .config()
            .serve_existing
            .as_ref()
            .is_some_and(|patterns| patterns.matches(name));
        if !matched {
            return Err(Error::ConsumerNotFound(format!(
                "consumer {name} is not served by this gateway"
            )));
        }
        let _one_at_a_time = self.0.binding.lock().await;
        if let Some(served) = self.0.registry.get(name) {
            return Ok(served);
        }
        let Some(client) = self
            .0
            .process
            .connection
            .get()
            .filter(|_| self.0.process.connection.is_connected())
        else {
            return Err(Error::Unavailable(
                "the connection to NATS is down; retrying".into(),
            ));
        };
        match inspect_existing(&client, &name.stream, &name.consumer).await {
            Ok(Existing::Usable) => {}
            Ok(Existing::Missing(why)) => return Err(Error::ConsumerNotFound(why)),
            Ok(Existing::Unsuitable(why)) => return Err(Error::ConsumerUnsuitable(why)),
            Err(err) => return Err(Error::Unavailable(format!("{err:#}"))),
        }
        let config = self.config().for_existing(&name.stream, &name.consumer);
        let served = self.serve(name.clone(), config, Source::Existing, false);
        info!(consumer = %name, "serving an existing consumer");
        served.consumer.wait_ready(BIND_WAIT).await?;
        Ok(served)
    }

    /// Unbind existing consumers idle for `--idle-unbind`, until `stop`.
    pub(super) async fn unbind_idle(self, stop: CancellationToken) {
        let idle_after = self.config().idle_unbind;
        // Often enough that none outlives its idle time by more than a tenth of it.
        let every = (idle_after / 10).clamp(Duration::from_millis(100), Duration::from_secs(30));
        let mut tick = tokio::time::interval(every);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            for (name, served) in self.0.registry.all() {
                if served.source != Source::Existing {
                    continue;
                }
                // An open stream and a waiting fetch are requests: nothing is unbound under
                // them, and the idle time counts from when the last of them ended.
                if served.consumer.has_requests_open() {
                    served.touch();
                    continue;
                }
                if served.consumer.leases_in_flight() == 0
                    && served.last_used().elapsed() >= idle_after
                {
                    info!(consumer = %name, idle = ?idle_after, "unbinding an idle existing consumer");
                    self.unserve(&name).await;
                }
            }
        }
    }
}
