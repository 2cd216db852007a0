//! A consumer's orderly stop: no new fetches, open streams ended, a grace for the leases
//! out to be settled, then what is still out nak'd (so the server redelivers it at once),
//! the pin of an ordered consumer handed over, and the background tasks stopped.
//!
//! May import: as the rest of `gateway`.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::Instant;
use tracing::{info, warn};

use super::{Consumer, Tasks};
use crate::dispatch::Command;
use crate::domain::ordering::PIN_GROUP;
use crate::nats::{self, settle as nats_settle};

impl Consumer {
    /// Stop taking fetches and answer the waiting ones now.
    pub(crate) async fn begin_shutdown(&self) {
        self.accepting.store(false, Ordering::Relaxed);
        // At once, whatever an open stream waits for (messages, credit): its client then
        // settles what it holds within the grace.
        self.end_streams("the gateway is stopping");
        let _ = self.commands.send(Command::Shutdown).await;
    }

    /// End every stream open on this consumer now, saying `reason`.
    pub(crate) fn end_streams(&self, reason: &str) {
        self.streams_end
            .send_modify(|end| *end = end.bumped(reason));
    }

    /// Whether a fetch waits or a stream is open on this consumer now.
    pub(crate) fn has_requests_open(&self) -> bool {
        self.activity.is_held()
    }

    /// Wait until no lease is in flight, or `grace` has passed.
    pub(crate) async fn settle_grace(&self, grace: Duration) {
        let deadline = Instant::now() + grace;
        loop {
            let settled = self.state.settled();
            tokio::pin!(settled);
            // Registered before looking, so a settle landing in between is not missed.
            settled.as_mut().enable();
            let in_flight = self.state.in_flight();
            if in_flight == 0 {
                // A settle that ended the last lease may still wait for its record: it is
                // answered 2xx (or 503) only then.
                let _ = tokio::time::timeout_at(deadline, self.recorder.idle()).await;
                return;
            }
            if Instant::now() >= deadline {
                // What becomes of these leases is said once, by `stop`, when it knows.
                return;
            }
            let wake = self
                .state
                .next_expiry()
                .filter(|at| *at > Instant::now())
                .map_or(deadline, |at| at.min(deadline));
            tokio::select! {
                () = settled => {}
                () = tokio::time::sleep_until(wake) => {}
            }
        }
    }

    /// Stop the background tasks, nak unleased deliveries and flush NATS.
    pub(crate) async fn stop(&self, tasks: Tasks) {
        let _ = self.commands.send(Command::Stop).await;
        if tokio::time::timeout(Duration::from_secs(5), tasks.dispatcher)
            .await
            .is_err()
        {
            warn!("the dispatcher did not stop in time");
        }
        // Leases still out after the grace can no longer be settled through this process:
        // nak them, so the server redelivers them now rather than after ack_wait.
        let revoked = self.state.leases().revoke_live(Instant::now());
        if !revoked.is_empty() {
            let naked = match self.connected() {
                Ok(bound) => {
                    // Bounded as a whole: a connection that drops now must not hold up the
                    // exit (the server then redelivers after ack_wait, as after a crash).
                    let naks = async {
                        for reply in &revoked {
                            nats_settle::release(&bound, reply).await;
                        }
                    };
                    tokio::time::timeout(Duration::from_secs(2), naks)
                        .await
                        .is_ok()
                }
                Err(_) => false,
            };
            if naked {
                info!(
                    count = revoked.len(),
                    "shutdown grace over with leases still out: nak'd them, the server redelivers them at once"
                );
            } else {
                warn!(
                    count = revoked.len(),
                    "shutdown grace over with leases still out: NATS unreachable, the server redelivers them after ack_wait"
                );
            }
        }
        // The pinned replica of an ordered consumer hands the pin over now that it holds
        // nothing: another replica is pinned by its next pull, not after the pin timeout.
        if self.state.pin().is_some()
            && let Ok(bound) = self.connected()
        {
            match nats::pull::unpin(&bound, PIN_GROUP).await {
                Ok(()) => info!(
                    "gave up the pin of the ordered consumer: another replica takes it at once"
                ),
                Err(err) => {
                    warn!(error = %format!("{err:#}"), "could not give up the pin of the ordered consumer; another replica takes it after the pin timeout")
                }
            }
        }
        self.withdraw().await;
        tasks.stop.cancel();
        if let Ok(bound) = self.bound() {
            let _ = tokio::time::timeout(Duration::from_secs(2), bound.client.flush()).await;
        }
    }
}
