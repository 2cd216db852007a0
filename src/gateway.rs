//! The gateway core: fetch, settle, extend and inspect, over the lease table, the dispatcher
//! and the NATS boundary. HTTP handlers call this and only this.
//!
//! A supervisor task keeps the NATS connection bound to the consumer (retrying while NATS is
//! away, rebinding after a reconnect or a deleted consumer) and publishes the binding on a
//! watch channel; the dispatcher and every request read the current binding from there.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use async_nats::Event;
use futures::FutureExt as _;
use futures::future::join_all;
use time::OffsetDateTime;
use tokio::sync::{Notify, mpsc, oneshot, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::config::Config;
use crate::consumer::{self, AckCommand, BindError, Bound, ConfirmError};
use crate::dead_letter;
use crate::dispatch::{Command, Delivery, Demand, Dispatcher, Leased};
use crate::error::Error;
use crate::idempotency::{Begin, Fingerprint, IdempotencyCache, Scope};
use crate::lease_id::{DeliveryKey, LeaseCoordinates, LeaseKey, LeaseSigner};
use crate::leases::{LeaseTable, Refusal, SettleKind, SettleStart};
use crate::metrics::{Metrics, SettleAction, SettleOutcome, Snapshot};

/// How long settled and expired leases are remembered, so that retries get the first answer.
const LEASE_MEMORY: Duration = Duration::from_secs(600);
/// At most this many settled or expired leases are remembered.
const LEASE_MEMORY_MAX: usize = 500_000;

/// State shared by the request paths and the dispatcher.
pub struct Shared {
    leases: Mutex<LeaseTable>,
    signer: LeaseSigner,
    /// Bumped when the consumer is recreated; ids of an earlier epoch are void.
    epoch: AtomicU32,
    /// The highest consumer sequence delivered to the gateway in this epoch.
    highest_consumer_sequence: AtomicU64,
    ack_wait_ms: AtomicU64,
    max_ack_pending: AtomicUsize,
    rebind: Notify,
    /// Wakes the dispatcher (one waiter) when a settle frees capacity.
    capacity_freed: Arc<Notify>,
    /// Wakes every shutdown wait when a settle lands.
    settled: Notify,
    /// Fetches wait for capacity: the next settle wakes the dispatcher.
    starved: AtomicBool,
    pub metrics: Metrics,
    /// The NATS client once created (it reconnects by itself), for the connection gauge.
    client: OnceLock<async_nats::Client>,
}

impl Shared {
    fn leases(&self) -> MutexGuard<'_, LeaseTable> {
        // A panic while holding the lock cannot leave the table half-updated in a way that
        // matters more than stopping service would, so keep going with it.
        self.leases
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn ack_wait(&self) -> Duration {
        Duration::from_millis(self.ack_wait_ms.load(Ordering::Relaxed))
    }

    /// How long before the server's own redelivery a lease ends: the server starts its timer
    /// when it sends, a little before the gateway receives.
    fn margin(&self) -> Duration {
        (self.ack_wait() / 20).min(Duration::from_secs(1))
    }

    /// How long a delivery nobody waits for is kept for the next fetch before it is nak'd:
    /// short, so that the gateway never sits on messages, and so that a client still gets
    /// at least three quarters of the ack_wait.
    pub fn hold(&self) -> Duration {
        (self.ack_wait() / 4).min(Duration::from_secs(2))
    }

    pub fn max_ack_pending(&self) -> usize {
        self.max_ack_pending.load(Ordering::Relaxed)
    }

    pub fn in_flight(&self) -> usize {
        self.leases().in_flight(Instant::now())
    }

    /// The lease epoch in force (see [`LeaseCoordinates::epoch`]).
    pub fn epoch(&self) -> u32 {
        self.epoch.load(Ordering::Relaxed)
    }

    pub fn next_expiry(&self) -> Option<Instant> {
        self.leases().next_expiry()
    }

    /// Slots of max_ack_pending in use (see [`LeaseTable::taken`]).
    pub fn taken(&self) -> usize {
        self.leases().taken(Instant::now())
    }

    /// When a slot of max_ack_pending frees by itself.
    pub fn next_release(&self) -> Option<Instant> {
        self.leases().next_release()
    }

    /// The consumer was recreated: every earlier lease is void, and its id must not match a
    /// delivery of the new consumer that happens to have the same sequence numbers.
    fn new_epoch(&self) {
        self.epoch.fetch_add(1, Ordering::Relaxed);
        self.highest_consumer_sequence.store(0, Ordering::Relaxed);
        let mut old = std::mem::replace(
            &mut *self.leases(),
            LeaseTable::new(LEASE_MEMORY, LEASE_MEMORY_MAX),
        );
        self.metrics.leases_expired(old.take_expired());
    }

    pub fn note_delivery(&self, coordinates: &LeaseCoordinates) {
        self.metrics.delivery_received(coordinates.key.delivered);
        self.highest_consumer_sequence
            .fetch_max(coordinates.consumer_sequence, Ordering::Relaxed);
        self.leases().note_delivery(coordinates.key, Instant::now());
    }

    /// A delivery was nak'd back without ever being leased.
    pub fn released(&self, key: DeliveryKey) {
        self.metrics.delivery_released();
        self.leases().note_unleased(key, Instant::now());
    }

    /// A settle freed a slot: wake the dispatcher only if fetches wait for one (a batch ack
    /// would otherwise wake it once per lease), and any shutdown grace.
    fn freed_capacity(&self) {
        if self.starved.swap(false, Ordering::Relaxed) {
            self.capacity_freed.notify_one();
        }
        self.settled.notify_waiters();
    }

    /// The dispatcher has fetches waiting for capacity.
    pub fn starving(&self) {
        self.starved.store(true, Ordering::Relaxed);
    }

    pub fn request_rebind(&self) {
        self.rebind.notify_one();
    }

    /// Issue leases for deliveries about to be handed to a client.
    pub fn lease(&self, deliveries: Vec<Delivery>) -> Vec<Leased> {
        let lifetime = self.ack_wait().saturating_sub(self.margin());
        self.metrics.leases_granted(deliveries.len());
        let mut leases = self.leases();
        deliveries
            .into_iter()
            .map(|delivery| {
                let expires_at = delivery.received_at + lifetime;
                leases.issue(delivery.coordinates.key, delivery.reply.clone(), expires_at);
                Leased {
                    id: self.signer.encode(&delivery.coordinates),
                    delivery,
                    expires_at,
                }
            })
            .collect()
    }

    /// Take back leases whose client never got them.
    pub fn withdraw(&self, leased: Vec<Leased>) -> Vec<Delivery> {
        self.metrics.leases_withdrawn(leased.len());
        let mut leases = self.leases();
        leased
            .into_iter()
            .map(|leased| {
                leases.withdraw(leased.delivery.coordinates.key);
                leased.delivery
            })
            .collect()
    }
}

/// The gateway as the HTTP layer sees it. Cheap to clone.
#[derive(Clone)]
pub struct Gateway {
    shared: Arc<Shared>,
    commands: mpsc::Sender<Command>,
    bound: watch::Receiver<Option<Arc<Bound>>>,
    accepting: Arc<AtomicBool>,
    next_fetch: Arc<AtomicU64>,
    config: Arc<Config>,
    idempotency: Arc<IdempotencyCache>,
}

/// Handles to the background tasks, for an orderly stop.
pub struct Tasks {
    stop: CancellationToken,
    dispatcher: tokio::task::JoinHandle<()>,
}

/// What a settle of one lease came to.
pub type SettleResult = Result<(), Error>;

/// What a successful settle sent to the server.
enum Sent {
    /// The settle, confirmed by the server.
    Confirmed,
    /// Nothing: the lease was already settled this way.
    Nothing,
}

/// Consumer state for `GET /consumer`.
pub struct ConsumerStatus {
    pub info: async_nats::jetstream::consumer::Info,
    pub leases_in_flight: usize,
}

impl Gateway {
    /// Start the supervisor and the dispatcher. Returns at once; NATS is reached in the
    /// background. The receiver gets the error that makes the gateway unable to work as
    /// configured (missing stream, immutable consumer field differs), if one comes.
    pub fn start(config: Config) -> (Self, Tasks, oneshot::Receiver<anyhow::Error>) {
        Self::start_with_lease_key(config, None)
    }

    /// As [`Gateway::start`], signing lease ids with `lease_key` (random when `None`).
    pub fn start_with_lease_key(
        config: Config,
        lease_key: Option<LeaseKey>,
    ) -> (Self, Tasks, oneshot::Receiver<anyhow::Error>) {
        let signer = match &lease_key {
            Some(key) => LeaseSigner::with_key(key.bytes(), &config.stream, &config.consumer),
            None => LeaseSigner::random(&config.stream, &config.consumer),
        };
        let shared = Arc::new(Shared {
            leases: Mutex::new(LeaseTable::new(LEASE_MEMORY, LEASE_MEMORY_MAX)),
            signer,
            // A random first epoch: with a shared --lease-key-file, the ids of a previous
            // process (whose settle state and reply subjects died with it) or of a consumer
            // recreated meanwhile must not name this process's deliveries, whose sequences
            // may repeat. They verify (genuine) but answer 410.
            epoch: AtomicU32::new(rand::random()),
            highest_consumer_sequence: AtomicU64::new(0),
            ack_wait_ms: AtomicU64::new(
                u64::try_from(config.ack_wait.as_millis()).unwrap_or(u64::MAX),
            ),
            max_ack_pending: AtomicUsize::new(config.max_ack_pending as usize),
            rebind: Notify::new(),
            capacity_freed: Arc::new(Notify::new()),
            settled: Notify::new(),
            starved: AtomicBool::new(false),
            metrics: Metrics::new(),
            client: OnceLock::new(),
        });
        let config = Arc::new(config);
        let (commands_tx, commands_rx) = mpsc::channel(1024);
        let (bound_tx, bound_rx) = watch::channel(None);
        let (fatal_tx, fatal_rx) = oneshot::channel();
        let stop = CancellationToken::new();

        let dispatcher = Dispatcher::new(shared.clone());
        let dispatcher = tokio::spawn({
            let bound_rx = bound_rx.clone();
            let capacity_freed = shared.capacity_freed.clone();
            let stop = stop.clone();
            async move {
                tokio::select! {
                    () = dispatcher.run(commands_rx, bound_rx, capacity_freed) => {}
                    () = stop.cancelled() => {}
                }
            }
        });
        tokio::spawn({
            let config = config.clone();
            let shared = shared.clone();
            let commands = commands_tx.clone();
            let stop = stop.clone();
            async move {
                let background = Background {
                    stop: stop.clone(),
                    shared: shared.clone(),
                };
                tokio::select! {
                    result = supervise(&config, &shared, bound_tx, commands, background) => {
                        if let Err(err) = result {
                            let _ = fatal_tx.send(err);
                        }
                    }
                    () = stop.cancelled() => {}
                }
            }
        });
        let gateway = Self {
            shared,
            commands: commands_tx,
            bound: bound_rx,
            accepting: Arc::new(AtomicBool::new(true)),
            next_fetch: Arc::new(AtomicU64::new(1)),
            config,
            idempotency: Arc::default(),
        };
        let tasks = Tasks { stop, dispatcher };
        (gateway, tasks, fatal_rx)
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    fn bound(&self) -> Result<Arc<Bound>, Error> {
        self.bound.borrow().clone().ok_or_else(|| {
            // No NATS address here: anyone may read /readyz, and the address is no one's business.
            Error::Unavailable("consumer not bound (NATS unreachable or starting)".into())
        })
    }

    fn connected(&self) -> Result<Arc<Bound>, Error> {
        let bound = self.bound()?;
        if bound.client.connection_state() != async_nats::connection::State::Connected {
            return Err(Error::Unavailable(
                "the connection to NATS is down; retrying".into(),
            ));
        }
        Ok(bound)
    }

    /// Connected to NATS and bound to the consumer.
    pub fn is_ready(&self) -> bool {
        self.readiness().is_ok()
    }

    /// Why the gateway is not ready, in words safe for anyone (no address, no names).
    pub fn readiness(&self) -> Result<(), Error> {
        if !self.accepting.load(Ordering::Relaxed) {
            return Err(Error::Unavailable("shutting down".into()));
        }
        self.connected().map(drop).map_err(|err| match err {
            Error::Unavailable(_) if self.bound.borrow().is_some() => {
                Error::Unavailable("not connected to NATS".into())
            }
            other => other,
        })
    }

    /// Look up a fetch's `Idempotency-Key` (see [`crate::idempotency`]).
    pub fn begin_idempotent(&self, scope: &Scope, fingerprint: Fingerprint) -> Begin {
        let now = Instant::now();
        self.idempotency.begin(scope, fingerprint, |key| {
            self.shared.leases().is_live(key, now)
        })
    }

    pub fn leases_in_flight(&self) -> usize {
        self.shared.in_flight()
    }

    /// The gateway's metrics, for recording from the HTTP layer.
    pub fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }

    /// The Prometheus text exposition, with the state-mirroring gauges read now.
    pub fn render_metrics(&self) -> String {
        let (leases_in_flight, delayed_naks, expired) = {
            let mut leases = self.shared.leases();
            let in_flight = leases.in_flight(Instant::now());
            (in_flight, leases.delayed_naks(), leases.take_expired())
        };
        let metrics = &self.shared.metrics;
        metrics.leases_expired(expired);
        let nats_connected = self.shared.client.get().is_some_and(|client| {
            client.connection_state() == async_nats::connection::State::Connected
        });
        metrics.render(Snapshot {
            leases_in_flight,
            delayed_naks,
            max_ack_pending: self.shared.max_ack_pending(),
            ack_wait: self.shared.ack_wait(),
            nats_connected,
        })
    }

    /// Lease up to `demand.batch` messages.
    pub async fn fetch(&self, demand: Demand) -> Result<Vec<Leased>, Error> {
        let started = Instant::now();
        let result = self.fetch_leases(demand).await;
        match &result {
            Ok(_) => self.shared.metrics.fetch_waited(started.elapsed()),
            Err(err) => self.shared.metrics.fetch_refused(err),
        }
        result
    }

    async fn fetch_leases(&self, demand: Demand) -> Result<Vec<Leased>, Error> {
        if !self.accepting.load(Ordering::Relaxed) {
            return Err(Error::Unavailable(
                "the gateway is shutting down; no new fetches".into(),
            ));
        }
        self.connected()?;
        let max_ack_pending = self.shared.max_ack_pending();
        {
            let now = Instant::now();
            let mut leases = self.shared.leases();
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
        let (answer, answered) = oneshot::channel();
        let id = self.next_fetch.fetch_add(1, Ordering::Relaxed);
        self.commands
            .send(Command::Fetch { id, demand, answer })
            .await
            .map_err(|_| Error::Unavailable("the gateway is stopping".into()))?;
        let mut pending = PendingFetch {
            id,
            answered: Some(answered),
            gateway: self,
        };
        // The dispatcher answers by the deadline; the bound only guards against it stalling.
        let bound = demand.wait + Duration::from_secs(5);
        let answered = pending
            .answered
            .as_mut()
            .ok_or_else(|| Error::Unavailable("the gateway is stopping".into()))?;
        let leased = match tokio::time::timeout(bound, answered).await {
            Ok(Ok(leased)) => leased,
            Ok(Err(_)) => return Err(Error::Unavailable("the gateway is stopping".into())),
            Err(_) => {
                return Err(Error::Unavailable(
                    "no answer from the dispatcher in time; NATS may be unreachable".into(),
                ));
            }
        };
        pending.answered = None;
        Ok(leased)
    }

    /// Take back leases whose client left before seeing them: the deliveries go to the
    /// next fetch (or are nak'd), as if never handed out.
    pub async fn give_back(&self, leased: Vec<Leased>) {
        let deliveries = self.shared.withdraw(leased);
        let _ = self.commands.send(Command::Return(deliveries)).await;
    }

    /// The lease a genuine id names. Forged or malformed: 404; from an earlier binding of
    /// the consumer: 410.
    fn decode(&self, id: &str) -> Result<LeaseCoordinates, Error> {
        let lease = self.shared.signer.decode(id).ok_or(Error::UnknownLease)?;
        if lease.epoch != self.shared.epoch.load(Ordering::Relaxed) {
            return Err(Error::LeaseGone);
        }
        Ok(lease)
    }

    /// Ack, nak or term one lease; `Ok` only once the server confirmed it.
    pub async fn settle(&self, id: &str, command: &AckCommand) -> SettleResult {
        let deadline = tokio::time::sleep(self.config.settle_timeout);
        self.settle_by(id, command, deadline).await
    }

    /// Settle every id concurrently (one batch costs about one NATS round trip, not one
    /// each); the results in the order of `ids`. The settles share one timer for their
    /// common timeout: one per settle costs measurably on the batch path.
    pub async fn settle_many(&self, ids: &[String], command: &AckCommand) -> Vec<SettleResult> {
        let deadline = Box::pin(tokio::time::sleep(self.config.settle_timeout)).shared();
        join_all(
            ids.iter()
                .map(|id| self.settle_by(id, command, deadline.clone())),
        )
        .await
    }

    /// [`Gateway::settle`], unconfirmed (504) once `deadline` resolves.
    async fn settle_by(
        &self,
        id: &str,
        command: &AckCommand,
        deadline: impl Future<Output = ()>,
    ) -> SettleResult {
        let (kind, action) = match command {
            AckCommand::Ack => (SettleKind::Ack, SettleAction::Ack),
            AckCommand::Nak { .. } => (SettleKind::Nak, SettleAction::Nak),
            AckCommand::Term { .. } => (SettleKind::Term, SettleAction::Term),
            AckCommand::InProgress => {
                return self.extend_by(id, deadline).await.map(|_| ());
            }
        };
        let lease = match self.decode(id) {
            Ok(lease) => lease,
            Err(err) => {
                self.report(action, id, None, SettleOutcome::of_error(&err));
                return Err(err);
            }
        };
        let result = self.settle_lease(lease.key, kind, command, deadline).await;
        let outcome = match &result {
            Ok(Sent::Confirmed) => SettleOutcome::Ok,
            Ok(Sent::Nothing) => SettleOutcome::Repeated,
            Err(err) => SettleOutcome::of_error(err),
        };
        self.report(action, id, Some(&lease), outcome);
        result.map(|_| ())
    }

    async fn settle_lease(
        &self,
        key: DeliveryKey,
        kind: SettleKind,
        command: &AckCommand,
        deadline: impl Future<Output = ()>,
    ) -> Result<Sent, Error> {
        let started = self.shared.leases().begin_settle(key, kind, Instant::now());
        let reply = match started {
            Ok(SettleStart::AlreadyDone) => return Ok(Sent::Nothing),
            Ok(SettleStart::Send(reply)) => reply,
            Err(refusal) => return Err(refused(refusal)),
        };
        let confirmed = match self.connected() {
            Ok(bound) => consumer::confirm(&bound.client, &reply, command, deadline).await,
            Err(_) => Err(ConfirmError::Unavailable),
        };
        {
            let now = Instant::now();
            let mut leases = self.shared.leases();
            leases.finish_settle(key, kind, confirmed.is_ok(), now);
            if let (Ok(()), AckCommand::Nak { delay: Some(delay) }) = (&confirmed, command) {
                leases.park(key.stream_sequence, now + *delay);
            }
        }
        if confirmed.is_ok() {
            self.shared.freed_capacity();
        }
        confirmed.map(|()| Sent::Confirmed).map_err(unconfirmed)
    }

    /// Count a settle (or extension) of one lease and log it with the lease's coordinates
    /// (`None`: the id names no lease of the current binding, logged at debug only: nothing
    /// of a stranger's input goes to the default log).
    fn report(
        &self,
        action: SettleAction,
        id: &str,
        lease: Option<&LeaseCoordinates>,
        outcome: SettleOutcome,
    ) {
        self.shared.metrics.settled(action, outcome);
        let kind = action.as_str();
        let result = outcome.as_str();
        match lease {
            // At info, the default level: issue 3 asks for lease ids and sequences on every
            // settle, so a message's fate can be traced in the logs as shipped.
            Some(lease) => info!(
                lease_id = id,
                stream_sequence = lease.key.stream_sequence,
                consumer_sequence = lease.consumer_sequence,
                delivered = lease.key.delivered,
                kind,
                result,
                "lease settle"
            ),
            // Not a lease id of this binding: whatever the client sent is not logged.
            None => debug!(kind, result, "lease settle with an id of no current lease"),
        }
    }

    /// Restart a lease's clock (and the server's ack timer). Returns the new expiry.
    pub async fn extend(&self, id: &str) -> Result<OffsetDateTime, Error> {
        let deadline = tokio::time::sleep(self.config.settle_timeout);
        self.extend_by(id, deadline).await
    }

    /// [`Gateway::extend`], unconfirmed (504) once `deadline` resolves.
    async fn extend_by(
        &self,
        id: &str,
        deadline: impl Future<Output = ()>,
    ) -> Result<OffsetDateTime, Error> {
        let lease = match self.decode(id) {
            Ok(lease) => lease,
            Err(err) => {
                self.report(
                    SettleAction::InProgress,
                    id,
                    None,
                    SettleOutcome::of_error(&err),
                );
                return Err(err);
            }
        };
        let result = self.extend_lease(lease.key, deadline).await;
        let outcome = match &result {
            Ok(_) => SettleOutcome::Ok,
            Err(err) => SettleOutcome::of_error(err),
        };
        self.report(SettleAction::InProgress, id, Some(&lease), outcome);
        result
    }

    async fn extend_lease(
        &self,
        key: DeliveryKey,
        deadline: impl Future<Output = ()>,
    ) -> Result<OffsetDateTime, Error> {
        let reply = self
            .shared
            .leases()
            .begin_extend(key, Instant::now())
            .map_err(refused)?;
        let sent_at = Instant::now();
        let confirmed = match self.connected() {
            Ok(bound) => {
                consumer::confirm(&bound.client, &reply, &AckCommand::InProgress, deadline).await
            }
            Err(_) => Err(ConfirmError::Unavailable),
        };
        // The server restarts its timer when it processes +WPI, after we sent it: counting
        // from the send keeps the lease inside the server's window.
        let lifetime = self.shared.ack_wait().saturating_sub(self.shared.margin());
        let extended_to = confirmed.is_ok().then_some(sent_at + lifetime);
        let expires_at = self.shared.leases().finish_extend(key, extended_to);
        confirmed.map_err(unconfirmed)?;
        match expires_at {
            Some(expires_at) => Ok(wall_clock(expires_at)),
            None => Err(Error::LeaseGone),
        }
    }

    /// The server's view of the consumer plus the gateway's leases.
    pub async fn status(&self) -> Result<ConsumerStatus, Error> {
        let bound = self.connected()?;
        let info = consumer::consumer_info(&bound)
            .await
            .map_err(|err| Error::Unavailable(format!("{err:#}")))?;
        Ok(ConsumerStatus {
            info,
            leases_in_flight: self.leases_in_flight(),
        })
    }

    /// Publish to the stream (subject already validated against the stream's subjects).
    pub async fn publish(
        &self,
        subject: String,
        headers: async_nats::HeaderMap,
        payload: bytes::Bytes,
    ) -> Result<async_nats::jetstream::publish::PublishAck, Error> {
        let bound = self.connected()?;
        if !bound
            .stream_subjects
            .iter()
            .any(|filter| crate::subject::matches(filter, &subject))
        {
            return Err(Error::invalid(
                "subject",
                format!(
                    "stream {} does not capture subject {subject:?}; it captures {}",
                    self.config.stream,
                    bound.stream_subjects.join(", ")
                ),
            ));
        }
        consumer::publish(
            &bound,
            subject,
            headers,
            payload,
            self.config.settle_timeout,
        )
        .await
        .map_err(|err| Error::Unavailable(format!("{err:#}")))
    }

    /// Stop taking fetches and answer the waiting ones now.
    pub async fn begin_shutdown(&self) {
        self.accepting.store(false, Ordering::Relaxed);
        let _ = self.commands.send(Command::Shutdown).await;
    }

    /// Wait until no lease is in flight, or `grace` has passed.
    pub async fn settle_grace(&self, grace: Duration) {
        let deadline = Instant::now() + grace;
        loop {
            let settled = self.shared.settled.notified();
            tokio::pin!(settled);
            // Registered before looking, so a settle landing in between is not missed.
            settled.as_mut().enable();
            let in_flight = self.shared.in_flight();
            if in_flight == 0 {
                return;
            }
            if Instant::now() >= deadline {
                info!(
                    in_flight,
                    "shutdown grace over with leases still out; the server redelivers them after ack_wait"
                );
                return;
            }
            let wake = self
                .shared
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
    pub async fn stop(&self, tasks: Tasks) {
        let _ = self.commands.send(Command::Stop).await;
        if tokio::time::timeout(Duration::from_secs(5), tasks.dispatcher)
            .await
            .is_err()
        {
            warn!("the dispatcher did not stop in time");
        }
        // Leases still out after the grace can no longer be settled through this process:
        // nak them, so the server redelivers them now rather than after ack_wait.
        let revoked = self.shared.leases().revoke_live(Instant::now());
        if !revoked.is_empty()
            && let Ok(bound) = self.connected()
        {
            // Bounded as a whole: a connection that drops now must not hold up the exit
            // (the server then redelivers after ack_wait, as after a crash).
            let naks = async {
                for reply in &revoked {
                    consumer::release(&bound.client, reply).await;
                }
            };
            if tokio::time::timeout(Duration::from_secs(2), naks)
                .await
                .is_ok()
            {
                info!(
                    count = revoked.len(),
                    "nak'd the leases still out: the server redelivers them at once"
                );
            }
        }
        tasks.stop.cancel();
        if let Ok(bound) = self.bound() {
            let _ = tokio::time::timeout(Duration::from_secs(2), bound.client.flush()).await;
        }
    }
}

/// A fetch waiting for its answer. Dropped before the answer was taken (the HTTP client
/// went away), it tells the dispatcher, and takes back any leases already on their way.
struct PendingFetch<'a> {
    id: u64,
    answered: Option<oneshot::Receiver<Vec<Leased>>>,
    gateway: &'a Gateway,
}

impl Drop for PendingFetch<'_> {
    fn drop(&mut self) {
        let Some(mut answered) = self.answered.take() else {
            return;
        };
        answered.close();
        let command = match answered.try_recv() {
            Ok(leased) => Command::Return(self.gateway.shared.withdraw(leased)),
            Err(_) => Command::Abandon { id: self.id },
        };
        let commands = self.gateway.commands.clone();
        if let Err(mpsc::error::TrySendError::Full(command)) = commands.try_send(command) {
            tokio::spawn(async move {
                let _ = commands.send(command).await;
            });
        }
    }
}

fn refused(refusal: Refusal) -> Error {
    match refusal {
        // The id's signature proved this gateway issued it: it is no longer remembered
        // (settled or expired long ago), not unknown.
        Refusal::Unknown => Error::LeaseGone,
        Refusal::Gone => Error::LeaseGone,
        Refusal::Conflict(settled) | Refusal::Settled(settled) => Error::AlreadySettled { settled },
    }
}

fn unconfirmed(err: ConfirmError) -> Error {
    match err {
        ConfirmError::TimedOut => Error::TimedOut,
        ConfirmError::Unavailable => Error::Unavailable(
            "NATS is unavailable or the consumer is gone; the settle was not confirmed".into(),
        ),
    }
}

/// The wall-clock time of a monotonic instant.
pub fn wall_clock(at: Instant) -> OffsetDateTime {
    let now = Instant::now();
    let wall_now = OffsetDateTime::now_utc();
    if at >= now {
        wall_now + (at - now)
    } else {
        wall_now - (now - at)
    }
}

/// The gateway's metrics, for a task that outlives a borrow of [`Shared`].
#[derive(Clone)]
struct SharedMetrics(Arc<Shared>);

impl AsRef<Metrics> for SharedMetrics {
    fn as_ref(&self) -> &Metrics {
        &self.0.metrics
    }
}

/// What the supervisor starts next to the binding, on the same connection.
struct Background {
    stop: CancellationToken,
    shared: Arc<Shared>,
}

/// Keep the gateway bound: connect, bind, and rebind after reconnects or when asked.
/// Returns only on a fatal error (missing stream, immutable field differs).
async fn supervise(
    config: &Config,
    shared: &Shared,
    bound_tx: watch::Sender<Option<Arc<Bound>>>,
    commands: mpsc::Sender<Command>,
    background: Background,
) -> anyhow::Result<()> {
    let (events_tx, mut events) = mpsc::unbounded_channel();
    let client = consumer::connect(config, events_tx).await?;
    let _ = shared.client.set(client.clone());
    // A Connected event counts as a reconnect only after a Disconnected one: the first
    // connection is not one, whether or not async-nats reports it as an event.
    let mut connection_lost = false;
    let ephemeral_name = format!("{}-{:016x}", config.consumer, rand::random::<u64>());
    if let Some(subject) = &config.dead_letter_subject {
        let target = dead_letter::Target {
            stream: config.stream.clone(),
            consumer: if config.ephemeral {
                ephemeral_name.clone()
            } else {
                config.consumer.clone()
            },
            subject: subject.clone(),
        };
        // Subscribed once: async-nats renews subscriptions after every reconnect.
        tokio::spawn(dead_letter::run(
            client.clone(),
            target,
            SharedMetrics(background.shared.clone()),
            background.stop.child_token(),
        ));
    }
    let mut identity_seen: Option<(String, OffsetDateTime)> = None;
    let mut published = false;
    let mut backoff = Duration::from_millis(100);
    loop {
        // Wait for the connection; async-nats reconnects on its own.
        while client.connection_state() != async_nats::connection::State::Connected {
            match tokio::time::timeout(Duration::from_secs(1), events.recv()).await {
                Ok(Some(Event::Disconnected)) => {
                    connection_lost = true;
                    let _ = commands.send(Command::ConnectionLost).await;
                }
                Ok(Some(Event::Connected)) if connection_lost => {
                    connection_lost = false;
                    shared.metrics.nats_reconnected();
                }
                Ok(None) => anyhow::bail!("the NATS client stopped"),
                _ => {}
            }
        }
        let bound = match consumer::bind(config, &client, &ephemeral_name).await {
            Ok(bound) => bound,
            Err(BindError::Fatal(message)) => anyhow::bail!(message),
            Err(BindError::Transient(err)) => {
                warn!(error = %format!("{err:#}"), retry_in = ?backoff, "cannot bind the consumer yet");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        backoff = Duration::from_millis(100);
        if let Some(subject) = &config.dead_letter_subject
            && bound
                .stream_subjects
                .iter()
                .any(|filter| crate::subject::matches(filter, subject))
        {
            warn!(%subject, stream = %config.stream, "the consumed stream captures the dead-letter subject: dead letters come back to this consumer");
        }
        let identity = (bound.consumer_name.clone(), bound.created);
        // A server that lost deliveries in a crash (state not yet on disk) sends them again
        // with the same sequences and delivery counts, so the ids handed out before would
        // name the new deliveries too: start a new epoch.
        let forgot_deliveries = bound.delivered_consumer_sequence
            < shared.highest_consumer_sequence.load(Ordering::Relaxed);
        shared.ack_wait_ms.store(
            u64::try_from(bound.ack_wait.as_millis()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        shared
            .max_ack_pending
            .store(bound.max_ack_pending, Ordering::Relaxed);
        if identity_seen.as_ref() != Some(&identity) || forgot_deliveries {
            if identity_seen.is_some() {
                warn!(consumer = %identity.0, forgot_deliveries, "the consumer was recreated or lost deliveries; every earlier lease is void");
                shared.new_epoch();
            }
            identity_seen = Some(identity);
            published = false;
        }
        if !published {
            let mut bound = bound;
            bound.epoch = shared.epoch();
            bound_tx.send_replace(Some(Arc::new(bound)));
            published = true;
        }
        // Stay bound until the connection comes back after a drop, or a rebind is asked for.
        loop {
            tokio::select! {
                event = events.recv() => match event {
                    Some(Event::Disconnected) => {
                        connection_lost = true;
                        warn!("disconnected from NATS; leases stay valid, fetches answer 503 until reconnected");
                        let _ = commands.send(Command::ConnectionLost).await;
                    }
                    Some(Event::Connected) => {
                        if std::mem::take(&mut connection_lost) {
                            shared.metrics.nats_reconnected();
                        }
                        info!("reconnected to NATS");
                        let _ = commands.send(Command::Reconnected).await;
                        break;
                    }
                    Some(Event::ServerError(err)) => error!(error = %err, "NATS server error"),
                    Some(other) => info!(event = %other, "NATS event"),
                    None => anyhow::bail!("the NATS client stopped"),
                },
                () = shared.rebind.notified() => {
                    bound_tx.send_replace(None);
                    published = false;
                    break;
                }
            }
        }
    }
}
