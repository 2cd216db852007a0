//! Dead letters: a message JetStream gives up on (max_deliver exhausted) or a client
//! terminated is republished, with its headers and delivery metadata, to `--dead-letter-subject`.
//!
//! JetStream itself only emits an advisory (`MAX_DELIVERIES`, `MSG_TERMINATED`) and leaves the
//! message in the stream, no longer tracked by the consumer. This task listens for both
//! advisories of the gateway's consumer, reads the message by stream sequence and publishes a
//! copy through JetStream with a `Nats-Msg-Id` derived from stream, consumer and sequence, so
//! the dead-letter stream stores it once even when the advisory is seen twice (two replicas,
//! a retry after a timeout) — within that stream's duplicate window (2 min by default).
//!
//! May import: `config`, `domain`, `metrics`. Nothing of the gateway above the boundary.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, stream::RawMessageErrorKind};
use async_nats::{Client, HeaderMap, HeaderValue};
use futures::StreamExt as _;
use serde::Deserialize;
use time::format_description::well_known::Rfc3339;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::metrics::Metrics;

/// Header names of the delivery metadata added to a dead letter.
pub mod headers {
    /// `max_deliveries` or `terminated`.
    pub const REASON: &str = "Ruststream-Dead-Letter-Reason";
    /// The reason a client gave with `term` (absent when none was given).
    pub const TERM_REASON: &str = "Ruststream-Dead-Letter-Term-Reason";
    /// The subject the message was published to.
    pub const SUBJECT: &str = "Ruststream-Dead-Letter-Subject";
    pub const STREAM: &str = "Ruststream-Dead-Letter-Stream";
    pub const STREAM_SEQUENCE: &str = "Ruststream-Dead-Letter-Stream-Sequence";
    pub const CONSUMER: &str = "Ruststream-Dead-Letter-Consumer";
    /// How many times the consumer delivered it.
    pub const DELIVERIES: &str = "Ruststream-Dead-Letter-Deliveries";
    /// When it was published to the source stream (RFC 3339).
    pub const PUBLISHED_AT: &str = "Ruststream-Dead-Letter-Published-At";
    /// Prefix for the original's own `Nats-*` headers, which are not copied as they are:
    /// they are publish directives (dedup id, expected sequence, rollup, TTL) that would act
    /// on the dead-letter stream.
    pub const ORIGINAL_PREFIX: &str = "Ruststream-Dead-Letter-Original-";
}

/// Reasons in [`headers::REASON`].
pub(crate) const REASON_MAX_DELIVERIES: &str = "max_deliveries";
pub(crate) const REASON_TERMINATED: &str = "terminated";

/// How many advisories are handled at once; more wait (the subscription buffers them).
const CONCURRENCY: usize = 16;
/// Each NATS call of one attempt is bounded by this.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// Retries of a failed attempt (NATS away, dead-letter stream leaderless) stop after this,
/// well inside the default 2-minute duplicate window that keeps retries from doubling.
const RETRY_FOR: Duration = Duration::from_secs(60);

/// Where the dead letters of which consumer go.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    pub(crate) stream: String,
    pub(crate) consumer: String,
    pub(crate) subject: String,
}

/// Why JetStream stopped delivering a message.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Cause {
    MaxDeliveries,
    Terminated { reason: Option<String> },
}

/// The fields of both advisories this task uses.
#[derive(Debug, Deserialize)]
struct Advisory {
    stream_seq: u64,
    #[serde(default)]
    deliveries: u64,
    #[serde(default)]
    reason: Option<String>,
}

fn advisory_subjects(target: &Target) -> [String; 2] {
    [
        format!(
            "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{}.{}",
            target.stream, target.consumer
        ),
        format!(
            "$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{}.{}",
            target.stream, target.consumer
        ),
    ]
}

