//! `--day-two`: the dead-letter rows of docs/benchmark.md. `--messages` dead letters (written
//! as the gateway writes them) are listed 1 000 at a time, newest and oldest first (p50 and
//! p99 of `--latency-samples` requests each), then sent back by one redrive at `rate` 10 000
//! (dead-letter stream and target on one nats-server), timed from the POST to its task's
//! `done`; a native loop (async-nats: an ordered consumer reading a copy of them, a publish
//! each, the acks awaited a chunk at a time, then each deleted) does the same in the same run.
//! Last, the bytes of the console's first load.

use std::time::Duration;

use anyhow::{Context as _, ensure};
use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer, stream};
use futures::StreamExt as _;
use ruststream_nats::dead_letter::headers;
use tokio::time::Instant;

use super::nats;
use super::stats::percentile;
use super::support::{GatewayChild, gateway_binary, http_client, server_version};

const TARGET: &str = "DAYTWO";
const GATEWAY_DLQ: &str = "DLQ";
const NATIVE_DLQ: &str = "NATIVEDLQ";
/// Messages a native chunk publishes before awaiting their acks, as the gateway's chunk.
const NATIVE_CHUNK: usize = 256;

/// Write `count` dead letters to `subject` as the gateway writes them.
async fn write(js: &jetstream::Context, subject: &str, count: u64) -> anyhow::Result<()> {
    let mut acks = Vec::with_capacity(1000);
    for n in 0..count {
        let mut written = HeaderMap::new();
        written.insert(headers::REASON, "terminated");
        written.insert(headers::TERM_REASON, "malformed: bench");
        written.insert(headers::STREAM, TARGET);
        written.insert(headers::CONSUMER, "billing");
        written.insert(headers::SUBJECT, "daytwo.orders");
        written.insert(headers::STREAM_SEQUENCE, (n + 1).to_string().as_str());
        written.insert(headers::DELIVERIES, "1");
        acks.push(
            js.publish_with_headers(subject.to_owned(), written, vec![b'x'; 256].into())
                .await?,
        );
        if acks.len() == 1000 {
            for ack in acks.drain(..) {
                ack.await?;
            }
        }
    }
    for ack in acks {
        ack.await?;
    }
    Ok(())
}

