//! The gateway core: fetch, settle, extend and inspect, over the lease table, the dispatcher
//! and the NATS boundary. HTTP handlers call this and only this.
//!
//! A supervisor task keeps the NATS connection bound to the consumer (retrying while NATS is
//! away, rebinding after a reconnect or a deleted consumer) and publishes the binding on a
//! watch channel; the dispatcher and every request read the current binding from there.
//!
//! May import: `dispatch`, `nats`, `state`, `domain`, `config`, `error`, `metrics`. Never `http`.

mod fetch;
mod replicas;
mod supervisor;

pub(crate) use fetch::{Caller, Idempotency};

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use futures::FutureExt as _;
use futures::future::join_all;
use time::OffsetDateTime;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::config::Config;
use crate::dispatch::{Command, Dispatcher};
use crate::domain::finals::MessageKey;
use crate::domain::idempotency::IdempotencyCache;
use crate::domain::lease_id::{
    DeliveryKey, InstanceId, LeaseCoordinates, LeaseKey, LeaseSigner, SignedLease,
};
use crate::domain::leases::{Refusal, SettleStart};
use crate::domain::seal::Sealer;
use crate::domain::settle::{AckCommand, SettleKind};
use crate::domain::{subject, wall_clock};
use crate::error::Error;
use crate::metrics::{Metrics, SettleAction, SettleOutcome, Snapshot};
use crate::nats::dead_letter::Outcome;
use crate::nats::publish::PublishFailure;
use crate::nats::replicas::{ReplicaRecord, Subjects};
use crate::nats::settle::{self as nats_settle, ConfirmError};
use crate::nats::trust::Trust;
use crate::nats::{self, Bound, Client};
use crate::state::LeaseState;
use supervisor::{Background, supervise};

/// The gateway as the HTTP layer sees it. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Gateway {
    state: Arc<LeaseState>,
    /// The NATS client once created (it reconnects by itself), for the connection gauge.
    client: Arc<OnceLock<Client>>,
    commands: mpsc::Sender<Command>,
    bound: watch::Receiver<Option<Arc<Bound>>>,
    /// Whether the NATS connection is up (from its events) and the binding checked since
    /// the last reconnect; waiting fetches watch it.
    nats_up: watch::Receiver<bool>,
    accepting: Arc<AtomicBool>,
    next_fetch: Arc<AtomicU64>,
    config: Arc<Config>,
    idempotency: Arc<IdempotencyCache>,
    /// This process, as its lease ids name it.
    instance: InstanceId,
    started_at: OffsetDateTime,
    /// What replicas on the consumer send each other.
    subjects: Arc<Subjects>,
    /// The live replicas' last heartbeats (this one's included once it beat).
    replicas: Arc<Mutex<Vec<ReplicaRecord>>>,
    /// True while other replicas are live and, all together, hold max_ack_pending
    /// deliveries: a fetch here would get nothing from the server.
    consumer_full: watch::Receiver<bool>,
    /// Whether this replica listens for settles other replicas forward: until it does, a
    /// lease it issued could not be settled elsewhere, so it is not ready.
    forwarding: Arc<AtomicBool>,
    /// Whether this replica's heartbeat is in the shared stream (or there is none): until
    /// it is, another replica could take its leases for a dead owner's, so it issues none.
    announced: Arc<AtomicBool>,
    /// The seal on what this replica sends other replicas, and what it believes of theirs.
    trust: Arc<Trust>,
}

/// Handles to the background tasks, for an orderly stop.
pub(crate) struct Tasks {
    stop: CancellationToken,
    dispatcher: tokio::task::JoinHandle<()>,
}

/// What a settle of one lease came to.
pub(crate) type SettleResult = Result<(), Error>;

/// What a successful settle sent to the server.
enum Sent {
    /// The settle, confirmed by the server.
    Confirmed,
    /// Nothing: the lease was already settled this way.
    Nothing,
}

/// Consumer state for `GET /consumer`.
pub(crate) struct ConsumerStatus {
    pub(crate) info: async_nats::jetstream::consumer::Info,
    pub(crate) leases_in_flight: usize,
}

