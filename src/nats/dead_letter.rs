//! Dead letters: a message JetStream gives up on (max_deliver exhausted) or a client
//! terminated is republished, with its headers and delivery metadata, to `--dead-letter-subject`.
//!
//! JetStream itself only emits an advisory (`MAX_DELIVERIES`, `MSG_TERMINATED`) and leaves the
//! message in the stream, no longer tracked by the consumer. Each advisory names a message by
//! stream sequence; this module reads it and publishes a copy through JetStream with a
//! `Nats-Msg-Id` derived from stream, consumer and sequence, so the dead-letter stream stores
//! it once even when it is copied twice (two replicas, an advisory redelivered after a crash,
//! a term copied before it was sent) — within that stream's duplicate window (2 min by default).
//!
//! The advisories reach it through the advisory stream ([`super::advisories`]); the live
//! subscription here ([`listen`]) is what remains when that stream cannot be had (an
//! ephemeral consumer, another stream already capturing the subjects). [`copy_before_term`]
//! is the copy a term makes itself when the stream deletes the message on term.
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
pub(crate) const CONCURRENCY: usize = 16;
/// Advisories being handled: at most [`CONCURRENCY`] at once, each on its own task, each
/// given up at `stop`.
pub(crate) struct Handlers {
    slots: Arc<Semaphore>,
    stop: CancellationToken,
}

impl Handlers {
    pub(crate) fn new(stop: &CancellationToken) -> Self {
        Self {
            slots: Arc::new(Semaphore::new(CONCURRENCY)),
            stop: stop.clone(),
        }
    }

    /// Wait for a free slot, then run `work` on a task of its own until it ends or `stop`.
    /// `false` when no slot can be had any more.
    pub(crate) async fn spawn(&self, work: impl Future<Output = ()> + Send + 'static) -> bool {
        let Ok(slot) = self.slots.clone().acquire_owned().await else {
            return false;
        };
        let stop = self.stop.clone();
        tokio::spawn(async move {
            let _slot = slot;
            tokio::select! {
                () = stop.cancelled() => {}
                () = work => {}
            }
        });
        true
    }
}

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
pub(crate) enum Cause {
    MaxDeliveries,
    Terminated { reason: Option<String> },
}

/// The fields of both advisories this module uses.
#[derive(Debug, Deserialize)]
pub(crate) struct Advisory {
    stream_seq: u64,
    #[serde(default)]
    deliveries: u64,
    #[serde(default)]
    reason: Option<String>,
}

/// The subjects of the consumer's `MAX_DELIVERIES` and `MSG_TERMINATED` advisories.
pub(crate) fn advisory_subjects(target: &Target) -> [String; 2] {
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

/// An advisory as received on `subject` with `payload`: what it names and why.
pub(crate) fn read_advisory(
    subject: &str,
    payload: &[u8],
) -> Result<(Advisory, Cause), serde_json::Error> {
    let advisory: Advisory = serde_json::from_slice(payload)?;
    let cause = if subject.starts_with("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.") {
        Cause::MaxDeliveries
    } else {
        Cause::Terminated {
            reason: term_reason(advisory.reason.as_deref()),
        }
    };
    Ok((advisory, cause))
}

/// A term reason as a dead letter carries it: none rather than a blank one.
fn term_reason(reason: Option<&str>) -> Option<String> {
    reason.filter(|r| !r.trim().is_empty()).map(str::to_owned)
}

/// Listen for the consumer's advisories on a plain subscription until `stop`, dead-lettering
/// each message named. An advisory published while this process is not subscribed is
/// missed: the fallback when the advisory stream cannot be had.
/// async-nats re-subscribes after a reconnect, so one subscription lasts the process.
pub(crate) async fn listen<M>(client: Client, target: Target, metrics: M, stop: CancellationToken)
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
    warn!(subject = %target.subject, "dead-lettering from a live subscription: advisories published while no gateway listens are missed");
    let js = jetstream::new(client);
    let target = Arc::new(target);
    let handlers = Handlers::new(&stop);
    loop {
        let message = tokio::select! {
            () = stop.cancelled() => return,
            message = advisories.next() => match message {
                Some(message) => message,
                None => return,
            },
        };
        let (advisory, cause) = match read_advisory(message.subject.as_str(), &message.payload) {
            Ok(read) => read,
            Err(err) => {
                warn!(error = %err, subject = %message.subject, "unreadable advisory ignored");
                continue;
            }
        };
        let (js, target, metrics) = (js.clone(), target.clone(), metrics.clone());
        let copy = async move {
            let _ = dead_letter(&js, &target, &advisory, &cause, metrics.as_ref()).await;
        };
        if !handlers.spawn(copy).await {
            return;
        }
    }
}

