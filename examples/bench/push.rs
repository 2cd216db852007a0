//! `scripts/bench.sh --push`: push delivery against a native forwarder in the same run.
//!
//! An endpoint in the benchmark process answers every request 204 at once. Each round
//! drains `--messages` messages (of `--payload-bytes`) four ways, each through a durable
//! consumer of its own on one stream:
//!
//! - **native forwarder, batch 1**: async-nats `messages()` on a pull consumer, an HTTP POST
//!   per message (the message as JSON with the fields the gateway sends but the lease's,
//!   its data base64, and the Standard Webhooks id and timestamp headers), 64 in flight,
//!   then a confirmed ack (`double_ack`) of each;
//! - **gateway push, batch 1**: a consumer with a `[consumer.push]` table (`max_in_flight`
//!   64) pushing to the same endpoint;
//! - **native forwarder, batch 100**: `messages()` in chunks of up to 100, one POST of
//!   `{"messages": […]}` per chunk, 64 chunks in flight, then the chunk's confirmed acks;
//! - **gateway push, batch 100**: `batch = 100`.
//!
//! A drain is timed from its first request to the last confirmed ack (the consumer's
//! `num_ack_pending` and `num_pending` both 0 for the gateway; every ack awaited for the
//! native side). Then the latency row: one message a millisecond for 2 s to a fresh push
//! consumer, each timed from its publish to its request's arrival (p50, p99), the first 100
//! a warm-up left out. The overload and idle rows are `push_pacing`'s; `--push-row` picks
//! rows.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context as _, ensure};
use async_nats::jetstream::{self, consumer, stream};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use futures::StreamExt as _;
use tokio::time::Instant;

use super::args::PushRow;
use super::nats;
use super::stats::median;
use super::support::{AbortOnDrop, GatewayChild, gateway_with, http_client, server_version};

const STREAM: &str = "PUSHB";
const IN_FLIGHT: usize = 64;
/// Messages of the latency row, one a millisecond.
const LATENCY_MESSAGES: usize = 2000;
/// The first probes, left out of the latency figures.
const LATENCY_WARM_UP: usize = 100;

/// What the endpoint has seen: messages (a batch counts each), and when each latency probe
/// (a payload `probe-<n>`) arrived.
#[derive(Default)]
struct Seen {
    messages: AtomicU64,
    probes: Mutex<Vec<(usize, Instant)>>,
}

async fn endpoint(seen: Arc<Seen>) -> anyhow::Result<(String, AbortOnDrop)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .context("binding the endpoint")?;
    let url = format!("http://{}/hook", listener.local_addr()?);
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(move |body: axum::body::Bytes| {
            let seen = seen.clone();
            async move {
                let at = Instant::now();
                let value: serde_json::Value =
                    serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
                let messages = match value.get("messages").and_then(|m| m.as_array()) {
                    Some(all) => all.clone(),
                    None => vec![value],
                };
                seen.messages
                    .fetch_add(messages.len() as u64, Ordering::Relaxed);
                for message in &messages {
                    let data = message["data"].as_str().unwrap_or_default();
                    let payload = STANDARD.decode(data).unwrap_or_default();
                    if let Some(n) = std::str::from_utf8(&payload)
                        .ok()
                        .and_then(|text| text.strip_prefix("probe-"))
                        .and_then(|n| n.parse().ok())
                        && let Ok(mut probes) = seen.probes.lock()
                    {
                        probes.push((n, at));
                    }
                }
                axum::http::StatusCode::NO_CONTENT
            }
        }),
    );
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok((url, AbortOnDrop(task)))
}

/// A message as the gateway's json format sends it: every field of the message the gateway
/// sends (all but its lease's id and expiry, which only a lease has), so the endpoint is
/// given the same work by both; serialized from a typed struct, as a careful forwarder would.
#[derive(serde::Serialize)]
struct Forwarded<'a> {
    subject: &'a str,
    data: String,
    encoding: &'static str,
    headers: std::collections::BTreeMap<String, Vec<&'a str>>,
    stream: Option<&'a str>,
    consumer: Option<&'a str>,
    stream_sequence: Option<u64>,
    consumer_sequence: Option<u64>,
    delivered: Option<i64>,
    pending: Option<u64>,
    published_at: Option<String>,
}

/// A batch, as the gateway's json format sends one.
#[derive(serde::Serialize)]
struct ForwardedBatch<'a> {
    messages: Vec<Forwarded<'a>>,
}

