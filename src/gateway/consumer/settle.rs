//! Settles and extensions of leases: one id or a batch, here or forwarded to the replica
//! that issued them; each `Ok` only once the server confirmed it, each refusal fenced by
//! the lease table before anything reaches NATS.
//!
//! May import: as the rest of `gateway`.

use std::collections::HashMap;

use futures::FutureExt as _;
use futures::future::join_all;
use time::OffsetDateTime;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::domain::finals::{Final, MessageKey};
use crate::domain::lease_id::{DeliveryKey, InstanceId, LeaseCoordinates, SignedLease};
use crate::domain::leases::{Refusal, SettleStart};
use crate::domain::settle::{AckCommand, SettleKind};
use crate::domain::wall_clock;
use crate::error::Error;
use crate::metrics::{SettleAction, SettleOutcome};
use crate::nats::dead_letter::Outcome;
use crate::nats::settle::{self as nats_settle, ConfirmError};
use crate::nats::{self, Bound};
use crate::state::LeaseState;
use crate::telemetry;
use crate::telemetry::spans::MessageSpan;

use super::wire::{self, settle_outcome};
use super::{Consumer, Sent, SettleResult};

impl Consumer {
    /// The replica to forward a settle of this lease to, when another one issued it.
    fn owner_elsewhere(&self, signed: Option<SignedLease>) -> Option<InstanceId> {
        signed
            .map(|signed| signed.owner)
            .filter(|owner| *owner != self.process.instance)
    }

