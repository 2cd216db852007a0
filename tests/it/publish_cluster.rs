//! Atomic batches on a 3-node cluster (R3, nats-server's default sync) while the stream's
//! leader is killed -9: every batch is stored whole or not at all, and a client that retries
//! a batch it was not told the fate of (same msg ids) never stores it twice.

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::support::cluster::{Cluster, create_stream_when_ready, jetstream_of};
use crate::support::{STREAM, Setup};

const ROUNDS: usize = 20;
const BATCH: usize = 200;

/// Connect to the cluster and make ORDERS, R3 and open to atomic batches (retrying while a
/// fresh cluster elects its meta leader).
async fn create_atomic_stream(urls: &str) -> jetstream::Context {
    let js = jetstream_of(urls).await;
    create_stream_when_ready(
        &js,
        stream::Config {
            name: STREAM.to_owned(),
            subjects: vec!["orders.>".to_owned()],
            num_replicas: 3,
            allow_atomic_publish: true,
            ..Default::default()
        },
    )
    .await;
    js
}

async fn healthy_leader(js: &jetstream::Context) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(Ok(mut stream)) =
            tokio::time::timeout(Duration::from_secs(2), js.get_stream(STREAM)).await
            && let Ok(Ok(info)) = tokio::time::timeout(Duration::from_secs(2), stream.info()).await
            && let Some(cluster) = &info.cluster
            && let Some(leader) = &cluster.leader
            && cluster.replicas.len() == 2
            && cluster
                .replicas
                .iter()
                .all(|peer| peer.current && !peer.offline)
        {
            return leader.clone();
        }
        assert!(
            Instant::now() < deadline,
            "the stream has a leader and two current followers within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn batch(round: usize) -> Value {
    let messages: Vec<Value> = (0..BATCH)
        .map(|i| {
            let id = format!("r{round}-{i}");
            json!({ "subject": "orders.atomic", "data": id, "msg_id": id })
        })
        .collect();
    json!({ "messages": messages, "atomic": true })
}

/// 20 rounds: an atomic batch of 200 is posted while the stream leader is killed -9 (a few
/// ms in: before, during or after the batch), then retried as a client would until it is
/// stored (201) or known stored (409 `batch-already-stored`), the node restarted meanwhile. Then the
/// stream holds each batch exactly once, whole, in order and contiguous.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn atomic_batches_are_whole_or_absent_when_the_stream_leader_is_killed() {
    let mut cluster = Cluster::start(3, false).await;
    let urls = cluster.urls();
    let js = create_atomic_stream(&urls).await;
    let gateway = Setup::consumer("atomic-cluster")
        .settle_timeout("2s")
        .ready(&urls)
        .await;
    let mut answers = BTreeMap::new();
    for round in 0..ROUNDS {
        let leader = healthy_leader(&js).await;
        let body = batch(round);
        let kill_after = Duration::from_millis((round % 10) as u64);
        let (first, ()) = tokio::join!(
            gateway.try_post("/publish/batch", Some(&body), Some(Duration::from_secs(30))),
            async {
                tokio::time::sleep(kill_after).await;
                cluster.node(&leader).kill();
            }
        );
        let first = first.expect("the gateway answers");
        assert!(
            first.status == 201 || first.status == 503,
            "round {round}, first try: stored (201), or not known (503): {} {}",
            first.status,
            first.text
        );
        *answers.entry(first.status).or_insert(0) += 1;
        // Back at once, as a supervisor restarts it: it may rejoin during the election.
        cluster.node(&leader).restart().await;
        let mut answer = first;
        let deadline = Instant::now() + Duration::from_secs(60);
        while answer.status != 201 {
            if answer.status == 409 {
                assert_eq!(
                    answer.body["type"], "urn:ruststream-nats:problem:batch-already-stored",
                    "round {round}: {}",
                    answer.text
                );
                *answers.entry(409).or_insert(0) += 1;
                break;
            }
            assert_eq!(
                answer.status, 503,
                "round {round}, a retry: stored (201), known stored (409) or not known (503): {} {}",
                answer.status, answer.text
            );
            assert!(
                Instant::now() < deadline,
                "round {round}: the batch is stored within 60 s of the kill: {}",
                answer.text
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
            answer = gateway
                .try_post("/publish/batch", Some(&body), Some(Duration::from_secs(30)))
                .await
                .expect("the gateway answers");
        }
        if answer.status == 201 {
            assert_eq!(answer.body["count"], BATCH, "{}", answer.text);
        }
    }
    // First answers, and 409 for a retry of a batch the first try stored unbeknown.
    eprintln!("answers (status: rounds): {answers:?}");
    healthy_leader(&js).await;

    let mut stream = js.get_stream(STREAM).await.expect("the stream");
    let last = stream
        .info()
        .await
        .expect("stream info")
        .state
        .last_sequence;
    let mut stored: BTreeMap<usize, Vec<(u64, usize)>> = BTreeMap::new();
    for sequence in 1..=last {
        let Some(message) = stored_message(&stream, sequence).await else {
            continue;
        };
        let id = String::from_utf8_lossy(&message.payload).into_owned();
        let (round, index) = id
            .trim_start_matches('r')
            .split_once('-')
            .and_then(|(round, index)| Some((round.parse().ok()?, index.parse().ok()?)))
            .unwrap_or_else(|| panic!("only the batches' messages: {id}"));
        stored.entry(round).or_default().push((sequence, index));
    }
    for round in 0..ROUNDS {
        let messages = stored.get(&round).cloned().unwrap_or_default();
        let indexes: Vec<usize> = messages.iter().map(|(_, index)| *index).collect();
        assert_eq!(
            indexes,
            (0..BATCH).collect::<Vec<_>>(),
            "round {round}: the batch once, whole and in order"
        );
        let first_sequence = messages[0].0;
        assert!(
            messages
                .iter()
                .zip(first_sequence..)
                .all(|((sequence, _), expected)| *sequence == expected),
            "round {round}: contiguous sequences {messages:?}"
        );
    }
}

/// The message at `sequence`, `None` when the stream holds none there. Any other error (a
/// timeout or no responders while the leader settles after the last kill) is asked again
/// until a deadline: taken as "none", it would read as a batch stored in part.
async fn stored_message(
    stream: &async_nats::jetstream::stream::Stream,
    sequence: u64,
) -> Option<async_nats::jetstream::message::StreamMessage> {
    use async_nats::jetstream::stream::RawMessageErrorKind;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match stream.get_raw_message(sequence).await {
            Ok(message) => return Some(message),
            Err(err) if matches!(err.kind(), RawMessageErrorKind::NoMessageFound) => return None,
            Err(err) => {
                assert!(
                    Instant::now() < deadline,
                    "reading sequence {sequence} for 30 s: {err}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}
