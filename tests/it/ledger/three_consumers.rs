//! The multi-consumer run: three consumers of one stream on two replicas, through a replica
//! killed, the other rolled and the server killed.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::support::client::batch_results;
use crate::support::cluster::Cluster;
use crate::support::{Action, Client, Setup};

use super::book::answer_text;
use super::fleet::client;
use super::params::{ACK_WAIT, CONSUMER, RUN_DEADLINE, STREAM};
use super::streams::create_streams;

/// The consumers of the multi-consumer run: the default one and two of the consumers file.
const MANY: [&str; 3] = ["ledger", "shipping", "analytics"];
/// Messages each of them must settle.
const MANY_K: usize = 150;

/// What the multi-consumer run saw, per consumer.
#[derive(Default)]
struct ManyLedger {
    /// Ids acked (a 2xx answered) by each consumer's workers.
    acked: HashMap<&'static str, HashSet<String>>,
    /// Leases a consumer's fetch handed out that named another consumer.
    crossed: Vec<String>,
    /// Settles a fault explains (410, 503, 504, no answer): the message comes back.
    refused: usize,
    /// Ids whose ack went unanswered (no answer, 503, 504): it may have landed, and then
    /// the message rightly never comes back.
    unconfirmed: HashMap<&'static str, HashSet<String>>,
    /// Settle answers a roll or a kill can never explain (a 404 for a genuine id, a 409).
    impossible: Vec<String>,
}

fn lock_many(ledger: &Mutex<ManyLedger>) -> std::sync::MutexGuard<'_, ManyLedger> {
    ledger
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn many_acked(ledger: &Mutex<ManyLedger>) -> usize {
    lock_many(ledger).acked.values().map(HashSet::len).sum()
}

