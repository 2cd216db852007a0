//! Fetch, as the core serves it: lease a batch for a caller that may hang up mid-wait (its
//! fetch is then withdrawn and whatever it was about to get goes to the next fetch), with an
//! optional `Idempotency-Key` whose repeat gets the first answer.
//!
//! May import: as the rest of `gateway`.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tracing::warn;

use super::Consumer;
use crate::dispatch::Command;
use crate::domain::delivery::{Demand, Leased};
use crate::domain::idempotency::{Begin, Fingerprint, Scope};
use crate::domain::settle::AckCommand;
use crate::error::Error;
use crate::metrics::FetchRefusal;

/// Whoever asked for a fetch, as far as the core needs to know them: whether they are still
/// there to take the answer. The HTTP layer implements it on its socket watcher.
pub(crate) trait Caller: Sync {
    /// Resolves once the caller hung up.
    fn hung_up(&self) -> impl Future<Output = ()> + Send;
    /// Whether the caller has hung up, without waiting.
    fn has_hung_up(&self) -> bool;
}

/// What makes a fetch retry-safe: its key (scoped by its credentials) and its request.
pub(crate) struct Idempotency {
    pub(crate) scope: Scope,
    pub(crate) fingerprint: Fingerprint,
}

/// A fetch's answer, rendered.
pub(crate) struct Fetched {
    pub(crate) body: Bytes,
    /// The first answer for this `Idempotency-Key`, given again.
    pub(crate) replayed: bool,
}

impl Consumer {
    /// Lease up to `demand.batch` messages for `caller` and render the answer with `render`.
    /// With `idempotency`, a repeat gets the first answer (even one whose caller hung up
    /// before reading it: it said it would retry), and a repeat with another request is a
    /// 422. Without it, leases issued to a caller that hung up meanwhile are given back.
    pub(crate) async fn fetch<C: Caller>(
        &self,
        demand: Demand,
        idempotency: Option<Idempotency>,
        caller: Option<&C>,
        render: impl Fn(Vec<Leased>) -> Result<Bytes, Error>,
    ) -> Result<Fetched, Error> {
        let started = Instant::now();
        let _in_progress = self.state.metrics.fetch_in_progress();
        let Some(idempotency) = idempotency else {
            let leased = self.lease_for(demand, caller).await?;
            if caller.is_some_and(Caller::has_hung_up) {
                // It left while the answer was on its way: nobody would see these leases.
                // Boxed, as the forward to a pinned replica below.
                Box::pin(self.give_back(leased)).await;
                return Err(Error::ClientGone);
            }
            let count = leased.len();
            // Rendered here, so that the latency includes the JSON.
            let body = render(leased)?;
            self.state.metrics.fetch_served(started.elapsed(), count);
            return Ok(Fetched {
                body,
                replayed: false,
            });
        };
        // Boxed: unboxed, its state would be part of every fetch's future, which each long
        // poll holds for its whole wait, keyed or not.
        Box::pin(self.fetch_keyed(demand, idempotency, caller, render, started)).await
    }

