//! The ledger test (anchor: Jepsen's NATS queue workload). Publish K messages with unique ids,
//! run W HTTP workers against the gateway (a child process, so it can be killed -9) with mixed
//! behaviour — mostly ack, some batch-ack, some nak with a delay, some term with a recorded
//! reason, some abandon the lease and let it expire — and two streaming workers, leased to
//! over SSE and over a WebSocket (acking in band), inject one kind of fault per run, and keep
//! a ledger of every delivery and every settle answer.
//!
//! Per run it prints K, acked, termed, lost, duplicates, redeliveries and the time to recover
//! after each fault, and asserts:
//! - **lost = 0**: every id ended acked or termed on purpose, and the server holds nothing
//!   pending or unacknowledged. Only a 2xx counts as acked or termed; an id whose settle
//!   answer a fault swallowed (or whose ack a vanishing client hung up on) is reported apart,
//!   as unconfirmed, and is not lost only if the server holds nothing any more.
//! - **answers as the contract says** in the runs without a server or gateway fault: every
//!   fetch 200, no settle of a worker answered 5xx or not at all (so no unconfirmed ack but
//!   those the vanishing client hung up on), naks 204, batch results one per id asked for.
//! - **duplicates** (a message handed out again after its ack or term got 2xx) are 0 in the
//!   runs without a fault and in the single-server kill -9 run (the gateway settles the
//!   redeliveries of what the server forgot again itself); in the gateway-kill and cluster
//!   runs they are counted and reported. In every run, no gateway process leases again a
//!   message whose ack or term it confirmed itself, whatever the server forgot.
//!   The servers run with `jetstream { sync_interval: always }`, so what it confirmed is on
//!   disk before the confirmation (NATS-FACTS: by default file storage fsyncs every 2
//!   minutes, and Jepsen lost acknowledged writes that way) — but for one run at the default,
//!   as most deployments run it: the gateway rolled, killed, then the server killed -9 twice
//!   and paused while that gateway lives.
//! - **recovery**: after each fault is healed, a fetch answers 200 again within 20 s.
//! - **dead letters**: the gateway runs with `--dead-letter-subject`; in the runs without a
//!   server or gateway fault, the dead-letter stream holds exactly the termed ids, once each,
//!   with the reasons the ledger recorded; with the gateway killed, it still holds every id
//!   termed with a 2xx (the advisory stream keeps what the killed gateway had not copied).
//! - **non-sticky replicas**: three gateways on the consumer, every request to a random one
//!   and every settle deliberately at another replica than the fetch, through a replica
//!   kill -9 and restart, a rolling restart (SIGTERM, start again) of the other two, a
//!   replica paused 3 s and a nats-server kill -9 (or, on the cluster, the consumer leader's
//!   node killed): lost = 0, and a settle of a live lease whose owner is alive (not killed or
//!   stopped since the fetch) is never refused (404/410).
//! - **two replicas on a 3-node cluster at the default sync**: leader step-downs, the stream
//!   leader killed -9, the consumer leader's node paused 6 s, a replica's own node killed -9:
//!   lost = 0 (so no 410 for an ack that landed: its message would never come back), and an
//!   owner still running is never taken for gone while its lease lives.

use std::collections::{HashMap, HashSet};
use std::io::Write as _;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use serde_json::{Value, json};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::support::client::{batch_results, http_builder};
use crate::support::cluster::{Cluster, jetstream_of};
use crate::support::{Action, Client, FetchRequest, GatewayProcess, Reply, Setup, wait_for};

const STREAM: &str = "LEDGER";
const CONSUMER: &str = "ledger";
/// Termed messages are dead-lettered here; the ledger checks them against its terms.
const DLQ_STREAM: &str = "LEDGER_DLQ";
const DLQ_SUBJECT: &str = "dlq.ledger";
/// Messages per run.
const K: usize = 300;
/// HTTP workers per run.
const W: usize = 8;
/// The consumer's ack_wait: short, so abandoned leases come back quickly.
const ACK_WAIT: &str = "2s";
/// A fetch must answer 200 again within this long after a fault is healed.
const RECOVERY_BOUND: Duration = Duration::from_secs(20);
/// The longest one run may take before it is declared stuck.
const RUN_DEADLINE: Duration = Duration::from_secs(90);

/// A ledger run, started as a task of its own.
type LedgerRun = fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// Every ledger run, one after another, in one test. The runs share two cores, so they never
/// overlap; as five tests, the ones waiting for their turn held the suite's other test
/// threads idle (about 100 s of a CI run). Each run is a task: one that fails (its panic is
/// printed above) does not keep the others from running. `RUSTSTREAM_LEDGER=<part of a
/// name>` runs only the matching ones, e.g. `RUSTSTREAM_LEDGER=cluster cargo test --test it
/// ledger::`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_ledger_run_in_turn() {
    let only = std::env::var("RUSTSTREAM_LEDGER").unwrap_or_default();
    let runs: [(&str, LedgerRun); 5] = [
        ("single_node_faults", || {
            Box::pin(ledger_single_node_faults())
        }),
        ("cluster_faults", || Box::pin(ledger_cluster_faults())),
        ("non_sticky_replicas", || {
            Box::pin(ledger_non_sticky_replicas())
        }),
        ("three_consumers_on_two_replicas", || {
            Box::pin(ledger_three_consumers_on_two_replicas())
        }),
        ("rolling_upgrade_from_the_previous_release", || {
            Box::pin(ledger_rolling_upgrade_from_the_previous_release())
        }),
    ];
    let mut failed = Vec::new();
    let mut ran = 0;
    for (name, run) in runs {
        if !name.contains(only.as_str()) {
            continue;
        }
        ran += 1;
        if tokio::spawn(run()).await.is_err() {
            failed.push(name);
        }
    }
    assert!(ran > 0, "RUSTSTREAM_LEDGER={only} names no ledger run");
    assert!(
        failed.is_empty(),
        "ledger runs failed: {failed:?} (each one's failure is printed above)"
    );
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Acked,
    Termed,
}

#[derive(Default)]
struct Ledger {
    /// Confirmed (2xx) settles that end a message, by id.
    settled: HashMap<String, Outcome>,
    /// The reason each term was sent with (whatever its answer: a term whose answer was lost
    /// may have landed and been dead-lettered).
    term_reasons: HashMap<String, String>,
    /// Ids with a worker's settle sent whose answer never came or was a 5xx (a fault, 504):
    /// it may or may not have landed.
    ack_unconfirmed: HashSet<String>,
    /// Ids whose ack the vanishing client sent and hung up on before the answer.
    hung_up: HashSet<String>,
    /// Answers outside the contract for a run without a fault: a fetch not answered 200, a
    /// settle answered 5xx or not at all, a nak not answered 204, a batch whose results do
    /// not match its ids. Reported always, a failure in the runs without a fault.
    unexpected: Vec<String>,
    deliveries: u64,
    redeliveries: u64,
    /// Every `(id, delivered)` seen, for the diagnosis of a lost id.
    seen: HashMap<String, Vec<u64>>,
    /// `(id, delivered)` of deliveries after the id's ack or term got 2xx.
    duplicates: Vec<(String, u64)>,
    /// The gateway processes (replica, life) that confirmed an id's ack or term.
    ended_by: HashMap<String, HashSet<(usize, u64)>>,
    /// `(id, delivered)` of deliveries by a gateway process that itself had confirmed the
    /// id's ack or term: never allowed, whatever the server forgot.
    same_process_duplicates: Vec<(String, u64)>,
    /// Settles refused (404/410) although sent well before the lease's expiry to a live
    /// owner (not killed or stopped since the fetch, no nats-server killed meanwhile).
    refused_live: Vec<String>,
}