fn as_json(message: &jetstream::Message) -> Forwarded<'_> {
    let info = message.info().ok();
    let mut headers = std::collections::BTreeMap::new();
    if let Some(map) = &message.headers {
        for (name, values) in map.iter() {
            headers.insert(
                name.to_string(),
                values.iter().map(|value| value.as_str()).collect(),
            );
        }
    }
    Forwarded {
        subject: message.subject.as_str(),
        data: STANDARD.encode(&message.payload),
        encoding: "base64",
        headers,
        stream: info.as_ref().map(|info| info.stream),
        consumer: info.as_ref().map(|info| info.consumer),
        stream_sequence: info.as_ref().map(|info| info.stream_sequence),
        consumer_sequence: info.as_ref().map(|info| info.consumer_sequence),
        delivered: info.as_ref().map(|info| info.delivered),
        pending: info.as_ref().map(|info| info.pending),
        published_at: info.as_ref().and_then(|info| {
            info.published
                .format(&time::format_description::well_known::Rfc3339)
                .ok()
        }),
    }
}

/// The Standard Webhooks headers every request of the gateway carries (no signature: the
/// benchmark's push table has no secret): `webhook-id` of the first message, the time now.
fn webhook_headers(first: Option<&jetstream::Message>) -> reqwest::header::HeaderMap {
    let mut headers = reqwest::header::HeaderMap::new();
    let id = first
        .and_then(|message| message.info().ok())
        .map(|info| format!("{}:{}", info.stream, info.stream_sequence))
        .unwrap_or_default();
    let timestamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    if let Ok(id) = id.parse() {
        headers.insert("webhook-id", id);
    }
    headers.insert("webhook-timestamp", timestamp.into());
    headers
}

/// A gateway serving only the consumer of `entry` (the lines of one `[[consumer]]` of
/// stream STREAM after `stream = …`), and the directory of its consumers file and log.
async fn pushing(
    args: &super::args::Args,
    nats_url: &str,
    entry: &str,
) -> anyhow::Result<(GatewayChild, tempfile::TempDir)> {
    gateway_with(
        args,
        nats_url,
        STREAM,
        &format!("[[consumer]]\nstream = \"{STREAM}\"\n{entry}"),
    )
    .await
}

/// The native forwarder: fetch, POST (one message or a chunk of up to `batch`), confirmed ack.
async fn native(
    js: &jetstream::Context,
    name: &str,
    url: &str,
    messages: u64,
    batch: usize,
) -> anyhow::Result<Duration> {
    let stream = js.get_stream(STREAM).await?;
    let consumer: consumer::PullConsumer = stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some(name.to_owned()),
            ack_policy: consumer::AckPolicy::Explicit,
            ..Default::default()
        })
        .await?;
    let http = http_client()?;
    let acked = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let incoming = consumer.messages().await?.take(messages as usize);
    incoming
        .ready_chunks(batch)
        .for_each_concurrent(IN_FLIGHT, |chunk| {
            let (http, acked) = (http.clone(), acked.clone());
            async move {
                let chunk: Vec<jetstream::Message> = chunk.into_iter().flatten().collect();
                let body = if batch == 1 {
                    chunk
                        .first()
                        .map(|first| serde_json::to_vec(&as_json(first)))
                } else {
                    Some(serde_json::to_vec(&ForwardedBatch {
                        messages: chunk.iter().map(as_json).collect(),
                    }))
                };
                let Some(Ok(body)) = body else {
                    return;
                };
                let answered = http
                    .post(url)
                    .headers(webhook_headers(chunk.first()))
                    .header(reqwest::header::CONTENT_TYPE, "application/json")
                    .body(body)
                    .send()
                    .await;
                if answered.is_ok_and(|answer| answer.status().is_success()) {
                    let acks = chunk.iter().map(|message| message.double_ack());
                    let done = futures::future::join_all(acks).await;
                    acked.fetch_add(
                        done.iter().filter(|done| done.is_ok()).count() as u64,
                        Ordering::Relaxed,
                    );
                }
            }
        })
        .await;
    ensure!(
        acked.load(Ordering::Relaxed) == messages,
        "the native forwarder acked {} of {messages}",
        acked.load(Ordering::Relaxed)
    );
    Ok(started.elapsed())
}

