//! The ledger's workers: HTTP fetchers, a worker leased to over SSE, one over a WebSocket
//! acking in band, and clients that vanish mid-fetch and mid-ack.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::support::{Action, FetchRequest};

use super::book::{
    Lease, Outcome, SharedLedger, answer_text, confirm, lock, record_at, record_fetched,
    record_fetched_at, unexpected,
};
use super::fleet::{Fleet, client};
use super::settles::{Behaviour, ack, ack_after, behaviour, settle_leases};

pub(super) async fn worker(fleet: Arc<Fleet>, ledger: SharedLedger, stop: CancellationToken) {
    while !stop.is_cancelled() {
        let owner = fleet.pick();
        let generation = (fleet.generation(owner), fleet.life(owner));
        let answer = fleet.clients[owner]
            .try_fetch(&FetchRequest::new(5, 500).utf8(), None)
            .await;
        let reply = match answer {
            Ok(reply) if reply.status == 200 => reply,
            other => {
                unexpected(&ledger, format!("fetch: {}", answer_text(&other)));
                // Pacing the retry while a fault lasts.
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let leases = record_fetched_at(&ledger, &reply, owner, generation);
        settle_leases(&fleet, &ledger, leases).await;
    }
}

/// Credit of the streaming workers: a few leases out at a time, as a fetch worker has.
const STREAM_CREDIT: &str = "max_in_flight=5&encoding=utf8";

/// A worker leased to over Server-Sent Events (`GET /events`) at a random replica, settling
/// over HTTP as the fetch workers do. A stream that ends (a fault, a shutdown, the client's
/// 15 s bound) is opened again; only a refused open counts against the contract.
///
/// Deliveries are recorded as they arrive, by a reader apart from the settling: a stream
/// keeps sending while its client settles, and a delivery read late would look like one
/// made late (after a newer delivery of the message was settled elsewhere).
pub(super) async fn sse_worker(fleet: Arc<Fleet>, ledger: SharedLedger, stop: CancellationToken) {
    while !stop.is_cancelled() {
        let owner = fleet.pick();
        // As the stream opens: a fault since (a server killed, whose restart may void the
        // leases) makes a refusal of its leases no breach.
        let generation = (fleet.generation(owner), fleet.life(owner));
        let client = &fleet.clients[owner];
        let opened = client
            .http
            .get(client.url(&format!("/events?{STREAM_CREDIT}")))
            .send()
            .await;
        let mut response = match opened {
            Ok(response) if response.status() == 200 => response,
            other => {
                let what = match other {
                    Ok(response) => format!("{}", response.status()),
                    Err(err) => format!("no answer: {err}"),
                };
                unexpected(&ledger, format!("events: {what}"));
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (arrived, mut leases) = tokio::sync::mpsc::unbounded_channel();
        let reader_ledger = ledger.clone();
        let reader = tokio::spawn(async move {
            let mut text = String::new();
            while let Ok(Some(chunk)) = response.chunk().await {
                text.push_str(&String::from_utf8_lossy(&chunk));
                while let Some(end) = text.find("\n\n") {
                    let event: String = text.drain(..end + 2).collect();
                    let is_message = event.lines().any(|line| line == "event: message");
                    let data = event.lines().find_map(|line| line.strip_prefix("data: "));
                    let (true, Some(data)) = (is_message, data) else {
                        continue;
                    };
                    let Ok(message) = serde_json::from_str::<Value>(data) else {
                        unexpected(&reader_ledger, format!("events: not JSON: {data}"));
                        continue;
                    };
                    for lease in record_at(&reader_ledger, [&message], owner, generation) {
                        let _ = arrived.send(lease);
                    }
                }
            }
        });
        loop {
            let lease = tokio::select! {
                () = stop.cancelled() => {
                    reader.abort();
                    return;
                }
                lease = leases.recv() => lease,
            };
            let Some(lease) = lease else {
                break;
            };
            settle_leases(&fleet, &ledger, vec![lease]).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What the reader of a WebSocket passes on.
enum FromSocket {
    Lease(Lease),
    /// A `settled` frame: its `ref` and its first result's status.
    Settled(Option<u64>, Option<u64>),
}

/// A worker leased to over a WebSocket (`GET /ws`) at a random replica: what it acks it acks
/// in band, one `ack` operation at a time, and takes the `settled` frame's status as an
/// HTTP ack's; its other settles go over HTTP. A socket that ends is opened again.
/// Deliveries are recorded as they arrive (see [`sse_worker`]).
pub(super) async fn ws_worker(fleet: Arc<Fleet>, ledger: SharedLedger, stop: CancellationToken) {
    use futures::{SinkExt as _, StreamExt as _};
    use tokio_tungstenite::tungstenite::Message;
    let mut next_ref = 0u64;
    while !stop.is_cancelled() {
        let owner = fleet.pick();
        let generation = (fleet.generation(owner), fleet.life(owner));
        let url = format!(
            "{}/ws?{STREAM_CREDIT}",
            fleet.clients[owner].base().replacen("http://", "ws://", 1)
        );
        let opened = tokio::time::timeout(
            Duration::from_secs(5),
            tokio_tungstenite::connect_async(url),
        )
        .await;
        let Ok(Ok((socket, _))) = opened else {
            unexpected(&ledger, "ws: the handshake failed".into());
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let (mut sink, mut source) = socket.split();
        let (arrived, mut frames) = tokio::sync::mpsc::unbounded_channel();
        let reader_ledger = ledger.clone();
        let reader = tokio::spawn(async move {
            while let Some(Ok(frame)) = source.next().await {
                let Message::Text(text) = frame else {
                    continue;
                };
                let Ok(frame) = serde_json::from_str::<Value>(&text) else {
                    continue;
                };
                if frame["type"] == "message" {
                    for lease in record_at(&reader_ledger, [&frame], owner, generation) {
                        let _ = arrived.send(FromSocket::Lease(lease));
                    }
                } else if frame["type"] == "settled" {
                    let status = frame["results"][0]["status"].as_u64();
                    let _ = arrived.send(FromSocket::Settled(frame["ref"].as_u64(), status));
                }
            }
        });
        loop {
            let next = tokio::select! {
                () = stop.cancelled() => {
                    reader.abort();
                    return;
                }
                next = frames.recv() => next,
            };
            let lease = match next {
                Some(FromSocket::Lease(lease)) => lease,
                Some(FromSocket::Settled(..)) => continue,
                None => break,
            };
            if behaviour(&lease) != Behaviour::Ack {
                settle_leases(&fleet, &ledger, vec![lease]).await;
                continue;
            }
            next_ref += 1;
            let operation = json!({ "op": "ack", "ids": [lease.id], "ref": next_ref });
            if sink
                .send(Message::Text(operation.to_string().into()))
                .await
                .is_err()
            {
                // Not sent: the lease is as it was; acked over HTTP instead.
                ack(&fleet, &ledger, &lease).await;
                break;
            }
            // Leases that arrive meanwhile wait their turn.
            let mut later = Vec::new();
            let status = loop {
                match tokio::time::timeout(Duration::from_secs(20), frames.recv()).await {
                    Ok(Some(FromSocket::Settled(Some(reference), status)))
                        if reference == next_ref =>
                    {
                        break status;
                    }
                    Ok(Some(FromSocket::Settled(..))) => {}
                    Ok(Some(FromSocket::Lease(lease))) => later.push(lease),
                    Ok(None) | Err(_) => break None,
                }
            };
            match status {
                Some(204) => confirm(&ledger, &lease, Outcome::Acked),
                Some(status @ (404 | 409 | 410)) => {
                    fleet.check_refusal(&ledger, &lease, status as u16, "");
                }
                // 504 or 503 in band, or the socket gone before the answer: it may have
                // landed; retried over HTTP as an unanswered ack is.
                _ => {
                    unexpected(&ledger, format!("ws ack {}: {status:?}", lease.ledger_id));
                    ack_after(&fleet, &ledger, &lease, true).await;
                }
            }
            for lease in later {
                settle_leases(&fleet, &ledger, vec![lease]).await;
            }
            if status.is_none() {
                break;
            }
        }
        reader.abort();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Clients that vanish: a long poll dropped mid-wait, and an ack dropped mid-flight.
pub(super) async fn vanishing_client(
    base: String,
    ledger: SharedLedger,
    stop: CancellationToken,
    round: u64,
) {
    let client = client(&base);
    let mut round = round;
    while !stop.is_cancelled() {
        round += 1;
        // Mid-fetch: gone after 50–350 ms of a 2 s long poll.
        let patience = Duration::from_millis(50 + (round * 70) % 300);
        let fetched = client
            .try_fetch(&FetchRequest::new(3, 2000).utf8(), Some(patience))
            .await;
        if let Ok(reply) = fetched {
            // Answered before it left: those are real leases, abandoned.
            record_fetched(&ledger, &reply);
        }
        // Mid-settle: fetch normally, then send acks and hang up before the answer.
        let Ok(reply) = client
            .try_fetch(&FetchRequest::new(2, 200).utf8(), None)
            .await
        else {
            continue;
        };
        for lease in record_fetched(&ledger, &reply) {
            let answer = client
                .try_settle(&lease.id, Action::Ack, None, Some(Duration::from_millis(1)))
                .await;
            // Answered before the hang-up after all: a confirmed ack like any other.
            if answer.is_ok_and(|reply| reply.status == 204) {
                confirm(&ledger, &lease, Outcome::Acked);
            } else {
                lock(&ledger).hung_up.insert(lease.ledger_id.clone());
            }
        }
    }
}
