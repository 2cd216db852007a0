//! The NATS side of a run: the work and dead-letter streams, the messages published, and what
//! the servers say of the backlog and the leaders.

use std::collections::HashMap;
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::support::cluster::jetstream_of;

use super::params::{CONSUMER, DLQ_STREAM, DLQ_SUBJECT, K, STREAM};

/// Connect and create the work stream and the dead-letter stream (retrying while a fresh
/// cluster elects its meta leader).
pub(super) async fn create_streams(urls: &str, replicas: usize) -> jetstream::Context {
    let js = jetstream_of(urls).await;
    for (name, subject) in [(STREAM, "ledger.>"), (DLQ_STREAM, DLQ_SUBJECT)] {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let created = js
                .create_stream(stream::Config {
                    name: name.to_owned(),
                    subjects: vec![subject.to_owned()],
                    num_replicas: replicas,
                    ..Default::default()
                })
                .await;
            match created {
                Ok(_) => break,
                Err(_) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                Err(err) => panic!("create stream {name}: {err}"),
            }
        }
    }
    js
}

/// The dead letters stored: ledger id → term reason header.
pub(super) async fn dead_letters(js: &jetstream::Context) -> Option<HashMap<String, String>> {
    let mut stream = js.get_stream(DLQ_STREAM).await.ok()?;
    let last = stream.info().await.ok()?.state.last_sequence;
    let mut letters = HashMap::new();
    for sequence in 1..=last {
        let Ok(letter) = stream.get_raw_message(sequence).await else {
            continue;
        };
        let id = String::from_utf8_lossy(&letter.payload).into_owned();
        let reason = letter
            .headers
            .get("Ruststream-Dead-Letter-Term-Reason")
            .map(|value| value.as_str().to_owned())
            .unwrap_or_default();
        // A second copy of one id would be a failed dedup: keep it visible.
        if letters.insert(id.clone(), reason).is_some() {
            letters.insert(format!("{id} (again)"), String::new());
        }
    }
    Some(letters)
}

pub(super) async fn publish_all(js: &jetstream::Context) -> Vec<String> {
    let ids: Vec<String> = (0..K).map(|n| format!("id-{n}")).collect();
    let mut acks = Vec::with_capacity(K);
    for id in &ids {
        acks.push(
            js.publish("ledger.work", id.clone().into())
                .await
                .expect("publish"),
        );
    }
    for ack in acks {
        ack.await.expect("the stream stored the message");
    }
    ids
}

/// The consumer's `(num_pending, num_ack_pending)`, if the cluster answers.
pub(super) async fn server_backlog(js: &jetstream::Context) -> Option<(u64, usize)> {
    let mut stream = tokio::time::timeout(Duration::from_secs(2), js.get_stream(STREAM))
        .await
        .ok()?
        .ok()?;
    let info = tokio::time::timeout(Duration::from_secs(2), stream.consumer_info(CONSUMER))
        .await
        .ok()?
        .ok()?;
    let _ = &mut stream;
    Some((info.num_pending, info.num_ack_pending))
}

/// Ask a JetStream leader to step down (`api`: the API subject after `$JS.API.`), and wait
/// for the answer.
pub(super) async fn step_down(js: &jetstream::Context, api: &str) {
    let answer: Result<Value, _> = js.request(api.to_owned(), &json!({})).await;
    assert!(
        answer
            .as_ref()
            .is_ok_and(|answer| answer["success"] == json!(true)),
        "{api}: {answer:?}"
    );
}

pub(super) async fn stream_leader(js: &jetstream::Context) -> Option<String> {
    let mut stream = js.get_stream(STREAM).await.ok()?;
    let info = stream.info().await.ok()?;
    info.cluster
        .as_ref()
        .and_then(|cluster| cluster.leader.clone())
}

pub(super) async fn consumer_leader(js: &jetstream::Context) -> Option<String> {
    let stream = js.get_stream(STREAM).await.ok()?;
    let info = stream.consumer_info(CONSUMER).await.ok()?;
    info.cluster.and_then(|cluster| cluster.leader)
}