/// The gateway pushing `name` (made by the gateway from its consumers file) until every
/// message is acked.
#[allow(clippy::too_many_arguments)]
async fn gateway(
    args: &super::args::Args,
    js: &jetstream::Context,
    nats_url: &str,
    name: &str,
    url: &str,
    batch: usize,
    seen: &Seen,
    messages: u64,
) -> anyhow::Result<(Duration, f64)> {
    let before = seen.messages.load(Ordering::Relaxed);
    let (gateway, _dir) = pushing(
        args,
        nats_url,
        &format!("name = \"{name}\"\n\n[consumer.push]\nurl = \"{url}\"\nbatch = {batch}\nmax_in_flight = {IN_FLIGHT}\n"),
    )
    .await?;
    let deadline = Instant::now() + Duration::from_secs(120);
    while seen.messages.load(Ordering::Relaxed) == before {
        ensure!(Instant::now() < deadline, "no push arrived");
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    let started = Instant::now();
    let cpu_before = super::process_stats::cpu_seconds(gateway.pid).unwrap_or_default();
    let stream = js.get_stream(STREAM).await?;
    // The server is asked only once every message arrived: a question to it every 2 ms
    // while the push runs would cost the server (so the gateway) what the native side
    // never pays.
    while seen.messages.load(Ordering::Relaxed) < before + messages {
        ensure!(Instant::now() < deadline, "not every message arrived");
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    loop {
        let info = stream
            .consumer_info(name)
            .await
            .map_err(|err| anyhow::anyhow!("{err}"))?;
        if info.num_pending == 0
            && info.num_ack_pending == 0
            && info.ack_floor.stream_sequence >= messages
        {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "the push did not finish: {info:?}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let took = started.elapsed();
    let cpu = super::process_stats::cpu_seconds(gateway.pid).unwrap_or_default() - cpu_before;
    gateway.stop().await?;
    Ok((took, cpu))
}

pub(crate) async fn run(args: &super::args::Args) -> anyhow::Result<()> {
    let wants = |row: PushRow| args.push_rows.is_empty() || args.push_rows.contains(&row);
    let monitor_port = nats::free_port();
    let server =
        nats::NatsServer::with_config(&format!("http: \"127.0.0.1:{monitor_port}\"")).await;
    let monitor = format!("http://127.0.0.1:{monitor_port}");
    let version = server_version(&nats::nats_server_binary())?;
    let client = async_nats::connect(server.url()).await?;
    let js = jetstream::new(client);
    js.create_stream(stream::Config {
        name: STREAM.into(),
        subjects: vec!["pushb.>".into()],
        ..Default::default()
    })
    .await?;
    let seen = Arc::new(Seen::default());
    let (url, _endpoint) = endpoint(seen.clone()).await?;
    eprintln!(
        "bench --push: {version}; {} messages a drain",
        args.messages
    );
    if wants(PushRow::Throughput) {
        throughput(args, &js, &server, &url, &seen, &monitor).await?;
    }
    if wants(PushRow::Latency) {
        latency(args, &js, &server.url(), &url, &seen).await?;
    }
    if wants(PushRow::Overload) {
        super::push_pacing::overload(args, &server.url()).await?;
    }
    if wants(PushRow::Idle) {
        super::push_pacing::idle(args).await?;
    }
    Ok(())
}

/// Batch 1 and 100, the gateway against the native forwarder, round by round.
async fn throughput(
    args: &super::args::Args,
    js: &jetstream::Context,
    server: &nats::NatsServer,
    url: &str,
    seen: &Seen,
    monitor: &str,
) -> anyhow::Result<()> {
    let nats_url = &server.url();
    let server_cpu = || {
        server
            .pid()
            .and_then(super::process_stats::cpu_seconds)
            .unwrap_or_default()
    };
    let http = http_client()?;
    let payload = bytes::Bytes::from(vec![b'x'; args.payload_bytes as usize]);
    let mut acks = Vec::new();
    for _ in 0..args.messages {
        acks.push(js.publish("pushb.msg", payload.clone()).await?);
        if acks.len() == super::support::PUBLISH_CHUNK {
            for ack in acks.drain(..) {
                ack.await?;
            }
        }
    }
    for ack in acks {
        ack.await?;
    }
    let rate = |took: Duration| args.messages as f64 / took.as_secs_f64();
    let mut ratios: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    for round in 0..args.rounds {
        for (at, batch) in [1usize, 100].into_iter().enumerate() {
            let counted = super::push_pacing::server_messages(&http, monitor).await?;
            let own_cpu =
                || super::process_stats::cpu_seconds(std::process::id()).unwrap_or_default();
            let cpu_before = own_cpu();
            let server_before = server_cpu();
            let native = native(
                js,
                &format!("native{round}b{batch}"),
                url,
                args.messages,
                batch,
            )
            .await?;
            let native_cpu = own_cpu() - cpu_before;
            let native_server_cpu = server_cpu() - server_before;
            let server_before = server_cpu();
            let native_messages =
                super::push_pacing::server_messages(&http, monitor).await? - counted;
            let cpu_before = own_cpu();
            let (pushed, gateway_cpu) = gateway(
                args,
                js,
                nats_url,
                &format!("push{round}b{batch}"),
                url,
                batch,
                seen,
                args.messages,
            )
            .await?;
            let endpoint_cpu = own_cpu() - cpu_before;
            let gateway_server_cpu = server_cpu() - server_before;
            let gateway_messages = super::push_pacing::server_messages(&http, monitor).await?
                - counted
                - native_messages;
            let ratio = rate(pushed) / rate(native);
            let per_message = |count: u64| count as f64 / args.messages as f64;
            let micros = |seconds: f64| seconds * 1e6 / args.messages as f64;
            eprintln!(
                "round {round}, batch {batch}: native {:.0} msg/s, gateway push {:.0} msg/s: {ratio:.2} \
                 (NATS messages at the server per message: native {:.2}, gateway {:.2}; CPU µs per \
                 message: native forwarder and endpoint {:.1}, gateway {:.1} and endpoint {:.1}; \
                 nats-server {:.1} and {:.1})",
                rate(native),
                rate(pushed),
                per_message(native_messages),
                per_message(gateway_messages),
                micros(native_cpu),
                micros(gateway_cpu),
                micros(endpoint_cpu),
                micros(native_server_cpu),
                micros(gateway_server_cpu),
            );
            ratios[at].push(ratio);
        }
    }
    println!(
        "push batch 1 ÷ native forwarder (median of {} rounds): {:.2}",
        args.rounds,
        median(ratios[0].clone()).unwrap_or_default()
    );
    println!(
        "push batch 100 ÷ native forwarder batching the same way: {:.2}",
        median(ratios[1].clone()).unwrap_or_default()
    );
    Ok(())
}

/// Publish → request received, one message a millisecond.
async fn latency(
    args: &super::args::Args,
    js: &jetstream::Context,
    nats_url: &str,
    url: &str,
    seen: &Seen,
) -> anyhow::Result<()> {
    // Latency: a fresh push consumer delivering new messages only, one published a millisecond (the first 100 a warm-up).
    let (gateway, _dir) = pushing(
        args,
        nats_url,
        &format!(
            "name = \"latency\"\ndeliver_policy = \"new\"\n\n[consumer.push]\nurl = \"{url}\"\n"
        ),
    )
    .await?;
    // Probes published before the consumer exists would never be delivered (policy new).
    let stream = js.get_stream(STREAM).await?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while stream
        .get_consumer::<consumer::pull::Config>("latency")
        .await
        .is_err()
    {
        ensure!(
            Instant::now() < deadline,
            "the latency consumer was not made"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut sent = Vec::with_capacity(LATENCY_MESSAGES);
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    for n in 0..LATENCY_MESSAGES {
        tick.tick().await;
        sent.push(Instant::now());
        js.publish("pushb.probe", format!("probe-{n}").into())
            .await?;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while seen.probes.lock().map_or(0, |probes| probes.len()) < LATENCY_MESSAGES {
        ensure!(Instant::now() < deadline, "not every probe arrived");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    gateway.stop().await?;
    let mut latencies: Vec<f64> = seen
        .probes
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .iter()
        // After a warm-up, as the event-latency row of the drains.
        .filter(|(n, _)| *n >= LATENCY_WARM_UP)
        .map(|(n, at)| at.duration_since(sent[*n]).as_secs_f64() * 1000.0)
        .collect();
    latencies.sort_by(f64::total_cmp);
    let percentile = |p: usize| latencies[(latencies.len() * p / 100).min(latencies.len() - 1)];
    println!(
        "publish → request received at 1 000 msg/s: p50 {:.2} ms, p99 {:.2} ms",
        percentile(50),
        percentile(99)
    );
    Ok(())
}