impl Gateway {
    /// Start the supervisor and the dispatcher, signing lease ids with `lease_key` (random
    /// when `None`). Returns at once; NATS is reached in the background. The receiver gets
    /// the error that makes the gateway unable to work as configured (missing stream,
    /// immutable consumer field differs), if one comes.
    pub(crate) fn start(
        config: Config,
        lease_key: Option<LeaseKey>,
    ) -> (Self, Tasks, oneshot::Receiver<anyhow::Error>) {
        let instance = InstanceId::random();
        // Without a key file nothing is shared: lease ids and seals die with the process.
        let key = match &lease_key {
            Some(key) => key.bytes().to_vec(),
            None => rand::random::<[u8; 32]>().to_vec(),
        };
        let signer = LeaseSigner::with_key(&key, &config.stream, &config.consumer, instance);
        let state = Arc::new(LeaseState::new(
            signer,
            config.ack_wait,
            config.max_ack_pending as usize,
        ));
        let trust = Arc::new(Trust::new(
            Sealer::new(&key, instance),
            config.accept_unsigned_replicas,
            state.metrics.internal_messages_rejected(),
        ));
        let client = Arc::new(OnceLock::new());
        let config = Arc::new(config);
        let (commands_tx, commands_rx) = mpsc::channel(1024);
        let (bound_tx, bound_rx) = watch::channel(None);
        let (connected_tx, nats_up) = watch::channel(false);
        let (fatal_tx, fatal_rx) = oneshot::channel();
        let stop = CancellationToken::new();

        let dispatcher = Dispatcher::new(state.clone());
        let dispatcher = tokio::spawn({
            let bound_rx = bound_rx.clone();
            let capacity_freed = state.capacity_freed();
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
            let state = state.clone();
            let trust = trust.clone();
            let commands = commands_tx.clone();
            let stop = stop.clone();
            let client = client.clone();
            async move {
                let background = Background {
                    stop: stop.clone(),
                    state: state.clone(),
                    client,
                    connected: connected_tx,
                    trust,
                };
                tokio::select! {
                    result = supervise(&config, &state, bound_tx, commands, background) => {
                        if let Err(err) = result {
                            let _ = fatal_tx.send(err);
                        }
                    }
                    () = stop.cancelled() => {}
                }
            }
        });
        let (consumer_full_tx, consumer_full) = watch::channel(false);
        let subjects = Arc::new(Subjects::new(
            &config.internal_prefix,
            &config.stream,
            &config.consumer,
        ));
        let gateway = Self {
            state,
            client,
            commands: commands_tx,
            bound: bound_rx,
            nats_up,
            accepting: Arc::new(AtomicBool::new(true)),
            next_fetch: Arc::new(AtomicU64::new(1)),
            config,
            idempotency: Arc::default(),
            instance,
            started_at: OffsetDateTime::now_utc(),
            subjects,
            replicas: Arc::default(),
            consumer_full,
            forwarding: Arc::default(),
            announced: Arc::default(),
            trust,
        };
        tokio::spawn(gateway.clone().serve_forwarded(stop.clone()));
        tokio::spawn(gateway.clone().keep_in_step(consumer_full_tx, stop.clone()));
        let tasks = Tasks { stop, dispatcher };
        (gateway, tasks, fatal_rx)
    }

    pub(crate) fn config(&self) -> &Config {
        &self.config
    }

    fn bound(&self) -> Result<Arc<Bound>, Error> {
        self.bound.borrow().clone().ok_or_else(|| {
            // No NATS address here: anyone may read /readyz, and the address is no one's business.
            Error::Unavailable("consumer not bound (NATS unreachable or starting)".into())
        })
    }

    /// The binding, once connected and checked since the last reconnect.
    fn connected(&self) -> Result<Arc<Bound>, Error> {
        let bound = self.bound()?;
        if !bound.is_connected() || !*self.nats_up.borrow() {
            return Err(Error::Unavailable(
                "the connection to NATS is down; retrying".into(),
            ));
        }
        Ok(bound)
    }