pub(crate) async fn run(args: &super::args::Args) -> anyhow::Result<()> {
    let server = nats::NatsServer::start().await;
    let version = server_version(&nats::nats_server_binary())?;
    let client = async_nats::ConnectOptions::new()
        .request_timeout(Some(Duration::from_secs(30)))
        .connect(server.url())
        .await?;
    let js = jetstream::new(client);
    for (name, subjects) in [
        (TARGET, "daytwo.>"),
        (GATEWAY_DLQ, "dlq.>"),
        (NATIVE_DLQ, "nativedlq.>"),
    ] {
        js.create_stream(stream::Config {
            name: name.into(),
            subjects: vec![subjects.into()],
            ..Default::default()
        })
        .await?;
    }
    let count = args.messages;
    write(&js, "dlq.orders", count).await?;
    write(&js, "nativedlq.orders", count).await?;
    eprintln!("bench --day-two: {version}; {count} dead letters of 256 bytes each");

    let logs = tempfile::Builder::new()
        .prefix("bench-day-two-")
        .tempdir()?;
    let http = http_client()?;
    let gateway = GatewayChild::start_on(
        &gateway_binary(args)?,
        &server.url(),
        (TARGET, "billing"),
        &["--dead-letter-subject".into(), "dlq.orders".into()],
        &args.gateway_env,
        logs.path().join("gateway.log"),
        &http,
    )
    .await?;

    // Listing: a page of 1 000, newest and oldest first.
    for order in ["newest", "oldest"] {
        let url = format!("{}/dead-letters?limit=1000&order={order}", gateway.base);
        let mut samples = Vec::new();
        for _ in 0..args.latency_samples.min(1000) {
            let started = Instant::now();
            let response = http.get(&url).send().await?;
            ensure!(response.status() == 200, "GET {url}: {}", response.status());
            let page: serde_json::Value = response.json().await?;
            let elapsed = started.elapsed();
            ensure!(page["dead_letters"].as_array().map(Vec::len) == Some(1000));
            samples.push(super::stats::micros(elapsed));
        }
        println!(
            "| list 1 000 of {count}, {order} first | p50 {:.1} ms, p99 {:.1} ms ({} requests) |",
            percentile(&mut samples, 0.50),
            percentile(&mut samples, 0.99),
            samples.len()
        );
    }

    // Redrive at rate 10 000, against the native loop.
    let started = Instant::now();
    let answer: serde_json::Value = http
        .post(format!("{}/dead-letters/redrive", gateway.base))
        .json(&serde_json::json!({"rate": 10_000}))
        .send()
        .await?
        .json()
        .await?;
    let task = answer["task"].as_str().context("no task")?.to_owned();
    // Read as the console reads it: once a second, but to the millisecond once it is near.
    let done = loop {
        let now: serde_json::Value = http
            .get(format!("{}/dead-letters/redrive/{task}", gateway.base))
            .send()
            .await?
            .json()
            .await?;
        ensure!(now["status"].is_null(), "GET the task: {now}");
        if now["state"] != "running" {
            break now;
        }
        let left = count.saturating_sub(now["published"].as_u64().unwrap_or(0));
        let pause = if left < 2_000 { 5 } else { 200 };
        tokio::time::sleep(Duration::from_millis(pause)).await;
    };
    let gateway_secs = started.elapsed().as_secs_f64();
    ensure!(
        done["state"] == "done" && done["published"] == count && done["removed"] == count,
        "the redrive ended {done}"
    );
    let native_secs = native_redrive(&js, count).await?;
    let (gateway_rate, native_rate) = (count as f64 / gateway_secs, count as f64 / native_secs);
    println!(
        "| redrive {count} at rate 10 000 | {gateway_rate:.0} msg/s ({gateway_secs:.2} s); native {native_rate:.0} msg/s; ratio {:.2} |",
        gateway_rate / native_rate
    );
    let target = js.get_stream(TARGET).await?.info().await?.state.messages;
    ensure!(
        target == 2 * count,
        "the target holds {target}, not {}",
        2 * count
    );

    // The console's first load: the page and the two files it names.
    let mut bytes = 0;
    for path in ["/console", "/console/console.js", "/console/console.css"] {
        bytes += http
            .get(format!("{}{path}", gateway.base))
            .send()
            .await?
            .bytes()
            .await?
            .len();
    }
    println!("| console first load | {bytes} bytes (3 files) |");
    gateway.stop().await
}

/// The same redrive with async-nats alone: read the copy in order, publish each (acks
/// awaited a chunk at a time), then delete what was stored. Seconds taken.
async fn native_redrive(js: &jetstream::Context, count: u64) -> anyhow::Result<f64> {
    let started = Instant::now();
    let dlq = js.get_stream(NATIVE_DLQ).await?;
    let reader = dlq
        .create_consumer(consumer::pull::OrderedConfig::default())
        .await?;
    let mut messages = reader.messages().await?.take(count as usize);
    let mut chunk = Vec::with_capacity(NATIVE_CHUNK);
    let mut read = 0;
    while read < count {
        chunk.clear();
        while chunk.len() < NATIVE_CHUNK && read < count {
            let message = messages.next().await.context("the copy ended")??;
            read += 1;
            let sequence = message
                .info()
                .map_err(|err| anyhow::anyhow!("{err}"))?
                .stream_sequence;
            let ack = js
                .publish_with_headers(
                    "daytwo.orders",
                    message.headers.clone().unwrap_or_default(),
                    message.payload.clone(),
                )
                .await?;
            chunk.push((sequence, ack));
        }
        let mut stored = Vec::with_capacity(chunk.len());
        for (sequence, ack) in chunk.drain(..) {
            ack.await?;
            stored.push(sequence);
        }
        let deletes = futures::stream::iter(stored.into_iter().map(|sequence| {
            // Removed, not erased, as the gateway removes them.
            async move {
                let answer: serde_json::Value = js
                    .request(
                        format!("STREAM.MSG.DELETE.{NATIVE_DLQ}"),
                        &serde_json::json!({"seq": sequence, "no_erase": true}),
                    )
                    .await?;
                ensure!(answer["success"] == true, "delete {sequence}: {answer}");
                anyhow::Ok(())
            }
        }))
        .buffer_unordered(64)
        .collect::<Vec<_>>()
        .await;
        for deleted in deletes {
            deleted?;
        }
    }
    Ok(started.elapsed().as_secs_f64())
}
