//! `scripts/bench.sh --consumers`: one gateway serving many existing consumers through
//! `--serve-existing '*/*'` — each bound by its first fetch (one message leased and acked),
//! then all idle — and one of them drained beside a gateway that serves only it.
//!
//! The rows: the first fetch's latency on a consumer not yet bound (bind included, p50/p99),
//! the gateway's RSS after the idle period, the messages it sends NATS per second while all
//! are idle (from the server's own count of the connection's messages, `/connz`), and the
//! drain rate of fetch 100 + batch ack with 8 clients on one consumer, against a gateway
//! serving only that consumer in the same run.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context as _, anyhow, ensure};
use async_nats::jetstream::{self, consumer, stream};
use tokio::time::Instant;

use super::nats;
use super::process_stats::status_kb;
use super::support::{GatewayChild, gateway_binary, http_client, server_version};

/// What `--consumers` was asked for.
pub(crate) struct Scale {
    pub(crate) consumers: u32,
    pub(crate) streams: u32,
    pub(crate) idle: Duration,
    pub(crate) messages: u64,
}

/// The drain's clients, as the issue's row says.
const DRAIN_CLIENTS: usize = 8;
const DRAIN_BATCH: u32 = 100;

pub(crate) async fn run(scale: Scale, args: &super::args::Args) -> anyhow::Result<()> {
    let monitor = nats::free_port();
    let server = nats::NatsServer::with_config(&format!("http: \"127.0.0.1:{monitor}\"")).await;
    let version = server_version(&nats::nats_server_binary())?;
    let gateway_bin = gateway_binary(args)?;
    let client = async_nats::connect(server.url())
        .await
        .with_context(|| format!("connecting to {}", server.url()))?;
    let js = jetstream::new(client.clone());
    let per_stream = (scale.consumers / scale.streams).max(1);
    eprintln!(
        "bench --consumers: {version}; {} streams × {per_stream} durable consumers …",
        scale.streams
    );
    let mut names = Vec::new();
    for s in 0..scale.streams {
        let name = format!("SCALE{s}");
        let handle = js
            .create_stream(stream::Config {
                name: name.clone(),
                subjects: vec![format!("scale{s}.>")],
                ..Default::default()
            })
            .await
            .with_context(|| format!("creating stream {name}"))?;
        for c in 0..per_stream {
            handle
                .create_consumer(consumer::pull::Config {
                    durable_name: Some(format!("c{c}")),
                    ..Default::default()
                })
                .await
                .with_context(|| format!("creating consumer {name}/c{c}"))?;
            names.push((name.clone(), format!("c{c}")));
        }
        js.publish(format!("scale{s}.first"), "first".into())
            .await?
            .await
            .context("publishing the first message")?;
    }

    let logs = tempfile::Builder::new()
        .prefix("bench-consumers-")
        .tempdir()
        .context("a directory for the gateway logs")?;
    let http = http_client()?;
    let flags = vec![
        "--no-default-consumer".to_string(),
        "--serve-existing".into(),
        "*/*".into(),
    ];
    let gateway = GatewayChild::start(
        &gateway_bin,
        &server.url(),
        "none",
        &flags,
        &args.gateway_env,
        logs.path().join("many.log"),
        &http,
    )
    .await?;
    let started_rss = status_kb(gateway.pid, "VmRSS").unwrap_or(0);

    // First fetch of each consumer: bind included.
    let mut firsts = Vec::with_capacity(names.len());
    for (stream, name) in &names {
        let url = format!("{}/streams/{stream}/consumers/{name}/fetch", gateway.base);
        let at = Instant::now();
        let answer = http
            .post(&url)
            .body(r#"{"batch":1,"wait_ms":1000}"#)
            .send()
            .await
            .with_context(|| format!("first fetch of {stream}/{name}"))?;
        ensure!(
            answer.status() == 200,
            "first fetch of {stream}/{name}: {}",
            answer.status()
        );
        let body: serde_json::Value = answer.json().await?;
        firsts.push(at.elapsed());
        let ids: Vec<&str> = body["messages"]
            .as_array()
            .map(|all| all.iter().filter_map(|m| m["id"].as_str()).collect())
            .unwrap_or_default();
        ensure!(
            ids.len() == 1,
            "{stream}/{name}: expected the first message, got {body}"
        );
        let acked = http
            .post(format!("{}/messages/ack", gateway.base))
            .body(serde_json::json!({ "ids": ids }).to_string())
            .send()
            .await?;
        ensure!(
            acked.status() == 200,
            "ack on {stream}/{name}: {}",
            acked.status()
        );
    }
    firsts.sort();
    let percentile = |p: usize| firsts[(firsts.len() * p / 100).min(firsts.len() - 1)];
    eprintln!(
        "bench --consumers: {} bound; first fetch p50 {:?} p99 {:?}; idling {:?} …",
        firsts.len(),
        percentile(50),
        percentile(99),
        scale.idle
    );

    // Idle: what the gateway sends NATS over the second half of the idle period (a consumer
    // falls silent 10 s after its last request), counted by the server.
    tokio::time::sleep(scale.idle / 2).await;
    let sent_before = gateway_messages(&http, monitor).await?;
    let idle_from = Instant::now();
    tokio::time::sleep(scale.idle - scale.idle / 2).await;
    let sent_after = gateway_messages(&http, monitor).await?;
    let idle_rate = (sent_after - sent_before) as f64 / idle_from.elapsed().as_secs_f64();
    let idle_rss = status_kb(gateway.pid, "VmRSS").unwrap_or(0);

    // The drain: one of the many, then a gateway of that consumer alone.
    let subject = "scale0.drain";
    for n in 0..scale.messages {
        js.publish(subject, format!("m{n}").into()).await?;
    }
    js.publish(subject, "last".into()).await?.await?;
    let many_rate = drain(
        &http,
        &format!("{}/streams/SCALE0/consumers/c0/fetch", gateway.base),
        &gateway.base,
        scale.messages,
    )
    .await?;
    // A consumer of its own, from after the stream's first message (which c0 acked before
    // its drain): the same messages to drain.
    let solo_flags = vec!["--deliver-policy".to_string(), "by-start-sequence=2".into()];
    let solo = GatewayChild::start_on(
        &gateway_bin,
        &server.url(),
        ("SCALE0", "solo"),
        &solo_flags,
        &args.gateway_env,
        logs.path().join("solo.log"),
        &http,
    )
    .await?;
    let solo_rate = drain(
        &http,
        &format!("{}/fetch", solo.base),
        &solo.base,
        scale.messages,
    )
    .await?;

    let mb = |kb: u64| kb as f64 / 1024.0;
    println!();
    println!(
        "## {} consumers on {} streams, one gateway (--serve-existing '*/*'), {version}",
        names.len(),
        scale.streams
    );
    println!();
    println!("| row | figure | target |");
    println!("|---|---|---|");
    println!("| gateway RSS at start | {:.1} MB | – |", mb(started_rss));
    println!(
        "| gateway RSS after {} s idle, all bound once | {:.1} MB | ≤ 64 MB |",
        scale.idle.as_secs(),
        mb(idle_rss)
    );
    println!("| messages to NATS per second while all idle | {idle_rate:.1} | ≤ 5 |");
    println!(
        "| first fetch on a consumer not bound yet (bind included) | p50 {:.1} ms, p99 {:.1} ms | p99 ≤ 100 ms |",
        percentile(50).as_secs_f64() * 1e3,
        percentile(99).as_secs_f64() * 1e3
    );
    println!(
        "| fetch {DRAIN_BATCH} + batch ack, {DRAIN_CLIENTS} clients, one of the {} | {many_rate:.0} msg/s | – |",
        names.len()
    );
    println!("| the same on a gateway serving only that consumer | {solo_rate:.0} msg/s | – |");
    println!(
        "| ratio | {:.2} | ≥ 0.9 |",
        if solo_rate > 0.0 {
            many_rate / solo_rate
        } else {
            0.0
        }
    );
    drop(gateway);
    drop(solo);
    if args.keep_logs {
        println!("gateway logs kept in {}", logs.keep().display());
    }
    drop(client);
    drop(server);
    Ok(())
}

/// Messages the server received from the gateway's connection (named `ruststream-nats`).
async fn gateway_messages(http: &reqwest::Client, monitor: u16) -> anyhow::Result<u64> {
    let connz: serde_json::Value = http
        .get(format!("http://127.0.0.1:{monitor}/connz?limit=4096"))
        .send()
        .await
        .context("reading /connz")?
        .json()
        .await?;
    connz["connections"]
        .as_array()
        .and_then(|all| {
            all.iter()
                .filter(|c| c["name"] == "ruststream-nats")
                .map(|c| c["in_msgs"].as_u64())
                .sum::<Option<u64>>()
        })
        .ok_or_else(|| anyhow!("no gateway connection in /connz: {connz}"))
}

/// Drain `total` messages through `fetch_url` with [`DRAIN_CLIENTS`] clients, each fetching
/// [`DRAIN_BATCH`] and acking them in one batch; messages per second.
async fn drain(
    http: &reqwest::Client,
    fetch_url: &str,
    base: &str,
    total: u64,
) -> anyhow::Result<f64> {
    let acked = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let tasks: Vec<_> = (0..DRAIN_CLIENTS)
        .map(|_| {
            let (http, acked) = (http.clone(), acked.clone());
            let fetch_url = fetch_url.to_owned();
            let ack_url = format!("{base}/messages/ack");
            tokio::spawn(async move {
                while acked.load(Ordering::Relaxed) < total {
                    let body: serde_json::Value = http
                        .post(&fetch_url)
                        .body(format!(r#"{{"batch":{DRAIN_BATCH},"wait_ms":200}}"#))
                        .send()
                        .await?
                        .json()
                        .await?;
                    let ids: Vec<&str> = body["messages"]
                        .as_array()
                        .map(|all| all.iter().filter_map(|m| m["id"].as_str()).collect())
                        .unwrap_or_default();
                    if ids.is_empty() {
                        continue;
                    }
                    let answer = http
                        .post(&ack_url)
                        .body(serde_json::json!({ "ids": ids }).to_string())
                        .send()
                        .await?;
                    ensure!(answer.status() == 200, "batch ack: {}", answer.status());
                    acked.fetch_add(ids.len() as u64, Ordering::Relaxed);
                }
                anyhow::Ok(())
            })
        })
        .collect();
    for task in tasks {
        task.await??;
    }
    Ok(acked.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64())
}
