//! `--producers`: the publish side of docs/benchmark.md ("Producers"), each gateway figure
//! against async-nats doing the same in the same run, rounds alternated:
//! - batches of 100 × 256 B from 4 clients: `POST /publish/batch` against async-nats
//!   publishing each batch pipelined and awaiting every PubAck;
//! - atomic batches of 100: `"atomic": true` against the same nats-server atomic batch
//!   spoken natively (first message a request, the middle ones published, the commit a
//!   request);
//! - single `POST /publish` from 8 clients (printed, a guard);
//! - `--schedules` one-shot schedules made through batches of 1 000 and due over 20 s:
//!   how late each fired (its stored time against its `Ruststream-Scheduled-At`), p50/p99/max,
//!   and the gateway's RSS before and after.

use std::time::Duration;

use anyhow::{Context as _, ensure};
use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer, stream};
use futures::StreamExt as _;
use serde_json::json;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use tokio::time::Instant;

use super::nats;
use super::process_stats::status_kb;
use super::stats::percentile;
use super::support::{GatewayChild, gateway_binary, http_client, server_version};

const STREAM: &str = "PROD";
const BATCH: usize = 100;
const BATCH_CLIENTS: usize = 4;
const SINGLE_CLIENTS: usize = 8;
const PAYLOAD: usize = 256;

pub(crate) async fn run(args: &super::args::Args) -> anyhow::Result<()> {
    let server = nats::NatsServer::start().await;
    let version = server_version(&nats::nats_server_binary())?;
    let client = async_nats::ConnectOptions::new()
        .request_timeout(Some(Duration::from_secs(30)))
        .connect(server.url())
        .await?;
    let js = jetstream::new(client.clone());
    js.create_stream(stream::Config {
        name: STREAM.into(),
        subjects: vec!["prod.>".into(), format!("_RUSTSTREAM.schedule.{STREAM}.>")],
        allow_atomic_publish: true,
        allow_message_schedules: true,
        ..Default::default()
    })
    .await?;
    let logs = tempfile::Builder::new()
        .prefix("bench-producers-")
        .tempdir()?;
    let http = http_client()?;
    let gateway = GatewayChild::start_on(
        &gateway_binary(args)?,
        &server.url(),
        (STREAM, "reader"),
        &["--filter-subject".into(), "prod.>".into()],
        &args.gateway_env,
        logs.path().join("gateway.log"),
        &http,
    )
    .await?;
    let batches = (args.messages as usize / (BATCH * BATCH_CLIENTS)).max(1);
    let messages = batches * BATCH * BATCH_CLIENTS;
    eprintln!(
        "bench --producers: {version}; {messages} messages of {PAYLOAD} B a round, {} rounds",
        args.rounds
    );
    let body = |atomic: bool, round: u32, client: usize, batch: usize| {
        json!({
            "atomic": atomic,
            "messages": (0..BATCH).map(|i| json!({
                "subject": "prod.gateway",
                "data": "x".repeat(PAYLOAD),
                "msg_id": format!("{atomic}-{round}-{client}-{batch}-{i}"),
            })).collect::<Vec<_>>()
        })
        .to_string()
    };
    for atomic in [false, true] {
        let (mut gateway_rates, mut native_rates, mut ratios) =
            (Vec::new(), Vec::new(), Vec::new());
        for round in 0..args.rounds {
            // Every request body made before the clock starts, as the native side's
            // messages are: the figure is the gateway's, not the bench's JSON building.
            let bodies: Vec<Vec<String>> = (0..BATCH_CLIENTS)
                .map(|client| {
                    (0..batches)
                        .map(|batch| body(atomic, round, client, batch))
                        .collect()
                })
                .collect();
            let started = Instant::now();
            let url = format!("{}/publish/batch", gateway.base);
            let loops = bodies.into_iter().map(|bodies| {
                let (http, url) = (http.clone(), url.clone());
                async move {
                    for body in bodies {
                        let response = http
                            .post(&url)
                            .header("content-type", "application/json")
                            .body(body)
                            .send()
                            .await?;
                        let status = response.status().as_u16();
                        let answer = response.bytes().await?;
                        if atomic {
                            let stored: AtomicAnswer = serde_json::from_slice(&answer)
                                .with_context(|| format!("atomic batch: {status}"))?;
                            ensure!(
                                status == 201 && stored.count == BATCH,
                                "atomic batch: {status} {stored:?}"
                            );
                        } else {
                            let answer: BatchAnswer = serde_json::from_slice(&answer)
                                .with_context(|| format!("batch: {status}"))?;
                            let stored = answer
                                .results
                                .iter()
                                .filter(|result| result.status == 201)
                                .count();
                            ensure!(
                                status == 200 && stored == BATCH,
                                "batch: {status}, {stored} stored"
                            );
                        }
                    }
                    anyhow::Ok(())
                }
            });
            for outcome in futures::future::join_all(loops).await {
                outcome?;
            }
            let gateway_rate = messages as f64 / started.elapsed().as_secs_f64();
            let native_rate =
                native_batches(&client, &js, atomic, round, batches, messages).await?;
            gateway_rates.push(gateway_rate);
            native_rates.push(native_rate);
            ratios.push(gateway_rate / native_rate);
        }
        println!(
            "| {} of {BATCH} × {PAYLOAD} B, {BATCH_CLIENTS} clients | {:.0} msg/s; native {:.0} msg/s; ratio {:.2} (median of {}) |",
            if atomic {
                "atomic batches"
            } else {
                "POST /publish/batch"
            },
            super::stats::median(gateway_rates).unwrap_or_default(),
            super::stats::median(native_rates).unwrap_or_default(),
            super::stats::median(ratios).unwrap_or_default(),
            args.rounds
        );
    }

    let singles = (args.messages as usize / SINGLE_CLIENTS).max(1);
    let started = Instant::now();
    let loops = (0..SINGLE_CLIENTS).map(|_| {
        let (http, url) = (http.clone(), format!("{}/publish", gateway.base));
        async move {
            for _ in 0..singles {
                let response = http
                    .post(&url)
                    .json(&json!({"subject": "prod.single", "data": "x".repeat(PAYLOAD)}))
                    .send()
                    .await?;
                ensure!(response.status() == 201, "publish: {}", response.status());
            }
            anyhow::Ok(())
        }
    });
    for outcome in futures::future::join_all(loops).await {
        outcome?;
    }
    println!(
        "| single POST /publish, {SINGLE_CLIENTS} clients | {:.0} msg/s |",
        (singles * SINGLE_CLIENTS) as f64 / started.elapsed().as_secs_f64()
    );

    schedules(args, &js, &gateway, &http).await?;
    gateway.stop().await
}

