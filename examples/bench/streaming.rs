//! The streaming clients of the drains: a `GET /events` (Server-Sent Events) loop that acks
//! over HTTP in batches, a `GET /ws` loop that acks in band, and the event-stream helpers
//! the publish → event latency run shares with them.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context as _, bail, ensure};
use futures::StreamExt as _;
use serde_json::json;
use tokio::time::Instant;

use super::support::{BatchReply, http_client};
use super::tally::Tally;

type WebSocket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// One in-band `ack` operation of `ids`, counted, its send time queued for its answer.
async fn send_acks(
    socket: &mut WebSocket,
    ids: Vec<String>,
    operations: &AtomicU64,
    sent_at: &mut std::collections::VecDeque<Instant>,
) -> anyhow::Result<()> {
    use futures::SinkExt as _;
    let frame = json!({ "op": "ack", "ids": ids }).to_string();
    socket
        .send(tokio_tungstenite::tungstenite::Message::Text(frame.into()))
        .await
        .context("sending an ack operation")?;
    operations.fetch_add(1, Ordering::Relaxed);
    sent_at.push_back(Instant::now());
    Ok(())
}

/// A lease written to a stream (an SSE event's or a WebSocket frame's message): checked for
/// its payload's length and counted as fetched; its stream sequence.
fn streamed(message: &serde_json::Value, data_len: usize, tally: &Tally) -> anyhow::Result<u64> {
    let sequence = message["stream_sequence"]
        .as_u64()
        .context("stream_sequence")?;
    let data = message["data"].as_str().unwrap_or_default();
    ensure!(
        data.len() == data_len,
        "stream sequence {sequence} came with {} data characters, expected {data_len}",
        data.len()
    );
    tally.fetched(
        std::iter::once(message["delivered"].as_u64().unwrap_or(1)),
        Duration::ZERO,
    );
    Ok(sequence)
}

/// Ids acked together by [`sse_loop`].
pub(crate) const SSE_ACK_BATCH: usize = 100;
/// Batch acks [`sse_loop`] has under way at once, as a client keeps reading the stream while
/// its acks are answered (the WebSocket loop likewise sends operations without waiting).
pub(crate) const SSE_ACKS_IN_FLIGHT: usize = 4;

/// Drain through `GET /events` (max_in_flight 1000): events are read as they come and their
/// ids acked over HTTP, 100 to a `POST /messages/ack` (what is left when no event came for a
/// moment), up to [`SSE_ACKS_IN_FLIGHT`] of those under way while reading goes on; a message
/// counts once its batch result says 204. At the end the client stops acking, reads what was
/// already written to it, and naks every lease it still holds.
pub(crate) async fn sse_loop(
    base: String,
    http: reqwest::Client,
    tally: Arc<Tally>,
    requests: Arc<AtomicU64>,
    data_len: usize,
) -> anyhow::Result<()> {
    let mut response = open_events(&http, &format!("{base}/events?max_in_flight=1000")).await?;
    let ack_url: Arc<str> = format!("{base}/messages/ack").into();
    let mut acks = tokio::task::JoinSet::new();
    let ack = |batch: Vec<(String, u64)>| {
        let (http, url, tally, requests) = (
            http.clone(),
            ack_url.clone(),
            tally.clone(),
            requests.clone(),
        );
        async move { ack_streamed(&http, &url, batch, &tally, &requests).await }
    };
    let mut text = String::new();
    let mut pending: Vec<(String, u64)> = Vec::with_capacity(SSE_ACK_BATCH);
    let mut held: Vec<String> = Vec::new();
    let mut draining = false;
    loop {
        if tally.is_done() && !draining {
            draining = true;
            held.extend(pending.drain(..).map(|(id, _)| id));
        }
        let wait = if draining {
            Duration::from_millis(300)
        } else if pending.is_empty() {
            Duration::from_secs(1)
        } else {
            Duration::from_millis(2)
        };
        let chunk = match tokio::time::timeout(wait, response.chunk()).await {
            Ok(chunk) => chunk
                .context("reading the event stream")?
                .context("the gateway ended the event stream")?,
            Err(_) if draining => break,
            Err(_) => {
                if pending.is_empty() {
                    tally.check_stall()?;
                } else {
                    let batch = std::mem::take(&mut pending);
                    under_way(&mut acks, SSE_ACKS_IN_FLIGHT - 1).await?;
                    acks.spawn(ack(batch));
                }
                continue;
            }
        };
        text.push_str(&String::from_utf8_lossy(&chunk));
        for message in complete_messages(&mut text)? {
            let id = message["id"].as_str().context("a lease id")?.to_owned();
            if draining {
                held.push(id);
                continue;
            }
            let sequence = streamed(&message, data_len, &tally)?;
            pending.push((id, sequence));
            if pending.len() >= SSE_ACK_BATCH {
                let batch = std::mem::replace(&mut pending, Vec::with_capacity(SSE_ACK_BATCH));
                under_way(&mut acks, SSE_ACKS_IN_FLIGHT - 1).await?;
                acks.spawn(ack(batch));
            }
        }
    }
    under_way(&mut acks, 0).await?;
    // Closed before the naks: naks while it is open would free its credit for the
    // redeliveries. What its last pull still brings, the gateway's stop releases.
    drop(response);
    nak_leftover(&http, &base, &held).await
}

