//! The gateway runs of the drains: a gateway child (two for the forwarded run, with an OTLP
//! sink for the traced one) drained by HTTP fetch and ack loops or a streaming client, its
//! CPU, log and memory measured, and nothing left in flight at the end.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context as _, bail, ensure};
use async_nats::jetstream;
use futures::future::join_all;
use serde_json::json;
use tokio::time::Instant;

use super::args::{Args, Kind};
use super::native_drain::verify_consumer;
use super::outcome::{Outcome, Run};
use super::process_stats::status_kb;
use super::streaming::{sse_loop, websocket_loop};
use super::support::{
    BatchReply, ConsumerReply, FETCH_WAIT, FetchReply, GatewayChild, STREAM, http_client, otlp_sink,
};
use super::tally::{Tally, run_loops};

#[allow(clippy::too_many_arguments)]
pub(crate) async fn drain_gateway(
    run: Run,
    js: &jetstream::Context,
    nats_url: &str,
    consumer: &str,
    args: &Args,
    total: u64,
    binary: &Path,
    logs: &Path,
) -> anyhow::Result<Outcome> {
    let http = http_client()?;
    let mut flags = args.gateway_flags.clone();
    if run.kind == Kind::Forwarded {
        // Replicas must share the key that signs lease ids.
        let key = logs.join(format!("{consumer}.key"));
        std::fs::write(
            &key,
            "bench replicas share this lease key: 0123456789abcdef",
        )
        .context("writing the lease key")?;
        flags.extend(["--lease-key-file".to_string(), key.display().to_string()]);
    }
    // Kept until the drain ends: the traced gateway exports to it.
    let _sink = if run.kind == Kind::Traced {
        let (address, sink) = otlp_sink().await?;
        flags.push(format!("--otlp-endpoint=http://{address}"));
        Some(sink)
    } else {
        None
    };
    let start = |log: &str| {
        GatewayChild::start(
            binary,
            nats_url,
            consumer,
            &flags,
            &args.gateway_env,
            logs.join(log),
            &http,
        )
    };
    let gateway = start(&format!("{consumer}.log")).await?;
    // The replica the batch acks go to, which forwards them to `gateway`.
    let settler = if run.kind == Kind::Forwarded {
        Some(start(&format!("{consumer}-settler.log")).await?)
    } else {
        None
    };
    let (lines_before, bytes_before) = gateway.log_size();

    let stream_len = args.messages.max(args.latency_samples) * 2;
    let tally = Arc::new(Tally::new(total, stream_len, Some(gateway.pid)));
    let requests = Arc::new(AtomicU64::new(0));
    let batch = if run.kind == Kind::Latency {
        1
    } else {
        args.batch
    };
    // Base64 with padding, the gateway's default encoding.
    let data_len = (args.payload_bytes as usize).div_ceil(3) * 4;
    let base = gateway.base.clone();
    let settle_base = settler
        .as_ref()
        .map_or_else(|| base.clone(), |settler| settler.base.clone());
    if run.kind == Kind::SseBatch {
        run_loops(run.clients, |_| {
            sse_loop(
                base.clone(),
                http.clone(),
                tally.clone(),
                requests.clone(),
                data_len,
            )
        })
        .await?;
    } else if matches!(run.kind, Kind::WsEach | Kind::WsHundred) {
        let per_op = if run.kind == Kind::WsEach { 1 } else { 100 };
        run_loops(run.clients, |_| {
            websocket_loop(
                base.clone(),
                tally.clone(),
                requests.clone(),
                per_op,
                data_len,
            )
        })
        .await?;
    } else {
        run_loops(run.clients, |_| {
            gateway_loop(
                run.kind,
                http.clone(),
                base.clone(),
                settle_base.clone(),
                tally.clone(),
                requests.clone(),
                batch,
                data_len,
            )
        })
        .await?;
    }
    let (lines_after, bytes_after) = gateway.log_size();
    let rss_kb = status_kb(gateway.pid, "VmHWM");
    let mut outcome = tally.finish(run)?;
    if let Some(figures) = outcome.gateway.as_mut() {
        figures.requests = requests.load(Ordering::Relaxed);
        figures.log_lines = lines_after - lines_before;
        figures.log_bytes = bytes_after - bytes_before;
        figures.rss_kb = rss_kb;
    }

    // A streaming client that closed with in-band acks unanswered leaves them finishing at
    // the gateway (they are not dropped with the socket): asked until none is in flight.
    let asked_from = Instant::now();
    let deadline = asked_from + Duration::from_secs(5);
    loop {
        let status: ConsumerReply = http
            .get(format!("{base}/consumer"))
            .send()
            .await
            .context("GET /consumer")?
            .error_for_status()
            .context("GET /consumer")?
            .json()
            .await
            .context("GET /consumer body")?;
        if status.leases_in_flight == 0 {
            let waited = asked_from.elapsed();
            if waited > Duration::from_millis(5) {
                eprintln!(
                    "bench: {}: no lease in flight after {waited:?}",
                    run.label()
                );
            }
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "the gateway still reports {} leases in flight 5 s after every loop acked what it fetched",
            status.leases_in_flight
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stream = js.get_stream(STREAM).await.context("getting the stream")?;
    if matches!(run.kind, Kind::WsEach | Kind::WsHundred | Kind::SseBatch) {
        // A streaming client leaves with leases on their way (given back, nak'd) and the
        // gateway holding what its last pull brought: the stop releases it all.
        gateway.stop().await?;
        let info = stream
            .consumer_info(consumer)
            .await
            .with_context(|| format!("consumer info of {consumer}"))?;
        if info.num_ack_pending > 0 {
            // Not a failure of the drain (every message was acked once): what the stream's
            // last pull brought after the client left, left to the server's ack_wait.
            eprintln!(
                "bench: {}: consumer {consumer} holds {} unacknowledged deliveries after the client left and the gateway stopped (redelivered after ack_wait)",
                run.label(),
                info.num_ack_pending
            );
        }
    } else {
        verify_consumer(&stream, consumer).await?;
        gateway.stop().await?;
    }
    if let Some(settler) = settler {
        settler.stop().await?;
    }
    Ok(outcome)
}

#[allow(clippy::too_many_arguments)]
async fn gateway_loop(
    kind: Kind,
    http: reqwest::Client,
    base: String,
    settle_base: String,
    tally: Arc<Tally>,
    requests: Arc<AtomicU64>,
    batch: u32,
    data_len: usize,
) -> anyhow::Result<()> {
    let fetch_url = format!("{base}/fetch");
    let batch_ack_url = format!("{settle_base}/messages/ack");
    let healthz_url = format!("{base}/healthz");
    let fetch_body = json!({ "batch": batch, "wait_ms": FETCH_WAIT.as_millis() });
    let mut sequences = Vec::with_capacity(batch as usize);
    while !tally.is_done() {
        let fetch_started = Instant::now();
        let response = http
            .post(&fetch_url)
            .json(&fetch_body)
            .send()
            .await
            .context("POST /fetch")?;
        requests.fetch_add(1, Ordering::Relaxed);
        let status = response.status();
        if status != reqwest::StatusCode::OK {
            let body = response.text().await.unwrap_or_default();
            bail!("POST /fetch answered {status}: {body}");
        }
        let reply: FetchReply = response.json().await.context("POST /fetch body")?;
        let fetch_waited = fetch_started.elapsed();
        if reply.messages.is_empty() {
            tally.check_stall()?;
            continue;
        }
        tally.fetched(
            reply.messages.iter().map(|message| message.delivered),
            fetch_waited,
        );
        sequences.clear();
        for message in &reply.messages {
            ensure!(
                message.data.len() == data_len,
                "stream sequence {} came with {} data characters, expected {data_len}",
                message.stream_sequence,
                message.data.len()
            );
            sequences.push(message.stream_sequence);
        }

        if kind == Kind::Floor {
            let probes = reply.messages.iter().map(|_| {
                let request = http.get(&healthz_url).send();
                async move {
                    let response = request.await.context("GET /healthz")?;
                    ensure!(
                        response.status() == reqwest::StatusCode::OK,
                        "GET /healthz answered {}",
                        response.status()
                    );
                    // Read to the end, as a settle's answer is.
                    response.bytes().await.context("GET /healthz body")?;
                    Ok(())
                }
            });
            for result in join_all(probes).await {
                result?;
            }
            requests.fetch_add(reply.messages.len() as u64, Ordering::Relaxed);
        }
        let acks_started = Instant::now();
        match kind {
            Kind::Batch | Kind::Forwarded | Kind::Floor | Kind::Traced => {
                let ids: Vec<&str> = reply.messages.iter().map(|m| m.id.as_str()).collect();
                let response = http
                    .post(&batch_ack_url)
                    .json(&json!({ "ids": ids }))
                    .send()
                    .await
                    .context("POST /messages/ack")?;
                requests.fetch_add(1, Ordering::Relaxed);
                let status = response.status();
                if status != reqwest::StatusCode::OK {
                    let body = response.text().await.unwrap_or_default();
                    bail!("POST /messages/ack answered {status}: {body}");
                }
                let reply: BatchReply = response.json().await.context("POST /messages/ack body")?;
                ensure!(
                    reply.results.len() == ids.len(),
                    "POST /messages/ack answered {} results for {} ids",
                    reply.results.len(),
                    ids.len()
                );
                for ((result, id), sequence) in reply.results.iter().zip(&ids).zip(&sequences) {
                    ensure!(
                        result.id == *id,
                        "POST /messages/ack results out of request order: {} where {id} was expected",
                        result.id
                    );
                    ensure!(
                        result.status == 204,
                        "POST /messages/ack: stream sequence {sequence} answered {} ({:?})",
                        result.status,
                        result.detail
                    );
                }
            }
            Kind::Single | Kind::Latency => {
                let acks = reply.messages.iter().map(|message| {
                    let request = http
                        .post(format!("{base}/messages/{}/ack", message.id))
                        .send();
                    async move {
                        let response = request.await.with_context(|| {
                            format!(
                                "POST /messages/{{id}}/ack of stream sequence {}",
                                message.stream_sequence
                            )
                        })?;
                        let status = response.status();
                        if status != reqwest::StatusCode::NO_CONTENT {
                            let body = response.text().await.unwrap_or_default();
                            bail!(
                                "POST /messages/{{id}}/ack of stream sequence {} answered {status}: {body}",
                                message.stream_sequence
                            );
                        }
                        Ok(())
                    }
                });
                for result in join_all(acks).await {
                    result?;
                }
                requests.fetch_add(reply.messages.len() as u64, Ordering::Relaxed);
            }
            Kind::Native | Kind::WsEach | Kind::WsHundred | Kind::SseBatch | Kind::EventLatency => {
                unreachable!("the native and streaming runs have loops of their own")
            }
        }
        tally.acked(&sequences, acks_started.elapsed())?;
    }
    Ok(())
}