/// The replicas a run talks to: one in the sticky runs, three in the non-sticky ones, where
/// each fetch goes to a random replica and each settle to another one than the fetch.
struct Fleet {
    clients: Vec<Client>,
    /// Bumped when a replica is killed or has stopped (its leases may be refused from then
    /// on), and for all of them when a nats-server is killed (a new lease epoch may follow).
    generations: Vec<AtomicU64>,
    /// Bumped when a replica's process is replaced (killed or stopped, then started again):
    /// which process issued a lease and confirmed a settle.
    lives: Vec<AtomicU64>,
    /// Replicas out of the rotation, as a balancer's readiness check takes them out: in the
    /// roll, from the old process' exit until its successor is ready (a replica answers
    /// HTTP before its NATS connection is up, and its settles 503 until then).
    out: Vec<std::sync::atomic::AtomicBool>,
}

impl Fleet {
    fn new(bases: &[String]) -> Arc<Self> {
        Arc::new(Self {
            clients: bases.iter().map(|base| client(base)).collect(),
            generations: bases.iter().map(|_| AtomicU64::new(0)).collect(),
            lives: bases.iter().map(|_| AtomicU64::new(0)).collect(),
            out: bases
                .iter()
                .map(|_| std::sync::atomic::AtomicBool::new(false))
                .collect(),
        })
    }

    fn life(&self, replica: usize) -> u64 {
        self.lives[replica].load(Ordering::SeqCst)
    }

    /// Replica `replica`'s process is gone; the next one is another life.
    fn replaced(&self, replica: usize) {
        self.lives[replica].fetch_add(1, Ordering::SeqCst);
    }

    /// A random replica for a fetch.
    fn pick(&self) -> usize {
        let count = self.clients.len();
        let first = rand::random_range(0..count);
        (0..count)
            .map(|step| (first + step) % count)
            .find(|replica| !self.is_out(*replica))
            .unwrap_or(first)
    }

    /// The client for a settle of `lease`: another replica than the one that issued it,
    /// when there are several (one in the rotation, when there is one).
    fn settler(&self, lease: &Lease) -> &Client {
        let count = self.clients.len();
        if count == 1 {
            return &self.clients[0];
        }
        let first = rand::random_range(1..count);
        let other = (0..count - 1)
            .map(|step| (lease.owner + 1 + (first - 1 + step) % (count - 1)) % count)
            .find(|replica| !self.is_out(*replica))
            .unwrap_or((lease.owner + first) % count);
        &self.clients[other]
    }

    fn is_out(&self, replica: usize) -> bool {
        self.out[replica].load(Ordering::SeqCst)
    }

    /// Take `replica` out of the rotation, or put it back.
    fn set_out(&self, replica: usize, out: bool) {
        self.out[replica].store(out, Ordering::SeqCst);
    }

    fn generation(&self, replica: usize) -> u64 {
        self.generations[replica].load(Ordering::SeqCst)
    }

    fn bump(&self, replica: usize) {
        self.generations[replica].fetch_add(1, Ordering::SeqCst);
    }

    fn bump_all(&self) {
        for replica in 0..self.generations.len() {
            self.bump(replica);
        }
    }

    /// A settle of `lease` answered `status`, just now: a 404 or 410 answered while the lease
    /// was still live (the owner decided before its expiry) by an owner alive since the
    /// fetch breaks the contract.
    /// `detail`: the problem's, when the answer was one.
    fn check_refusal(&self, ledger: &SharedLedger, lease: &Lease, status: u16, detail: &str) {
        let answered_at = time::OffsetDateTime::now_utc();
        let live = lease
            .expires_at
            .is_some_and(|expires_at| answered_at < expires_at);
        if matches!(status, 404 | 410) && live && self.generation(lease.owner) == lease.generation {
            lock(ledger).refused_live.push(format!(
                "{} (delivery {}, issued by replica {}): {status} {}",
                lease.ledger_id,
                lease.delivered,
                lease.owner,
                detail.chars().take(200).collect::<String>()
            ));
        }
        // Whatever the servers did meanwhile, an owner still running is never taken for
        // gone while its lease lives (a missing heartbeat must not outweigh its answer).
        if status == 410
            && live
            && detail.contains(OWNER_GONE)
            && self.life(lease.owner) == lease.life
        {
            lock(ledger).refused_live.push(format!(
                "{} (delivery {}, issued by replica {}, still running): 410 owner gone",
                lease.ledger_id, lease.delivered, lease.owner
            ));
        }
    }
}

type SharedLedger = Arc<Mutex<Ledger>>;

fn lock(ledger: &SharedLedger) -> std::sync::MutexGuard<'_, Ledger> {
    ledger
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A leased message, as much of it as the ledger needs.
#[derive(Debug, Clone)]
struct Lease {
    id: String,
    ledger_id: String,
    delivered: u64,
    /// The replica that issued it, that replica's generation then and its process' life.
    owner: usize,
    generation: u64,
    life: u64,
    expires_at: Option<time::OffsetDateTime>,
}

fn record_delivery(ledger: &SharedLedger, message: &Value) -> Option<Lease> {
    let lease = Lease {
        id: message["id"].as_str()?.to_owned(),
        ledger_id: message["data"].as_str()?.to_owned(),
        delivered: message["delivered"].as_u64()?,
        owner: 0,
        generation: 0,
        life: 0,
        expires_at: message["lease_expires_at"].as_str().and_then(|at| {
            time::OffsetDateTime::parse(at, &time::format_description::well_known::Rfc3339).ok()
        }),
    };
    let mut ledger = lock(ledger);
    ledger.deliveries += 1;
    ledger
        .seen
        .entry(lease.ledger_id.clone())
        .or_default()
        .push(lease.delivered);
    if lease.delivered > 1 {
        ledger.redeliveries += 1;
    }
    if ledger.settled.contains_key(&lease.ledger_id) {
        ledger
            .duplicates
            .push((lease.ledger_id.clone(), lease.delivered));
    }
    Some(lease)
}

fn unexpected(ledger: &SharedLedger, what: String) {
    lock(ledger).unexpected.push(what);
}

/// An answer as text for the ledger's notes.
fn answer_text(answer: &Result<Reply, reqwest::Error>) -> String {
    match answer {
        Ok(reply) => format!("{} {}", reply.status, reply.text),
        Err(err) => format!("no answer: {err}"),
    }
}

/// A settle of `lease` got 2xx. The first confirmed outcome of an id stands (a duplicate
/// delivery settled again does not change what happened to the message).
fn confirm(ledger: &SharedLedger, lease: &Lease, outcome: Outcome) {
    let mut ledger = lock(ledger);
    ledger
        .settled
        .entry(lease.ledger_id.clone())
        .or_insert(outcome);
    // The settle was confirmed by the process that issued the lease (a successor answers
    // 410 for its predecessor's ids).
    ledger
        .ended_by
        .entry(lease.ledger_id.clone())
        .or_default()
        .insert((lease.owner, lease.life));
}

/// What a worker does with one delivery: a fixed function of id and delivery count, so runs
/// are comparable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Behaviour {
    Ack,
    BatchAck,
    NakWithDelay,
    Term,
    Abandon,
}

