//! Publishing to the stream (`POST /publish`) and reading the consumer's server-side state
//! (`GET /consumer`): JetStream API calls on a request path, each bounded in time.
//!
//! May import: nothing of the gateway above the NATS boundary.

use std::time::Duration;

use anyhow::Context as _;
use std::error::Error as _;

use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use async_nats::jetstream::{self, ErrorCode, consumer};
use bytes::Bytes;

use super::{API_TIMEOUT, Bound};

/// Server-side view of the consumer.
pub(crate) async fn consumer_info(bound: &Bound) -> anyhow::Result<consumer::Info> {
    let mut consumer = bound.consumer.clone();
    let info = tokio::time::timeout(API_TIMEOUT, consumer.info())
        .await
        .context("timed out asking for consumer info")?
        .context("asking for consumer info")?;
    Ok(info.clone())
}

/// Why the stream did not store a published message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PublishFailure {
    /// An expectation the publisher set did not hold (`Nats-Expected-Stream`,
    /// `Nats-Expected-Last-Sequence`, `-Last-Subject-Sequence`, `-Last-Msg-Id`); the
    /// sequence the server compared with, when it said (`wrong last sequence: N`).
    Expectation {
        detail: String,
        last_sequence: Option<u64>,
    },
    /// The stream refused the message itself: a header it does not allow (`Nats-Rollup`
    /// without rollups, a malformed directive) or its size.
    Refused(String),
    /// The stream's configuration does not allow what the message asks for: the setting
    /// that would (`allow_msg_ttl`, `allow_atomic`, `allow_msg_schedules`).
    Disallowed {
        setting: &'static str,
        detail: String,
    },
    /// An atomic batch whose `Nats-Msg-Id`s the stream already has: stored before (a
    /// retry), so nothing was stored now.
    AlreadyStored(String),
    /// NATS is unreachable, slow, or the stream has no leader; retrying may succeed.
    Unavailable(String),
}

/// The stream that captures `subject`, if one does.
pub(crate) async fn stream_capturing(
    js: &jetstream::Context,
    subject: &str,
) -> Result<Option<String>, PublishFailure> {
    use jetstream::context::GetStreamByNameErrorKind;
    match tokio::time::timeout(API_TIMEOUT, js.stream_by_subject(subject)).await {
        Err(_) => Err(PublishFailure::Unavailable(
            "timed out looking for the stream of the subject".into(),
        )),
        Ok(Ok(stream)) => Ok(Some(stream)),
        Ok(Err(err)) if matches!(err.kind(), GetStreamByNameErrorKind::NotFound) => Ok(None),
        Ok(Err(err)) => Err(PublishFailure::Unavailable(format!(
            "looking for the stream of the subject: {err}"
        ))),
    }
}

/// A message sent to the stream whose acknowledgement is still to come: a batch sends all
/// its messages before it awaits the first acknowledgement.
pub(crate) struct SentPublish {
    ack: jetstream::context::PublishAckFuture,
    timeout: Duration,
}

impl SentPublish {
    /// Wait for the stream's acknowledgement.
    pub(crate) async fn confirmed(self) -> Result<jetstream::publish::PublishAck, PublishFailure> {
        tokio::time::timeout(self.timeout, self.ack.into_future())
            .await
            .map_err(|_| PublishFailure::Unavailable("the stream did not answer in time".into()))?
            .map_err(|err| classify(&err))
    }
}

/// Where a published message goes: the stream that stores it and the JetStream context
/// that sends it there.
#[derive(Clone)]
pub(crate) struct Route {
    js: jetstream::Context,
    /// The stream that captures the subject.
    pub(crate) stream: String,
    /// Whether to send `Nats-Expected-Stream` (the stream was looked up by subject, not
    /// bound: the server checks it is still the one).
    expect_stream: bool,
    timeout: Duration,
}

impl Route {
    /// To the stream `bound` reads.
    pub(crate) fn bound(bound: &Bound, stream: &str, timeout: Duration) -> Self {
        Self {
            js: bound.jetstream.clone(),
            stream: stream.to_owned(),
            expect_stream: false,
            timeout,
        }
    }

    /// To `stream`, found by its subjects.
    pub(crate) fn looked_up(js: jetstream::Context, stream: String, timeout: Duration) -> Self {
        Self {
            js,
            stream,
            expect_stream: true,
            timeout,
        }
    }

