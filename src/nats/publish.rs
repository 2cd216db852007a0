//! Publishing to the stream (`POST /publish`) and reading the consumer's server-side state
//! (`GET /consumer`): JetStream API calls on a request path, each bounded in time.
//!
//! May import: nothing of the gateway above the NATS boundary.

use std::time::Duration;

use anyhow::Context as _;
use async_nats::jetstream::{self, consumer};
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

/// Publish to the stream and wait for its acknowledgement.
pub(crate) async fn publish(
    bound: &Bound,
    subject: String,
    headers: async_nats::HeaderMap,
    payload: Bytes,
    timeout: Duration,
) -> anyhow::Result<jetstream::publish::PublishAck> {
    let ack = tokio::time::timeout(
        timeout,
        bound
            .jetstream
            .publish_with_headers(subject, headers, payload),
    )
    .await
    .context("timed out publishing")?
    .context("publishing")?;
    tokio::time::timeout(timeout, ack.into_future())
        .await
        .context("timed out waiting for the stream's acknowledgement")?
        .context("the stream did not acknowledge the message")
}
