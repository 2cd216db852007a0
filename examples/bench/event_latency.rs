//! The publish → event rows of the drains: messages published one a millisecond while one
//! `GET /events` stream is open, each timed from its publish to its event, beside the same
//! read natively by async-nats `messages()`.

use std::future::IntoFuture as _;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, anyhow, ensure};
use async_nats::jetstream::{self, consumer, stream};
use futures::StreamExt as _;
use futures::future::join_all;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::args::Args;
use super::stats::{Percentiles, percentile};
use super::streaming::{
    SSE_ACK_BATCH, SSE_ACKS_IN_FLIGHT, complete_messages, open_events, post_acks, under_way,
};
use super::support::{GatewayChild, http_client};

/// Messages published before the timed ones, so that the stream's pull is waiting at the
/// server and the connections are warm when timing starts.
const EVENT_LATENCY_WARM_UP: u64 = 100;

/// One round of [`Kind::EventLatency`](super::args::Kind::EventLatency): a stream and a
/// gateway of their own, one `GET /events?max_in_flight=1000&encoding=utf8` open, then
/// `--latency-samples` messages (after a warm-up) published one a millisecond, each carrying
/// its publish time; the client acks what it read in batches, as
/// [`sse_loop`](super::streaming::sse_loop). Returns the p50 and p99 in ms.
pub(crate) async fn event_latency(
    js: &jetstream::Context,
    nats_url: &str,
    args: &Args,
    round: u32,
    binary: &Path,
    logs: &Path,
) -> anyhow::Result<Percentiles> {
    let stream = format!("LIVE{round}");
    let subject = format!("live{round}.msg");
    js.create_stream(stream::Config {
        name: stream.clone(),
        subjects: vec![subject.clone()],
        ..Default::default()
    })
    .await
    .context("creating the stream")?;
    let http = http_client()?;
    let gateway = GatewayChild::start_on(
        binary,
        nats_url,
        (&stream, "live"),
        &args.gateway_flags,
        &args.gateway_env,
        logs.join(format!("live{round}.log")),
        &http,
    )
    .await?;
    let url = format!("{}/events?max_in_flight=1000&encoding=utf8", gateway.base);
    let mut response = open_events(&http, &url).await?;
    let epoch = Instant::now();
    let total = EVENT_LATENCY_WARM_UP + args.latency_samples;
    let publisher = publish_paced(js, &subject, total, epoch);
    let ack_url: Arc<str> = format!("{}/messages/ack", gateway.base).into();
    let mut acks = tokio::task::JoinSet::new();
    let ack = |ids: Vec<String>| {
        let (http, url) = (http.clone(), ack_url.clone());
        async move { post_acks(&http, &url, &ids).await }
    };
    let mut latencies = Vec::with_capacity(args.latency_samples as usize);
    let mut read = 0;
    let mut pending = Vec::new();
    let mut text = String::new();
    let deadline = Instant::now() + Duration::from_secs(60) + Duration::from_millis(total);
    while read < total {
        let chunk = match tokio::time::timeout_at(
            deadline.min(Instant::now() + Duration::from_millis(5)),
            response.chunk(),
        )
        .await
        {
            Ok(chunk) => chunk
                .context("reading the event stream")?
                .context("the gateway ended the event stream")?,
            Err(_) => {
                ensure!(
                    Instant::now() < deadline,
                    "{read} of {total} events came before the deadline"
                );
                if !pending.is_empty() {
                    under_way(&mut acks, SSE_ACKS_IN_FLIGHT - 1).await?;
                    acks.spawn(ack(std::mem::take(&mut pending)));
                }
                continue;
            }
        };
        let arrived = epoch.elapsed().as_micros();
        text.push_str(&String::from_utf8_lossy(&chunk));
        for message in complete_messages(&mut text)? {
            let sent: u128 = message["data"]
                .as_str()
                .and_then(|sent| sent.parse().ok())
                .context("a message's publish time")?;
            read += 1;
            if read > EVENT_LATENCY_WARM_UP {
                latencies.push(u32::try_from(arrived.saturating_sub(sent)).unwrap_or(u32::MAX));
            }
            pending.push(message["id"].as_str().context("a lease id")?.to_owned());
            if pending.len() >= SSE_ACK_BATCH {
                under_way(&mut acks, SSE_ACKS_IN_FLIGHT - 1).await?;
                acks.spawn(ack(std::mem::take(&mut pending)));
            }
        }
    }
    if !pending.is_empty() {
        acks.spawn(ack(pending));
    }
    under_way(&mut acks, 0).await?;
    publisher.await.context("the publisher")??;
    drop(response);
    gateway.stop().await?;
    js.delete_stream(&stream)
        .await
        .with_context(|| format!("deleting stream {stream}"))?;
    Ok((
        percentile(&mut latencies, 0.5),
        percentile(&mut latencies, 0.99),
    ))
}