/// Listen for the consumer's advisories until `stop`, dead-lettering each message named.
/// async-nats re-subscribes after a reconnect, so one subscription lasts the process.
pub(crate) async fn run<M>(client: Client, target: Target, metrics: M, stop: CancellationToken)
where
    M: AsRef<Metrics> + Clone + Send + 'static,
{
    let [max_deliveries, terminated] = advisory_subjects(&target);
    let subscribed = async {
        let a = client.subscribe(max_deliveries.clone()).await?;
        let b = client.subscribe(terminated.clone()).await?;
        Ok::<_, async_nats::SubscribeError>(futures::stream::select(a, b))
    };
    let mut advisories = match subscribed.await {
        Ok(advisories) => advisories,
        Err(err) => {
            error!(error = %err, "cannot subscribe to the consumer's advisories; dead letters are off");
            return;
        }
    };
    info!(subject = %target.subject, "dead-lettering exhausted and terminated messages");
    let js = jetstream::new(client);
    let target = Arc::new(target);
    let slots = Arc::new(Semaphore::new(CONCURRENCY));
    loop {
        let message = tokio::select! {
            () = stop.cancelled() => return,
            message = advisories.next() => match message {
                Some(message) => message,
                None => return,
            },
        };
        let cause = if message.subject.as_str() == max_deliveries {
            Cause::MaxDeliveries
        } else {
            Cause::Terminated { reason: None }
        };
        let advisory: Advisory = match serde_json::from_slice(&message.payload) {
            Ok(advisory) => advisory,
            Err(err) => {
                warn!(error = %err, subject = %message.subject, "unreadable advisory ignored");
                continue;
            }
        };
        let cause = match cause {
            Cause::Terminated { .. } => Cause::Terminated {
                reason: advisory.reason.clone().filter(|r| !r.trim().is_empty()),
            },
            other => other,
        };
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        let (js, target, metrics, stop) =
            (js.clone(), target.clone(), metrics.clone(), stop.clone());
        tokio::spawn(async move {
            let _slot = slot;
            tokio::select! {
                () = stop.cancelled() => {}
                () = dead_letter(&js, &target, &advisory, &cause, metrics.as_ref()) => {}
            }
        });
    }
}