    /// Send a message, not waiting for its acknowledgement.
    pub(crate) async fn send(
        &self,
        subject: String,
        mut headers: async_nats::HeaderMap,
        payload: Bytes,
    ) -> Result<SentPublish, PublishFailure> {
        if self.expect_stream {
            headers.insert("Nats-Expected-Stream", self.stream.as_str());
        }
        let ack = tokio::time::timeout(
            self.timeout,
            self.js.publish_with_headers(subject, headers, payload),
        )
        .await
        .map_err(|_| {
            PublishFailure::Unavailable("the stream did not take the message in time".into())
        })?
        .map_err(|err| classify(&err))?;
        Ok(SentPublish {
            ack,
            timeout: self.timeout,
        })
    }

    /// Publish `messages` as one atomic batch (nats-server 2.12+, the stream's
    /// `allow_atomic`): the first as a request (the server says at once whether it takes the
    /// batch), the middle ones without a reply, the last with the commit; the stream stores
    /// all of them or none.
    pub(crate) async fn publish_atomic(
        &self,
        messages: Vec<(String, async_nats::HeaderMap, Bytes)>,
    ) -> Result<BatchAck, PublishFailure> {
        let client = self.js.client();
        let batch_id = batch_id();
        let count = messages.len();
        let unavailable = |what: String| PublishFailure::Unavailable(what);
        for (index, (subject, mut headers, payload)) in messages.into_iter().enumerate() {
            headers.insert("Nats-Batch-Id", batch_id.as_str());
            headers.insert("Nats-Batch-Sequence", (index + 1).to_string().as_str());
            if self.expect_stream {
                headers.insert("Nats-Expected-Stream", self.stream.as_str());
            }
            let last = index + 1 == count;
            if last {
                headers.insert("Nats-Batch-Commit", "1");
            }
            if index > 0 && !last {
                client
                    .publish_with_headers(subject, headers, payload)
                    .await
                    .map_err(|err| unavailable(format!("sending the batch failed: {err}")))?;
                continue;
            }
            let reply = tokio::time::timeout(
                self.timeout,
                client.request_with_headers(subject, headers, payload),
            )
            .await
            .map_err(|_| {
                unavailable(
                    "the stream did not answer the batch in time; it may or may not be stored: retry it with the same msg ids".into(),
                )
            })?
            .map_err(|err| {
                unavailable(format!(
                    "the batch was not confirmed ({err}); it may or may not be stored: retry it with the same msg ids"
                ))
            })?;
            // The first message's answer is empty when the stream takes the batch.
            if !last && reply.payload.is_empty() {
                continue;
            }
            match serde_json::from_slice::<jetstream::response::Response<BatchAck>>(&reply.payload)
            {
                Ok(jetstream::response::Response::Ok(ack)) if last => return Ok(ack),
                Ok(jetstream::response::Response::Err { error }) => {
                    return Err(classify(&PublishError::with_source(
                        PublishErrorKind::Other,
                        error,
                    )));
                }
                _ => {
                    return Err(unavailable(
                        "the stream answered the batch in a way this gateway does not know".into(),
                    ));
                }
            }
        }
        Err(unavailable(
            "an atomic batch needs at least one message".into(),
        ))
    }

    /// The JetStream context it publishes through.
    pub(crate) fn jetstream(&self) -> &jetstream::Context {
        &self.js
    }

    /// Whether both routes go to the same stream.
    pub(crate) fn same_stream(&self, other: &Self) -> bool {
        self.stream == other.stream
    }
}

/// The stream's answer to a committed atomic batch.
#[derive(Debug, serde::Deserialize)]
pub(crate) struct BatchAck {
    pub(crate) stream: String,
    /// The sequence of the batch's last message.
    #[serde(rename = "seq")]
    pub(crate) last_sequence: u64,
    /// How many messages the batch stored.
    pub(crate) count: u64,
}