    /// Why the gateway is not ready, in words safe for anyone (no address, no names).
    pub(crate) fn readiness(&self) -> Result<(), Error> {
        if !self.accepting.load(Ordering::Relaxed) {
            return Err(Error::ShuttingDown);
        }
        self.connected().map(drop).map_err(|err| match err {
            Error::Unavailable(_) if self.bound.borrow().is_some() => {
                Error::Unavailable("not connected to NATS".into())
            }
            other => other,
        })?;
        self.known_to_replicas()
    }

    /// Whether the other replicas can tell this one's leases from a dead owner's: it
    /// listens for the settles they forward and its heartbeat is in the shared stream.
    fn known_to_replicas(&self) -> Result<(), Error> {
        if !self.forwarding.load(Ordering::Relaxed) {
            return Err(Error::Unavailable(
                "not yet listening for settles forwarded by other replicas".into(),
            ));
        }
        if !self.announced.load(Ordering::Relaxed) {
            return Err(Error::Unavailable(
                "not yet announced to the other replicas".into(),
            ));
        }
        Ok(())
    }

    pub(crate) fn leases_in_flight(&self) -> usize {
        self.state.in_flight()
    }

    /// The gateway's metrics, for recording from the HTTP layer.
    pub(crate) fn metrics(&self) -> &Metrics {
        &self.state.metrics
    }

    /// The Prometheus text exposition, with the state-mirroring gauges read now.
    pub(crate) fn render_metrics(&self) -> String {
        let (leases_in_flight, delayed_naks, expired) = {
            let mut leases = self.state.leases();
            let in_flight = leases.in_flight(Instant::now());
            (in_flight, leases.delayed_naks(), leases.take_expired())
        };
        let metrics = &self.state.metrics;
        metrics.leases_expired(expired);
        let nats_connected = self.client.get().is_some_and(nats::is_connected);
        metrics.render(Snapshot {
            leases_in_flight,
            delayed_naks,
            max_ack_pending: self.state.max_ack_pending(),
            ack_wait: self.state.ack_wait(),
            nats_connected,
        })
    }

    /// The replica to forward a settle of this lease to, when another one issued it.
    fn owner_elsewhere(&self, signed: Option<SignedLease>) -> Option<InstanceId> {
        signed
            .map(|signed| signed.owner)
            .filter(|owner| *owner != self.instance)
    }

    /// Ack, nak or term one lease; `Ok` only once the server confirmed it. A lease another
    /// replica issued is settled there.
    pub(crate) async fn settle(&self, id: &str, command: &AckCommand) -> SettleResult {
        let signed = self.state.signer().decode(id);
        if let Some(owner) = self.owner_elsewhere(signed) {
            return only_answer(self.forward(owner, &[id], command).await).map(drop);
        }
        let deadline = tokio::time::sleep(self.config.settle_timeout);
        self.settle_by(id, signed, command, deadline).await
    }

    /// Settle every id concurrently (one batch costs about one NATS round trip, not one
    /// each); the results in the order of `ids`. Ids other replicas issued are forwarded, one
    /// request per replica, alongside.
    pub(crate) async fn settle_many(
        &self,
        ids: &[String],
        command: &AckCommand,
    ) -> Vec<SettleResult> {
        let leases: Vec<(&str, Option<SignedLease>)> = ids
            .iter()
            .map(|id| (id.as_str(), self.state.signer().decode(id)))
            .collect();
        let (here, elsewhere) = replicas::by_owner(&leases, self.instance);
        if elsewhere.is_empty() {
            return self.settle_many_here(&leases, command).await;
        }
        let local: Vec<(&str, Option<SignedLease>)> = here.iter().map(|at| leases[*at]).collect();
        let forwarded = elsewhere.into_iter().map(|(owner, positions)| {
            let ids: Vec<&str> = positions.iter().map(|at| leases[*at].0).collect();
            async move {
                let results = self.forward(owner, &ids, command).await;
                positions.into_iter().zip(results).collect::<Vec<_>>()
            }
        });
        let (local_results, forwarded_results) =
            futures::join!(self.settle_many_here(&local, command), join_all(forwarded));
        let mut results: Vec<Option<SettleResult>> = vec![None; ids.len()];
        for (at, result) in here.into_iter().zip(local_results) {
            results[at] = Some(result);
        }
        for (at, result) in forwarded_results.into_iter().flatten() {
            results[at] = Some(result.map(drop));
        }
        results
            .into_iter()
            .map(|result| result.unwrap_or_else(|| Err(no_answer())))
            .collect()
    }

