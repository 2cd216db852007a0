//! Push delivery: for every consumer whose consumers-file entry has a `[consumer.push]`
//! table, a worker that leases its messages and POSTs them to the endpoint, settling each as
//! the answer says ([`crate::domain::push`] holds the rules). A push is a client of the same
//! core a fetch is: it leases through a lease stream and settles through the settle path, so
//! every push is fenced, counts against max_ack_pending and may be settled at any replica.
//! A changed table is applied live; a removed one stops the worker.
//!
//! May import: `gateway` (the core), `http::dto` (a pushed message is rendered as a fetch
//! renders it) and `http::client` (the core's caller type), `domain`, `config`, `metrics`,
//! `tls_client`, `telemetry`.

mod attempt;
mod client;
mod request;
mod worker;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::info;

use crate::config::PushSpec;
use crate::domain::consumers::ConsumerName;
use crate::gateway::Gateway;

/// The longest a stopping gateway waits for its abandoned requests to be nak'd.
const NAK_ABANDONED_WITHIN: Duration = Duration::from_secs(2);

/// The push workers of one gateway.
pub(crate) struct Pushers {
    abandon: CancellationToken,
    stop: CancellationToken,
    requests: TaskTracker,
}

/// Start pushing for every consumer the consumers file gives a push table, following the
/// file as it changes.
pub(crate) fn start(gateway: &Gateway) -> Pushers {
    let pushers = Pushers {
        abandon: CancellationToken::new(),
        stop: CancellationToken::new(),
        requests: TaskTracker::new(),
    };
    tokio::spawn(keep_pushing(
        gateway.clone(),
        pushers.stop.clone(),
        pushers.abandon.clone(),
        pushers.requests.clone(),
    ));
    pushers
}

impl Pushers {
    /// After the shutdown grace: abandon the requests still in flight (their messages are
    /// nak'd, for another replica or a restart to push) and wait for them.
    pub(crate) async fn finish(&self) {
        self.stop.cancel();
        self.abandon.cancel();
        self.requests.close();
        let _ = tokio::time::timeout(NAK_ABANDONED_WITHIN, self.requests.wait()).await;
    }
}

/// One running worker: its push table, and what retires it.
struct Running {
    spec: watch::Sender<Arc<PushSpec>>,
    retired: CancellationToken,
}

async fn keep_pushing(
    gateway: Gateway,
    stop: CancellationToken,
    abandon: CancellationToken,
    requests: TaskTracker,
) {
    let mut pushes = gateway.pushes();
    let mut running: HashMap<ConsumerName, Running> = HashMap::new();
    loop {
        let in_force = pushes.borrow_and_update().clone();
        for (name, spec) in in_force.iter() {
            match running.get(name) {
                Some(worker) => {
                    worker.spec.send_if_modified(|now| {
                        let changed = **now != *spec;
                        if changed {
                            info!(consumer = %name, endpoint = %spec.shown_url(), "the push table changed; pushing with the new one");
                            *now = Arc::new(spec.clone());
                        }
                        changed
                    });
                }
                None => {
                    info!(consumer = %name, endpoint = %spec.shown_url(), "pushing this consumer's messages");
                    let (spec_tx, spec_rx) = watch::channel(Arc::new(spec.clone()));
                    let retired = stop.child_token();
                    tokio::spawn(
                        worker::Worker {
                            gateway: gateway.clone(),
                            name: name.clone(),
                            spec: spec_rx,
                            retired: retired.clone(),
                            abandon: abandon.clone(),
                            requests: requests.clone(),
                        }
                        .run(),
                    );
                    running.insert(
                        name.clone(),
                        Running {
                            spec: spec_tx,
                            retired,
                        },
                    );
                }
            }
        }
        running.retain(|name, worker| {
            let kept = in_force.contains_key(name);
            if !kept {
                info!(consumer = %name, "the push table was removed; no more pushes (requests in flight are answered)");
                worker.retired.cancel();
            }
            kept
        });
        tokio::select! {
            changed = pushes.changed() => if changed.is_err() {
                return;
            },
            () = stop.cancelled() => return,
        }
    }
}
