//! The replica exchange, for a consumer several replicas serve with no sticky sessions: a
//! settle of a lease another replica issued is forwarded to that replica (the lease id
//! names it) and answered as it answers — 504 when the outcome is unknown, 410 only when
//! nobody received it; the questions one replica asks the others (which leases are live,
//! how messages ended, the highest sequence delivered there); a fetch of an ordered
//! consumer forwarded to the replica pinned to it; and the answers to what others forward
//! here (the process's one subscription hands them to [`Consumer::settle_forwarded`] and
//! [`Consumer::fetch_forwarded`]).
//!
//! May import: as the rest of `gateway`.

use std::time::Duration;

use time::OffsetDateTime;
use tokio::time::Instant;
use tracing::debug;

use super::Consumer;
use super::STREAM_SLICE;
use super::wire::{
    Settled, command_of, forwarded, from_remote, from_remote_lease, outcome_of, request_kind,
    to_remote, to_remote_lease,
};
use crate::domain::delivery::{Demand, Leased};
use crate::domain::finals::{Final, MessageKey};
use crate::domain::lease_id::{InstanceId, SignedLease};
use crate::domain::settle::AckCommand;
use crate::error::Error;
use crate::nats::forward::{
    self, ForwardError, ForwardedDemand, ForwardedSettle, RemoteLease, RemoteResult,
};

/// A forwarded settle waits for the owner's answer this much beyond `--settle-timeout`, so
/// that an owner's own answer at its timeout (504, or a late confirmation) wins the race.
const FORWARD_GRACE: Duration = Duration::from_millis(250);
/// How long a forward finding nobody listening for the owner keeps asking before it calls
/// the owner gone: longer than a replica takes to reconnect to another node.
const NO_RESPONDERS_FOR: Duration = Duration::from_secs(2);
/// How long a forward that found no owner waits before asking once more.
const NO_RESPONDERS_RETRY: Duration = Duration::from_millis(250);
/// The kind of a forwarded request that only asks which leases are live (a keyed fetch
/// retried at another replica replays its first answer only while one is).
const LIVE: &str = "live";

/// The kind of a forwarded request that asks how messages (named `<stream sequence>.<publish
/// time in ns>`) ended at the replica asked: a replica newly pinned to an ordered consumer
/// asks before it leases what the server may have forgotten was settled.
const FINALS: &str = "finals";
/// The id of a `finals` question that asks for the highest stream sequence delivered to the
/// replica asked (answered `highest:<n>`).
const HIGHEST: &str = "highest";

/// A request of `kind` that only asks something of another replica about `ids`.
fn question(kind: &str, ids: Vec<String>) -> ForwardedSettle {
    ForwardedSettle {
        kind: kind.to_owned(),
        delay_ms: None,
        reason: None,
        ids,
        fetch: None,
    }
}

impl Consumer {
    /// Settle (or extend) `ids`, leases `owner` issued, by forwarding them to it: one
    /// request for all of them. The results in the order of `ids`.
    pub(super) async fn forward(
        &self,
        owner: InstanceId,
        ids: &[&str],
        command: &AckCommand,
    ) -> Vec<Settled> {
        let all = |err: Error| ids.iter().map(|_| Err(err.clone())).collect::<Vec<_>>();
        let results = match self.forward_request(owner, forwarded(command, ids)).await {
            Ok(results) => results.into_iter().map(from_remote).collect(),
            // Nobody listens for the owner: it is gone, and so are its leases (the server
            // redelivers their messages after ack_wait).
            Err(ForwardError::OwnerGone) => all(Error::OwnerGone),
            Err(ForwardError::TimedOut) => all(Error::TimedOut),
            Err(ForwardError::Unavailable(detail)) => all(Error::Unavailable(detail)),
        };
        for result in &results {
            self.state.metrics.settle_forwarded(outcome_of(result));
        }
        debug!(%owner, count = ids.len(), kind = request_kind(command), "forwarded settles to the replica that issued the leases");
        results
    }