    /// How long a settle here waits for the server's confirmation: `--settle-timeout`, or
    /// until the connection to NATS drops, whichever comes first. A confirmation can no
    /// longer come once the connection is gone, and a client holding more leases of the
    /// same fetch should not wait out the timeout to hear so: it settles the rest (each
    /// refused at once while NATS is away) before their messages come back to others. The
    /// answer is the same 504 either way: the settle may or may not have landed.
    pub(super) fn confirmation_deadline(&self) -> impl Future<Output = ()> + Send + 'static {
        let timeout = tokio::time::sleep(self.config.settle_timeout);
        let mut nats_up = self.nats_up.clone();
        async move {
            let dropped = async move {
                // The supervisor gone (the consumer stopping) says nothing of the
                // connection: then only the timeout ends the wait.
                if nats_up.wait_for(|up| !*up).await.is_err() {
                    std::future::pending::<()>().await;
                }
            };
            tokio::select! {
                () = timeout => {}
                () = dropped => {}
            }
        }
    }

    /// Ack, nak or term one lease; `Ok` only once the server confirmed it. A lease another
    /// replica issued is settled there.
    pub(crate) async fn settle(&self, id: &str, command: &AckCommand) -> SettleResult {
        self.settle_decoded(id, self.state.signer().decode(id), command)
            .await
    }

    /// [`Consumer::settle`] of a lease this process holds as it was issued (a push worker's):
    /// its id is not verified again.
    pub(crate) async fn settle_issued(&self, id: &str, command: &AckCommand) -> SettleResult {
        self.settle_decoded(id, self.state.signer().decode_issued(id), command)
            .await
    }

    async fn settle_decoded(
        &self,
        id: &str,
        signed: Option<SignedLease>,
        command: &AckCommand,
    ) -> SettleResult {
        if let Some(owner) = self.owner_elsewhere(signed) {
            // Boxed: the forward's state would otherwise be part of every settle's future,
            // copied whole each time one is moved into a task or a set.
            return only_answer(Box::pin(self.forward(owner, &[id], command)).await).map(drop);
        }
        self.settle_by(id, signed, command, self.confirmation_deadline())
            .await
    }

    /// Settle every id concurrently (one batch costs about one NATS round trip, not one
    /// each); the results in the order of `ids`. Ids other replicas issued are forwarded, one
    /// request per replica, alongside.
    pub(crate) async fn settle_many(
        &self,
        ids: &[String],
        command: &AckCommand,
    ) -> Vec<SettleResult> {
        let signer = self.state.signer();
        self.settle_many_decoded(ids, |id| signer.decode(id), command)
            .await
    }

    /// [`Consumer::settle_many`] of leases this process holds as they were issued (a push
    /// worker's): their ids are not verified again.
    pub(crate) async fn settle_many_issued(
        &self,
        ids: &[String],
        command: &AckCommand,
    ) -> Vec<SettleResult> {
        let signer = self.state.signer();
        self.settle_many_decoded(ids, |id| signer.decode_issued(id), command)
            .await
    }

    async fn settle_many_decoded(
        &self,
        ids: &[String],
        decode: impl Fn(&str) -> Option<SignedLease>,
        command: &AckCommand,
    ) -> Vec<SettleResult> {
        let leases: Vec<(&str, Option<SignedLease>)> =
            ids.iter().map(|id| (id.as_str(), decode(id))).collect();
        let (here, elsewhere) = wire::by_owner(&leases, self.process.instance);
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
        let mut results: Vec<Option<SettleResult>> = vec![None; leases.len()];
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

    /// [`Consumer::settle_many`] of leases settled here: not issued elsewhere. The settles
    /// share one timer for their common timeout: one per settle costs measurably on the
    /// batch path.
    pub(super) async fn settle_many_here(
        &self,
        leases: &[(&str, Option<SignedLease>)],
        command: &AckCommand,
    ) -> Vec<SettleResult> {
        let deadline = Box::pin(self.confirmation_deadline()).shared();
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

    /// [`Consumer::settle`] of a lease settled here, unconfirmed (504) once `deadline`
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
            // Boxed, as the dead-letter copy (see there).
            AckCommand::InProgress => {
                return Box::pin(self.extend_by(id, signed, deadline))
                    .await
                    .map(|_| ());
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

    /// [`Consumer::extend`] of a lease extended here, unconfirmed (504) once `deadline`
    /// resolves.
    pub(super) async fn extend_by(
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
                let mut span = self.settle_span(action, None);
                self.report(action, id, None, settle_outcome(&err), &mut span);
                return Err(err);
            }
        };
        let mut span = self.settle_span(action, Some(&lease));
        match act(lease).await {
            Ok((value, outcome)) => {
                self.report(action, id, Some(&lease), outcome, &mut span);
                Ok(value)
            }
            Err(err) => {
                self.report(action, id, Some(&lease), settle_outcome(&err), &mut span);
                Err(err)
            }
        }
    }

    /// The trace span of one settle (a disabled one when tracing is off), with what the
    /// lease table kept of the message.
    fn settle_span(&self, action: SettleAction, lease: Option<&LeaseCoordinates>) -> MessageSpan {
        if !telemetry::on() {
            return MessageSpan::none();
        }
        let note = lease.and_then(|lease| self.state.leases().note(lease.key));
        let name = self.name();
        telemetry::spans::settle_span(
            action.as_str(),
            &name.stream,
            &name.consumer,
            lease,
            note.as_deref(),
        )
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
        let ending = Final::of(command).map(|outcome| (MessageKey::of(lease), outcome));
        let reply = match started {
            // A retry: its record may be what failed the first time (then answered 503),
            // and it is answered 2xx only with one stored.
            Ok(SettleStart::AlreadyDone) => {
                if let Some(ending) = ending {
                    self.recorder.record(ending, deadline).await?;
                }
                return Ok(Sent::Nothing);
            }
            Ok(SettleStart::Send(reply)) => reply,
            Err(refusal) => return Err(refused(refusal)),
        };
        let in_motion = InMotion {
            state: &self.state,
            key,
            kind,
        };
        // Pending before the lease is finished: see `Recorder::reserve`.
        let mut reservation = ending.as_ref().map(|_| self.recorder.reserve());
        let mut recording = None;
        let mut deadline = std::pin::pin!(deadline);
        let confirmed = match self.connected() {
            Ok(bound) => match self
                .copy_before_term(&bound, key, command, &mut deadline)
                .await
            {
                Ok(()) => {
                    // The record goes out alongside the settle: the answer waits for both,
                    // not one after the other (dropped unconfirmed, it is voided).
                    if let (Some(reservation), Some(ending)) = (reservation.take(), ending) {
                        recording = Some(reservation.start(ending)?);
                    }
                    nats_settle::confirm(&bound, &reply, command, deadline.as_mut()).await
                }
                Err(not_copied) => {
                    // Nothing was sent: the lease stays as it was, the term may be retried.
                    drop(in_motion);
                    return Err(not_copied);
                }
            },
            Err(_) => Err(ConfirmError::Unavailable),
        };
        {
            let now = Instant::now();
            std::mem::forget(in_motion);
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
        confirmed.map_err(unconfirmed)?;
        if let Some(recording) = recording {
            // Answered 2xx only once every gateway can know it ended (503 otherwise; the
            // server has the settle, and a retry records it again).
            recording.stored(deadline).await?;
        }
        Ok(Sent::Confirmed)
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
        // Boxed: a batch settle moves one settle future per id into its set, and the copy's
        // state (some 3 KB) in every one of them cost an eighth of the gateway's CPU on the
        // batch path.
        Box::pin(self.dead_letter_before_term(bound, key, reason.as_deref(), subject, deadline))
            .await
    }

    /// The copy of [`Consumer::copy_before_term`], once it is known to be needed.
    async fn dead_letter_before_term(
        &self,
        bound: &Bound,
        key: DeliveryKey,
        reason: Option<&str>,
        subject: &str,
        deadline: &mut (impl Future<Output = ()> + Unpin),
    ) -> Result<(), Error> {
        let target = nats::dead_letter::Target {
            stream: self.config.stream.clone(),
            consumer: bound.consumer_name.clone(),
            subject: subject.to_owned(),
        };
        let copy = nats::dead_letter::copy_before_term(
            &bound.jetstream,
            &target,
            key.stream_sequence,
            key.delivered,
            reason,
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
        span: &mut MessageSpan,
    ) {
        self.state.metrics.settled(action, outcome);
        telemetry::spans::settled(
            span,
            outcome.as_str(),
            matches!(
                outcome,
                SettleOutcome::Timeout | SettleOutcome::Unavailable | SettleOutcome::Error
            ),
        );
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
        self.extend_by(id, signed, self.confirmation_deadline())
            .await
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
}

/// The one answer a forwarded settle of one id got.
fn only_answer(mut results: Vec<wire::Settled>) -> wire::Settled {
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

/// A settle sent and not yet answered. Dropped before its answer (the client hung up and
/// the request's future went with it), it ends as unconfirmed: the lease stays valid for a
/// retry, and the message no longer counts as ending, so a new delivery of it is not held
/// back for an answer that never comes.
struct InMotion<'a> {
    state: &'a LeaseState,
    key: DeliveryKey,
    kind: SettleKind,
}

impl Drop for InMotion<'_> {
    fn drop(&mut self) {
        self.state
            .leases()
            .finish_settle(self.key, self.kind, false, Instant::now());
    }
}
