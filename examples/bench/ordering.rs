//! `--ordering`: the ordered-per-key rows of docs/benchmark.md. `--messages` messages over
//! 1 000 keys (`ordered.k<n>`, round robin) are drained by 8 workers, each a keep-alive HTTP
//! loop of `POST /fetch {"batch":10}`, a 1 ms handler per message (one after the other), and
//! one batch ack: through a consumer without an ordering key, then one with
//! `--ordering-key subject:2`, then that again with one stuck key — its first message is
//! dropped unsettled by the worker that gets it, so it comes back only when its lease expires
//! (`ack_wait` 5 s), while its successors wait. The rows: the ordered rate against the
//! unordered one, and the other keys' rate with the stuck key against without it.
//!
//! Every message must be acked exactly once, and per key in stream order, one at a time:
//! the workers write a ledger (when each lease was handed out and when its ack was sent),
//! checked after each ordered run.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, ensure};
use async_nats::jetstream::{self, stream};
use serde::Deserialize;
use tokio::time::Instant;

use super::nats;
use super::support::{GatewayChild, gateway_binary, http_client, server_version};

const ORDERED: &str = "ORDERED";
const KEYS: u64 = 1_000;
const WORKERS: usize = 8;
const HANDLER: Duration = Duration::from_millis(1);
const ACK_WAIT: &str = "5s";
/// The stuck key's subject token.
const STUCK: &str = "stuck";

#[derive(Debug, Deserialize)]
struct Fetched {
    messages: Vec<Message>,
}

#[derive(Debug, Deserialize)]
struct Message {
    id: String,
    subject: String,
    stream_sequence: u64,
    delivered: u64,
}

/// One lease as a worker saw it.
struct Entry {
    key: String,
    sequence: u64,
    got: Instant,
    ack_sent: Instant,
}

/// What a drain came to.
struct Drained {
    /// Messages acked per second, of the keys other than the stuck one.
    others_rate: f64,
    ledger: Vec<Entry>,
}

pub(crate) async fn run(args: &super::args::Args) -> anyhow::Result<()> {
    let server = nats::NatsServer::start().await;
    let version = server_version(&nats::nats_server_binary())?;
    let count = args.messages;
    // The stuck key's messages first, so that its head is among the first leased.
    keyed_stream(&server.url(), count, true).await?;
    eprintln!(
        "bench --ordering: {version}; {count} messages over {KEYS} keys (+5 of a key that sticks), {WORKERS} workers, handler {} ms",
        HANDLER.as_millis()
    );
    let logs = tempfile::Builder::new()
        .prefix("bench-ordering-")
        .tempdir()?;
    let http = http_client()?;
    let binary = gateway_binary(args)?;
    let total = count + 5;

    let mut runs = Vec::new();
    for (consumer, ordered, stuck) in [
        ("unordered", false, false),
        ("ordered", true, false),
        ("ordered-stuck", true, true),
    ] {
        let mut flags = vec!["--ack-wait".to_owned(), ACK_WAIT.to_owned()];
        if ordered {
            flags.extend(["--ordering-key".to_owned(), "subject:2".to_owned()]);
        }
        let gateway = GatewayChild::start_on(
            &binary,
            &server.url(),
            (ORDERED, consumer),
            &flags,
            &args.gateway_env,
            logs.path().join(format!("{consumer}.log")),
            &http,
        )
        .await?;
        let drained = drain(&gateway.base, total, stuck).await?;
        gateway.stop().await?;
        if ordered {
            check_ledger(&drained.ledger)?;
        }
        runs.push(drained.others_rate);
    }
    let (unordered, ordered, stuck) = (runs[0], runs[1], runs[2]);
    println!(
        "| {KEYS} keys, {WORKERS} workers, handler 1 ms | ordered {ordered:.0} msg/s; unordered {unordered:.0} msg/s; ratio {:.2} |",
        ordered / unordered
    );
    println!(
        "| one stuck key (its head expires, ack_wait {ACK_WAIT}) | the other keys {stuck:.0} msg/s; without it {ordered:.0} msg/s; cost {:.1} % |",
        (1.0 - stuck / ordered) * 100.0
    );
    Ok(())
}