fn behaviour(lease: &Lease) -> Behaviour {
    let n: u64 = lease
        .ledger_id
        .trim_start_matches("id-")
        .parse()
        .unwrap_or(0);
    let roll = (n.wrapping_mul(2_654_435_761) ^ lease.delivered.wrapping_mul(40_503)) % 100;
    if lease.delivered > 2 {
        // Converge: later deliveries are acked.
        return if roll < 50 {
            Behaviour::BatchAck
        } else {
            Behaviour::Ack
        };
    }
    match roll {
        0..5 => Behaviour::Abandon,
        5..13 => Behaviour::NakWithDelay,
        13..18 if lease.delivered == 1 => Behaviour::Term,
        13..45 => Behaviour::BatchAck,
        _ => Behaviour::Ack,
    }
}

/// The ledger's client: a shorter bound than the suite's, so a worker caught by a fault
/// moves on.
fn client(base: &str) -> Client {
    let http = http_builder()
        .timeout(Duration::from_secs(15))
        .build()
        .expect("reqwest client");
    Client::with_http(base, http)
}

/// The deliveries of a fetch answered 200, recorded in the ledger.
fn record_fetched(ledger: &SharedLedger, reply: &Reply) -> Vec<Lease> {
    reply
        .body
        .get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|message| record_delivery(ledger, message))
        .collect()
}

/// [`record_fetched`] of a fetch at replica `owner` (in its `generation` and `life`).
fn record_fetched_at(
    ledger: &SharedLedger,
    reply: &Reply,
    owner: usize,
    generation: (u64, u64),
) -> Vec<Lease> {
    let messages = reply
        .body
        .get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten();
    record_at(ledger, messages, owner, generation)
}

/// Deliveries leased by replica `owner` (in its `generation` and `life`), recorded in the
/// ledger: a fetch's, or one written to a stream.
fn record_at<'m>(
    ledger: &SharedLedger,
    messages: impl IntoIterator<Item = &'m Value>,
    owner: usize,
    (generation, life): (u64, u64),
) -> Vec<Lease> {
    let leases: Vec<Lease> = messages
        .into_iter()
        .filter_map(|message| record_delivery(ledger, message))
        .map(|lease| Lease {
            owner,
            generation,
            life,
            ..lease
        })
        .collect();
    let mut ledger = lock(ledger);
    for lease in &leases {
        if ledger
            .ended_by
            .get(&lease.ledger_id)
            .is_some_and(|ended| ended.contains(&(owner, life)))
        {
            ledger
                .same_process_duplicates
                .push((lease.ledger_id.clone(), lease.delivered));
        }
    }
    leases
}

/// Send an ack (single) and record the answer; retry a 504 (the lease stays valid).
async fn ack(fleet: &Fleet, ledger: &SharedLedger, lease: &Lease) {
    ack_after(fleet, ledger, lease, false).await;
}

/// `unanswered`: an earlier attempt of this ack got no definite answer (504, or a batch that
/// failed), so it may have landed at the server however the retries end.
async fn ack_after(fleet: &Fleet, ledger: &SharedLedger, lease: &Lease, mut unanswered: bool) {
    for _ in 0..3 {
        let answer = fleet
            .settler(lease)
            .try_settle(&lease.id, Action::Ack, None, None)
            .await;
        if let Ok(reply) = &answer {
            fleet.check_refusal(ledger, lease, reply.status, &reply.text);
        }
        match answer.as_ref().map(|reply| reply.status) {
            Ok(204) => {
                confirm(ledger, lease, Outcome::Acked);
                return;
            }
            Ok(504) => {
                unexpected(
                    ledger,
                    format!("ack {}: {}", lease.ledger_id, answer_text(&answer)),
                );
                unanswered = true;
            }
            // Expired or superseded (410), from a gateway since restarted (404): it comes back,
            // unless an unanswered earlier attempt landed after all.
            Ok(404 | 409 | 410) => break,
            // 503 or no answer: the ack may or may not have reached the server.
            _ => {
                unexpected(
                    ledger,
                    format!("ack {}: {}", lease.ledger_id, answer_text(&answer)),
                );
                unanswered = true;
                break;
            }
        }
    }
    if unanswered {
        lock(ledger).ack_unconfirmed.insert(lease.ledger_id.clone());
    }
}

async fn batch_ack(fleet: &Fleet, ledger: &SharedLedger, leases: &[Lease]) {
    if leases.is_empty() {
        return;
    }
    let ids: Vec<&str> = leases.iter().map(|lease| lease.id.as_str()).collect();
    // Not at the replica of the first lease (the others may be anywhere).
    let answer = fleet
        .settler(&leases[0])
        .try_post("/messages/ack", Some(&json!({ "ids": ids })), None)
        .await;
    let results = match &answer {
        Ok(reply) if reply.status == 200 => Some(batch_results(reply)),
        _ => None,
    };
    let Some(results) = results else {
        unexpected(ledger, format!("batch ack: {}", answer_text(&answer)));
        let mut ledger = lock(ledger);
        for lease in leases {
            ledger.ack_unconfirmed.insert(lease.ledger_id.clone());
        }
        return;
    };
    // Matched by id, not by position: each id asked for has exactly one result.
    let mut by_id: HashMap<&str, u16> = HashMap::new();
    for result in &results {
        if let Some(lease) = leases.iter().find(|lease| lease.id == result.id) {
            let detail = result.detail.as_deref().unwrap_or_default();
            fleet.check_refusal(ledger, lease, result.status, detail);
        }
        if by_id.insert(result.id.as_str(), result.status).is_some() {
            unexpected(ledger, format!("batch ack: two results for {}", result.id));
        }
    }
    if results.len() != leases.len() {
        unexpected(
            ledger,
            format!(
                "batch ack of {} ids: {} results",
                leases.len(),
                results.len()
            ),
        );
    }
    for lease in leases {
        match by_id.get(lease.id.as_str()) {
            Some(204) => confirm(ledger, lease, Outcome::Acked),
            Some(404 | 409 | 410) => {}
            // 504 in a batch: retry it alone.
            Some(_) => ack_after(fleet, ledger, lease, true).await,
            None => {
                unexpected(
                    ledger,
                    format!("batch ack: no result for {}", lease.ledger_id),
                );
                ack_after(fleet, ledger, lease, true).await;
            }
        }
    }
}

async fn term(fleet: &Fleet, ledger: &SharedLedger, lease: &Lease) {
    let reason = format!("ledger: {} rejected on purpose", lease.ledger_id);
    lock(ledger)
        .term_reasons
        .insert(lease.ledger_id.clone(), reason.clone());
    let answer = fleet
        .settler(lease)
        .try_settle(
            &lease.id,
            Action::Term,
            Some(&json!({ "reason": reason })),
            None,
        )
        .await;
    let status = answer.as_ref().map(|reply| reply.status).ok();
    if let Ok(reply) = &answer {
        fleet.check_refusal(ledger, lease, reply.status, &reply.text);
    }
    if status == Some(204) {
        confirm(ledger, lease, Outcome::Termed);
    } else {
        if !matches!(status, Some(404 | 409 | 410)) {
            unexpected(
                ledger,
                format!("term {}: {}", lease.ledger_id, answer_text(&answer)),
            );
        }
        // Not confirmed: the message comes back, and is then acked or termed again. A term
        // that did land counts as unconfirmed-but-settled, like an ack.
        lock(ledger).ack_unconfirmed.insert(lease.ledger_id.clone());
    }
}