    /// [`Consumer::fetch`] with an `Idempotency-Key`.
    async fn fetch_keyed<C: Caller>(
        &self,
        demand: Demand,
        idempotency: Idempotency,
        caller: Option<&C>,
        render: impl Fn(Vec<Leased>) -> Result<Bytes, Error>,
        started: Instant,
    ) -> Result<Fetched, Error> {
        loop {
            let claim = match self.begin_idempotent(&idempotency.scope, idempotency.fingerprint) {
                Begin::Replay(body) => {
                    return Ok(Fetched {
                        body,
                        replayed: true,
                    });
                }
                Begin::Mismatch => {
                    return Err(Error::invalid(
                        "Idempotency-Key",
                        "Idempotency-Key: already used with a different request body; use a new key",
                    ));
                }
                Begin::Wait(mut done) => {
                    // The first request with this key is still waiting: take its answer.
                    match caller {
                        Some(caller) => tokio::select! {
                            _ = done.changed() => {}
                            () = caller.hung_up() => return Err(Error::ClientGone),
                        },
                        None => {
                            let _ = done.changed().await;
                        }
                    }
                    continue;
                }
                Begin::First(claim) => claim,
            };
            // A retry reaching this replica after the first went to another one.
            let digest = idempotency.scope.digest();
            match self.shared_answer(&idempotency, &digest).await {
                Some(SharedAnswer::Same(body)) => {
                    return Ok(Fetched {
                        body,
                        replayed: true,
                    });
                }
                Some(SharedAnswer::Other) => {
                    return Err(Error::invalid(
                        "Idempotency-Key",
                        "Idempotency-Key: already used with a different request body; use a new key",
                    ));
                }
                None => {}
            }
            let leased = self.lease_for(demand, caller).await?;
            let count = leased.len();
            let keys = leased
                .iter()
                .map(|leased| leased.delivery.coordinates.key)
                .collect();
            let body = render(leased)?;
            // Remembered even when the caller hung up meanwhile: it said it would retry, and
            // its retry gets these leases instead of stranding them until they expire.
            claim.answer(body.clone(), keys);
            if count > 0 {
                self.share_answer(&idempotency, &digest, body.clone()).await;
            }
            self.state.metrics.fetch_served(started.elapsed(), count);
            return Ok(Fetched {
                body,
                replayed: false,
            });
        }
    }

    /// The answer another replica gave first to this fetch's key, while a lease of it is
    /// live there (as for a key this replica remembers). One this replica gave is not
    /// looked at: its own memory of the key, which let this fetch go first, knows better. A
    /// shared stream that cannot be read costs the retry-safety across replicas only, not
    /// the fetch.
    async fn shared_answer(&self, idempotency: &Idempotency, digest: &str) -> Option<SharedAnswer> {
        let bound = self.bound().ok()?;
        // An answer lives in the shared stream for ack_wait; older, it is a replay.
        let max_age = self.state.ack_wait() + Duration::from_secs(10);
        let mut found = None;
        // The fleet's, then (an earlier release's replica may have answered) the consumer's own.
        for shared in bound.shared() {
            let key = shared.answer_key(&self.name.stream, &self.name.consumer, digest);
            match shared.remembered_answer(&key, max_age).await {
                Ok(Some(remembered)) => {
                    found = Some(remembered);
                    break;
                }
                Ok(None) => {}
                Err(err) => {
                    warn!(error = %format!("{err:#}"), "cannot read the answers replicas share; this keyed fetch is retry-safe at this replica only");
                }
            }
        }
        let remembered = found?;
        if remembered.owner == self.process.instance.to_string()
            || !self.any_live_elsewhere(&remembered.body).await
        {
            return None;
        }
        Some(
            if remembered.fingerprint == idempotency.fingerprint.to_hex() {
                SharedAnswer::Same(remembered.body)
            } else {
                SharedAnswer::Other
            },
        )
    }

    /// Share a keyed fetch's answer with the other replicas for as long as its leases can
    /// live, before the client sees it: a retry anywhere gets it.
    async fn share_answer(&self, idempotency: &Idempotency, digest: &str, body: Bytes) {
        let Ok(bound) = self.bound() else {
            return;
        };
        for shared in bound.shared() {
            let key = shared.answer_key(&self.name.stream, &self.name.consumer, digest);
            if let Err(err) = shared
                .remember_answer(
                    &key,
                    self.process.instance,
                    &idempotency.fingerprint.to_hex(),
                    body.clone(),
                    self.state.ack_wait(),
                )
                .await
            {
                warn!(error = %format!("{err:#}"), "cannot share a keyed fetch's answer with the other replicas; a retry at another replica leases anew");
            }
        }
    }

