//! The consumers file kept in force: read again whenever it changes. A new entry is served
//! at once; a removed one takes no new fetch (404) while its live leases still settle, and
//! is let go when the last one ends; a changed ack_wait or max_ack_pending is applied to the
//! live consumer at once; an entry whose other settings changed is served anew once it has
//! no live lease (503 with Retry-After meanwhile). A file that no longer parses is refused with one ERROR line, and the
//! one read before stays in force.
//!
//! May import: as the rest of `gateway`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::config::{ConsumerSpec, load_consumers_file};
use crate::domain::consumers::ConsumerName;

use super::Gateway;
use super::consumer::SettingsChange;
use super::registry::Source;

/// How often the file is looked at: well within the 5 s in which a new entry is served.
const LOOK_EVERY: Duration = Duration::from_secs(1);

/// Keep the file's consumers served as it says, from `initial` (read at start) on.
pub(super) async fn keep_in_force(
    gateway: Gateway,
    path: PathBuf,
    initial: Vec<ConsumerSpec>,
    stop: CancellationToken,
) {
    let mut in_force: HashMap<ConsumerName, ConsumerSpec> = by_name(initial);
    let mut last_text = std::fs::read(&path).ok();
    let mut tick = tokio::time::interval(LOOK_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let text = std::fs::read(&path).ok();
        if text != last_text {
            last_text = text;
            match load_consumers_file(&path) {
                Ok(specs) => {
                    info!(path = %path.display(), consumers = specs.len(), "the consumers file changed; applying it");
                    gateway.declare_pushes(&specs);
                    in_force = by_name(specs);
                }
                Err(why) => {
                    error!(error = %why, "the consumers file no longer parses; keeping the one read before");
                }
            }
        }
        gateway.apply_declared(&in_force).await;
    }
}

fn by_name(specs: Vec<ConsumerSpec>) -> HashMap<ConsumerName, ConsumerSpec> {
    specs
        .into_iter()
        .map(|spec| (ConsumerName::new(&spec.stream, &spec.name), spec))
        .collect()
}

impl Gateway {
    /// Bring the served file consumers in line with `declared`.
    async fn apply_declared(&self, declared: &HashMap<ConsumerName, ConsumerSpec>) {
        for (name, spec) in declared {
            match self.0.registry.get(name) {
                None => {
                    info!(consumer = %name, "serving a consumer the consumers file declares");
                    self.serve_declared(spec, false);
                }
                Some(served) if served.source == Source::File => match served.consumer.change_to(spec) {
                    SettingsChange::None => served.reinstate(),
                    SettingsChange::Live => match served.consumer.apply_live(spec).await {
                        Ok(()) => served.reinstate(),
                        Err(err) => {
                            warn!(consumer = %name, error = %err, "cannot apply the consumers file's new ack_wait/max_ack_pending yet; trying again");
                        }
                    },
                    SettingsChange::Rebind if served.consumer.leases_in_flight() == 0 => {
                        info!(consumer = %name, "the consumers file changed this consumer's settings; binding it anew");
                        self.unserve(name).await;
                        self.serve_declared(spec, false);
                    }
                    // Applied once its live leases have ended: its streams end now, so that
                    // they do not lease on under the old settings.
                    SettingsChange::Rebind => served.retire_until_rebound(
                        "the consumers file changed this consumer's settings; open the stream again",
                    ),
                },
                // The default consumer or an existing one of that name is served already.
                Some(_) => {}
            }
        }
        for (name, served) in self.0.registry.all() {
            if served.source != Source::File {
                continue;
            }
            if !declared.contains_key(&name) && !served.is_retired() {
                info!(consumer = %name, "removed from the consumers file: no new fetches; its live leases still settle");
                served.retire("the consumer was removed from the consumers file");
            }
            if served.is_retired() && served.consumer.leases_in_flight() == 0 {
                self.unserve(&name).await;
            }
        }
    }
}