    /// Whether any lease of a fetch answer another replica gave is still live there (asked
    /// of its owner, which alone knows; a gone owner's leases are gone).
    pub(super) async fn any_live_elsewhere(&self, body: &[u8]) -> bool {
        #[derive(serde::Deserialize)]
        struct Answer {
            messages: Vec<Message>,
        }
        #[derive(serde::Deserialize)]
        struct Message {
            id: String,
        }
        let Ok(answer) = serde_json::from_slice::<Answer>(body) else {
            return false;
        };
        let ids: Vec<String> = answer.messages.into_iter().map(|m| m.id).collect();
        let Some(owner) = ids
            .first()
            .and_then(|id| self.state.signer().decode(id))
            .map(|signed| signed.owner)
        else {
            return false;
        };
        self.forward_request(owner, question(LIVE, ids))
            .await
            .is_ok_and(|results| {
                results
                    .iter()
                    .any(|result| matches!(result, RemoteResult::Ok { .. }))
            })
    }

    /// How each of `messages` ended through any other replica, if it did (in order): asked
    /// of every other replica process at once; one that does not answer counts as knowing
    /// nothing.
    pub(super) async fn finals_elsewhere(&self, messages: Vec<MessageKey>) -> Vec<Option<Final>> {
        let mut outcomes: Vec<Option<Final>> = vec![None; messages.len()];
        let ids: Vec<String> = messages
            .iter()
            .map(|message| {
                format!(
                    "{}.{}",
                    message.stream_sequence, message.published_unix_nanos
                )
            })
            .collect();
        let others = self.process.fleet.others(self.process.instance);
        let asked = others
            .into_iter()
            .map(|other| self.forward_request(other, question(FINALS, ids.clone())));
        for answer in futures::future::join_all(asked).await.into_iter().flatten() {
            for (outcome, result) in outcomes.iter_mut().zip(answer) {
                if let RemoteResult::AlreadySettled { settled } = result {
                    match settled.as_str() {
                        "ack" => *outcome = Some(Final::Acked),
                        "term" if outcome.is_none() => {
                            *outcome = Some(Final::Terminated { reason: None });
                        }
                        _ => {}
                    }
                }
            }
        }
        outcomes
    }