    /// Lease for this fetch, giving up when the caller hangs up mid-wait.
    pub(super) async fn lease_for<C: Caller>(
        &self,
        demand: Demand,
        caller: Option<&C>,
    ) -> Result<Vec<Leased>, Error> {
        match caller {
            // Dropping the fetch when the caller hangs up hands its place (and anything its
            // pull still brings) to the next fetch.
            Some(caller) => tokio::select! {
                leased = self.lease_batch(demand) => leased,
                () = caller.hung_up() => Err(Error::ClientGone),
            },
            None => self.lease_batch(demand).await,
        }
    }

    /// Look up a fetch's `Idempotency-Key` (see [`crate::idempotency`]).
    fn begin_idempotent(&self, scope: &Scope, fingerprint: Fingerprint) -> Begin {
        let now = Instant::now();
        self.idempotency.begin(scope, fingerprint, |key| {
            self.state.leases().is_live(key, now)
        })
    }

    /// Lease up to `demand.batch` messages: here, or through the replica pinned to an
    /// ordered consumer.
    async fn lease_batch(&self, demand: Demand) -> Result<Vec<Leased>, Error> {
        if self.accepting.load(Ordering::Relaxed)
            && let Some(pinned) = self.pinned_elsewhere()
        {
            // Boxed: unboxed, the forward's state would be part of every fetch's future.
            return Box::pin(self.lease_at_pinned(pinned, demand)).await;
        }
        self.lease_here(demand).await
    }

    /// Lease up to `demand.batch` messages here, counting the wait or the refusal.
    pub(super) async fn lease_here(&self, demand: Demand) -> Result<Vec<Leased>, Error> {
        let started = Instant::now();
        let result = self.wait_for_leases(demand).await;
        match &result {
            Ok(_) => self.state.metrics.fetch_waited(started.elapsed()),
            Err(Error::AtCapacity { .. }) => {
                self.state.metrics.fetch_refused(FetchRefusal::AtCapacity);
            }
            Err(Error::Unavailable(_) | Error::ShuttingDown) => {
                self.state.metrics.fetch_refused(FetchRefusal::Unavailable);
            }
            // Validation errors and a client gone are no refusals.
            Err(_) => {}
        }
        result
    }

    async fn wait_for_leases(&self, demand: Demand) -> Result<Vec<Leased>, Error> {
        if !self.accepting.load(Ordering::Relaxed) {
            return Err(Error::ShuttingDown);
        }
        self.connected()?;
        // A patient demand (a push worker's) keeps nothing awake while it waits: an idle
        // push consumer falls silent as any idle consumer does (no reads of its state, out
        // of the heartbeat) while its pull waits at the server; what arrives wakes it.
        let _awake = (!demand.patient).then(|| self.activity.hold());
        // A consumer that fell silent beats again (and reads its settings) before it leases.
        if !demand.patient {
            self.activity.wake_up().await;
        }
        self.refuse_if_paused()?;
        self.known_to_replicas()?;
        let max_ack_pending = self.state.max_ack_pending();
        {
            let now = Instant::now();
            let mut leases = self.state.leases();
            if leases.taken(now) >= max_ack_pending {
                let retry_after = leases
                    .next_release()
                    .map(|at| at.saturating_duration_since(now))
                    .unwrap_or(Duration::from_secs(1));
                return Err(Error::AtCapacity {
                    max_ack_pending,
                    retry_after,
                });
            }
        }
        // Other replicas' leases are not in this table: the server's count says when all
        // of them together are full (it then delivers nothing, silently).
        let shared_capacity_reached = || Error::AtCapacity {
            max_ack_pending,
            retry_after: Duration::from_secs(1),
        };
        if *self.consumer_full.borrow() {
            return Err(shared_capacity_reached());
        }
        let (answer, answered) = oneshot::channel();
        let id = self.next_fetch.fetch_add(1, Ordering::Relaxed);
        self.commands
            .send(Command::Fetch { id, demand, answer })
            .await
            .map_err(|_| Error::ShuttingDown)?;
        let mut pending = PendingFetch {
            id,
            answered: Some(answered),
            gateway: self,
        };
        // The dispatcher answers by the deadline; the bound only guards against it stalling.
        let bound = demand.wait + Duration::from_secs(5);
        let answered = pending.answered.as_mut().ok_or(Error::ShuttingDown)?;
        let mut nats_up = self.nats_up.clone();
        // Behind a load balancer a client should learn of an outage at once and try a
        // replica that is connected, not sleep through its whole wait.
        let connection_lost = async move {
            let _ = nats_up.wait_for(|up| !*up).await;
        };
        let mut consumer_full = self.consumer_full.clone();
        let became_full = async move {
            if consumer_full.wait_for(|full| *full).await.is_err() {
                // Nobody watches the consumer any more (stopping): never.
                std::future::pending::<()>().await;
            }
        };
        let leased = tokio::select! {
            // An answer that is there wins: its leases were issued.
            biased;
            answer = tokio::time::timeout(bound, answered) => match answer {
                Ok(Ok(leased)) => leased,
                Ok(Err(_)) => return Err(Error::ShuttingDown),
                Err(_) => {
                    return Err(Error::Unavailable(
                        "no answer from the dispatcher in time; NATS may be unreachable".into(),
                    ));
                }
            },
            () = connection_lost => {
                return Err(Error::Unavailable(
                    "the connection to NATS was lost while this fetch waited; retry".into(),
                ));
            }
            () = became_full => return Err(shared_capacity_reached()),
        };
        pending.answered = None;
        if demand.patient && !leased.is_empty() {
            // Its live leases keep it awake from now on; one step first, so that the
            // other replicas know it before its leases reach anyone who may settle them.
            self.activity.wake_up().await;
        }
        Ok(leased)
    }

