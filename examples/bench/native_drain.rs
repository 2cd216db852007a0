//! The native run: async-nats draining a durable pull consumer, fetch then confirmed acks,
//! the figure every gateway run is divided by; and the check that a drain left nothing
//! pending.

use std::sync::Arc;

use anyhow::{Context as _, anyhow, ensure};
use async_nats::jetstream::{self, consumer};
use bytes::Bytes;
use futures::StreamExt as _;
use futures::future::join_all;
use tokio::time::Instant;

use super::args::{Args, Kind, NativeAck};
use super::outcome::{Outcome, Run};
use super::process_stats::cpu_seconds;
use super::support::{ACK_WAIT, FETCH_WAIT, MAX_ACK_PENDING, STREAM};
use super::tally::Tally;

pub(crate) async fn drain_native(
    client: &async_nats::Client,
    js: &jetstream::Context,
    consumer_name: &str,
    args: &Args,
    total: u64,
) -> anyhow::Result<Outcome> {
    let stream = js.get_stream(STREAM).await.context("getting the stream")?;
    let consumer: consumer::PullConsumer = stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some(consumer_name.to_string()),
            ack_policy: consumer::AckPolicy::Explicit,
            ack_wait: ACK_WAIT,
            max_ack_pending: MAX_ACK_PENDING,
            ..Default::default()
        })
        .await
        .context("creating the native pull consumer")?;
    let stream_len = total.max(args.messages).max(args.latency_samples) * 2;
    let tally = Arc::new(Tally::new(total, stream_len, None));
    let run = Run {
        kind: Kind::Native,
        clients: 1,
    };
    // Nothing else runs in this process meanwhile: its CPU is the native client's.
    let cpu_before = cpu_seconds(std::process::id());
    native_loop(
        client.clone(),
        consumer,
        tally.clone(),
        args.batch as usize,
        args.payload_bytes as usize,
        args.native_ack,
    )
    .await?;
    let cpu_after = cpu_seconds(std::process::id());
    let mut outcome = tally.finish(run)?;
    outcome.native_cpu_seconds = cpu_before
        .zip(cpu_after)
        .map(|(before, after)| after - before);
    verify_consumer(&stream, consumer_name).await?;
    Ok(outcome)
}

async fn native_loop(
    client: async_nats::Client,
    consumer: consumer::PullConsumer,
    tally: Arc<Tally>,
    batch: usize,
    payload_bytes: usize,
    native_ack: NativeAck,
) -> anyhow::Result<()> {
    let mut messages = Vec::with_capacity(batch);
    let mut sequences = Vec::with_capacity(batch);
    while !tally.is_done() {
        messages.clear();
        let fetch_started = Instant::now();
        let mut fetch = consumer
            .fetch()
            .max_messages(batch)
            .expires(FETCH_WAIT)
            .messages()
            .await
            .context("starting a fetch")?;
        while let Some(message) = fetch.next().await {
            messages.push(message.map_err(|err| anyhow!("fetch: {err}"))?);
        }
        let fetch_waited = fetch_started.elapsed();
        if messages.is_empty() {
            tally.check_stall()?;
            continue;
        }

        sequences.clear();
        let mut delivered = Vec::with_capacity(messages.len());
        for message in &messages {
            let info = message
                .info()
                .map_err(|err| anyhow!("reading a message's metadata: {err}"))?;
            ensure!(
                message.payload.len() == payload_bytes,
                "stream sequence {} has {} payload bytes, expected {payload_bytes}",
                info.stream_sequence,
                message.payload.len()
            );
            sequences.push(info.stream_sequence);
            delivered.push(u64::try_from(info.delivered).unwrap_or(0));
        }
        tally.fetched(delivered.into_iter(), fetch_waited);
        let acks_started = Instant::now();
        let acks = messages.iter().map(|message| {
            let client = &client;
            async move {
                match native_ack {
                    NativeAck::DoubleAck => message.double_ack().await.map_err(|err| anyhow!(err)),
                    NativeAck::Request => {
                        let reply = message
                            .reply
                            .clone()
                            .ok_or_else(|| anyhow!("a message without a reply subject"))?;
                        client
                            .request(reply, Bytes::from_static(b"+ACK"))
                            .await
                            .map(drop)
                            .map_err(|err| anyhow!(err))
                    }
                }
            }
        });
        for (ack, sequence) in join_all(acks).await.into_iter().zip(&sequences) {
            ack.with_context(|| format!("confirmed ack of stream sequence {sequence}"))?;
        }
        tally.acked(&sequences, acks_started.elapsed())?;
    }
    Ok(())
}

/// Nothing of the run may be left delivered and unacked, or redelivered.
pub(crate) async fn verify_consumer(
    stream: &jetstream::stream::Stream,
    consumer: &str,
) -> anyhow::Result<()> {
    let info = stream
        .consumer_info(consumer)
        .await
        .with_context(|| format!("consumer info of {consumer}"))?;
    ensure!(
        info.num_ack_pending == 0 && info.num_redelivered == 0,
        "consumer {consumer} after the drain: num_ack_pending {}, num_redelivered {} (expected 0, 0)",
        info.num_ack_pending,
        info.num_redelivered,
    );
    Ok(())
}