/// A batch id nobody else uses (32 hex digits; the server takes up to 64 characters).
fn batch_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// A client error (the publisher's headers or message) or an outage, by the JetStream error
/// code the stream answered with.
fn classify(err: &PublishError) -> PublishFailure {
    let refused = |what: &dyn std::fmt::Display| format!("the stream refused the message: {what}");
    match err.kind() {
        PublishErrorKind::WrongLastMessageId | PublishErrorKind::WrongLastSequence => {
            let said = source_or_kind(err);
            PublishFailure::Expectation {
                last_sequence: last_sequence_in(&said),
                detail: refused(&said),
            }
        }
        PublishErrorKind::MaxPayloadExceeded => {
            PublishFailure::Refused(refused(&"larger than the server's max_payload"))
        }
        PublishErrorKind::Other => match err
            .source()
            .and_then(|source| source.downcast_ref::<jetstream::Error>())
        {
            // A retry racing its first attempt (a leader change in between): the first may
            // still be stored, and a retry with the same id then answers as it did.
            Some(api) if api.error_code() == ErrorCode::STREAM_DUPLICATE_MESSAGE_CONFLICT => {
                PublishFailure::Unavailable(format!(
                    "the stream is still storing an earlier publish with this Nats-Msg-Id; retry: {api}"
                ))
            }
            Some(api)
                if api.error_code() == ErrorCode::ATOMIC_PUBLISH_CONTAINS_DUPLICATE_MESSAGE =>
            {
                PublishFailure::AlreadyStored(format!(
                    "the stream already has messages with this batch's msg ids (stored by an earlier attempt); nothing was stored now: {api}"
                ))
            }
            // By the JetStream error code first: the server answers some refusals of the
            // message itself (a rollup the stream does not allow) with a 500.
            Some(api) if EXPECTATIONS.contains(&api.error_code()) => PublishFailure::Expectation {
                last_sequence: last_sequence_in(&api.to_string()),
                detail: refused(api),
            },
            Some(api)
                if REFUSALS.contains(&api.error_code()) || (400..500).contains(&api.code()) =>
            {
                match setting_to_allow(api.error_code()) {
                    Some(setting) => PublishFailure::Disallowed {
                        setting,
                        detail: refused(api),
                    },
                    None => PublishFailure::Refused(refused(api)),
                }
            }
            Some(api) => PublishFailure::Unavailable(format!("the stream is unavailable: {api}")),
            None => PublishFailure::Unavailable(format!("publishing failed: {err}")),
        },
        PublishErrorKind::StreamNotFound => {
            PublishFailure::Unavailable("no stream answered for the subject".into())
        }
        PublishErrorKind::TimedOut
        | PublishErrorKind::BrokenPipe
        | PublishErrorKind::MaxAckPending => {
            PublishFailure::Unavailable(format!("publishing failed: {}", err.kind()))
        }
    }
}

/// The stream setting whose absence the JetStream error `code` reports.
fn setting_to_allow(code: ErrorCode) -> Option<&'static str> {
    match code {
        ErrorCode::MESSAGE_TTL_DISABLED => Some("allow_msg_ttl"),
        ErrorCode::ATOMIC_PUBLISH_DISABLED => Some("allow_atomic"),
        ErrorCode::MESSAGE_SCHEDULES_DISABLED => Some("allow_msg_schedules"),
        _ => None,
    }
}

