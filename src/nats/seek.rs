//! Rewinding a consumer at the server: where it stands, the stream sequence a target names
//! (a time becomes the first message stored at or after it), how many of its messages a
//! move would deliver again or skip, the move itself (`$JS.API.CONSUMER.RESET`, nats-server
//! ≥ 2.14: the consumer is moved, not deleted), and the mark a move leaves in the consumer's
//! metadata so that every replica learns of it.
//!
//! May import: `domain`. Nothing of the gateway above the NATS boundary.

use std::time::Duration;

use anyhow::{Context as _, bail};
use async_nats::jetstream::{self, consumer};
use serde_json::{Value, json};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use super::seek_mark::SEEK_MARK;
use super::{API_TIMEOUT, Bound};

/// The first nats-server release with the consumer reset.
pub(crate) const RESET_SINCE: (u64, u64) = (2, 14);
/// How long the consumer that counts messages from a sequence may outlive a crashed count.
const COUNTER_INACTIVE: Duration = Duration::from_secs(10);

/// Where the consumer stands, with the stream around it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Position {
    /// Messages after `delivered` that it has yet to deliver (its filter applied).
    pub(crate) pending: u64,
    pub(crate) first: u64,
    pub(crate) last: u64,
}

/// The version of the server this binding is connected to, when it can be read.
pub(crate) fn server_version(bound: &Bound) -> String {
    bound.client.server_info().version
}

/// Whether `version` (`2.15.1`, `2.14.0-RC.1`) has the consumer reset.
pub(crate) fn supports_reset(version: &str) -> bool {
    at_least(version, RESET_SINCE)
}

/// Whether server `version` is `since` (major, minor) or later.
pub(crate) fn at_least(version: &str, since: (u64, u64)) -> bool {
    let mut parts = version
        .split(['.', '-'])
        .map(|part| part.parse::<u64>().ok());
    match (parts.next().flatten(), parts.next().flatten()) {
        (Some(major), Some(minor)) => (major, minor) >= since,
        _ => false,
    }
}

/// The consumer's position and its stream's first and last sequences.
pub(crate) async fn position(bound: &Bound) -> anyhow::Result<(Position, consumer::Info)> {
    let info = super::publish::consumer_info(bound).await?;
    let stream = tokio::time::timeout(API_TIMEOUT, bound.jetstream.get_stream(&info.stream_name))
        .await
        .context("timed out asking for stream info")?
        .context("asking for stream info")?;
    let state = stream.cached_info().state.clone();
    Ok((
        Position {
            pending: info.num_pending,
            first: state.first_sequence,
            last: state.last_sequence,
        },
        info,
    ))
}

/// The sequence of the first message stored at or after `at`; `None`: none is.
pub(crate) async fn first_at_or_after(
    js: &jetstream::Context,
    stream: &str,
    at: OffsetDateTime,
) -> anyhow::Result<Option<u64>> {
    let start_time = at.format(&Rfc3339).context("formatting the time")?;
    let answer: Value = api(
        js,
        format!("STREAM.MSG.GET.{stream}"),
        json!({ "start_time": start_time }),
    )
    .await?;
    if let Some(sequence) = answer["message"]["seq"].as_u64() {
        return Ok(Some(sequence));
    }
    match answer["error"]["err_code"].as_u64() {
        // "no message found"
        Some(10037) => Ok(None),
        _ => bail!("the server did not find the message at that time: {answer}"),
    }
}

/// How many messages from `sequence` on the consumer's filter takes: counted by a
/// short-lived ephemeral consumer (deleted at once, or by the server soon after), which
/// delivers nothing.
pub(crate) async fn pending_from(
    bound: &Bound,
    info: &consumer::Info,
    sequence: u64,
) -> anyhow::Result<u64> {
    let stream = tokio::time::timeout(
        API_TIMEOUT,
        bound.jetstream.get_stream_no_info(&info.stream_name),
    )
    .await
    .context("timed out looking up the stream")?
    .context("looking up the stream")?;
    let counter = consumer::pull::Config {
        deliver_policy: consumer::DeliverPolicy::ByStartSequence {
            start_sequence: sequence,
        },
        ack_policy: consumer::AckPolicy::None,
        filter_subject: info.config.filter_subject.clone(),
        filter_subjects: info.config.filter_subjects.clone(),
        inactive_threshold: COUNTER_INACTIVE,
        memory_storage: true,
        num_replicas: 1,
        ..Default::default()
    };
    let made = tokio::time::timeout(API_TIMEOUT, stream.create_consumer(counter))
        .await
        .context("timed out counting the messages")?
        .context("counting the messages")?;
    let pending = made.cached_info().num_pending;
    let name = made.cached_info().name.clone();
    let _ = tokio::time::timeout(API_TIMEOUT, stream.delete_consumer(&name)).await;
    Ok(pending)
}

/// Move the consumer so that `sequence` is the next stream sequence it delivers.
pub(crate) async fn reset(bound: &Bound, stream: &str, sequence: u64) -> anyhow::Result<()> {
    let answer: Value = api(
        &bound.jetstream,
        format!("CONSUMER.RESET.{stream}.{}", bound.consumer_name),
        json!({ "seq": sequence }),
    )
    .await?;
    if answer.get("error").is_some() {
        bail!(
            "the server refused to move the consumer: {}",
            answer["error"]
        );
    }
    Ok(())
}

/// Leave `mark` in the consumer's metadata (its config otherwise as the server has it in
/// `info`); `None`: the mark `info` has, put back (a move that failed half-way).
pub(crate) async fn leave_mark(
    bound: &Bound,
    info: &consumer::Info,
    mark: Option<&str>,
) -> anyhow::Result<()> {
    let mut config = info.config.clone();
    if let Some(mark) = mark {
        config
            .metadata
            .insert(SEEK_MARK.to_owned(), mark.to_owned());
    }
    let request = json!({
        "stream_name": info.stream_name,
        "config": config,
        "action": "update",
    });
    let answer: Value = api(
        &bound.jetstream,
        format!(
            "CONSUMER.CREATE.{}.{}",
            info.stream_name, bound.consumer_name
        ),
        request,
    )
    .await?;
    if answer.get("error").is_some() {
        bail!(
            "the server refused to mark the consumer: {}",
            answer["error"]
        );
    }
    Ok(())
}

async fn api(js: &jetstream::Context, subject: String, body: Value) -> anyhow::Result<Value> {
    let answer: Result<Value, _> =
        tokio::time::timeout(API_TIMEOUT, js.request(subject.clone(), &body))
            .await
            .with_context(|| format!("timed out asking {subject}"))?;
    // The API's own errors come back as a body with "error", which this parses as JSON
    // like any other answer; a request that failed on its way is an error here.
    answer.with_context(|| format!("asking {subject}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reset_is_had_from_two_fourteen_on() {
        assert!(supports_reset("2.15.1"));
        assert!(supports_reset("2.14.0-RC.1"));
        assert!(supports_reset("3.0.0"));
        assert!(!supports_reset("2.11.9"));
        assert!(!supports_reset("2.9"));
        assert!(!supports_reset("garbled"));
    }
}
