//! What replicas exchange, translated: settle commands and their answers to and from the
//! forwarded form, and a batch's ids grouped by the replica that issued each.
//!
//! May import: as the rest of `gateway`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use bytes::Bytes;
use time::OffsetDateTime;
use tokio::time::Instant;

use crate::domain::delivery::{Delivery, Leased, Unparsed};
use crate::domain::lease_id::{DeliveryKey, LeaseCoordinates};

use crate::domain::lease_id::{InstanceId, SignedLease};
use crate::domain::settle::{AckCommand, SettleKind};
use crate::error::Error;
use crate::metrics::SettleOutcome;
use crate::nats::forward::{ForwardedSettle, RemoteLease, RemoteResult};

/// What a settle of one lease came to, at whichever replica did it: `Some(expiry)` for an
/// extension.
pub(super) type Settled = Result<Option<OffsetDateTime>, Error>;

/// Group `ids` (positions into them) by the replica that issued each; `None`: this one, or
/// no genuine id at all (answered here, 404, without forwarding).
pub(super) fn by_owner(
    leases: &[(&str, Option<SignedLease>)],
    me: InstanceId,
) -> (Vec<usize>, HashMap<InstanceId, Vec<usize>>) {
    let mut here = Vec::new();
    let mut elsewhere: HashMap<InstanceId, Vec<usize>> = HashMap::new();
    for (at, (_, lease)) in leases.iter().enumerate() {
        match lease {
            Some(lease) if lease.owner != me => elsewhere.entry(lease.owner).or_default().push(at),
            _ => here.push(at),
        }
    }
    (here, elsewhere)
}

pub(super) fn request_kind(command: &AckCommand) -> &'static str {
    match command {
        AckCommand::Ack => "ack",
        AckCommand::Nak { .. } => "nak",
        AckCommand::Term { .. } => "term",
        AckCommand::InProgress => "in_progress",
    }
}

pub(super) fn forwarded(command: &AckCommand, ids: &[&str]) -> ForwardedSettle {
    let (delay_ms, reason) = match command {
        AckCommand::Nak { delay } => (
            delay.map(|delay| u64::try_from(delay.as_millis()).unwrap_or(u64::MAX)),
            None,
        ),
        AckCommand::Term { reason } => (None, reason.clone()),
        AckCommand::Ack | AckCommand::InProgress => (None, None),
    };
    ForwardedSettle {
        kind: request_kind(command).to_owned(),
        delay_ms,
        reason,
        ids: ids.iter().map(|id| (*id).to_owned()).collect(),
        fetch: None,
    }
}

