//! What the ordering tests share: publishing with a key, fetching as (key, sequence,
//! delivered), and draining across gateways while recording when each lease came and was
//! acked, then checking per key that nothing overlapped and stream order held.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::json;
use tokio::time::Instant;

use crate::support::{Client, Deadline, Msg};

/// The message's ordering key, as `POST /publish` wrote it.
pub(super) fn key_of(message: &Msg) -> Option<String> {
    let value = message.headers.get("Ruststream-Ordering-Key")?;
    let value = value
        .as_array()
        .and_then(|values| values.first())
        .unwrap_or(value);
    value.as_str().map(str::to_owned)
}

pub(super) async fn publish_keyed(gateway: &Client, key: Option<&str>, data: &str) -> u64 {
    let mut body = json!({"subject": "orders.created", "data": data});
    if let Some(key) = key {
        body["ordering_key"] = json!(key);
    }
    let reply = gateway.post("/publish", Some(&body)).await;
    assert_eq!(reply.status, 201, "publish: {}", reply.text);
    reply.body["sequence"].as_u64().expect("a sequence")
}

/// What one fetch brings within `wait_ms`, as (key, stream sequence, delivered).
pub(super) async fn fetch_keys(gateway: &Client, wait_ms: u64) -> Vec<(Option<String>, u64, u64)> {
    gateway
        .fetch_n(10, wait_ms)
        .await
        .iter()
        .map(|message| (key_of(message), message.stream_sequence, message.delivered))
        .collect()
}

/// Fetch until a message comes (within 10 s).
pub(super) async fn next_message(gateway: &Client) -> Msg {
    let deadline = Deadline::after("a message is leased", Duration::from_secs(10));
    loop {
        if let Some(message) = gateway.fetch_n(1, 500).await.into_iter().next() {
            return message;
        }
        deadline.tick().await;
    }
}

/// One lease as a worker saw it: when it came, and when its ack was sent.
pub(super) struct Seen {
    pub(super) key: String,
    pub(super) sequence: u64,
    pub(super) got: Instant,
    pub(super) ack_sent: Instant,
}

impl Seen {
    /// `message`, got at `got`, its ack about to be sent (its key: the subject's 2nd token).
    pub(super) fn of(message: &Msg, got: Instant) -> Self {
        Self {
            key: message
                .subject
                .split('.')
                .nth(1)
                .unwrap_or_default()
                .to_owned(),
            sequence: message.stream_sequence,
            got,
            ack_sent: Instant::now(),
        }
    }
}

/// Fetch from `gateways` in turn (a balancer without sticky sessions) and ack each message
/// at the other one, until `total` are acked; returns (key, sequence, got, ack sent) per
/// lease, in the order they were leased.
pub(super) async fn drain_in_turn(
    gateways: &[&Client],
    total: usize,
    within: Duration,
) -> Vec<Seen> {
    let mut done: Vec<Seen> = Vec::new();
    let deadline = Deadline::after("every message is acked", within);
    let mut turn = 0;
    while done.len() < total {
        let (fetching, settling) = (
            gateways[turn % gateways.len()],
            gateways[(turn + 1) % gateways.len()],
        );
        turn += 1;
        let reply = fetching
            .fetch_reply(Some(&json!({"batch": 5, "wait_ms": 300})))
            .await;
        if reply.status == 503 {
            // The pin moving (a replica killed): asked again, as a client would.
            tokio::time::sleep(Duration::from_millis(100)).await;
            deadline.tick().await;
            continue;
        }
        assert_eq!(reply.status, 200, "{}", reply.text);
        let fetched = reply.messages();
        let got = Instant::now();
        for message in fetched {
            let seen = Seen::of(&message, got);
            assert_eq!(settling.ack(&message.id).await, 204);
            done.push(seen);
        }
        deadline
            .tick_seeing(format_args!("{} of {total} acked", done.len()))
            .await;
    }
    done
}

/// Per key: stream order, and no lease before the one before it was acked.
pub(super) fn assert_ordered(done: &[Seen]) {
    let mut by_key: BTreeMap<&str, Vec<&Seen>> = BTreeMap::new();
    for seen in done {
        by_key.entry(seen.key.as_str()).or_default().push(seen);
    }
    for (key, leases) in by_key {
        for pair in leases.windows(2) {
            assert!(
                pair[0].sequence < pair[1].sequence && pair[1].got >= pair[0].ack_sent,
                "key {key}: {} leased after {} (or before it was acked)",
                pair[1].sequence,
                pair[0].sequence
            );
        }
    }
}
