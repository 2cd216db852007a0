//! Settles forwarded between replicas over NATS request/reply: only the replica that issued
//! a lease knows whether it is still live (nak'd, expired, superseded), and the server
//! accepts stale acks, so a replica that gets a settle for another's lease sends it to the
//! owner's subject ([`super::replicas::Subjects::settle`]) and answers what the owner
//! answered. The wire form is JSON; the signed lease ids travel as they came, and the owner
//! verifies them again. Requests and answers are sealed ([`super::trust`]): a forged answer
//! is dropped (the settle answers 503, never a forged outcome), and so is a forged request.
//!
//! May import: `domain`. Nothing of the gateway above the boundary.

use std::time::Duration;

use async_nats::{Client, HeaderMap, RequestErrorKind, Subscriber};
use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::domain::lease_id::InstanceId;
use crate::domain::seal::Kind;

use super::trust::Trust;

/// A forwarded settle sealed longer ago than this is a replay (or a clock far off).
const MAX_AGE: Duration = Duration::from_secs(10);

/// A settle (or extension) of one owner's leases.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ForwardedSettle {
    /// `ack`, `nak`, `term` or `in_progress`; or `live`, which only asks which of the
    /// leases are live (answered `ok` or `gone`, nothing settled).
    pub(crate) kind: String,
    /// A nak's delay.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) delay_ms: Option<u64>,
    /// A term's reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) reason: Option<String>,
    pub(crate) ids: Vec<String>,
    /// Kind `fetch`: a fetch forwarded to the replica pinned to an ordered consumer, which
    /// alone leases its messages (`ids` is empty).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) fetch: Option<ForwardedDemand>,
}

/// The kind of a forwarded fetch.
pub(crate) const FETCH: &str = "fetch";

/// What a forwarded fetch asks for.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ForwardedDemand {
    pub(crate) batch: usize,
    pub(crate) wait_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) max_bytes: Option<usize>,
}

/// A lease the pinned replica issued for a forwarded fetch, as it travels back: the
/// message, its lease id, and how long the lease has left (clocks of two replicas need
/// not agree; the time a message spends on the wire only shortens it).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct RemoteLease {
    pub(crate) id: String,
    pub(crate) subject: String,
    /// The subject's exact bytes (base64), when they are not UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) subject_raw: Option<String>,
    /// The payload, base64.
    pub(crate) payload: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) headers: Vec<(String, Vec<String>)>,
    /// The header block's exact bytes (base64), when it could not be parsed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) headers_raw: Option<String>,
    pub(crate) stream: String,
    pub(crate) consumer: String,
    pub(crate) stream_sequence: u64,
    pub(crate) consumer_sequence: u64,
    pub(crate) delivered: u64,
    pub(crate) pending: u64,
    pub(crate) published_unix_nanos: i64,
    pub(crate) expires_in_ms: u64,
}

/// The owner's answer for one id, in the order of the request's ids.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub(crate) enum RemoteResult {
    /// Confirmed by the server; an extension says until when (Unix milliseconds).
    Ok {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        expires_at_unix_ms: Option<i64>,
    },
    /// Settled before with `settled` (ack, nak or term).
    AlreadySettled {
        settled: String,
    },
    Gone,
    Unknown,
    Timeout,
    Unavailable {
        detail: String,
    },
}

/// The owner's whole answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ForwardedResults {
    pub(crate) results: Vec<RemoteResult>,
    /// A forwarded fetch's leases; absent when it failed (then `results` says why).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) leases: Option<Vec<RemoteLease>>,
}

/// Why a forwarded settle got no answer from its owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ForwardError {
    /// Nobody listens on the owner's subject: the replica is gone.
    OwnerGone,
    /// The owner did not answer in time (stalled, or its server slow).
    TimedOut,
    /// Not connected, or an answer that makes no sense.
    Unavailable(String),
}

/// Send `settle` to `owner`, listening on `subject`, and wait up to `timeout` for its
/// answer: one result per id.
pub(crate) async fn forward(
    client: &Client,
    trust: &Trust,
    to: (InstanceId, String),
    settle: &ForwardedSettle,
    timeout: Duration,
) -> Result<Vec<RemoteResult>, ForwardError> {
    let results = ask(client, trust, to, settle, timeout).await?;
    if results.results.len() != settle.ids.len() {
        return Err(ForwardError::Unavailable(format!(
            "the owning replica answered {} results for {} ids",
            results.results.len(),
            settle.ids.len()
        )));
    }
    Ok(results.results)
}