/// The same batches with async-nats alone; messages a second.
async fn native_batches(
    client: &async_nats::Client,
    js: &jetstream::Context,
    atomic: bool,
    round: u32,
    batches: usize,
    messages: usize,
) -> anyhow::Result<f64> {
    // Every message's headers made before the clock starts, as the gateway's bodies are.
    let work: Vec<Vec<Vec<(String, HeaderMap)>>> = (0..BATCH_CLIENTS)
        .map(|client_index| {
            (0..batches)
                .map(|batch| {
                    (0..BATCH)
                        .map(|i| {
                            let id = format!("native-{atomic}-{round}-{client_index}-{batch}-{i}");
                            let mut headers = HeaderMap::new();
                            headers.insert("Nats-Msg-Id", id.as_str());
                            (id, headers)
                        })
                        .collect()
                })
                .collect()
        })
        .collect();
    let payload = bytes::Bytes::from(vec![b'x'; PAYLOAD]);
    let started = Instant::now();
    let loops = work.into_iter().map(|batches| {
        let (client, js, payload) = (client.clone(), js.clone(), payload.clone());
        async move {
            for batch in batches {
                if atomic {
                    native_atomic(&client, batch, &payload).await?;
                } else {
                    let mut acks = Vec::with_capacity(BATCH);
                    for (_, headers) in batch {
                        acks.push(
                            js.publish_with_headers("prod.native", headers, payload.clone())
                                .await?,
                        );
                    }
                    for ack in
                        futures::future::join_all(acks.into_iter().map(|ack| ack.into_future()))
                            .await
                    {
                        ack?;
                    }
                }
            }
            anyhow::Ok(())
        }
    });
    for outcome in futures::future::join_all(loops).await {
        outcome?;
    }
    Ok(messages as f64 / started.elapsed().as_secs_f64())
}

/// One nats-server atomic batch, as the gateway speaks it: `(msg id, headers)` per message,
/// the batch named after the first id.
async fn native_atomic(
    client: &async_nats::Client,
    messages: Vec<(String, HeaderMap)>,
    payload: &bytes::Bytes,
) -> anyhow::Result<()> {
    let count = messages.len();
    let batch_id = messages
        .first()
        .map(|(id, _)| id.clone())
        .unwrap_or_default();
    for (index, (_, mut headers)) in messages.into_iter().enumerate() {
        headers.insert("Nats-Batch-Id", batch_id.as_str());
        headers.insert("Nats-Batch-Sequence", (index + 1).to_string().as_str());
        let last = index + 1 == count;
        if last {
            headers.insert("Nats-Batch-Commit", "1");
        }
        let payload = payload.clone();
        if index > 0 && !last {
            client
                .publish_with_headers("prod.native", headers, payload)
                .await?;
            continue;
        }
        let reply = client
            .request_with_headers("prod.native", headers, payload)
            .await?;
        if last {
            let ack: serde_json::Value = serde_json::from_slice(&reply.payload)?;
            ensure!(ack["count"] == count, "native atomic batch: {ack}");
        } else {
            ensure!(
                reply.payload.is_empty(),
                "native batch start: {:?}",
                reply.payload
            );
        }
    }
    Ok(())
}