/// The stream `ORDERED` with `count` messages over [`KEYS`] keys, round robin, and with
/// `stuck`, 5 of the key that sticks before them; a client that rides out a server restart.
async fn keyed_stream(url: &str, count: u64, stuck: bool) -> anyhow::Result<jetstream::Context> {
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(url)
        .await?;
    let js = jetstream::new(client);
    js.create_stream(stream::Config {
        name: ORDERED.into(),
        subjects: vec!["ordered.>".into()],
        ..Default::default()
    })
    .await?;
    let stuck_subjects = (0..if stuck { 5 } else { 0 }).map(|n| format!("ordered.{STUCK}.{n}"));
    let keyed = (0..count).map(|n| format!("ordered.k{}.{n}", n % KEYS));
    let mut acks = Vec::with_capacity(1000);
    for subject in stuck_subjects.chain(keyed) {
        acks.push(js.publish(subject, "x".into()).await?);
        if acks.len() >= 1000 {
            for ack in acks.drain(..) {
                ack.await?;
            }
        }
    }
    for ack in acks {
        ack.await?;
    }
    Ok(js)
}

/// Drain `total` messages with the workers; with `stuck`, the first delivery of the stuck
/// key's head is dropped unsettled.
async fn drain(base: &str, total: u64, stuck: bool) -> anyhow::Result<Drained> {
    let http = http_client()?;
    let ledger = Arc::new(Mutex::new(Vec::<Entry>::new()));
    let acked = Arc::new(Mutex::new(HashMap::<u64, u32>::new()));
    let others_done = Arc::new(Mutex::new(None::<Instant>));
    let others_acked = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let others_total = total - 5;
    let workers = (0..WORKERS).map(|_| {
        let (http, base) = (http.clone(), base.to_owned());
        let (ledger, acked, others_done) = (ledger.clone(), acked.clone(), others_done.clone());
        let others_acked = others_acked.clone();
        tokio::spawn(async move {
            let mut last_progress = Instant::now();
            loop {
                let done = acked.lock().map(|acked| acked.len() as u64).unwrap_or(0);
                if done >= total {
                    return anyhow::Ok(());
                }
                ensure!(
                    last_progress.elapsed() < Duration::from_secs(60),
                    "nothing acked for a minute ({done} of {total})"
                );
                let fetched: Fetched = http
                    .post(format!("{base}/fetch"))
                    .json(&serde_json::json!({"batch": 10, "wait_ms": 500}))
                    .send()
                    .await?
                    .json()
                    .await?;
                let got = Instant::now();
                let mut ids = Vec::new();
                let mut entries = Vec::new();
                for message in fetched.messages {
                    let key = message
                        .subject
                        .split('.')
                        .nth(1)
                        .unwrap_or_default()
                        .to_owned();
                    if stuck
                        && key == STUCK
                        && message.delivered == 1
                        && message.subject.ends_with(".0")
                    {
                        continue;
                    }
                    tokio::time::sleep(HANDLER).await;
                    entries.push(Entry {
                        key,
                        sequence: message.stream_sequence,
                        got,
                        ack_sent: Instant::now(),
                    });
                    ids.push(message.id);
                }
                if ids.is_empty() {
                    continue;
                }
                let settled: serde_json::Value = http
                    .post(format!("{base}/messages/ack"))
                    .json(&serde_json::json!({ "ids": ids }))
                    .send()
                    .await?
                    .json()
                    .await?;
                let statuses = settled["results"]
                    .as_array()
                    .context("no results")?
                    .iter()
                    .all(|result| result["status"] == 204);
                ensure!(statuses, "an ack was not 204: {settled}");
                last_progress = Instant::now();
                let mut acked = acked.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
                for entry in &entries {
                    *acked.entry(entry.sequence).or_default() += 1;
                }
                let others = others_acked.fetch_add(
                    entries.iter().filter(|entry| entry.key != STUCK).count() as u64,
                    Ordering::Relaxed,
                ) + entries.iter().filter(|entry| entry.key != STUCK).count() as u64;
                if others >= others_total
                    && let Ok(mut done) = others_done.lock()
                {
                    done.get_or_insert_with(Instant::now);
                }
                drop(acked);
                ledger
                    .lock()
                    .map_err(|_| anyhow::anyhow!("poisoned"))?
                    .extend(entries);
            }
        })
    });
    for worker in futures::future::join_all(workers).await {
        worker??;
    }
    let acked = acked.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
    ensure!(
        acked.len() as u64 == total && acked.values().all(|times| *times == 1),
        "every message acked exactly once"
    );
    let finished = others_done
        .lock()
        .ok()
        .and_then(|done| *done)
        .unwrap_or_else(Instant::now);
    let ledger = std::mem::take(&mut *ledger.lock().map_err(|_| anyhow::anyhow!("poisoned"))?);
    Ok(Drained {
        others_rate: others_total as f64 / finished.duration_since(started).as_secs_f64(),
        ledger,
    })
}