/// A lease issued here for a fetch another replica forwarded, as it travels back.
pub(super) fn to_remote_lease(leased: Leased) -> RemoteLease {
    let delivery = leased.delivery;
    let headers = delivery
        .headers
        .as_ref()
        .map(|map| {
            map.iter()
                .map(|(name, values)| {
                    (
                        name.to_string(),
                        values.iter().map(ToString::to_string).collect(),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    RemoteLease {
        id: leased.id,
        subject: delivery.subject.to_string(),
        subject_raw: delivery.unparsed.subject.map(|raw| STANDARD.encode(raw)),
        payload: STANDARD.encode(&delivery.payload),
        headers,
        headers_raw: delivery.unparsed.headers.map(|raw| STANDARD.encode(raw)),
        stream: delivery.stream,
        consumer: delivery.consumer,
        stream_sequence: delivery.coordinates.key.stream_sequence,
        consumer_sequence: delivery.coordinates.consumer_sequence,
        delivered: delivery.coordinates.key.delivered,
        pending: delivery.pending,
        published_unix_nanos: delivery.coordinates.published_unix_nanos,
        expires_in_ms: u64::try_from(
            leased
                .expires_at
                .saturating_duration_since(Instant::now())
                .as_millis(),
        )
        .unwrap_or(u64::MAX),
    }
}

/// A lease the pinned replica issued, as this replica hands it to its client: settles of it
/// are forwarded back there (its id names that replica), so it carries no reply subject.
/// `None` for one that makes no sense (not base64).
pub(super) fn from_remote_lease(remote: RemoteLease) -> Option<Leased> {
    let raw = |text: Option<String>| -> Option<Option<Bytes>> {
        match text {
            None => Some(None),
            Some(text) => STANDARD.decode(text).ok().map(|raw| Some(Bytes::from(raw))),
        }
    };
    let mut headers = async_nats::HeaderMap::new();
    for (name, values) in &remote.headers {
        for value in values {
            headers.append(name.as_str(), value.as_str());
        }
    }
    let delivery = Delivery {
        coordinates: LeaseCoordinates {
            epoch: 0,
            key: DeliveryKey {
                stream_sequence: remote.stream_sequence,
                delivered: remote.delivered,
            },
            consumer_sequence: remote.consumer_sequence,
            published_unix_nanos: remote.published_unix_nanos,
        },
        reply: Arc::from(""),
        subject: remote.subject.into(),
        payload: Bytes::from(STANDARD.decode(remote.payload).ok()?),
        headers: (!remote.headers.is_empty()).then_some(headers),
        unparsed: Unparsed {
            subject: raw(remote.subject_raw)?,
            headers: raw(remote.headers_raw)?,
        },
        stream: remote.stream,
        consumer: remote.consumer,
        pending: remote.pending,
        published_at: OffsetDateTime::from_unix_timestamp_nanos(i128::from(
            remote.published_unix_nanos,
        ))
        .unwrap_or(OffsetDateTime::UNIX_EPOCH),
        received_at: Instant::now(),
    };
    Some(Leased {
        id: remote.id,
        delivery,
        expires_at: Instant::now() + Duration::from_millis(remote.expires_in_ms),
    })
}

pub(super) fn command_of(request: &ForwardedSettle) -> Option<AckCommand> {
    match request.kind.as_str() {
        "ack" => Some(AckCommand::Ack),
        "nak" => Some(AckCommand::Nak {
            delay: request.delay_ms.map(Duration::from_millis),
        }),
        "term" => Some(AckCommand::Term {
            reason: request.reason.clone(),
        }),
        "in_progress" => Some(AckCommand::InProgress),
        _ => None,
    }
}

fn settle_kind(name: &str) -> Option<SettleKind> {
    match name {
        "ack" => Some(SettleKind::Ack),
        "nak" => Some(SettleKind::Nak),
        "term" => Some(SettleKind::Term),
        _ => None,
    }
}

pub(super) fn to_remote(result: Settled) -> RemoteResult {
    match result {
        Ok(expires_at) => RemoteResult::Ok {
            expires_at_unix_ms: expires_at
                .map(|at| i64::try_from(at.unix_timestamp_nanos() / 1_000_000).unwrap_or(i64::MAX)),
        },
        Err(Error::AlreadySettled { settled }) => RemoteResult::AlreadySettled {
            settled: settled.as_str().to_owned(),
        },
        Err(Error::LeaseGone | Error::OwnerGone) => RemoteResult::Gone,
        Err(Error::UnknownLease) => RemoteResult::Unknown,
        Err(Error::TimedOut) => RemoteResult::Timeout,
        Err(other) => RemoteResult::Unavailable {
            detail: other.to_string(),
        },
    }
}

pub(super) fn from_remote(result: RemoteResult) -> Settled {
    match result {
        RemoteResult::Ok { expires_at_unix_ms } => Ok(expires_at_unix_ms.and_then(|ms| {
            OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000).ok()
        })),
        RemoteResult::AlreadySettled { settled } => match settle_kind(&settled) {
            Some(settled) => Err(Error::AlreadySettled { settled }),
            None => Err(Error::Unavailable(format!(
                "the owning replica answered an unknown settle kind {settled:?}"
            ))),
        },
        RemoteResult::Gone => Err(Error::LeaseGone),
        RemoteResult::Unknown => Err(Error::UnknownLease),
        RemoteResult::Timeout => Err(Error::TimedOut),
        RemoteResult::Unavailable { detail } => Err(Error::Unavailable(detail)),
    }
}

pub(super) fn outcome_of(result: &Settled) -> SettleOutcome {
    match result {
        Ok(_) => SettleOutcome::Ok,
        Err(err) => settle_outcome(err),
    }
}

/// The outcome a failed settle reports in the metrics.
pub(super) fn settle_outcome(err: &Error) -> SettleOutcome {
    match err {
        Error::AlreadySettled { .. } => SettleOutcome::AlreadySettled,
        Error::LeaseGone | Error::OwnerGone => SettleOutcome::Gone,
        Error::UnknownLease => SettleOutcome::Unknown,
        Error::TimedOut => SettleOutcome::Timeout,
        Error::Unavailable(_) | Error::ShuttingDown => SettleOutcome::Unavailable,
        _ => SettleOutcome::Error,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_answer_crosses_the_wire_unchanged() {
        let at = OffsetDateTime::from_unix_timestamp(1_800_000_000).expect("valid time");
        let answers: Vec<Settled> = vec![
            Ok(None),
            Ok(Some(at)),
            Err(Error::AlreadySettled {
                settled: SettleKind::Nak,
            }),
            Err(Error::LeaseGone),
            Err(Error::UnknownLease),
            Err(Error::TimedOut),
            Err(Error::Unavailable("NATS is down".into())),
        ];
        for answer in answers {
            let wire = serde_json::to_vec(&to_remote(answer.clone())).expect("encodes");
            let back = from_remote(serde_json::from_slice(&wire).expect("decodes"));
            assert_eq!(format!("{back:?}"), format!("{answer:?}"));
        }
    }

    #[test]
    fn commands_cross_the_wire_unchanged() {
        for command in [
            AckCommand::Ack,
            AckCommand::Nak { delay: None },
            AckCommand::Nak {
                delay: Some(Duration::from_millis(1500)),
            },
            AckCommand::Term { reason: None },
            AckCommand::Term {
                reason: Some("bad payload".into()),
            },
            AckCommand::InProgress,
        ] {
            let request = forwarded(&command, &["id"]);
            let wire = serde_json::to_vec(&request).expect("encodes");
            let back = command_of(&serde_json::from_slice(&wire).expect("decodes"));
            assert_eq!(format!("{back:?}"), format!("{:?}", Some(command)));
        }
    }

    #[test]
    fn ids_are_grouped_by_the_replica_that_issued_them() {
        use crate::domain::lease_id::{DeliveryKey, LeaseCoordinates};
        let lease = |owner| {
            Some(SignedLease {
                owner: InstanceId(owner),
                lease: LeaseCoordinates {
                    epoch: 1,
                    key: DeliveryKey {
                        stream_sequence: 1,
                        delivered: 1,
                    },
                    consumer_sequence: 1,
                    published_unix_nanos: 0,
                },
                issued_expiry_unix_ms: None,
            })
        };
        let (here, elsewhere) = by_owner(
            &[
                ("a", lease(1)),
                ("b", lease(2)),
                ("c", None),
                ("d", lease(3)),
                ("e", lease(2)),
            ],
            InstanceId(1),
        );
        assert_eq!(here, vec![0, 2]);
        assert_eq!(elsewhere[&InstanceId(2)], vec![1, 4]);
        assert_eq!(elsewhere[&InstanceId(3)], vec![3]);
    }
}