    /// [`Gateway::settle_many`] of leases settled here: not issued elsewhere. The settles
    /// share one timer for their common timeout: one per settle costs measurably on the
    /// batch path.
    async fn settle_many_here(
        &self,
        leases: &[(&str, Option<SignedLease>)],
        command: &AckCommand,
    ) -> Vec<SettleResult> {
        let deadline = Box::pin(tokio::time::sleep(self.config.settle_timeout)).shared();
        // An id listed twice is settled (and counted) once; each position gets its answer.
        let mut distinct: Vec<(&str, Option<SignedLease>)> = Vec::with_capacity(leases.len());
        let mut position: HashMap<&str, usize> = HashMap::with_capacity(leases.len());
        for (id, signed) in leases {
            position.entry(id).or_insert_with(|| {
                distinct.push((id, *signed));
                distinct.len() - 1
            });
        }
        let results = join_all(
            distinct
                .iter()
                .map(|(id, signed)| self.settle_by(id, *signed, command, deadline.clone())),
        )
        .await;
        leases
            .iter()
            .map(|(id, _)| results[position[id]].clone())
            .collect()
    }

    /// [`Gateway::settle`] of a lease settled here, unconfirmed (504) once `deadline`
    /// resolves.
    async fn settle_by(
        &self,
        id: &str,
        signed: Option<SignedLease>,
        command: &AckCommand,
        deadline: impl Future<Output = ()>,
    ) -> SettleResult {
        let (kind, action) = match command {
            AckCommand::Ack => (SettleKind::Ack, SettleAction::Ack),
            AckCommand::Nak { .. } => (SettleKind::Nak, SettleAction::Nak),
            AckCommand::Term { .. } => (SettleKind::Term, SettleAction::Term),
            AckCommand::InProgress => {
                return self.extend_by(id, signed, deadline).await.map(|_| ());
            }
        };
        self.on_lease(id, signed, action, |lease| async move {
            let sent = self.settle_lease(&lease, kind, command, deadline).await?;
            let outcome = match sent {
                Sent::Confirmed => SettleOutcome::Ok,
                Sent::Nothing => SettleOutcome::Repeated,
            };
            Ok(((), outcome))
        })
        .await
    }

    /// [`Gateway::extend`] of a lease extended here, unconfirmed (504) once `deadline`
    /// resolves.
    async fn extend_by(
        &self,
        id: &str,
        signed: Option<SignedLease>,
        deadline: impl Future<Output = ()>,
    ) -> Result<OffsetDateTime, Error> {
        self.on_lease(id, signed, SettleAction::InProgress, |lease| async move {
            let expires_at = self.extend_lease(lease.key, deadline).await?;
            Ok((expires_at, SettleOutcome::Ok))
        })
        .await
    }

    /// The one path of every settle and extension done here: the id, decoded as `signed`,
    /// is checked (404 when forged or malformed, 410 when from an earlier binding of the
    /// consumer, without touching anything), `act` runs on the lease it names, and the
    /// outcome is counted and logged.
    async fn on_lease<T, F>(
        &self,
        id: &str,
        signed: Option<SignedLease>,
        action: SettleAction,
        act: impl FnOnce(LeaseCoordinates) -> F,
    ) -> Result<T, Error>
    where
        F: Future<Output = Result<(T, SettleOutcome), Error>>,
    {
        let lease = match signed {
            None => Err(Error::UnknownLease),
            Some(signed) if signed.lease.epoch != self.state.epoch() => Err(Error::LeaseGone),
            Some(signed) => Ok(signed.lease),
        };
        let lease = match lease {
            Ok(lease) => lease,
            Err(err) => {
                self.report(action, id, None, settle_outcome(&err));
                return Err(err);
            }
        };
        match act(lease).await {
            Ok((value, outcome)) => {
                self.report(action, id, Some(&lease), outcome);
                Ok(value)
            }
            Err(err) => {
                self.report(action, id, Some(&lease), settle_outcome(&err));
                Err(err)
            }
        }
    }