/// Nak with a 300 ms delay, at another replica than the lease's: the message comes back
/// either way, but anything but 204 (or a lease that just expired) breaks the contract.
async fn nak_with_delay(fleet: &Fleet, ledger: &SharedLedger, lease: &Lease) {
    let answer = fleet
        .settler(lease)
        .try_settle(
            &lease.id,
            Action::Nak,
            Some(&json!({ "delay_ms": 300 })),
            None,
        )
        .await;
    let status = answer.as_ref().map(|reply| reply.status).ok();
    if let Ok(reply) = &answer {
        fleet.check_refusal(ledger, lease, reply.status, &reply.text);
    }
    if !matches!(status, Some(204 | 410)) {
        unexpected(
            ledger,
            format!("nak {}: {}", lease.ledger_id, answer_text(&answer)),
        );
    }
}

/// Do with the leases of one fetch (or one streamed batch) what [`behaviour`] says, over
/// HTTP, each settle at another replica than the lease's.
async fn settle_leases(fleet: &Fleet, ledger: &SharedLedger, leases: Vec<Lease>) {
    let mut batch = Vec::new();
    for lease in leases {
        match behaviour(&lease) {
            Behaviour::Ack => ack(fleet, ledger, &lease).await,
            Behaviour::BatchAck => batch.push(lease),
            Behaviour::NakWithDelay => nak_with_delay(fleet, ledger, &lease).await,
            Behaviour::Term => term(fleet, ledger, &lease).await,
            Behaviour::Abandon => {}
        }
    }
    batch_ack(fleet, ledger, &batch).await;
}