/// Per key: leased in stream order, and none before the one before it was acked.
fn check_ledger(ledger: &[Entry]) -> anyhow::Result<()> {
    let mut by_key: BTreeMap<&str, Vec<&Entry>> = BTreeMap::new();
    for entry in ledger {
        by_key.entry(entry.key.as_str()).or_default().push(entry);
    }
    let mut violations = 0;
    for leases in by_key.values_mut() {
        leases.sort_by_key(|entry| entry.got);
        for pair in leases.windows(2) {
            if pair[0].sequence >= pair[1].sequence || pair[1].got < pair[0].ack_sent {
                violations += 1;
            }
        }
    }
    ensure!(
        violations == 0,
        "{violations} leases out of order or overlapping"
    );
    Ok(())
}

/// `--ordering-ledger`: `--messages` over 1 000 keys through two replicas without sticky
/// sessions (each worker fetches at one and acks at the other), with the pinned replica
/// killed -9 (and started again) after a third and nats-server killed -9 (and started again)
/// after two thirds; the server runs with `sync_interval: always` (`--default-sync`: its
/// default). The row: order
/// violations and overlapping leases of a key among the acks answered 204, and messages
/// the server does not count acked at the end (lost).
pub(crate) async fn ledger(args: &super::args::Args) -> anyhow::Result<()> {
    let dir = tempfile::Builder::new()
        .prefix("bench-ordering-ledger-")
        .tempdir()?;
    let port = nats::free_port();
    let config = dir.path().join("server.conf");
    std::fs::write(
        &config,
        format!(
            "listen: \"127.0.0.1:{port}\"\njetstream {{\n  store_dir: {}\n{}}}\n",
            nats::quoted(&dir.path().join("store")),
            if args.default_sync {
                ""
            } else {
                "  sync_interval: always\n"
            }
        ),
    )?;
    let mut server = nats::NatsServer::node("nats-server", port, &config, dir.path());
    server
        .spawn_and_wait()
        .await
        .map_err(|err| anyhow::anyhow!(err))?;
    let count = args.messages;
    let js = keyed_stream(&server.url(), count, false).await?;
    let key = dir.path().join("lease.key");
    std::fs::write(
        &key,
        "bench replicas share this lease key: 0123456789abcdef",
    )?;
    let flags = vec![
        "--ack-wait".to_owned(),
        ACK_WAIT.to_owned(),
        "--ordering-key".to_owned(),
        "subject:2".to_owned(),
        "--lease-key-file".to_owned(),
        key.display().to_string(),
    ];
    let http = http_client()?;
    let binary = gateway_binary(args)?;
    let mut replicas = Vec::new();
    for name in ["a", "b"] {
        replicas.push(
            GatewayChild::start_on(
                &binary,
                &server.url(),
                (ORDERED, "ledger"),
                &flags,
                &args.gateway_env,
                dir.path().join(format!("{name}.log")),
                &http,
            )
            .await?,
        );
    }
    let bases: Vec<String> = replicas
        .iter()
        .map(|replica| replica.base.clone())
        .collect();
    eprintln!(
        "bench --ordering-ledger: {count} messages over {KEYS} keys, two replicas, {WORKERS} workers"
    );
    let ledger = Arc::new(Mutex::new(Vec::<Entry>::new()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let started = Instant::now();
    let workers: Vec<_> = (0..WORKERS)
        .map(|worker| {
            let (http, ledger, stop) = (http.clone(), ledger.clone(), stop.clone());
            let (fetch_at, ack_at) = (bases[worker % 2].clone(), bases[(worker + 1) % 2].clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let Ok(response) = http
                        .post(format!("{fetch_at}/fetch"))
                        .json(&serde_json::json!({"batch": 10, "wait_ms": 500}))
                        .send()
                        .await
                    else {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    };
                    let got = Instant::now();
                    let Ok(fetched) = response.json::<Fetched>().await else {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    };
                    if fetched.messages.is_empty() {
                        continue;
                    }
                    let ids: Vec<&str> = fetched.messages.iter().map(|m| m.id.as_str()).collect();
                    let ack_sent = Instant::now();
                    let Ok(response) = http
                        .post(format!("{ack_at}/messages/ack"))
                        .json(&serde_json::json!({ "ids": ids }))
                        .send()
                        .await
                    else {
                        continue;
                    };
                    let Ok(settled) = response.json::<serde_json::Value>().await else {
                        continue;
                    };
                    let results = settled["results"].as_array().cloned().unwrap_or_default();
                    let mut entries = Vec::new();
                    for (message, result) in fetched.messages.iter().zip(results) {
                        if result["status"] == 204 {
                            entries.push(Entry {
                                key: message
                                    .subject
                                    .split('.')
                                    .nth(1)
                                    .unwrap_or_default()
                                    .to_owned(),
                                sequence: message.stream_sequence,
                                got,
                                ack_sent,
                            });
                        }
                    }
                    if let Ok(mut ledger) = ledger.lock() {
                        ledger.extend(entries);
                    }
                }
            })
        })
        .collect();
    let acked = |ledger: &Mutex<Vec<Entry>>| ledger.lock().map_or(0, |ledger| ledger.len() as u64);
    let wait_for = |share: u64| {
        let ledger = ledger.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(300);
            while acked(&ledger) < share {
                ensure!(Instant::now() < deadline, "stalled at {}", acked(&ledger));
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            anyhow::Ok(())
        }
    };
    wait_for(count / 3).await?;
    // The pinned replica, killed -9 and started again.
    let mut pinned = 0;
    for (at, base) in bases.iter().enumerate() {
        let view: serde_json::Value = http
            .get(format!("{base}/consumer"))
            .send()
            .await?
            .json()
            .await?;
        let this_pinned = view["replicas"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|replica| replica["this_replica"] == true && replica["pinned"] == true);
        if this_pinned {
            pinned = at;
        }
    }
    replicas[pinned].kill9();
    tokio::time::sleep(Duration::from_millis(500)).await;
    replicas[pinned].restart(&http).await?;
    wait_for(2 * count / 3).await?;
    server.kill();
    tokio::time::sleep(Duration::from_millis(500)).await;
    server.restart().await;
    // Done when the server counts nothing pending or unacked.
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let done = match js.get_stream(ORDERED).await.ok() {
            Some(stream) => stream
                .consumer_info("ledger")
                .await
                .is_ok_and(|info| info.num_pending == 0 && info.num_ack_pending == 0),
            None => false,
        };
        if done {
            break;
        }
        ensure!(Instant::now() < deadline, "the ledger run did not finish");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let elapsed = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let floor = js
        .get_stream(ORDERED)
        .await?
        .consumer_info("ledger")
        .await?
        .ack_floor
        .stream_sequence;
    let lost = count.saturating_sub(floor);
    let sync = if args.default_sync {
        "default sync"
    } else {
        "sync_interval: always"
    };
    for worker in futures::future::join_all(workers).await {
        worker?;
    }
    let ledger = std::mem::take(&mut *ledger.lock().map_err(|_| anyhow::anyhow!("poisoned"))?);
    let mut by_key: BTreeMap<&str, Vec<&Entry>> = BTreeMap::new();
    for entry in &ledger {
        by_key.entry(entry.key.as_str()).or_default().push(entry);
    }
    let (mut disorder, mut overlaps) = (0, 0);
    for leases in by_key.values_mut() {
        leases.sort_by_key(|entry| entry.got);
        for pair in leases.windows(2) {
            if pair[0].sequence >= pair[1].sequence {
                disorder += 1;
            }
            if pair[1].got < pair[0].ack_sent {
                overlaps += 1;
            }
        }
    }
    let mut sequences: Vec<u64> = ledger.iter().map(|entry| entry.sequence).collect();
    sequences.sort_unstable();
    let answered = sequences.len();
    sequences.dedup();
    let twice = answered - sequences.len();
    let unanswered = count - sequences.len() as u64;
    println!(
        "| ledger {count} over {KEYS} keys, pinned replica -9, nats-server -9 ({sync}) | order violations {disorder}, overlapping leases {overlaps}, lost {lost}; acks answered 204 twice {twice}, acks landed unanswered {unanswered}; {:.0} s |",
        elapsed.as_secs_f64()
    );
    for replica in replicas {
        replica.stop().await?;
    }
    ensure!(
        disorder == 0 && overlaps == 0 && lost == 0,
        "the ledger found violations or losses"
    );
    Ok(())
}