    async fn settle_lease(
        &self,
        lease: &LeaseCoordinates,
        kind: SettleKind,
        command: &AckCommand,
        deadline: impl Future<Output = ()>,
    ) -> Result<Sent, Error> {
        let key = lease.key;
        let started = self.state.leases().begin_settle(key, kind, Instant::now());
        let reply = match started {
            Ok(SettleStart::AlreadyDone) => return Ok(Sent::Nothing),
            Ok(SettleStart::Send(reply)) => reply,
            Err(refusal) => return Err(refused(refusal)),
        };
        let mut deadline = std::pin::pin!(deadline);
        let confirmed = match self.connected() {
            Ok(bound) => match self
                .copy_before_term(&bound, key, command, &mut deadline)
                .await
            {
                Ok(()) => nats_settle::confirm(&bound, &reply, command, deadline).await,
                Err(not_copied) => {
                    // Nothing was sent: the lease stays as it was, the term may be retried.
                    self.state
                        .leases()
                        .finish_settle(key, kind, false, Instant::now());
                    return Err(not_copied);
                }
            },
            Err(_) => Err(ConfirmError::Unavailable),
        };
        {
            let now = Instant::now();
            let mut leases = self.state.leases();
            leases.finish_settle(key, kind, confirmed.is_ok(), now);
            if confirmed.is_ok() {
                self.state.confirmed(MessageKey::of(lease), command);
            }
            if let (Ok(()), AckCommand::Nak { delay: Some(delay) }) = (&confirmed, command) {
                leases.park(key.stream_sequence, now + *delay);
            }
        }
        if confirmed.is_ok() {
            self.state.freed_capacity();
        }
        confirmed.map(|()| Sent::Confirmed).map_err(unconfirmed)
    }