    /// Take back leases whose client left before seeing them: the deliveries go to the
    /// next fetch (or are nak'd), as if never handed out.
    /// Send the dispatcher `command` from a `drop`, which cannot wait: at once, or from a
    /// task when its queue is full.
    pub(super) fn tell_from_drop(&self, command: Command) {
        let commands = self.commands.clone();
        if let Err(mpsc::error::TrySendError::Full(command)) = commands.try_send(command) {
            tokio::spawn(async move {
                let _ = commands.send(command).await;
            });
        }
    }

    pub(super) async fn give_back(&self, leased: Vec<Leased>) {
        // Leases the replica pinned to an ordered consumer issued are given back there, as
        // a nak: the same message comes back first for its key.
        let (remote, leased): (Vec<Leased>, Vec<Leased>) = leased
            .into_iter()
            .partition(|leased| leased.delivery.reply.is_empty());
        if let Some(owner) = remote
            .first()
            .and_then(|leased| self.state.signer().decode(&leased.id))
            .map(|signed| signed.owner)
        {
            let ids: Vec<&str> = remote.iter().map(|leased| leased.id.as_str()).collect();
            self.forward(owner, &ids, &AckCommand::Nak { delay: None })
                .await;
        }
        if leased.is_empty() {
            return;
        }
        let deliveries = self.state.give_back(leased);
        let _ = self.commands.send(Command::GiveBack(deliveries)).await;
    }
}

/// What another replica answered first under a key.
enum SharedAnswer {
    /// To the same request: its body, to give again.
    Same(Bytes),
    /// To another request under the same key (422).
    Other,
}

/// A fetch waiting for its answer. Dropped before the answer was taken (the HTTP client
/// went away), it tells the dispatcher, and takes back any leases already on their way.
struct PendingFetch<'a> {
    id: u64,
    answered: Option<oneshot::Receiver<Vec<Leased>>>,
    gateway: &'a Consumer,
}

impl Drop for PendingFetch<'_> {
    fn drop(&mut self) {
        let Some(mut answered) = self.answered.take() else {
            return;
        };
        answered.close();
        let command = match answered.try_recv() {
            Ok(leased) => Command::GiveBack(self.gateway.state.give_back(leased)),
            Err(_) => Command::Withdraw { id: self.id },
        };
        self.gateway.tell_from_drop(command);
    }
}