    /// The highest stream sequence delivered to any other replica process.
    pub(super) async fn highest_elsewhere(&self) -> u64 {
        let others = self.process.fleet.others(self.process.instance);
        let asked = others
            .into_iter()
            .map(|other| self.forward_request(other, question(FINALS, vec![HIGHEST.to_owned()])));
        futures::future::join_all(asked)
            .await
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|result| match result {
                RemoteResult::AlreadySettled { settled } => settled
                    .strip_prefix(HIGHEST)
                    .and_then(|rest| rest.strip_prefix(':'))
                    .and_then(|number| number.parse::<u64>().ok()),
                _ => None,
            })
            .max()
            .unwrap_or(0)
    }

    /// Which of `ids` (leases of one other replica) are still live there, in order; `None`
    /// when that replica cannot be asked.
    pub(super) async fn live_where_issued(&self, ids: Vec<String>) -> Option<Vec<bool>> {
        let owner = self.state.signer().decode(ids.first()?)?.owner;
        let results = self.forward_request(owner, question(LIVE, ids)).await;
        match results {
            Ok(results) => Some(
                results
                    .iter()
                    .map(|result| matches!(result, RemoteResult::Ok { .. }))
                    .collect(),
            ),
            // Gone with its leases.
            Err(ForwardError::OwnerGone) => Some(Vec::new()),
            Err(_) => None,
        }
    }

    /// Send `request` to `owner` and wait (bounded) for its answer.
    ///
    /// [`ForwardError::OwnerGone`] (410) only when this request is known to have reached
    /// nobody: nobody was listening for the owner. No silence of the owner makes the answer
    /// 410: one whose heartbeats are not stored may be alive, leasing, and applying what it
    /// is sent (a 410 for its live lease would hand the message to a second worker, and one
    /// for a settle it applied would lose the message). So a request that got no answer in
    /// time — or whose wait this replica's own connection dropping cut short — is
    /// [`ForwardError::TimedOut`] (504), and a retry is answered by the owner as the first
    /// attempt ended. Behind a listener that answers nothing (a monitoring tap), a dead
    /// owner's settles therefore stay 504 until its messages come back.
    async fn forward_request(
        &self,
        owner: InstanceId,
        request: ForwardedSettle,
    ) -> Result<Vec<RemoteResult>, ForwardError> {
        let Some(client) = self.process.connection.get() else {
            return Err(ForwardError::Unavailable(
                "not connected to NATS yet; retrying".into(),
            ));
        };
        let timeout = self.config.settle_timeout + FORWARD_GRACE;
        let to = (owner, self.subjects.settle(owner));
        let asked = async {
            // Nobody listening is not yet a dead owner: one reconnecting (its node killed)
            // has no subscription for a moment, and in a cluster a subscription reaches the
            // other servers a moment after it is made. Asked again for a while (well within
            // 3 s) before the owner is called gone; its heartbeats missing do not shorten
            // that: a live owner whose heartbeats are not stored may still hold live leases.
            // Leases past their expiry as issued are not asked again: only an extension
            // could have kept them live, and a 410 for one still settles nothing.
            let give_up_at = Instant::now() + NO_RESPONDERS_FOR;
            loop {
                match forward::forward(&client, &self.process.trust, to.clone(), &request, timeout)
                    .await
                {
                    // The ids decoded again only then: an owner that answers needs none of it.
                    Err(ForwardError::OwnerGone)
                        if Instant::now() < give_up_at && !self.expired_as_issued(&request.ids) =>
                    {
                        tokio::time::sleep(NO_RESPONDERS_RETRY).await;
                    }
                    other => return other,
                }
            }
        };
        let mut nats_up = self.nats_up.clone();
        let connection_dropped = async move {
            if nats_up.wait_for(|up| !*up).await.is_err() {
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            answer = asked => answer,
            () = connection_dropped => Err(ForwardError::TimedOut),
        }
    }

    /// Whether every one of `ids` names a lease past its expiry as issued (its id says when;
    /// ids of an earlier release do not). A settle of such a lease that reaches nobody
    /// settled nothing: the lease was over unless its owner extended it.
    fn expired_as_issued(&self, ids: &[String]) -> bool {
        let now_unix_ms =
            i64::try_from(OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000)
                .unwrap_or(i64::MAX);
        let signer = self.state.signer();
        !ids.is_empty()
            && ids.iter().all(|id| {
                signer
                    .decode(id)
                    .and_then(|signed| signed.issued_expiry_unix_ms)
                    .is_some_and(|expiry| expiry <= now_unix_ms)
            })
    }

    /// The replica pinned to this ordered consumer, when it is another one: it alone leases
    /// the consumer's messages, so fetches and streams here are forwarded to it.
    pub(super) fn pinned_elsewhere(&self) -> Option<InstanceId> {
        if self.state.ordering_key().is_none() || self.state.pin().is_some() {
            return None;
        }
        let me = self.process.instance;
        self.process
            .fleet
            .pinned_on(&self.name)
            .filter(|pinned| *pinned != me)
    }

    /// Lease through the replica pinned to this ordered consumer: it leases as for a fetch
    /// of its own, and its leases are settled there (their ids name it).
    pub(super) async fn lease_at_pinned(
        &self,
        pinned: InstanceId,
        demand: Demand,
    ) -> Result<Vec<Leased>, Error> {
        let Some(client) = self.process.connection.get() else {
            return Err(Error::Unavailable(
                "not connected to NATS yet; retrying".into(),
            ));
        };
        let forwarded = ForwardedDemand {
            batch: demand.batch,
            wait_ms: u64::try_from(demand.wait.as_millis()).unwrap_or(u64::MAX),
            max_bytes: demand.max_bytes,
        };
        let timeout = demand.wait + self.config.settle_timeout + FORWARD_GRACE;
        let to = (pinned, self.subjects.settle(pinned));
        let answered =
            forward::forward_fetch(&client, &self.process.trust, to, forwarded, timeout).await;
        match answered {
            Ok(leases) => {
                debug!(%pinned, count = leases.len(), "leased through the replica pinned to the ordered consumer");
                Ok(leases.into_iter().filter_map(from_remote_lease).collect())
            }
            // Gone (stopped, or killed): this replica pulls itself; the server pins it once
            // the pin is free (at once after a clean stop, after the pin timeout after a kill),
            // and until then its pull waits there.
            Err(ForwardError::OwnerGone) => {
                debug!(%pinned, "the replica pinned to the ordered consumer is gone; pulling here");
                self.lease_here(demand).await
            }
            Err(ForwardError::TimedOut) => Err(Error::Unavailable(
                "the replica pinned to this ordered consumer did not answer in time".into(),
            )),
            Err(ForwardError::Unavailable(detail)) => Err(Error::Unavailable(detail)),
        }
    }

    /// A fetch another replica forwarded to this one, pinned to the ordered consumer.
    pub(crate) async fn fetch_forwarded(
        &self,
        demand: ForwardedDemand,
    ) -> Result<Vec<RemoteLease>, String> {
        let batch = demand.batch.clamp(1, STREAM_SLICE);
        let demand = Demand {
            batch,
            credit: batch,
            wait: Duration::from_millis(demand.wait_ms).min(self.config.max_wait),
            max_bytes: demand.max_bytes,
            stream: None,
            patient: false,
        };
        match self.lease_here(demand).await {
            Ok(leased) => Ok(leased.into_iter().map(to_remote_lease).collect()),
            Err(err) => Err(err.to_string()),
        }
    }

    /// Do what another replica forwarded, as if a client had asked here.
    pub(crate) async fn settle_forwarded(&self, payload: &[u8]) -> Vec<RemoteResult> {
        let request: ForwardedSettle = match serde_json::from_slice(payload) {
            Ok(request) => request,
            Err(err) => {
                debug!(error = %err, "unreadable forwarded settle");
                return Vec::new();
            }
        };
        let ids: Vec<&str> = request.ids.iter().map(String::as_str).collect();
        if request.kind == FINALS {
            // Only a question: how these messages ended here, if they did.
            return ids
                .iter()
                .map(|id| {
                    if *id == HIGHEST {
                        return RemoteResult::AlreadySettled {
                            settled: format!("{HIGHEST}:{}", self.state.highest_stream_sequence()),
                        };
                    }
                    let message = id.split_once('.').and_then(|(sequence, published)| {
                        Some(MessageKey {
                            stream_sequence: sequence.parse().ok()?,
                            published_unix_nanos: published.parse().ok()?,
                        })
                    });
                    match message.and_then(|message| self.state.final_of_message(message)) {
                        Some(Final::Acked) => RemoteResult::AlreadySettled {
                            settled: "ack".into(),
                        },
                        Some(Final::Terminated { .. }) => RemoteResult::AlreadySettled {
                            settled: "term".into(),
                        },
                        None => RemoteResult::Unknown,
                    }
                })
                .collect();
        }
        if request.kind == LIVE {
            // Only a question: nothing is settled or counted.
            let now = tokio::time::Instant::now();
            return ids
                .iter()
                .map(|id| {
                    let live = self.own_lease(id).is_some_and(|signed| {
                        signed.lease.epoch == self.state.epoch()
                            && self.state.leases().is_live(signed.lease.key, now)
                    });
                    if live {
                        RemoteResult::Ok {
                            expires_at_unix_ms: None,
                        }
                    } else {
                        RemoteResult::Gone
                    }
                })
                .collect();
        }
        let results: Vec<Settled> = match command_of(&request) {
            None => ids.iter().map(|_| Err(Error::UnknownLease)).collect(),
            Some(AckCommand::InProgress) => {
                let extensions = ids.iter().map(|id| async move {
                    let signed = self.own_lease(id);
                    self.extend_by(id, signed, self.confirmation_deadline())
                        .await
                        .map(Some)
                });
                futures::future::join_all(extensions).await
            }
            Some(command) => {
                let leases: Vec<(&str, Option<SignedLease>)> =
                    ids.iter().map(|id| (*id, self.own_lease(id))).collect();
                self.settle_many_here(&leases, &command)
                    .await
                    .into_iter()
                    .map(|result| result.map(|()| None))
                    .collect()
            }
        };
        results
            .into_iter()
            .map(|result| {
                self.state
                    .metrics
                    .forwarded_settle_received(outcome_of(&result));
                to_remote(result)
            })
            .collect()
    }

    /// A forwarded id, decoded only if this replica issued it: an id forwarded here by
    /// mistake is not passed on again.
    fn own_lease(&self, id: &str) -> Option<SignedLease> {
        self.state
            .signer()
            .decode(id)
            .filter(|signed| signed.owner == self.process.instance)
    }
}