/// Wait until at most `most` of `acks` are under way; the first that failed fails the loop.
pub(crate) async fn under_way(
    acks: &mut tokio::task::JoinSet<anyhow::Result<()>>,
    most: usize,
) -> anyhow::Result<()> {
    while acks.len() > most {
        if let Some(done) = acks.join_next().await {
            done.context("a batch ack task")??;
        }
    }
    Ok(())
}

/// `GET` an event stream at `url`, which must answer 200.
pub(crate) async fn open_events(
    http: &reqwest::Client,
    url: &str,
) -> anyhow::Result<reqwest::Response> {
    let response = http
        .get(url)
        .timeout(Duration::from_secs(3600))
        .send()
        .await
        .context("GET /events")?;
    ensure!(
        response.status() == reqwest::StatusCode::OK,
        "GET /events answered {}",
        response.status()
    );
    Ok(response)
}

/// The `message` events complete in `text` (taken out of it), each its `data:` as JSON;
/// comments and other events are dropped.
pub(crate) fn complete_messages(text: &mut String) -> anyhow::Result<Vec<serde_json::Value>> {
    let mut messages = Vec::new();
    while let Some(end) = text.find("\n\n") {
        let event: String = text.drain(..end + 2).collect();
        if !event.lines().any(|line| line == "event: message") {
            continue;
        }
        let data = event
            .lines()
            .find_map(|line| line.strip_prefix("data: "))
            .context("a message event without data")?;
        messages.push(serde_json::from_str(data).context("an event's JSON")?);
    }
    Ok(messages)
}

/// One batch ack of streamed leases; each must answer 204.
async fn ack_streamed(
    http: &reqwest::Client,
    url: &str,
    batch: Vec<(String, u64)>,
    tally: &Tally,
    requests: &AtomicU64,
) -> anyhow::Result<()> {
    let started = Instant::now();
    let ids: Vec<&str> = batch.iter().map(|(id, _)| id.as_str()).collect();
    post_acks(http, url, &ids).await?;
    requests.fetch_add(1, Ordering::Relaxed);
    let sequences: Vec<u64> = batch.iter().map(|(_, sequence)| *sequence).collect();
    tally.acked(&sequences, started.elapsed())
}

/// `POST /messages/ack` of `ids`; every one must answer 204.
pub(crate) async fn post_acks(
    http: &reqwest::Client,
    url: &str,
    ids: &[impl AsRef<str>],
) -> anyhow::Result<()> {
    let ids: Vec<&str> = ids.iter().map(AsRef::as_ref).collect();
    let response = http
        .post(url)
        .json(&json!({ "ids": ids }))
        .send()
        .await
        .context("POST /messages/ack")?;
    ensure!(
        response.status() == reqwest::StatusCode::OK,
        "POST /messages/ack answered {}",
        response.status()
    );
    let reply: BatchReply = response.json().await.context("POST /messages/ack body")?;
    ensure!(reply.results.len() == ids.len(), "one result per id");
    for result in &reply.results {
        ensure!(
            result.status == 204,
            "ack of {} answered {}: {:?}",
            result.id,
            result.status,
            result.detail
        );
    }
    Ok(())
}