/// What became of an advisory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Handled {
    /// Copied, found copied already, or known to have nothing to copy: done with.
    Done,
    /// Retried for [`RETRY_FOR`] without success.
    GaveUp,
}

/// Copy one message to the dead-letter subject, retrying transient failures for a while.
pub(crate) async fn dead_letter(
    js: &jetstream::Context,
    target: &Target,
    advisory: &Advisory,
    cause: &Cause,
    metrics: &Metrics,
) -> Handled {
    let sequence = advisory.stream_seq;
    let give_up_at = tokio::time::Instant::now() + RETRY_FOR;
    let mut backoff = Duration::from_millis(250);
    loop {
        match attempt(js, target, advisory, cause).await {
            Ok(Outcome::Stored) => {
                metrics.dead_lettered();
                info!(stream_sequence = sequence, ?cause, subject = %target.subject, "dead-lettered");
                return Handled::Done;
            }
            Ok(Outcome::Duplicate) => {
                info!(
                    stream_sequence = sequence,
                    "already dead-lettered (another replica, an earlier attempt or the term)"
                );
                return Handled::Done;
            }
            Ok(Outcome::Missing) => {
                metrics.dead_letter_missing();
                warn!(
                    stream_sequence = sequence,
                    ?cause,
                    "the message is no longer in the stream (limits, work-queue retention or a purge); nothing to dead-letter"
                );
                return Handled::Done;
            }
            Ok(Outcome::RemovedOnTerm) => {
                info!(
                    stream_sequence = sequence,
                    "removed from the stream by its term (work-queue or interest retention); a term through the gateway copied it before it was sent"
                );
                return Handled::Done;
            }
            Err(err) => {
                if tokio::time::Instant::now() + backoff > give_up_at {
                    metrics.dead_letter_failed();
                    error!(stream_sequence = sequence, ?cause, error = %format!("{err:#}"), subject = %target.subject, "could not dead-letter; giving up");
                    return Handled::GaveUp;
                }
                warn!(stream_sequence = sequence, error = %format!("{err:#}"), retry_in = ?backoff, "dead-lettering failed; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(8));
            }
        }
    }
}

/// What one attempt at a copy came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Stored,
    /// The dead-letter stream had it already (same `Nats-Msg-Id` within its window).
    Duplicate,
    Missing,
    /// Missing, because a term removed it: the stream deletes on term (work-queue or interest
    /// retention), where a term through the gateway copies the message before it is sent.
    RemovedOnTerm,
}

/// Copy the message a lease names before its `+TERM` is sent, with the headers and dedup id
/// the advisory's copy would have: on a stream that deletes the message on term, the copy
/// made on the advisory would find nothing. One attempt; the client retries the term.
pub(crate) async fn copy_before_term(
    js: &jetstream::Context,
    target: &Target,
    stream_sequence: u64,
    delivered: u64,
    reason: Option<&str>,
) -> anyhow::Result<Outcome> {
    let advisory = Advisory {
        stream_seq: stream_sequence,
        deliveries: delivered,
        reason: None,
    };
    let cause = Cause::Terminated {
        reason: term_reason(reason),
    };
    attempt(js, target, &advisory, &cause).await
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
            if matches!(cause, Cause::Terminated { .. }) && deletes_on_term(js, target).await? {
                return Ok(Outcome::RemovedOnTerm);
            }
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

/// Whether the stream deletes a message once it is terminated: a work-queue stream at once,
/// an interest stream once no consumer wants it any more.
async fn deletes_on_term(js: &jetstream::Context, target: &Target) -> anyhow::Result<bool> {
    use anyhow::Context as _;
    let stream = tokio::time::timeout(CALL_TIMEOUT, js.get_stream(&target.stream))
        .await
        .context("timed out reading the stream's info")?
        .context("reading the stream's info")?;
    Ok(is_deleted_on_term(stream.cached_info().config.retention))
}

/// Whether a stream of `retention` deletes a message once it is terminated.
pub(crate) fn is_deleted_on_term(retention: jetstream::stream::RetentionPolicy) -> bool {
    use jetstream::stream::RetentionPolicy;
    matches!(
        retention,
        RetentionPolicy::WorkQueue | RetentionPolicy::Interest
    )
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