/// Publish `total` messages one a millisecond to `subject`, each carrying its publish time
/// (µs since `epoch`); done once every publish is acknowledged.
fn publish_paced(
    js: &jetstream::Context,
    subject: &str,
    total: u64,
    epoch: Instant,
) -> JoinHandle<anyhow::Result<()>> {
    let (js, subject) = (js.clone(), subject.to_owned());
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_millis(1));
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut acks = Vec::with_capacity(total as usize);
        for _ in 0..total {
            every.tick().await;
            let sent = epoch.elapsed().as_micros().to_string();
            acks.push(
                js.publish(subject.clone(), sent.into())
                    .await?
                    .into_future(),
            );
        }
        for ack in join_all(acks).await {
            ack.context("publish ack")?;
        }
        anyhow::Ok(())
    })
}

/// The native figure beside [`event_latency`]: the same paced publishing, read by an
/// async-nats pull consumer's `messages()` stream (each message acked). p50 and p99 in ms.
pub(crate) async fn native_event_latency(
    js: &jetstream::Context,
    args: &Args,
    round: u32,
) -> anyhow::Result<Percentiles> {
    let stream_name = format!("NATIVE_LIVE{round}");
    let subject = format!("native-live{round}.msg");
    let stream = js
        .create_stream(stream::Config {
            name: stream_name.clone(),
            subjects: vec![subject.clone()],
            ..Default::default()
        })
        .await
        .context("creating the stream")?;
    let consumer: consumer::PullConsumer = stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some("live".into()),
            ack_policy: consumer::AckPolicy::Explicit,
            ..Default::default()
        })
        .await
        .context("creating the consumer")?;
    let mut messages = consumer.messages().await.context("consumer messages")?;
    let epoch = Instant::now();
    let total = EVENT_LATENCY_WARM_UP + args.latency_samples;
    let publisher = publish_paced(js, &subject, total, epoch);
    let mut latencies = Vec::with_capacity(args.latency_samples as usize);
    for read in 1..=total {
        let message = tokio::time::timeout(Duration::from_secs(30), messages.next())
            .await
            .context("no message for 30 s")?
            .context("the messages stream ended")?
            .map_err(|err| anyhow!("messages: {err}"))?;
        let arrived = epoch.elapsed().as_micros();
        let sent: u128 = std::str::from_utf8(&message.payload)
            .ok()
            .and_then(|sent| sent.parse().ok())
            .context("a message's publish time")?;
        if read > EVENT_LATENCY_WARM_UP {
            latencies.push(u32::try_from(arrived.saturating_sub(sent)).unwrap_or(u32::MAX));
        }
        message.ack().await.map_err(|err| anyhow!("ack: {err}"))?;
    }
    publisher.await.context("the publisher")??;
    drop(messages);
    js.delete_stream(&stream_name)
        .await
        .with_context(|| format!("deleting stream {stream_name}"))?;
    Ok((
        percentile(&mut latencies, 0.5),
        percentile(&mut latencies, 0.99),
    ))
}