/// Give back the leases a streaming client still holds at its end, 1000 ids a
/// `POST /messages/nak`, so that the consumer ends with nothing pending.
async fn nak_leftover(http: &reqwest::Client, base: &str, ids: &[String]) -> anyhow::Result<()> {
    for ids in ids.chunks(1000) {
        http.post(format!("{base}/messages/nak"))
            .json(&json!({ "ids": ids }))
            .send()
            .await
            .context("POST /messages/nak of the leases left over")?;
    }
    Ok(())
}

/// Drain through `GET /ws`: leases arrive as frames (max_in_flight 1000), and are acked in
/// band, `per_op` ids an operation (what is left is sent when no frame came for a moment);
/// a message counts once its `settled` frame says 204.
pub(crate) async fn websocket_loop(
    base: String,
    tally: Arc<Tally>,
    operations: Arc<AtomicU64>,
    per_op: usize,
    data_len: usize,
) -> anyhow::Result<()> {
    use futures::SinkExt as _;
    use tokio_tungstenite::tungstenite::Message as Frame;
    let url = format!(
        "{}/ws?max_in_flight=1000",
        base.replacen("http://", "ws://", 1)
    );
    let (mut socket, _) = tokio_tungstenite::connect_async(url)
        .await
        .context("GET /ws")?;
    let mut sequences: std::collections::HashMap<String, u64> = std::collections::HashMap::new();
    let mut pending: Vec<String> = Vec::with_capacity(per_op);
    let mut sent_at: std::collections::VecDeque<Instant> = std::collections::VecDeque::new();
    while !tally.is_done() {
        let frame = if pending.is_empty() {
            tokio::time::timeout(Duration::from_secs(1), socket.next()).await
        } else {
            tokio::time::timeout(Duration::from_millis(2), socket.next()).await
        };
        let frame = match frame {
            Ok(Some(frame)) => frame.context("reading a frame")?,
            Ok(None) => bail!("the gateway closed the WebSocket"),
            Err(_) => {
                if !pending.is_empty() {
                    let ids = std::mem::take(&mut pending);
                    send_acks(&mut socket, ids, &operations, &mut sent_at).await?;
                } else {
                    tally.check_stall()?;
                }
                continue;
            }
        };
        let Frame::Text(text) = frame else { continue };
        let value: serde_json::Value = serde_json::from_str(&text).context("a frame's JSON")?;
        match value["type"].as_str() {
            Some("message") => {
                let id = value["id"].as_str().context("a lease id")?.to_owned();
                let sequence = streamed(&value, data_len, &tally)?;
                sequences.insert(id.clone(), sequence);
                pending.push(id);
                if pending.len() >= per_op {
                    let ids = std::mem::replace(&mut pending, Vec::with_capacity(per_op));
                    send_acks(&mut socket, ids, &operations, &mut sent_at).await?;
                }
            }
            Some("settled") => {
                let mut acked = Vec::new();
                for result in value["results"].as_array().context("results")? {
                    let id = result["id"].as_str().context("a result's id")?;
                    ensure!(
                        result["status"] == 204,
                        "ack of {id} answered {}",
                        result["status"]
                    );
                    acked.extend(sequences.remove(id));
                }
                let waited = sent_at
                    .pop_front()
                    .map_or(Duration::ZERO, |at| at.elapsed());
                tally.acked(&acked, waited)?;
            }
            other => bail!("unexpected frame {other:?}: {text}"),
        }
    }
    // Done: close, read what was already on its way (leases written to this client), and
    // give back every lease not acked, over HTTP, so the consumer ends with nothing pending.
    let _ = socket.send(Frame::Close(None)).await;
    while let Ok(Some(Ok(frame))) =
        tokio::time::timeout(Duration::from_secs(2), socket.next()).await
    {
        let Frame::Text(text) = frame else {
            if matches!(frame, Frame::Close(_)) {
                break;
            }
            continue;
        };
        let value: serde_json::Value = serde_json::from_str(&text).context("a frame's JSON")?;
        match value["type"].as_str() {
            Some("message") => {
                if let (Some(id), Some(sequence)) =
                    (value["id"].as_str(), value["stream_sequence"].as_u64())
                {
                    sequences.insert(id.to_owned(), sequence);
                }
            }
            Some("settled") => {
                for result in value["results"].as_array().into_iter().flatten() {
                    if let Some(id) = result["id"].as_str() {
                        sequences.remove(id);
                    }
                }
            }
            _ => {}
        }
    }
    let leftover: Vec<String> = sequences.into_keys().collect();
    nak_leftover(&http_client()?, &base, &leftover).await
}