/// The sequence in the server's `wrong last sequence: N`: the stream's last sequence for
/// `Nats-Expected-Last-Sequence`, the subject's for `-Last-Subject-Sequence`.
fn last_sequence_in(said: &str) -> Option<u64> {
    let (_, rest) = said.split_once("wrong last sequence: ")?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// JetStream error codes of expectations that did not hold.
const EXPECTATIONS: [ErrorCode; 4] = [
    ErrorCode::STREAM_WRONG_LAST_MESSAGE_ID,
    ErrorCode::STREAM_WRONG_LAST_SEQUENCE,
    ErrorCode::STREAM_WRONG_LAST_SEQUENCE_CONSTANT,
    ErrorCode::STREAM_NOT_MATCH,
];

/// JetStream error codes of a message the stream refuses for what the publisher sent:
/// retrying it unchanged cannot succeed, whatever HTTP-like code the server gave.
const REFUSALS: [ErrorCode; 23] = [
    ErrorCode::BAD_REQUEST,
    ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM,
    ErrorCode::STREAM_HEADER_EXCEEDS_MAXIMUM,
    ErrorCode::STREAM_SEALED,
    ErrorCode::STREAM_ROLLUP_FAILED,
    ErrorCode::MESSAGE_TTL_INVALID,
    ErrorCode::MESSAGE_TTL_DISABLED,
    ErrorCode::MESSAGE_INCR_DISABLED,
    ErrorCode::MESSAGE_INCR_MISSING,
    ErrorCode::MESSAGE_INCR_PAYLOAD,
    ErrorCode::MESSAGE_INCR_INVALID,
    ErrorCode::ATOMIC_PUBLISH_DISABLED,
    ErrorCode::ATOMIC_PUBLISH_MISSING_SEQ,
    ErrorCode::ATOMIC_PUBLISH_INCOMPLETE_BATCH,
    ErrorCode::ATOMIC_PUBLISH_UNSUPPORTED_HEADER,
    ErrorCode::ATOMIC_PUBLISH_INVALID_BATCH_ID,
    ErrorCode::MESSAGE_SCHEDULES_DISABLED,
    ErrorCode::MESSAGE_SCHEDULES_PATTERN_INVALID,
    ErrorCode::MESSAGE_SCHEDULES_TARGET_INVALID,
    ErrorCode::MESSAGE_SCHEDULES_TTL_INVALID,
    ErrorCode::MESSAGE_SCHEDULES_ROLLUP_INVALID,
    ErrorCode::STREAM_EXPECTED_LAST_SEQ_PER_SUBJECT_INVALID,
    ErrorCode::INVALID_JSON,
];

/// The JetStream error behind `err`, or its kind when it has none.
fn source_or_kind(err: &PublishError) -> String {
    err.source()
        .and_then(|source| source.downcast_ref::<jetstream::Error>())
        .map_or_else(|| err.kind().to_string(), ToString::to_string)
}

/// Give the consumer in use a new ack_wait and max_ack_pending (the server takes both on a
/// live consumer); the rest of its config stays as the server has it.
pub(crate) async fn update_settings(
    bound: &Bound,
    stream: &str,
    ack_wait: Duration,
    max_ack_pending: u32,
) -> anyhow::Result<()> {
    let stream = tokio::time::timeout(API_TIMEOUT, bound.jetstream.get_stream_no_info(stream))
        .await
        .context("timed out looking up the stream")?
        .context("looking up the stream")?;
    let mut config = consumer_info(bound).await?.config;
    config.ack_wait = ack_wait;
    config.max_ack_pending = i64::from(max_ack_pending);
    tokio::time::timeout(API_TIMEOUT, stream.update_consumer(config))
        .await
        .context("timed out updating the consumer's settings")?
        .context("updating the consumer's settings")?;
    Ok(())
}

/// Pause the consumer at the server until `until`, or resume it (`None`): the server's pause
/// holds for every replica and survives restarts. The pause the server now has (`None`: not
/// paused).
pub(crate) async fn pause_consumer(
    bound: &Bound,
    stream: &str,
    until: Option<time::OffsetDateTime>,
) -> anyhow::Result<Option<time::OffsetDateTime>> {
    let stream = tokio::time::timeout(API_TIMEOUT, bound.jetstream.get_stream_no_info(stream))
        .await
        .context("timed out looking up the stream")?
        .context("looking up the stream")?;
    let asked = async {
        match until {
            Some(until) => stream.pause_consumer(&bound.consumer_name, until).await,
            None => stream.resume_consumer(&bound.consumer_name).await,
        }
    };
    let response = tokio::time::timeout(API_TIMEOUT, asked)
        .await
        .context("timed out asking the server to pause or resume the consumer")?
        .context("pausing or resuming the consumer")?;
    Ok(response.paused.then_some(response.pause_until))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answered(code: usize, err_code: u64, description: &str) -> PublishFailure {
        let api: jetstream::Error = serde_json::from_value(serde_json::json!({
            "code": code, "err_code": err_code, "description": description
        }))
        .expect("a JetStream API error");
        classify(&PublishError::with_source(PublishErrorKind::Other, api))
    }

    #[test]
    fn a_retry_racing_its_first_attempt_is_transient_not_the_publishers_fault() {
        assert!(matches!(
            answered(409, 10158, "duplicate message id is in process"),
            PublishFailure::Unavailable(_)
        ));
        // Other 4xx refusals stay the publisher's.
        assert!(matches!(
            answered(400, 10054, "message size exceeds maximum allowed"),
            PublishFailure::Refused(_)
        ));
        assert!(matches!(
            answered(400, 10071, "wrong last sequence: 3"),
            PublishFailure::Expectation {
                last_sequence: Some(3),
                ..
            }
        ));
        assert!(matches!(
            answered(400, 10166, "per-message TTL is disabled"),
            PublishFailure::Disallowed {
                setting: "allow_msg_ttl",
                ..
            }
        ));
    }
}