/// Send a fetch to the replica pinned to an ordered consumer and wait up to `timeout` for
/// the leases it issued.
pub(crate) async fn forward_fetch(
    client: &Client,
    trust: &Trust,
    to: (InstanceId, String),
    demand: ForwardedDemand,
    timeout: Duration,
) -> Result<Vec<RemoteLease>, ForwardError> {
    let request = ForwardedSettle {
        kind: FETCH.to_owned(),
        delay_ms: None,
        reason: None,
        ids: Vec::new(),
        fetch: Some(demand),
    };
    let answer = ask(client, trust, to, &request, timeout).await?;
    match (answer.leases, answer.results.into_iter().next()) {
        (Some(leases), _) => Ok(leases),
        (None, Some(RemoteResult::Unavailable { detail })) => {
            Err(ForwardError::Unavailable(detail))
        }
        (None, Some(RemoteResult::Timeout)) => Err(ForwardError::TimedOut),
        (None, _) => Err(ForwardError::Unavailable(
            "the pinned replica does not serve forwarded fetches (an earlier release?)".into(),
        )),
    }
}

/// Send `request` to its owner, sealed, and read its sealed answer.
async fn ask(
    client: &Client,
    trust: &Trust,
    (owner, subject): (InstanceId, String),
    settle: &ForwardedSettle,
    timeout: Duration,
) -> Result<ForwardedResults, ForwardError> {
    if !super::is_connected(client) {
        return Err(ForwardError::Unavailable(
            "the connection to NATS is down; retrying".into(),
        ));
    }
    let payload = serde_json::to_vec(settle)
        .map_err(|err| ForwardError::Unavailable(format!("encoding a forwarded settle: {err}")))?;
    let mut headers = HeaderMap::new();
    trust.seal(Kind::ForwardedSettle, &subject, &[&payload], &mut headers);
    // Outside the seal: it only decides where the owner's spans go in a trace.
    crate::telemetry::spans::inject_forward(&mut headers);
    let request = async_nats::Request::new()
        .payload(Bytes::from(payload))
        .headers(headers)
        .timeout(Some(timeout));
    let answer = client
        .send_request(subject, request)
        .await
        .map_err(|err| match err.kind() {
            RequestErrorKind::NoResponders => ForwardError::OwnerGone,
            RequestErrorKind::TimedOut => ForwardError::TimedOut,
            _ => ForwardError::Unavailable(format!("forwarding the settle failed: {err}")),
        })?;
    if !trust.believe(
        Kind::ForwardedAnswer,
        answer.subject.as_str(),
        &[&answer.payload],
        answer.headers.as_ref(),
        MAX_AGE,
        Some(owner),
    ) {
        return Err(ForwardError::Unavailable(
            "the answer to a forwarded settle was not sealed by the replica that issued the lease; retrying is safe".into(),
        ));
    }
    serde_json::from_slice(&answer.payload).map_err(|err| {
        ForwardError::Unavailable(format!(
            "the owning replica answered something unreadable: {err}"
        ))
    })
}

/// Listen for settles forwarded to this replica. async-nats renews the subscription after
/// every reconnect.
pub(crate) async fn listen(client: &Client, subject: String) -> anyhow::Result<Subscriber> {
    client
        .subscribe(subject.clone())
        .await
        .map_err(|err| anyhow::anyhow!("subscribing to {subject}: {err}"))
}

/// Whether to act on a forwarded settle that came on `message`: sealed by a replica.
pub(crate) fn believe(trust: &Trust, message: &async_nats::Message) -> bool {
    trust.believe(
        Kind::ForwardedSettle,
        message.subject.as_str(),
        &[&message.payload],
        message.headers.as_ref(),
        MAX_AGE,
        None,
    )
}

/// Answer a forwarded settle (or, with `leases`, a forwarded fetch).
pub(crate) async fn answer(
    client: &Client,
    trust: &Trust,
    reply: async_nats::Subject,
    results: Vec<RemoteResult>,
    leases: Option<Vec<RemoteLease>>,
) {
    let payload = match serde_json::to_vec(&ForwardedResults { results, leases }) {
        Ok(payload) => payload,
        Err(err) => {
            tracing::error!(error = %err, "could not encode the answer to a forwarded settle");
            return;
        }
    };
    let mut headers = HeaderMap::new();
    trust.seal(
        Kind::ForwardedAnswer,
        reply.as_str(),
        &[&payload],
        &mut headers,
    );
    if let Err(err) = client
        .publish_with_headers(reply, headers, payload.into())
        .await
    {
        tracing::warn!(error = %err, "could not answer a forwarded settle; its replica answers 504");
    }
}
