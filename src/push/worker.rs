//! One push consumer's worker: the leasing loop. It leases what its window may send now
//! (through the same lease stream an SSE client uses, so every push is a fenced lease like a
//! fetch's) and hands each lease (or batch) to a request ([`super::attempt`]), which sends
//! it and settles it through the settle path as the answer says. It never retries on its
//! own: a retry is a nak with a delay, and JetStream redelivers.
//!
//! May import: as the rest of `push`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::error;

use crate::config::PushSpec;
use crate::domain::consumers::ConsumerName;
use crate::domain::delivery::Leased;
use crate::gateway::{Consumer, Gateway, LeaseStream, Step};
use crate::http::client::Client;

use super::attempt::{Attempts, Control};
use super::client::client_for;

/// How long a worker waits before looking again for a consumer that is not served (yet).
const LOOK_AGAIN: Duration = Duration::from_secs(1);

/// One push consumer's worker, for as long as its push table is in force.
pub(super) struct Worker {
    pub(super) gateway: Gateway,
    pub(super) name: ConsumerName,
    pub(super) spec: watch::Receiver<Arc<PushSpec>>,
    /// Cancelled when the push table is removed: no new push (requests in flight end as
    /// they would).
    pub(super) retired: CancellationToken,
    /// Cancelled after the shutdown grace: requests still in flight are abandoned and
    /// their messages nak'd.
    pub(super) abandon: CancellationToken,
    pub(super) requests: TaskTracker,
}

impl Worker {
    pub(super) async fn run(mut self) {
        loop {
            if self.retired.is_cancelled() || self.abandon.is_cancelled() {
                break;
            }
            let Some(consumer) = self.gateway.served(&self.name) else {
                tokio::select! {
                    () = tokio::time::sleep(LOOK_AGAIN) => continue,
                    () = self.retired.cancelled() => break,
                    () = self.abandon.cancelled() => break,
                }
            };
            if !self.push_to(&consumer).await {
                break;
            }
        }
        if let Some(consumer) = self.gateway.served(&self.name) {
            consumer.show_push(None);
        }
        self.gateway
            .metrics()
            .push()
            .forget(&self.name.stream, &self.name.consumer);
    }

    /// Push `consumer`'s messages until the push table changes (true: go on with the new
    /// one), or the consumer is no longer served (true), or the worker must stop (false).
    async fn push_to(&mut self, consumer: &Consumer) -> bool {
        let spec = self.spec.borrow_and_update().clone();
        let client = match client_for(&spec) {
            Ok(client) => client,
            Err(why) => {
                error!(consumer = %self.name, error = %why, "cannot push: the endpoint's TLS settings do not work; waiting for the consumers file to change");
                return tokio::select! {
                    changed = self.spec.changed() => changed.is_ok(),
                    () = self.retired.cancelled() => false,
                    () = self.abandon.cancelled() => false,
                };
            }
        };
        let control = Arc::new(Mutex::new(Control::new(&spec)));
        let attempts = Arc::new(Attempts {
            consumer: consumer.clone(),
            name: self.name.clone(),
            spec: spec.clone(),
            endpoint: spec.shown_url(),
            client,
            control,
            ended: Arc::new(Notify::new()),
            abandon: self.abandon.clone(),
        });
        attempts.show();
        let credit = Arc::new(AtomicUsize::new(0));
        let mut stream = LeaseStream::untracked(consumer.clone(), credit.clone());
        loop {
            // Room in the window, and the endpoint's pace.
            let ended = attempts.ended.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            let wait = room(&attempts, consumer.live_replicas());
            let room = match wait {
                Ok(room) => room,
                Err(pause) => {
                    tokio::select! {
                        () = ended => {}
                        () = tokio::time::sleep(pause) => {}
                        changed = self.spec.changed() => return changed.is_ok(),
                        () = self.retired.cancelled() => return false,
                        () = self.abandon.cancelled() => return false,
                    }
                    continue;
                }
            };
            credit.store(room, Ordering::Relaxed);
            // Not given up when a `Retry-After` comes meanwhile: what its pull brings is
            // leased to this worker and kept alive until the hold ends, rather than left
            // unleased at the dispatcher, where it would be nak'd (its delivery spent) long
            // before the hold ends.
            let step = tokio::select! {
                step = stream.next::<Client>(None) => step,
                changed = self.spec.changed() => return changed.is_ok(),
                () = self.retired.cancelled() => return false,
            };
            match step {
                Step::Lease(first) => {
                    let mut leases = vec![*first];
                    while leases.len() < room {
                        match stream.next_ready() {
                            Some(leased) => leases.push(*leased),
                            None => break,
                        }
                    }
                    if spec.batch > 1 && leases.len() < spec.batch.min(room) {
                        self.fill_batch(&mut stream, &mut leases, &spec, room).await;
                    }
                    for request in chunks(leases, spec.batch) {
                        attempts.send(request, &self.requests);
                    }
                }
                // Nothing for a while (or paused): what it shows may have changed.
                Step::Quiet => attempts.show(),
                // No new push; what is in flight is answered within the grace (or nak'd).
                Step::ShuttingDown => return false,
                // No longer served as it was (removed, rebound with new settings): look
                // for it again.
                Step::Ended(_) | Step::Gone => return true,
            }
        }
    }

