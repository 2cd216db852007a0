//! The default scenario, the drains: one stream published up front, then every round the
//! native run and each gateway run (and the publish → event latency), then the report.

use std::future::IntoFuture as _;
use std::time::Duration;

use anyhow::{Context as _, ensure};
use async_nats::jetstream::{self, stream};
use bytes::Bytes;
use futures::future::join_all;
use tokio::time::Instant;

use super::args::{Args, Kind};
use super::event_latency::{event_latency, native_event_latency};
use super::gateway_drain::drain_gateway;
use super::native_drain::drain_native;
use super::outcome::{Outcome, Run};
use super::report::print_report;
use super::stats::{Percentiles, median};
use super::support::{PUBLISH_CHUNK, STREAM, SUBJECT, gateway_binary, start_nats_server};

pub(crate) async fn bench(args: &Args) -> anyhow::Result<()> {
    let (server, version) = start_nats_server().await?;
    let gateway_bin = gateway_binary(args)?;
    eprintln!(
        "bench: {version} at {}; gateway {}",
        server.url(),
        gateway_bin.display()
    );

    let client = async_nats::ConnectOptions::new()
        .request_timeout(Some(Duration::from_secs(30)))
        .connect(server.url())
        .await
        .with_context(|| format!("connecting to {}", server.url()))?;
    let js = jetstream::new(client.clone());
    let payload = Bytes::from(vec![b'x'; args.payload_bytes as usize]);
    let wanted = |kind: Kind| args.scenarios.is_empty() || args.scenarios.contains(&kind);
    let mut runs = Vec::new();
    if wanted(Kind::Native) {
        runs.push(Run {
            kind: Kind::Native,
            clients: 1,
        });
    }
    for kind in [
        Kind::Batch,
        Kind::Single,
        Kind::Forwarded,
        Kind::Floor,
        Kind::Traced,
    ] {
        if wanted(kind) {
            runs.extend(args.clients.iter().map(|&clients| Run { kind, clients }));
        }
    }
    if wanted(Kind::Latency) {
        runs.push(Run {
            kind: Kind::Latency,
            clients: 1,
        });
    }
    for kind in [Kind::WsEach, Kind::WsHundred, Kind::SseBatch] {
        if wanted(kind) {
            runs.push(Run { kind, clients: 1 });
        }
    }
    let needed = args.messages.max(args.latency_samples);
    prepare_stream(&js, needed * 2, &payload).await?;
    let logs = tempfile::Builder::new()
        .prefix("bench-gateway-")
        .tempdir()
        .context("a directory for the gateway logs")?;

    let mut outcomes = Vec::new();
    let mut event_latencies = Vec::new();
    let mut n = 0;
    for round in 1..=args.rounds {
        if wanted(Kind::EventLatency) {
            eprintln!(
                "bench: event-latency (round {round}): {} messages published while a stream is open …",
                args.latency_samples
            );
            let (p50, p99) =
                event_latency(&js, &server.url(), args, round, &gateway_bin, logs.path())
                    .await
                    .with_context(|| format!("event-latency (round {round})"))?;
            let (native_p50, native_p99) = native_event_latency(&js, args, round)
                .await
                .with_context(|| format!("native event-latency (round {round})"))?;
            eprintln!(
                "bench: event-latency (round {round}): p50 {p50:.3} ms, p99 {p99:.3} ms (native messages(): {native_p50:.3} / {native_p99:.3} ms)"
            );
            event_latencies.push(((p50, p99), (native_p50, native_p99)));
        }
        for &run in &runs {
            n += 1;
            let consumer = format!("c{n}");
            let total = if run.kind == Kind::Latency {
                args.latency_samples
            } else {
                args.messages
            };
            eprintln!(
                "bench: {} (round {round}): draining {total} messages …",
                run.label()
            );
            let outcome = match run.kind {
                Kind::Native => drain_native(&client, &js, &consumer, args, total).await,
                _ => {
                    drain_gateway(
                        run,
                        &js,
                        &server.url(),
                        &consumer,
                        args,
                        total,
                        &gateway_bin,
                        logs.path(),
                    )
                    .await
                }
            }
            .with_context(|| format!("{} (round {round})", run.label()))?;
            eprintln!(
                "bench: {} (round {round}): {:.0} msg/s ({:.3} s){}",
                run.label(),
                outcome.rate(),
                outcome.seconds,
                outcome
                    .gateway
                    .as_ref()
                    .map(|g| format!(
                        ", gateway CPU {:.1} µs/msg",
                        g.cpu_micros_per_message(outcome.messages)
                    ))
                    .unwrap_or_default()
            );
            js.delete_consumer_from_stream(&consumer, STREAM)
                .await
                .with_context(|| format!("deleting consumer {consumer}"))?;
            outcomes.push(Outcome { round, ..outcome });
        }
    }

    print_report(args, &version, &runs, &outcomes);
    if !event_latencies.is_empty() {
        let (gateway, native): (Vec<Percentiles>, Vec<Percentiles>) =
            event_latencies.into_iter().unzip();
        let show = |pairs: Vec<Percentiles>| {
            let (p50s, p99s): (Vec<f64>, Vec<f64>) = pairs.into_iter().unzip();
            let one = |values| median(values).map_or_else(|| "-".into(), |v| format!("{v:.2}"));
            format!("{} ms / {} ms", one(p50s), one(p99s))
        };
        println!(
            "| publish → event on an open stream, messages flowing (one a ms), p50 / p99 | {} | ≤ 0.5 ms / ≤ 2 ms |",
            show(gateway)
        );
        println!(
            "| the same, native async-nats `messages()` (each acked), p50 / p99 | {} | |",
            show(native)
        );
    }
    if args.keep_logs {
        let kept = logs.keep();
        println!("gateway logs kept in {}", kept.display());
    }
    drop(client);
    drop(server);
    Ok(())
}

/// Create the stream and publish `count` messages to it (acks awaited in chunks).
async fn prepare_stream(
    js: &jetstream::Context,
    count: u64,
    payload: &Bytes,
) -> anyhow::Result<()> {
    js.create_stream(stream::Config {
        name: STREAM.to_string(),
        subjects: vec!["bench.>".to_string()],
        ..Default::default()
    })
    .await
    .context("creating the stream")?;

    let started = Instant::now();
    let mut remaining = count;
    let mut last_sequence = 0;
    while remaining > 0 {
        let chunk = remaining.min(PUBLISH_CHUNK as u64);
        let mut acks = Vec::with_capacity(chunk as usize);
        for _ in 0..chunk {
            acks.push(
                js.publish(SUBJECT, payload.clone())
                    .await
                    .context("publishing")?
                    .into_future(),
            );
        }
        for ack in join_all(acks).await {
            last_sequence = last_sequence.max(ack.context("publish ack")?.sequence);
        }
        remaining -= chunk;
    }
    ensure!(
        last_sequence == count,
        "the stream ends at sequence {last_sequence} after publishing {count} messages"
    );
    eprintln!(
        "bench: published {count} messages of {} bytes in {:.3} s",
        payload.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