    /// Before a term of a message the stream deletes on term (work-queue or interest
    /// retention), copy it to the dead-letter subject: the copy made on the server's
    /// advisory would find nothing. Same headers and dedup id as that copy, so whichever
    /// comes second is dropped by the dead-letter stream. Bounded by the settle's deadline.
    async fn copy_before_term(
        &self,
        bound: &Bound,
        key: DeliveryKey,
        command: &AckCommand,
        deadline: &mut (impl Future<Output = ()> + Unpin),
    ) -> Result<(), Error> {
        let (AckCommand::Term { reason }, Some(subject), true) = (
            command,
            &self.config.dead_letter_subject,
            bound.deletes_on_term,
        ) else {
            return Ok(());
        };
        let target = nats::dead_letter::Target {
            stream: self.config.stream.clone(),
            consumer: bound.consumer_name.clone(),
            subject: subject.clone(),
        };
        let copy = nats::dead_letter::copy_before_term(
            &bound.jetstream,
            &target,
            key.stream_sequence,
            key.delivered,
            reason.as_deref(),
        );
        let copied = tokio::select! {
            biased;
            copied = copy => copied,
            () = deadline => return Err(Error::TimedOut),
        };
        match copied {
            Ok(Outcome::Stored) => {
                self.state.metrics.dead_lettered();
                info!(stream_sequence = key.stream_sequence, %subject, "dead-lettered before the term");
                Ok(())
            }
            // Already copied (a retried term), or nothing left to copy (purged meanwhile).
            Ok(Outcome::Duplicate | Outcome::Missing | Outcome::RemovedOnTerm) => Ok(()),
            Err(err) => {
                warn!(stream_sequence = key.stream_sequence, error = %format!("{err:#}"), %subject, "could not dead-letter before the term; the term was not sent");
                Err(Error::Unavailable(format!(
                    "could not copy the message to the dead-letter subject, so the term was not sent: {err:#}"
                )))
            }
        }
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
        self.state.metrics.settled(action, outcome);
        let kind = action.as_str();
        let result = outcome.as_str();
        match lease {
            // At debug: a line per settle at the default level cost about a third of the
            // gateway's CPU under load; the metrics are the per-settle record, and
            // `RUST_LOG=ruststream_nats=debug` traces a message's fate by its lease id.
            Some(lease) => debug!(
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

    /// Restart a lease's clock (and the server's ack timer), at the replica that issued
    /// it. Returns the new expiry.
    pub(crate) async fn extend(&self, id: &str) -> Result<OffsetDateTime, Error> {
        let signed = self.state.signer().decode(id);
        if let Some(owner) = self.owner_elsewhere(signed) {
            let extended = self.forward(owner, &[id], &AckCommand::InProgress).await;
            return only_answer(extended)?.ok_or_else(no_answer);
        }
        let deadline = tokio::time::sleep(self.config.settle_timeout);
        self.extend_by(id, signed, deadline).await
    }

    async fn extend_lease(
        &self,
        key: DeliveryKey,
        deadline: impl Future<Output = ()>,
    ) -> Result<OffsetDateTime, Error> {
        let reply = self
            .state
            .leases()
            .begin_extend(key, Instant::now())
            .map_err(refused)?;
        let sent_at = Instant::now();
        let confirmed = match self.connected() {
            Ok(bound) => {
                nats_settle::confirm(&bound, &reply, &AckCommand::InProgress, deadline).await
            }
            Err(_) => Err(ConfirmError::Unavailable),
        };
        // The server restarts its timer when it processes +WPI, after we sent it: counting
        // from the send keeps the lease inside the server's window.
        let lifetime = self.state.ack_wait().saturating_sub(self.state.margin());
        let extended_to = confirmed.is_ok().then_some(sent_at + lifetime);
        let expires_at = self.state.leases().finish_extend(key, extended_to);
        confirmed.map_err(unconfirmed)?;
        match expires_at {
            Some(expires_at) => Ok(wall_clock(expires_at)),
            None => Err(Error::LeaseGone),
        }
    }

    /// The server's view of the consumer plus the gateway's leases.
    pub(crate) async fn status(&self) -> Result<ConsumerStatus, Error> {
        let bound = self.connected()?;
        let info = nats::publish::consumer_info(&bound)
            .await
            .map_err(|err| Error::Unavailable(format!("{err:#}")))?;
        Ok(ConsumerStatus {
            info,
            leases_in_flight: self.leases_in_flight(),
        })
    }

    /// Publish to the stream (subject already validated against the stream's subjects).
    pub(crate) async fn publish(
        &self,
        subject: String,
        headers: async_nats::HeaderMap,
        payload: bytes::Bytes,
    ) -> Result<async_nats::jetstream::publish::PublishAck, Error> {
        let bound = self.connected()?;
        if !bound
            .stream_subjects
            .iter()
            .any(|filter| subject::matches(filter, &subject))
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
        nats::publish::publish(
            &bound,
            subject,
            headers,
            payload,
            self.config.settle_timeout,
        )
        .await
        .map_err(|failure| match failure {
            PublishFailure::Expectation(detail) => Error::PublishPrecondition(detail),
            PublishFailure::Refused(detail) => Error::invalid("headers", detail),
            PublishFailure::Unavailable(detail) => Error::Unavailable(detail),
        })
    }

    /// Stop taking fetches and answer the waiting ones now.
    pub(crate) async fn begin_shutdown(&self) {
        self.accepting.store(false, Ordering::Relaxed);
        let _ = self.commands.send(Command::Shutdown).await;
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
        self.withdraw().await;
        tasks.stop.cancel();
        if let Ok(bound) = self.bound() {
            let _ = tokio::time::timeout(Duration::from_secs(2), bound.client.flush()).await;
        }
    }
}

/// The one answer a forwarded settle of one id got.
fn only_answer(mut results: Vec<replicas::Settled>) -> replicas::Settled {
    results.pop().unwrap_or_else(|| Err(no_answer()))
}

fn no_answer() -> Error {
    Error::Unavailable("the replica that issued the lease gave no answer for it".into())
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

/// The outcome a failed settle reports in the metrics.
fn settle_outcome(err: &Error) -> SettleOutcome {
    match err {
        Error::AlreadySettled { .. } => SettleOutcome::AlreadySettled,
        Error::LeaseGone => SettleOutcome::Gone,
        Error::UnknownLease => SettleOutcome::Unknown,
        Error::TimedOut => SettleOutcome::Timeout,
        Error::Unavailable(_) | Error::ShuttingDown => SettleOutcome::Unavailable,
        _ => SettleOutcome::Error,
    }
}