    /// Wait up to `batch_wait` for a batch to fill.
    async fn fill_batch(
        &mut self,
        stream: &mut LeaseStream,
        leases: &mut Vec<Leased>,
        spec: &PushSpec,
        room: usize,
    ) {
        let until = Instant::now() + spec.batch_wait;
        let wanted = spec.batch.min(room);
        while leases.len() < wanted {
            while leases.len() < wanted {
                match stream.next_ready() {
                    Some(leased) => leases.push(*leased),
                    None => break,
                }
            }
            if leases.len() >= wanted {
                return;
            }
            // A lease stream's step can be dropped: its pull goes on for the next one.
            match tokio::time::timeout_at(until, stream.next::<Client>(None)).await {
                Ok(Step::Lease(leased)) => leases.push(*leased),
                Ok(Step::Quiet) => {}
                Ok(_) | Err(_) => return,
            }
        }
    }
}

/// Split `leases` into requests of at most `batch`.
fn chunks(mut leases: Vec<Leased>, batch: usize) -> Vec<Vec<Leased>> {
    let mut requests = Vec::new();
    while !leases.is_empty() {
        let rest = leases.split_off(batch.min(leases.len()));
        requests.push(std::mem::replace(&mut leases, rest));
    }
    requests
}

/// How many messages may be leased now, or how long until some may. A `Retry-After` does
/// not stop the leasing: what is leased under it waits the hold out in its request, kept
/// alive, and the window bounds how much that is.
fn room(attempts: &Attempts, replicas: usize) -> Result<usize, Duration> {
    let now = Instant::now();
    let spec = &attempts.spec;
    let Ok(mut control) = attempts.control.lock() else {
        return Err(LOOK_AGAIN);
    };
    // The fleet shares max_in_flight and rate_limit, as it shares max_waiting.
    let share = spec.max_in_flight.div_ceil(replicas).max(1);
    control.window.limit(share);
    if spec.rate_limit > 0 {
        let rate = f64::from(spec.rate_limit) / replicas as f64;
        control.rate.set(rate);
    }
    if control.hold_until.is_some_and(|until| until <= now) {
        control.hold_until = None;
    }
    if !control.may_lease(now) {
        return Err(LOOK_AGAIN);
    }
    let requests = control.window.size();
    let gap = control.pacer.gap();
    if !gap.is_zero() && control.requests_in_flight > 0 {
        // Paced: one request at a time, the gap between them.
        return Err(gap);
    }
    let batch = spec.batch;
    let mut room = (requests - control.requests_in_flight) * batch;
    if !gap.is_zero() {
        room = batch;
    }
    if spec.rate_limit > 0 {
        room = room.min(batch);
        // What is leased under a hold is sent when it ends: its tokens are that moment's.
        let sent_at = control.hold_until.unwrap_or(now).max(now);
        control
            .rate
            .take(room, sent_at)
            .map_err(|wait| wait + (sent_at - now))?;
    }
    Ok(room)
}
