//! Exactly once across the fleet on a 3-node cluster, (e), at the server's default sync and
//! with `sync_interval: always`, in turn: two
//! gateway replicas drain an R3 stream while the consumer's and the stream's leaders are
//! killed -9 right after a batch of confirmed acks and started again. No message whose ack
//! was answered 204 is leased again by either replica, and every message ends acked (lost
//! 0). Acks answered otherwise (503 or 504 around the election) are retried by taking the
//! message again when it comes back.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use serde_json::json;
use tokio::time::Instant;

use crate::support::client::batch_results;
use crate::support::cluster::{Cluster, create_stream_when_ready, jetstream_of};
use crate::support::{Action, Client, STREAM, Setup, assert_stays};

const MESSAGES: usize = 300;
const CONSUMER: &str = "once-cluster";

/// The nodes leading the consumer and the stream now.
async fn leaders(js: &jetstream::Context) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(mut stream) = js.get_stream(STREAM).await
            && let Ok(info) = stream.info().await
            && let Some(stream_leader) = info.cluster.as_ref().and_then(|c| c.leader.clone())
            && let Ok(consumer) = stream.consumer_info(CONSUMER).await
            && let Some(consumer_leader) = consumer.cluster.and_then(|c| c.leader)
        {
            let mut names = vec![consumer_leader, stream_leader];
            names.dedup();
            return names;
        }
        assert!(
            Instant::now() < deadline,
            "the leaders are known within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Fetch at `gateway` and ack what came in one batch; the sequences answered 204. Panics
/// when a message acked 204 before is leased again.
async fn drain_once(gateway: &Client, acked: &HashSet<u64>) -> Vec<u64> {
    let reply = gateway
        .fetch_reply(Some(&json!({"batch": 50, "wait_ms": 300})))
        .await;
    match reply.status {
        200 => {}
        503 => return Vec::new(), // while the cluster elects: nothing leased
        status => panic!("fetch: {status} {}", reply.text),
    }
    let leased = reply.messages();
    let mut sequence_of = HashMap::new();
    for message in &leased {
        assert!(
            !acked.contains(&message.stream_sequence),
            "a message whose ack was answered 204 was leased again: {message:?}"
        );
        sequence_of.insert(message.id.clone(), message.stream_sequence);
    }
    if leased.is_empty() {
        return Vec::new();
    }
    let ids: Vec<&str> = leased.iter().map(|m| m.id.as_str()).collect();
    let answer = gateway
        .settle_many(Action::Ack, &json!({ "ids": ids }))
        .await;
    match answer.status {
        200 => {}
        503 => return Vec::new(), // none settled: each comes back
        status => panic!("batch ack: {status} {}", answer.text),
    }
    batch_results(&answer)
        .into_iter()
        .filter(|result| result.status == 204)
        .filter_map(|result| sequence_of.get(&result.id).copied())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_whose_leaders_are_killed_leases_nothing_answered_and_loses_nothing() {
    for sync_always in [false, true] {
        leaders_killed(sync_always).await;
    }
}

async fn leaders_killed(sync_always: bool) {
    let mut cluster = Cluster::start(3, sync_always).await;
    let urls = cluster.urls();
    let js = jetstream_of(&urls).await;
    create_stream_when_ready(
        &js,
        stream::Config {
            name: STREAM.to_owned(),
            subjects: vec!["orders.>".to_owned()],
            num_replicas: 3,
            ..Default::default()
        },
    )
    .await;
    let setup = Setup::consumer(CONSUMER).settle_timeout("2s");
    let a = setup.ready(&urls).await;
    let b = setup.ready(&urls).await;
    let mut published = HashSet::new();
    for n in 0..MESSAGES {
        let ack = js
            .publish("orders.1", format!("m{n}").into())
            .await
            .expect("publish")
            .await
            .expect("stored");
        published.insert(ack.sequence);
    }

    let mut acked = HashSet::new();
    let mut killed = false;
    let deadline = Instant::now() + Duration::from_secs(120);
    while acked.len() < MESSAGES {
        for gateway in [&*a, &*b] {
            acked.extend(drain_once(gateway, &acked).await);
        }
        if !killed && acked.len() >= MESSAGES / 3 {
            killed = true;
            for leader in leaders(&js).await {
                cluster.node(&leader).kill();
                cluster.node(&leader).restart().await;
            }
        }
        assert!(
            Instant::now() < deadline,
            "every message acked within 120 s (sync always: {sync_always}): {} of {MESSAGES}",
            acked.len()
        );
    }
    assert_eq!(
        acked, published,
        "lost 0: every message acked (sync always: {sync_always})"
    );
    assert_stays(
        "nothing is leased again",
        Duration::from_secs(3),
        || async {
            for gateway in [&*a, &*b] {
                // A 503 (a replica reading the consumer back after a reconnect) leases
                // nothing either.
                let reply = gateway
                    .fetch_reply(Some(&json!({"batch": 10, "wait_ms": 200})))
                    .await;
                match reply.status {
                    200 if !reply.messages().is_empty() => return false,
                    200 | 503 => {}
                    status => panic!("fetch: {status} {}", reply.text),
                }
            }
            true
        },
    )
    .await;
}