async fn worker(fleet: Arc<Fleet>, ledger: SharedLedger, stop: CancellationToken) {
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
async fn sse_worker(fleet: Arc<Fleet>, ledger: SharedLedger, stop: CancellationToken) {
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
async fn ws_worker(fleet: Arc<Fleet>, ledger: SharedLedger, stop: CancellationToken) {
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
async fn vanishing_client(base: String, ledger: SharedLedger, stop: CancellationToken, round: u64) {
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

/// A fault injected during a run, and how long after it was healed a fetch answered 200.
struct Fault {
    name: &'static str,
    recovered: tokio::task::JoinHandle<Option<Duration>>,
}

impl Fault {
    /// Start probing right after the heal: `POST /fetch` (wait 0) every 50 ms until one
    /// answers 200; a message it leases is nak'd back at once.
    fn healed(name: &'static str, base: &str) -> Self {
        let client = client(base);
        let recovered = tokio::spawn(async move {
            let healed_at = Instant::now();
            while healed_at.elapsed() < RECOVERY_BOUND + Duration::from_secs(5) {
                let answer = client
                    .try_fetch(&FetchRequest::new(1, 0), Some(Duration::from_secs(2)))
                    .await;
                if let Ok(reply) = answer
                    && reply.status == 200
                {
                    let took = healed_at.elapsed();
                    for message in reply.body["messages"].as_array().into_iter().flatten() {
                        if let Some(id) = message["id"].as_str() {
                            let _ = client.try_settle(id, Action::Nak, None, None).await;
                        }
                    }
                    return Some(took);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            None
        });
        Self { name, recovered }
    }

    /// [`Fault::healed`] of a server fault: until the consumer answers again (a cluster
    /// elects a new leader, which may redeliver early or have lost deliveries: a new lease
    /// epoch), the failover may void leases issued meanwhile, which is not the replicas'
    /// doing; so the fleet's generations move on again once it has recovered.
    fn healed_then(name: &'static str, base: &str, fleet: &Arc<Fleet>) -> Self {
        let probe = Self::healed(name, base);
        let fleet = fleet.clone();
        let recovered = tokio::spawn(async move {
            let took = probe.recovered.await.ok().flatten();
            fleet.bump_all();
            // A rebind (and a new lease epoch) can follow the first good fetch by a moment.
            tokio::time::sleep(Duration::from_secs(4)).await;
            fleet.bump_all();
            took
        });
        Self { name, recovered }
    }
}

/// What a run ended with.
struct Report {
    scenario: &'static str,
    /// Acked or termed with a 2xx.
    acked: usize,
    /// Not settled with a 2xx, settled at the server after all: a worker's settle whose answer
    /// a fault swallowed …
    acked_unconfirmed: usize,
    /// … or an ack the vanishing client hung up on.
    hung_up: usize,
    /// Answers outside the contract (see `Ledger::unexpected`).
    unexpected: Vec<String>,
    termed: usize,
    lost: Vec<String>,
    /// Termed ids without a recorded reason (must be 0: every term is on purpose).
    terms_without_reason: usize,
    /// Dead letters stored, and how many of them disagree with the ledger's terms (an id
    /// not termed with a 2xx, a missing one, a different reason, a second copy).
    dead_lettered: usize,
    dead_letter_mismatches: Vec<String>,
    /// Ids termed with a 2xx that are not in the dead-letter stream.
    termed_not_dead_lettered: usize,
    duplicates: Vec<(String, u64)>,
    same_process_duplicates: Vec<(String, u64)>,
    redeliveries: u64,
    refused_live: Vec<String>,
    recoveries: Vec<(&'static str, Option<Duration>)>,
    took: Duration,
}

impl Report {
    fn row(&self) -> String {
        let recoveries = if self.recoveries.is_empty() {
            "–".to_owned()
        } else {
            self.recoveries
                .iter()
                .map(|(name, took)| match took {
                    Some(took) => format!("{name} {:.1}s", took.as_secs_f64()),
                    None => format!("{name} NOT RECOVERED"),
                })
                .collect::<Vec<_>>()
                .join("; ")
        };
        format!(
            "| {:<28} | {:>3} | {:>5} ({:>2} unconfirmed) | {:>6} | {:>3} ({} differ) | {:>4} | {:>10} | {:>12} | {:>9} | {:>4} | {} | {:.0}s |",
            self.scenario,
            K,
            self.acked + self.acked_unconfirmed + self.hung_up,
            self.acked_unconfirmed + self.hung_up,
            self.termed,
            self.dead_lettered,
            self.dead_letter_mismatches.len(),
            self.lost.len(),
            self.duplicates.len(),
            self.redeliveries,
            self.unexpected.len(),
            self.refused_live.len(),
            recoveries,
            self.took.as_secs_f64()
        )
    }
}

const HEADER: &str = "| scenario                     |   K | acked (of which unconfirmed) | termed | dead-lettered | lost | duplicates | redeliveries | off-contract answers | live leases refused | recovery after fault | run |\n|---|---|---|---|---|---|---|---|---|---|---|---|";

/// Print past the test harness' capture, so CI logs show the table.
fn print_table(title: &str, reports: &[Report]) {
    let mut text = format!("\n==== ledger: {title} ====\n{HEADER}\n");
    for report in reports {
        text.push_str(&report.row());
        text.push('\n');
    }
    let _ = std::io::stderr().write_all(text.as_bytes());
}

/// Connect and create the work stream and the dead-letter stream (retrying while a fresh
/// cluster elects its meta leader).
async fn create_streams(urls: &str, replicas: usize) -> jetstream::Context {
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
async fn dead_letters(js: &jetstream::Context) -> Option<HashMap<String, String>> {
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

async fn publish_all(js: &jetstream::Context) -> Vec<String> {
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
async fn server_backlog(js: &jetstream::Context) -> Option<(u64, usize)> {
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

/// The name of the server leading the consumer.
/// What a 410 says when the replica that issued the lease was taken for gone.
const OWNER_GONE: &str = "the replica that issued it is gone";

/// The node each replica of [`Scenario::TwoReplicasOnCluster`] connects to first.
const OWN_NODE_OF_REPLICA: [usize; 2] = [1, 2];

/// Ask a JetStream leader to step down (`api`: the API subject after `$JS.API.`), and wait
/// for the answer.
async fn step_down(js: &jetstream::Context, api: &str) {
    let answer: Result<Value, _> = js.request(api.to_owned(), &json!({})).await;
    assert!(
        answer
            .as_ref()
            .is_ok_and(|answer| answer["success"] == json!(true)),
        "{api}: {answer:?}"
    );
}

async fn stream_leader(js: &jetstream::Context) -> Option<String> {
    let mut stream = js.get_stream(STREAM).await.ok()?;
    let info = stream.info().await.ok()?;
    info.cluster
        .as_ref()
        .and_then(|cluster| cluster.leader.clone())
}

async fn consumer_leader(js: &jetstream::Context) -> Option<String> {
    let stream = js.get_stream(STREAM).await.ok()?;
    let info = stream.consumer_info(CONSUMER).await.ok()?;
    info.cluster.and_then(|cluster| cluster.leader)
}

/// What a run injects.
enum Scenario {
    NoFault,
    KillNatsServer,
    KillGateway,
    VanishingClients,
    ClusterFaults,
    /// nats-server at its default sync_interval (most deployments), the stream deleted and
    /// made again beforehand: the gateway stopped and started again, killed -9 and started
    /// again, then the server killed -9 twice and paused while that gateway lives.
    DefaultSync,
    /// Three replicas, no stickiness, replica and server faults (`true`: on the cluster).
    NonSticky {
        cluster: bool,
    },
    /// Three replicas started on the previous release, rolled to this build one at a time
    /// under load (SIGTERM, this build started in its place).
    RollingUpgrade,
    /// Two replicas, no stickiness, on a 3-node cluster at nats-server's default sync, each
    /// replica first connected to a node of its own: the stream's and the consumer's leaders
    /// stepped down, the stream leader killed -9, the consumer leader's node paused 6 s, a
    /// replica's own node killed -9. No owner still running is taken for gone (the fleet
    /// stream and the heartbeats may lag meanwhile), no 410 for an ack that landed (lost 0).
    TwoReplicasOnCluster,
}

impl Scenario {
    fn name(&self) -> &'static str {
        match self {
            Self::NoFault => "no fault",
            Self::KillNatsServer => "nats-server kill -9",
            Self::KillGateway => "gateway kill -9",
            Self::VanishingClients => "clients vanish mid-fetch/ack",
            Self::ClusterFaults => "3-node cluster: leader/pause",
            Self::DefaultSync => "default sync: gw TERM/-9, server -9 ×2, pause",
            Self::NonSticky { cluster: false } => "3 replicas, non-sticky",
            Self::NonSticky { cluster: true } => "3 replicas, non-sticky, R3",
            Self::RollingUpgrade => "3 replicas rolled from the previous release",
            Self::TwoReplicasOnCluster => "2 replicas, R3, default sync: step-downs, -9, pause 6s",
        }
    }

    fn nodes(&self) -> usize {
        match self {
            Self::ClusterFaults
            | Self::NonSticky { cluster: true }
            | Self::TwoReplicasOnCluster => 3,
            _ => 1,
        }
    }

    fn gateways(&self) -> usize {
        match self {
            Self::NonSticky { .. } | Self::RollingUpgrade => 3,
            Self::TwoReplicasOnCluster => 2,
            _ => 1,
        }
    }
}

async fn run(scenario: Scenario) -> Report {
    let started = Instant::now();
    let replicas = scenario.nodes();
    let default_sync = matches!(
        scenario,
        Scenario::DefaultSync | Scenario::TwoReplicasOnCluster
    );
    let mut cluster = Cluster::start(replicas, !default_sync).await;
    let urls = cluster.urls();
    let mut js = create_streams(&urls, replicas).await;
    if matches!(scenario, Scenario::DefaultSync) {
        // A stream deleted and made again in the same store: what the server recovers
        // after a crash then mixes the two lives of its files.
        js.delete_stream(STREAM).await.expect("delete the stream");
        js = create_streams(&urls, replicas).await;
    }
    let ids = publish_all(&js).await;
    let mut key = tempfile::NamedTempFile::new().expect("lease key file");
    key.write_all(b"the ledger's replicas share this lease key: 0123456789")
        .expect("write the lease key");
    // Longer than a lease lives: a replica being rolled answers every settle of its leases
    // until they are settled or expired, and only then exits.
    let grace = if scenario.gateways() > 1 { "3s" } else { "1s" };
    let setup = Setup::consumer(CONSUMER)
        .stream(STREAM)
        .ack_wait(ACK_WAIT)
        .settle_timeout("2s")
        .shutdown_grace(grace)
        .dead_letter_subject(DLQ_SUBJECT)
        .lease_key_file(key.path());
    let mut gateways: Vec<GatewayProcess> = Vec::new();
    for own_node in OWN_NODE_OF_REPLICA.iter().cycle().take(scenario.gateways()) {
        gateways.push(match scenario {
            Scenario::RollingUpgrade => {
                let mut old = GatewayProcess::spawn_program(&setup, &urls, &previous_release());
                old.wait_ready(Duration::from_secs(20)).await;
                old
            }
            // Replica r first connects to node r + 1 (the cluster tells it of the others),
            // so that "its own node" is known.
            Scenario::TwoReplicasOnCluster => {
                setup.process(&cluster.nodes[*own_node].1.url()).await
            }
            _ => setup.process(&urls).await,
        });
    }
    let bases: Vec<String> = gateways.iter().map(|gateway| gateway.base()).collect();
    let base = bases[0].clone();
    let fleet = Fleet::new(&bases);
    let ledger: SharedLedger = Arc::default();
    let stop = CancellationToken::new();
    let mut tasks = Vec::new();
    for _ in 0..W {
        tasks.push(tokio::spawn(worker(
            fleet.clone(),
            ledger.clone(),
            stop.clone(),
        )));
    }
    // Streaming workers among the fetchers: one over SSE, one over a WebSocket (not in the
    // roll from the previous release, which streams nothing).
    if !matches!(scenario, Scenario::RollingUpgrade) {
        tasks.push(tokio::spawn(sse_worker(
            fleet.clone(),
            ledger.clone(),
            stop.clone(),
        )));
        tasks.push(tokio::spawn(ws_worker(
            fleet.clone(),
            ledger.clone(),
            stop.clone(),
        )));
    }
    if matches!(scenario, Scenario::VanishingClients) {
        for round in 0..2 {
            tasks.push(tokio::spawn(vanishing_client(
                base.clone(),
                ledger.clone(),
                stop.clone(),
                round,
            )));
        }
    }
    let settled = |ledger: &SharedLedger| lock(ledger).settled.len();
    let wait_for_settled = |fraction: usize| {
        let ledger = ledger.clone();
        async move {
            let deadline = Instant::now() + RUN_DEADLINE;
            while settled(&ledger) < K * fraction / 100 && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };

    let mut faults = Vec::new();
    match scenario {
        Scenario::NoFault | Scenario::VanishingClients => {}
        Scenario::KillNatsServer => {
            wait_for_settled(30).await;
            cluster.nodes[0].1.kill();
            // Down for a second (pacing: the outage itself is the fault).
            tokio::time::sleep(Duration::from_secs(1)).await;
            cluster.nodes[0].1.restart().await;
            faults.push(Fault::healed("restart", &base));
        }
        Scenario::KillGateway => {
            wait_for_settled(30).await;
            gateways[0].kill9();
            fleet.replaced(0);
            // Measured from the restart of the process, its start-up included.
            let probe = Fault::healed("restart", &base);
            gateways[0].restart().await;
            faults.push(probe);
        }
        Scenario::DefaultSync => {
            // A rolled gateway (SIGTERM, started again), then one killed -9.
            wait_for_settled(10).await;
            let status = gateways[0].terminate(Duration::from_secs(15)).await;
            assert!(status.success(), "stopped badly: {}", gateways[0].log());
            fleet.replaced(0);
            let probe = Fault::healed("gateway TERM", &base);
            gateways[0].restart().await;
            faults.push(probe);
            wait_for_settled(25).await;
            gateways[0].kill9();
            fleet.replaced(0);
            let probe = Fault::healed("gateway -9", &base);
            gateways[0].restart().await;
            faults.push(probe);
            // The server killed -9 twice while this gateway lives, settles confirmed between
            // the two (what a restarted server confirms it may lose again), then paused.
            for (share, name) in [(40, "server -9"), (55, "server -9 again")] {
                wait_for_settled(share).await;
                cluster.nodes[0].1.kill();
                tokio::time::sleep(Duration::from_secs(1)).await;
                cluster.nodes[0].1.restart().await;
                faults.push(Fault::healed(name, &base));
            }
            wait_for_settled(70).await;
            cluster.nodes[0].1.pause();
            tokio::time::sleep(Duration::from_secs(2)).await;
            cluster.nodes[0].1.resume();
            faults.push(Fault::healed("server pause 2s", &base));
        }
        Scenario::ClusterFaults => {
            wait_for_settled(15).await;
            let leader = consumer_leader(&js)
                .await
                .expect("the consumer has a leader");
            fleet.bump_all();
            cluster.node(&leader).kill();
            tokio::time::sleep(Duration::from_secs(1)).await;
            cluster.node(&leader).restart().await;
            faults.push(Fault::healed_then("leader kill", &base, &fleet));
            wait_for_settled(45).await;
            // Pause a node for 3 s: a hung server, sockets open, nothing answered.
            let paused = cluster
                .nodes
                .iter()
                .position(|(name, _)| *name != leader)
                .expect("another node");
            fleet.bump_all();
            cluster.nodes[paused].1.pause();
            tokio::time::sleep(Duration::from_secs(3)).await;
            cluster.nodes[paused].1.resume();
            faults.push(Fault::healed_then("pause 3s", &base, &fleet));
        }
        Scenario::NonSticky {
            cluster: on_cluster,
        } => {
            // A replica killed -9 and started again.
            wait_for_settled(15).await;
            fleet.bump(0);
            gateways[0].kill9();
            fleet.replaced(0);
            let probe = Fault::healed("replica kill", &bases[0]);
            gateways[0].restart().await;
            faults.push(probe);
            // A rolling restart of the other two, one at a time.
            wait_for_settled(30).await;
            for replica in [1, 2] {
                let status = gateways[replica].terminate(Duration::from_secs(15)).await;
                assert!(
                    status.success(),
                    "replica {replica} stopped badly: {}",
                    gateways[replica].log()
                );
                fleet.bump(replica);
                fleet.replaced(replica);
                gateways[replica].restart().await;
            }
            faults.push(Fault::healed("rolling restart", &bases[2]));
            // A replica stalled for 3 s: settles of its leases elsewhere wait (504).
            wait_for_settled(50).await;
            gateways[1].pause();
            tokio::time::sleep(Duration::from_secs(3)).await;
            // A settle it takes up after the stall finds a lease that expired meanwhile
            // (410, rightly): its leases from before are not counted as live.
            fleet.bump(1);
            gateways[1].resume();
            faults.push(Fault::healed("replica pause 3s", &bases[1]));
            // The server (or the consumer leader's node) killed -9 and started again.
            wait_for_settled(65).await;
            let node = if on_cluster {
                let leader = consumer_leader(&js)
                    .await
                    .expect("the consumer has a leader");
                cluster
                    .nodes
                    .iter()
                    .position(|(name, _)| *name == leader)
                    .expect("the leader is a node")
            } else {
                0
            };
            fleet.bump_all();
            cluster.nodes[node].1.kill();
            tokio::time::sleep(Duration::from_secs(1)).await;
            cluster.nodes[node].1.restart().await;
            faults.push(Fault::healed_then("server kill", &bases[0], &fleet));
        }
        Scenario::TwoReplicasOnCluster => {
            // Leaders stepped down. A new consumer leader may redeliver early, and the
            // owner then refuses the superseded lease rightly; what must never happen
            // (checked in every fault) is an owner still running taken for gone.
            wait_for_settled(15).await;
            fleet.bump_all();
            step_down(&js, &format!("STREAM.LEADER.STEPDOWN.{STREAM}")).await;
            step_down(
                &js,
                &format!("CONSUMER.LEADER.STEPDOWN.{STREAM}.{CONSUMER}"),
            )
            .await;
            faults.push(Fault::healed_then("leader step-downs", &bases[0], &fleet));
            // The stream leader killed -9 and started again a second later.
            wait_for_settled(30).await;
            let leader = wait_for("the stream has a leader", Duration::from_secs(20), || {
                stream_leader(&js)
            })
            .await;
            fleet.bump_all();
            cluster.node(&leader).kill();
            tokio::time::sleep(Duration::from_secs(1)).await;
            cluster.node(&leader).restart().await;
            faults.push(Fault::healed_then("stream leader -9", &bases[0], &fleet));
            // The consumer leader's node paused 6 s: sockets open, nothing answered.
            wait_for_settled(45).await;
            let leader = wait_for("the consumer has a leader", Duration::from_secs(20), || {
                consumer_leader(&js)
            })
            .await;
            // A consumer leader deposed may be followed by early redeliveries (the new
            // leader's timers): leases they supersede are refused rightly.
            fleet.bump_all();
            cluster.node(&leader).pause();
            tokio::time::sleep(Duration::from_secs(6)).await;
            cluster.node(&leader).resume();
            faults.push(Fault::healed_then(
                "consumer leader paused 6s",
                &bases[0],
                &fleet,
            ));
            // Replica 0's own node killed -9: the replica reconnects to another.
            wait_for_settled(60).await;
            fleet.bump_all();
            let own = OWN_NODE_OF_REPLICA[0];
            cluster.nodes[own].1.kill();
            tokio::time::sleep(Duration::from_secs(1)).await;
            cluster.nodes[own].1.restart().await;
            faults.push(Fault::healed_then(
                "replica's own node -9",
                &bases[0],
                &fleet,
            ));
        }
        Scenario::RollingUpgrade => {
            // One replica at a time: the old one drains (its leases settle through it or
            // any other), and this build takes its place. The release before sealed replica
            // traffic: the new replicas believe its unsealed messages for the length of the
            // roll.
            for (replica, gateway) in gateways.iter_mut().enumerate() {
                wait_for_settled(15 + 20 * replica).await;
                let status = gateway.terminate(Duration::from_secs(15)).await;
                assert!(
                    status.success(),
                    "old replica {replica} stopped badly: {}",
                    gateway.log()
                );
                fleet.bump(replica);
                fleet.replaced(replica);
                fleet.set_out(replica, true);
                gateway.upgrade(&["--accept-unsigned-replicas"]).await;
                fleet.set_out(replica, false);
            }
            faults.push(Fault::healed("rolling upgrade", &bases[2]));
        }
    }

    // Run until every id is settled, or nothing is left anywhere (an ack that landed without
    // its answer never comes back), and at least 2 ack_waits after the last fault healed.
    let last_heal = Instant::now();
    let deadline = Instant::now() + RUN_DEADLINE;
    let mut quiet_since: Option<Instant> = None;
    loop {
        let all_settled = settled(&ledger) == K;
        let quiet = !all_settled
            && last_heal.elapsed() >= Duration::from_secs(4)
            && server_backlog(&js).await == Some((0, 0));
        quiet_since = if quiet {
            quiet_since.or(Some(Instant::now()))
        } else {
            None
        };
        if all_settled || quiet_since.is_some_and(|at| at.elapsed() >= Duration::from_secs(3)) {
            break;
        }
        if Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.cancel();
    for task in tasks {
        let _ = task.await;
    }
    let backlog = server_backlog(&js).await;
    let mut recoveries = Vec::new();
    for fault in faults {
        recoveries.push((fault.name, fault.recovered.await.ok().flatten()));
    }
    // The workers have stopped: take the ledger out to read it.
    let ledger = std::mem::take(&mut *lock(&ledger));
    // Dead letters arrive shortly after the term, or, for advisories a killed gateway held,
    // after the advisory consumer's ack_wait (10 s): wait (bounded) for every termed id.
    let termed: Vec<&String> = ledger
        .settled
        .iter()
        .filter(|(_, outcome)| **outcome == Outcome::Termed)
        .map(|(id, _)| id)
        .collect();
    let termed_ids = termed.len();
    let dead_deadline = Instant::now() + Duration::from_secs(25);
    let letters = loop {
        let letters = dead_letters(&js).await.unwrap_or_default();
        let all_there = termed.iter().all(|id| letters.contains_key(*id));
        if (all_there && letters.len() >= termed_ids) || Instant::now() >= dead_deadline {
            break letters;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let mut dead_letter_mismatches: Vec<String> = letters
        .iter()
        .filter(|(id, reason)| ledger.term_reasons.get(*id) != Some(*reason))
        .map(|(id, reason)| {
            format!(
                "{id}: dead-lettered with {reason:?}, ledger {:?}",
                ledger.term_reasons.get(id)
            )
        })
        .collect();
    let not_dead_lettered: Vec<String> = termed
        .iter()
        .filter(|id| !letters.contains_key(**id))
        .map(|id| format!("{id}: termed (204), not dead-lettered"))
        .collect();
    let termed_not_dead_lettered = not_dead_lettered.len();
    dead_letter_mismatches.extend(not_dead_lettered);
    let acked = ledger
        .settled
        .values()
        .filter(|outcome| **outcome == Outcome::Acked)
        .count();
    let termed = ledger.settled.len() - acked;
    // Not settled with a 2xx: never counted as acked or termed. It is not lost only if a
    // settle of it was sent whose answer was lost (a fault, or the client hung up on it) and
    // the server holds nothing any more (the settle landed); the check below says in which
    // runs that may happen at all.
    let unsettled: Vec<&String> = ids
        .iter()
        .filter(|id| !ledger.settled.contains_key(*id))
        .collect();
    let server_empty = backlog == Some((0, 0));
    let answer_lost =
        |id: &String| ledger.ack_unconfirmed.contains(id) || ledger.hung_up.contains(id);
    let lost: Vec<String> = unsettled
        .iter()
        .filter(|id| !server_empty || !answer_lost(id))
        .map(|id| (*id).clone())
        .collect();
    let hung_up = unsettled
        .iter()
        .filter(|id| {
            server_empty && !ledger.ack_unconfirmed.contains(**id) && ledger.hung_up.contains(**id)
        })
        .count();
    let terms_without_reason = ledger
        .settled
        .iter()
        .filter(|(id, outcome)| {
            **outcome == Outcome::Termed && !ledger.term_reasons.contains_key(*id)
        })
        .count();
    if !lost.is_empty() {
        let stream = js.get_stream(STREAM).await.ok();
        for id in &lost {
            let sequence = id.trim_start_matches("id-").parse::<u64>().unwrap_or(0) + 1;
            let stored = match &stream {
                Some(stream) => stream.get_raw_message(sequence).await.is_ok(),
                None => false,
            };
            let seen = ledger.seen.get(id).cloned().unwrap_or_default();
            let behaviours: Vec<String> = seen
                .iter()
                .map(|delivered| {
                    let lease = Lease {
                        id: String::new(),
                        ledger_id: id.clone(),
                        delivered: *delivered,
                        owner: 0,
                        generation: 0,
                        life: 0,
                        expires_at: None,
                    };
                    format!("{delivered}:{:?}", behaviour(&lease))
                })
                .collect();
            eprintln!(
                "lost {id} (stream seq {sequence}, in stream: {stored}): deliveries {behaviours:?}"
            );
        }
        let info = match &stream {
            Some(stream) => stream
                .consumer_info(CONSUMER)
                .await
                .ok()
                .map(|info| format!("{info:?}")),
            None => None,
        };
        eprintln!(
            "{}: server backlog (num_pending, num_ack_pending) {backlog:?}; consumer {info:?}; gateway log (warnings):\n{}",
            scenario.name(),
            gateway_warnings(&gateways)
        );
    } else if !ledger.refused_live.is_empty() {
        // Why the owners refused them: a new lease epoch is logged as a warning.
        eprintln!(
            "{}: live leases refused {:?}; gateway log (warnings):\n{}",
            scenario.name(),
            ledger.refused_live,
            gateway_warnings(&gateways)
        );
    }
    Report {
        scenario: scenario.name(),
        acked,
        acked_unconfirmed: unsettled.len() - lost.len() - hung_up,
        hung_up,
        unexpected: ledger.unexpected.clone(),
        termed,
        lost,
        terms_without_reason,
        dead_lettered: letters.len(),
        dead_letter_mismatches,
        termed_not_dead_lettered,
        duplicates: ledger.duplicates.clone(),
        same_process_duplicates: ledger.same_process_duplicates.clone(),
        redeliveries: ledger.redeliveries,
        refused_live: ledger.refused_live.clone(),
        recoveries,
        took: started.elapsed(),
    }
}

/// Every warning and error the gateways logged, each line prefixed with its replica.
fn gateway_warnings(gateways: &[GatewayProcess]) -> String {
    gateways
        .iter()
        .enumerate()
        .flat_map(|(replica, gateway)| {
            gateway
                .log()
                .lines()
                .filter(|line| line.contains("WARN") || line.contains("ERROR"))
                .map(|line| format!("[replica {replica}] {line}"))
                .collect::<Vec<_>>()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// `faulty`: a server or gateway was killed during the run; then off-contract answers and
/// dead-letter differences are reported, not failed (a term whose answer was lost is
/// dead-lettered but not in the ledger; a server killed before it stored the advisory of a
/// term it had confirmed loses that advisory). `duplicates_allowed`: the gateway itself was killed
/// (its memory of confirmed settles died with it) or a cluster changed leaders while an ack
/// was in flight; everywhere else a message handed out again after a 2xx ack or term fails.
/// `replicas`: a non-sticky run, where a settle of a live lease at a live owner must never
/// be refused (reported in every run).
fn check(report: &Report, faulty: bool, duplicates_allowed: bool, replicas: bool) -> Vec<String> {
    let mut failures = Vec::new();
    // What docs/guarantees.md's ledger table shows for the runs without a server or gateway fault: every
    // answer as the contract says, no worker's settle left unanswered (unconfirmed acks
    // there are only those a vanishing client hung up on).
    if !faulty && !report.unexpected.is_empty() {
        failures.push(format!(
            "{}: {} answers outside the contract, e.g. {:?}",
            report.scenario,
            report.unexpected.len(),
            &report.unexpected[..report.unexpected.len().min(10)]
        ));
    }
    if !faulty && report.acked_unconfirmed > 0 {
        failures.push(format!(
            "{}: {} settles of well-behaved workers went unanswered",
            report.scenario, report.acked_unconfirmed
        ));
    }
    if !faulty && !report.dead_letter_mismatches.is_empty() {
        failures.push(format!(
            "{}: dead letters differ from the ledger's terms: {:?}",
            report.scenario, report.dead_letter_mismatches
        ));
    }
    if !report.lost.is_empty() {
        failures.push(format!(
            "{}: lost {} ids, e.g. {:?}",
            report.scenario,
            report.lost.len(),
            &report.lost[..report.lost.len().min(10)]
        ));
    }
    if replicas && !report.refused_live.is_empty() {
        failures.push(format!(
            "{}: {} settles of live leases at live owners refused: {:?}",
            report.scenario,
            report.refused_live.len(),
            &report.refused_live[..report.refused_live.len().min(10)]
        ));
    }
    if report.terms_without_reason > 0 {
        failures.push(format!(
            "{}: {} ids termed without a recorded reason",
            report.scenario, report.terms_without_reason
        ));
    }
    // A gateway process never leases again what it confirmed an ack or term of, whatever
    // the server forgot; only a successor (whose memory started empty) may.
    if !report.same_process_duplicates.is_empty() {
        failures.push(format!(
            "{}: {} messages leased again by the gateway process that had confirmed their ack/term: {:?}",
            report.scenario,
            report.same_process_duplicates.len(),
            &report.same_process_duplicates[..report.same_process_duplicates.len().min(10)]
        ));
    }
    if !duplicates_allowed && !report.duplicates.is_empty() {
        failures.push(format!(
            "{}: {} messages handed out again after a confirmed ack/term: {:?}",
            report.scenario,
            report.duplicates.len(),
            &report.duplicates[..report.duplicates.len().min(10)]
        ));
    }
    for (fault, recovered) in &report.recoveries {
        match recovered {
            Some(took) if *took <= RECOVERY_BOUND => {}
            other => failures.push(format!(
                "{}: no fetch answered 200 within {RECOVERY_BOUND:?} after {fault}: {other:?}",
                report.scenario
            )),
        }
    }
    failures
}

async fn ledger_single_node_faults() {
    let mut reports = Vec::new();
    let mut failures = Vec::new();
    // A server killed -9 forgets acks it had confirmed; the gateway, still running, settles
    // those redeliveries again itself, so no client sees a duplicate.
    for (scenario, faulty, duplicates_allowed) in [
        (Scenario::NoFault, false, false),
        (Scenario::VanishingClients, false, false),
        (Scenario::KillNatsServer, true, false),
        (Scenario::KillGateway, true, true),
        (Scenario::DefaultSync, true, true),
    ] {
        let gateway_killed = matches!(scenario, Scenario::KillGateway);
        let report = run(scenario).await;
        failures.extend(check(&report, faulty, duplicates_allowed, false));
        // A gateway killed -9 loses no dead letter of a term it answered: the advisory stream
        // keeps the advisories it had not copied.
        if gateway_killed && report.termed_not_dead_lettered > 0 {
            failures.push(format!(
                "{}: {} ids termed with a 2xx were not dead-lettered: {:?}",
                report.scenario, report.termed_not_dead_lettered, report.dead_letter_mismatches
            ));
        }
        reports.push(report);
    }
    print_table(
        "single nats-server (sync_interval: always; the last run at the default)",
        &reports,
    );
    assert!(failures.is_empty(), "{failures:#?}");
}

async fn ledger_cluster_faults() {
    let mut reports = Vec::new();
    let mut failures = Vec::new();
    for scenario in [
        Scenario::ClusterFaults,
        Scenario::NonSticky { cluster: true },
        Scenario::TwoReplicasOnCluster,
    ] {
        let replicas = scenario.gateways() > 1;
        let report = run(scenario).await;
        failures.extend(check(&report, true, true, replicas));
        reports.push(report);
    }
    print_table(
        "3-node cluster, stream R3 (sync_interval: always; the last run at the default)",
        &reports,
    );
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Three replicas behind no sticky balancer: every settle at another replica than the
/// fetch, through replica and server faults.
async fn ledger_rolling_upgrade_from_the_previous_release() {
    // Nothing is killed: every settle answered 2xx must hold, on old and new replicas alike.
    let report = run(Scenario::RollingUpgrade).await;
    let mut failures = check(&report, true, false, true);
    // What a roll may cost a client: a fetch refused (503, retried elsewhere) by a replica
    // draining or starting, or no answer from one between its stop and its successor's
    // start. Never a settle refused: an old replica's lease settles at a new one and the
    // other way round.
    let refused: Vec<&String> = report
        .unexpected
        .iter()
        .filter(|answer| !answer.starts_with("fetch: 503") && !answer.contains(": no answer: "))
        .collect();
    if !refused.is_empty() {
        failures.push(format!(
            "answers a roll must not cause: {:?}",
            &refused[..refused.len().min(10)]
        ));
    }
    print_table(
        "3 gateway replicas rolled from the previous release under load",
        &[report],
    );
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The previous release's binary: `RUSTSTREAM_PREVIOUS_RELEASE_BIN` (scripts/test.sh builds
/// it before the tests), else built now by scripts/previous-release.sh in a target
/// directory of its own.
fn previous_release() -> String {
    if let Ok(path) = std::env::var("RUSTSTREAM_PREVIOUS_RELEASE_BIN")
        && !path.is_empty()
    {
        return path;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/previous-release.sh");
    let output = std::process::Command::new("bash")
        .arg(&script)
        .env("PREVIOUS_RELEASE_OWN_TARGET", "1")
        .output()
        .expect("run scripts/previous-release.sh");
    assert!(
        output.status.success(),
        "building the previous release failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

async fn ledger_non_sticky_replicas() {
    // Replicas are killed: their memory of confirmed settles dies with them, so duplicates
    // are reported, not failed (as for the single gateway killed).
    let report = run(Scenario::NonSticky { cluster: false }).await;
    let failures = check(&report, true, true, true);
    print_table(
        "3 gateway replicas, non-sticky, single nats-server (sync_interval: always)",
        &[report],
    );
    assert!(failures.is_empty(), "{failures:#?}");
}

// ---- three consumers on one stream, two replicas ------------------------------------------

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
async fn ledger_three_consumers_on_two_replicas() {
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