/// Copy one message to the dead-letter subject, retrying transient failures for a while.
async fn dead_letter(
    js: &jetstream::Context,
    target: &Target,
    advisory: &Advisory,
    cause: &Cause,
    metrics: &Metrics,
) {
    let sequence = advisory.stream_seq;
    let give_up_at = tokio::time::Instant::now() + RETRY_FOR;
    let mut backoff = Duration::from_millis(250);
    loop {
        match attempt(js, target, advisory, cause).await {
            Ok(Outcome::Stored) => {
                metrics.dead_lettered();
                info!(stream_sequence = sequence, ?cause, subject = %target.subject, "dead-lettered");
                return;
            }
            Ok(Outcome::Duplicate) => {
                info!(
                    stream_sequence = sequence,
                    "already dead-lettered (another replica or an earlier attempt)"
                );
                return;
            }
            Ok(Outcome::Missing) => {
                metrics.dead_letter_missing();
                warn!(
                    stream_sequence = sequence,
                    ?cause,
                    "the message is no longer in the stream (limits, work-queue retention or a purge); nothing to dead-letter"
                );
                return;
            }
            Err(err) => {
                if tokio::time::Instant::now() + backoff > give_up_at {
                    metrics.dead_letter_failed();
                    error!(stream_sequence = sequence, ?cause, error = %format!("{err:#}"), subject = %target.subject, "could not dead-letter; giving up");
                    return;
                }
                warn!(stream_sequence = sequence, error = %format!("{err:#}"), retry_in = ?backoff, "dead-lettering failed; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(8));
            }
        }
    }
}

enum Outcome {
    Stored,
    Duplicate,
    Missing,
}

async fn attempt(
    js: &jetstream::Context,
    target: &Target,
    advisory: &Advisory,
    cause: &Cause,
) -> anyhow::Result<Outcome> {
    use anyhow::Context as _;
    let stream = tokio::time::timeout(CALL_TIMEOUT, js.get_stream_no_info(&target.stream))
        .await
        .context("timed out looking up the stream")?
        .context("looking up the stream")?;
    let original = tokio::time::timeout(CALL_TIMEOUT, stream.get_raw_message(advisory.stream_seq))
        .await
        .context("timed out reading the message")?;
    let original = match original {
        Ok(message) => message,
        Err(err) if err.kind() == RawMessageErrorKind::NoMessageFound => {
            return Ok(Outcome::Missing);
        }
        Err(err) => return Err(anyhow::Error::new(err).context("reading the message")),
    };
    let headers = dead_letter_headers(target, advisory, cause, &original);
    let published = tokio::time::timeout(
        CALL_TIMEOUT,
        js.publish_with_headers(target.subject.clone(), headers, original.payload),
    )
    .await
    .context("timed out publishing the dead letter")?
    .context("publishing the dead letter")?;
    let ack = tokio::time::timeout(CALL_TIMEOUT, published.into_future())
        .await
        .context("timed out waiting for the dead-letter stream's acknowledgement")?
        .context(
            "no stream stored the dead letter (is a stream capturing the dead-letter subject?)",
        )?;
    Ok(if ack.duplicate {
        Outcome::Duplicate
    } else {
        Outcome::Stored
    })
}

/// The id the dead-letter stream deduplicates on: one per message and consumer.
pub(crate) fn dedup_id(target: &Target, stream_sequence: u64) -> String {
    format!(
        "ruststream-dlq:{}:{}:{stream_sequence}",
        target.stream, target.consumer
    )
}

fn dead_letter_headers(
    target: &Target,
    advisory: &Advisory,
    cause: &Cause,
    original: &jetstream::message::StreamMessage,
) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (name, values) in original.headers.iter() {
        let name: &str = name.as_ref();
        let renamed = match name.get(..5) {
            Some(prefix) if prefix.eq_ignore_ascii_case("nats-") => {
                format!("{}{}", headers::ORIGINAL_PREFIX, &name[5..])
            }
            _ => name.to_owned(),
        };
        let Ok(renamed) = renamed.parse::<async_nats::HeaderName>() else {
            continue;
        };
        for value in values {
            headers.append(renamed.clone(), value.clone());
        }
    }
    let mut set = |name: &str, value: String| {
        // A value NATS cannot carry (a line break) is dropped rather than failing the copy.
        if let Ok(value) = value.parse::<HeaderValue>() {
            headers.insert(name, value);
        }
    };
    match cause {
        Cause::MaxDeliveries => set(headers::REASON, REASON_MAX_DELIVERIES.into()),
        Cause::Terminated { reason } => {
            set(headers::REASON, REASON_TERMINATED.into());
            if let Some(reason) = reason {
                set(headers::TERM_REASON, reason.clone());
            }
        }
    }
    set(headers::SUBJECT, original.subject.to_string());
    set(headers::STREAM, target.stream.clone());
    set(headers::STREAM_SEQUENCE, original.sequence.to_string());
    set(headers::CONSUMER, target.consumer.clone());
    set(headers::DELIVERIES, advisory.deliveries.to_string());
    if let Ok(published_at) = original.time.format(&Rfc3339) {
        set(headers::PUBLISHED_AT, published_at);
    }
    set("Nats-Msg-Id", dedup_id(target, original.sequence));
    headers
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advisories_parse() {
        let max: Advisory = serde_json::from_str(
            r#"{"type":"io.nats.jetstream.advisory.v1.max_deliver","id":"x","timestamp":"2026-01-01T00:00:00Z","stream":"ORDERS","consumer":"billing","stream_seq":7,"deliveries":3}"#,
        )
        .expect("parses");
        assert_eq!((max.stream_seq, max.deliveries, max.reason), (7, 3, None));
        let term: Advisory = serde_json::from_str(
            r#"{"type":"io.nats.jetstream.advisory.v1.terminated","stream":"ORDERS","consumer":"billing","consumer_seq":9,"stream_seq":8,"deliveries":1,"reason":"bad order"}"#,
        )
        .expect("parses");
        assert_eq!(term.reason.as_deref(), Some("bad order"));
    }

    #[test]
    fn the_dedup_id_names_stream_consumer_and_sequence() {
        let target = Target {
            stream: "ORDERS".into(),
            consumer: "billing".into(),
            subject: "DLQ.orders".into(),
        };
        assert_eq!(dedup_id(&target, 42), "ruststream-dlq:ORDERS:billing:42");
        assert_eq!(
            advisory_subjects(&target),
            [
                "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.ORDERS.billing".to_owned(),
                "$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.ORDERS.billing".to_owned()
            ]
        );
    }
}