/// One worker of `consumer`: fetch from a random replica by the consumer's own path, settle
/// each lease at the other replica (single acks and batches alternating).
async fn many_worker(
    clients: Arc<Vec<Client>>,
    consumer: &'static str,
    ledger: Arc<Mutex<ManyLedger>>,
    stop: CancellationToken,
) {
    let path = format!("/streams/{STREAM}/consumers/{consumer}/fetch");
    let mut round = 0usize;
    while !stop.is_cancelled() {
        round += 1;
        let from = rand::random_range(0..clients.len());
        let other = &clients[(from + 1) % clients.len()];
        let body = json!({ "batch": 5, "wait_ms": 500, "encoding": "utf8" });
        let reply = match clients[from].try_post(&path, Some(&body), None).await {
            Ok(reply) if reply.status == 200 => reply,
            _ => {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let leases = reply.messages();
        let mut held = Vec::new();
        for lease in &leases {
            if lease.consumer != consumer {
                lock_many(&ledger).crossed.push(format!(
                    "{consumer} got {}'s {}",
                    lease.consumer, lease.data
                ));
            }
            held.push((lease.id.clone(), lease.data.clone()));
        }
        let answers: Vec<(String, Result<u16, String>)> = if round.is_multiple_of(2) {
            let ids: Vec<&String> = held.iter().map(|(id, _)| id).collect();
            match other
                .try_post("/messages/ack", Some(&json!({ "ids": ids })), None)
                .await
            {
                Ok(reply) if reply.status == 200 => batch_results(&reply)
                    .into_iter()
                    .zip(&held)
                    .map(|(result, (_, data))| (data.clone(), Ok(result.status)))
                    .collect(),
                other => held
                    .iter()
                    .map(|(_, data)| (data.clone(), Err(answer_text(&other))))
                    .collect(),
            }
        } else {
            let mut answers = Vec::new();
            for (id, data) in &held {
                let answer = other.try_settle(id, Action::Ack, None, None).await;
                answers.push((
                    data.clone(),
                    answer
                        .as_ref()
                        .map(|reply| reply.status)
                        .map_err(|_| answer_text(&answer)),
                ));
            }
            answers
        };
        let mut ledger = lock_many(&ledger);
        for (data, answer) in answers {
            match answer {
                Ok(204) => {
                    ledger.acked.entry(consumer).or_default().insert(data);
                }
                Ok(410) => ledger.refused += 1,
                Ok(503 | 504) | Err(_) => {
                    ledger.refused += 1;
                    ledger.unconfirmed.entry(consumer).or_default().insert(data);
                }
                Ok(status) => ledger
                    .impossible
                    .push(format!("{consumer} ack of {data}: {status}")),
            }
        }
    }
}

/// Three consumers of one stream (the default one and two declared in the consumers file)
/// on two replicas sharing a lease key, each lease settled at the other replica, while a
/// replica is killed -9, the other rolled, and the server killed -9 (at its default sync
/// interval). Every consumer settles every message; none is handed another's lease; no
/// settle answers what a fault cannot explain.
pub(super) async fn ledger_three_consumers_on_two_replicas() {
    let started = Instant::now();
    let mut cluster = Cluster::start(1, false).await;
    let urls = cluster.urls();
    let js = create_streams(&urls, 1).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let key = dir.path().join("lease.key");
    std::fs::write(&key, [9u8; 32]).expect("lease key");
    let file = dir.path().join("consumers.toml");
    std::fs::write(
        &file,
        format!(
            "[[consumer]]\nstream = \"{STREAM}\"\nname = \"shipping\"\nack_wait = \"{ACK_WAIT}\"\n\n\
             [[consumer]]\nstream = \"{STREAM}\"\nname = \"analytics\"\nack_wait = \"{ACK_WAIT}\"\n"
        ),
    )
    .expect("consumers file");
    let setup = Setup::consumer(CONSUMER)
        .stream(STREAM)
        .ack_wait(ACK_WAIT)
        .settle_timeout("2s")
        .shutdown_grace("3s")
        .lease_key_file(&key)
        .flag("--consumers-file", file.display().to_string());
    let mut gateways = [setup.process(&urls).await, setup.process(&urls).await];
    let clients = Arc::new(
        gateways
            .iter()
            .map(|gateway| client(&gateway.base()))
            .collect::<Vec<_>>(),
    );
    let mut ids = HashSet::new();
    for n in 0..MANY_K {
        let data = format!("many-{n}");
        js.publish("ledger.many", data.clone().into())
            .await
            .expect("publish")
            .await
            .expect("stored");
        ids.insert(data);
    }
    let ledger: Arc<Mutex<ManyLedger>> = Arc::default();
    let stop = CancellationToken::new();
    let mut tasks = Vec::new();
    for consumer in MANY {
        for _ in 0..2 {
            tasks.push(tokio::spawn(many_worker(
                clients.clone(),
                consumer,
                ledger.clone(),
                stop.clone(),
            )));
        }
    }
    let total = MANY_K * MANY.len();
    let reach = |share: usize| {
        let ledger = ledger.clone();
        async move {
            let deadline = Instant::now() + RUN_DEADLINE;
            while many_acked(&ledger) < total * share / 100 && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    reach(20).await;
    gateways[0].kill9();
    gateways[0].restart().await;
    reach(45).await;
    let status = gateways[1].terminate(Duration::from_secs(15)).await;
    assert!(status.success(), "stopped badly: {}", gateways[1].log());
    gateways[1].restart().await;
    reach(70).await;
    cluster.nodes[0].1.kill();
    tokio::time::sleep(Duration::from_secs(1)).await;
    cluster.nodes[0].1.restart().await;
    // Until every consumer settled every message, or nothing is left on the server for any
    // (an ack that landed without its answer never comes back), or the deadline.
    let deadline = Instant::now() + RUN_DEADLINE;
    let mut quiet_since: Option<Instant> = None;
    while Instant::now() < deadline {
        let done = lock_many(&ledger)
            .acked
            .values()
            .filter(|acked| acked.len() >= MANY_K)
            .count();
        if done == MANY.len() {
            break;
        }
        let mut left = 0;
        for consumer in MANY {
            left += match js.get_stream(STREAM).await {
                Ok(stream) => match stream.consumer_info(consumer).await {
                    Ok(info) => info.num_pending + info.num_ack_pending as u64,
                    Err(_) => 1,
                },
                Err(_) => 1,
            };
        }
        quiet_since = if left == 0 {
            quiet_since.or(Some(Instant::now()))
        } else {
            None
        };
        if quiet_since.is_some_and(|at| at.elapsed() >= Duration::from_secs(3)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.cancel();
    for task in tasks {
        let _ = task.await;
    }
    let ledger = std::mem::take(&mut *lock_many(&ledger));
    let mut failures = Vec::new();
    let mut rows = Vec::new();
    for consumer in MANY {
        let acked = ledger.acked.get(consumer).cloned().unwrap_or_default();
        let unconfirmed = ledger
            .unconfirmed
            .get(consumer)
            .cloned()
            .unwrap_or_default();
        let landed_unanswered = unconfirmed.iter().filter(|id| !acked.contains(*id)).count();
        let lost: Vec<&String> = ids
            .iter()
            .filter(|id| !acked.contains(*id) && !unconfirmed.contains(*id))
            .collect();
        rows.push(format!(
            "| {consumer} | {MANY_K} | {} ({landed_unanswered} unconfirmed) | {} |",
            acked.len() + landed_unanswered,
            lost.len()
        ));
        if !lost.is_empty() {
            failures.push(format!(
                "{consumer}: lost {}, e.g. {:?}",
                lost.len(),
                &lost[..lost.len().min(5)]
            ));
        }
    }
    if !ledger.crossed.is_empty() {
        failures.push(format!("leases of another consumer: {:?}", ledger.crossed));
    }
    if !ledger.impossible.is_empty() {
        failures.push(format!(
            "settles no fault explains: {:?}",
            ledger.impossible
        ));
    }
    println!(
        "\n==== ledger: three consumers of one stream on two replicas (replica -9, roll, server -9 at the default sync) ====\n\
         | consumer | K | acked (of which unconfirmed) | lost |\n|---|---|---|---|\n{}\n\
         settles refused by a fault (410/503/504/no answer, retried): {}; leases of another consumer: {}; run {}s",
        rows.join("\n"),
        ledger.refused,
        ledger.crossed.len(),
        started.elapsed().as_secs()
    );
    assert!(failures.is_empty(), "{failures:#?}");
}