/// The parts of a batch answer the bench checks.
#[derive(Debug, serde::Deserialize)]
struct BatchAnswer {
    results: Vec<ItemStatus>,
}

#[derive(Debug, serde::Deserialize)]
struct ItemStatus {
    status: u16,
}

#[derive(Debug, serde::Deserialize)]
struct AtomicAnswer {
    count: usize,
}

/// `--schedules` one-shot schedules due over 20 s: how late each fired, and the gateway's
/// memory.
async fn schedules(
    args: &super::args::Args,
    js: &jetstream::Context,
    gateway: &GatewayChild,
    http: &reqwest::Client,
) -> anyhow::Result<()> {
    const PER_REQUEST: usize = 1000;
    let count = args.schedules as usize;
    let rss_before = status_kb(gateway.pid, "VmRSS").unwrap_or_default();
    let made = Instant::now();
    // Due from 30 s after the start over the next 20 s, so that all are made before the
    // first is due.
    let first_due = OffsetDateTime::now_utc() + time::Duration::seconds(30);
    let url = format!("{}/publish/batch", gateway.base);
    let requests = futures::stream::iter((0..count).step_by(PER_REQUEST).map(|start| {
        let (http, url) = (http.clone(), url.clone());
        async move {
            let messages: Vec<_> = (start..(start + PER_REQUEST).min(count))
                .map(|i| {
                    let due = first_due + time::Duration::milliseconds((i * 20_000 / count) as i64);
                    json!({"subject": "prod.scheduled", "data": "x", "deliver_at": due.format(&Rfc3339).unwrap_or_default()})
                })
                .collect();
            let sent = messages.len();
            let answer: serde_json::Value =
                http.post(&url).json(&json!({ "messages": messages })).send().await?.json().await?;
            let scheduled = answer["results"].as_array().map_or(0, |results| {
                results.iter().filter(|result| result["status"] == 202).count()
            });
            ensure!(scheduled == sent, "schedules: {answer}");
            anyhow::Ok(())
        }
    }))
    .buffer_unordered(4)
    .collect::<Vec<_>>()
    .await;
    for request in requests {
        request?;
    }
    let made_secs = made.elapsed().as_secs_f64();
    ensure!(
        OffsetDateTime::now_utc() < first_due,
        "making {count} schedules took {made_secs:.1} s, past the first one's time"
    );
    let rss_made = status_kb(gateway.pid, "VmRSS").unwrap_or_default();
    let stream = js.get_stream(STREAM).await?;
    let reader = stream
        .create_consumer(consumer::pull::OrderedConfig {
            filter_subject: "prod.scheduled".into(),
            ..Default::default()
        })
        .await?;
    let mut fired = reader.messages().await?;
    let mut lateness = Vec::with_capacity(count);
    let deadline = Instant::now() + Duration::from_secs(120);
    while lateness.len() < count {
        let message = tokio::time::timeout_at(deadline, fired.next())
            .await
            .context("the schedules did not all fire within 120 s")?
            .context("the reader ended")??;
        let due = message
            .headers
            .as_ref()
            .and_then(|headers| headers.get("Ruststream-Scheduled-At"))
            .context("a fired message without Ruststream-Scheduled-At")?;
        let due = OffsetDateTime::parse(due.as_str(), &Rfc3339)?;
        let stored = message
            .info()
            .map_err(|err| anyhow::anyhow!("{err}"))?
            .published;
        let late = (stored - due).whole_microseconds().max(0);
        lateness.push(u32::try_from(late).unwrap_or(u32::MAX));
    }
    let rss_after = status_kb(gateway.pid, "VmRSS").unwrap_or_default();
    let max = lateness.iter().max().copied().unwrap_or_default();
    println!(
        "| {count} one-shot schedules over 20 s | made in {made_secs:.1} s; fired late p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms; gateway RSS {} → {} → {} MB |",
        percentile(&mut lateness, 0.50),
        percentile(&mut lateness, 0.99),
        f64::from(max) / 1e3,
        rss_before / 1024,
        rss_made / 1024,
        rss_after / 1024
    );
    Ok(())
}
