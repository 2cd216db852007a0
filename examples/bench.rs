//! Benchmark: drain N JetStream messages natively with async-nats and through the gateway, and
//! print msg/s for each and the gateway-to-native ratios — all in one run.
//!
//! ```text
//! scripts/bench.sh                                   # installs nats-server when needed
//! NATS_SERVER_BIN=/path/to/nats-server cargo run --release --example bench -- --help
//! ```
//!
//! The command starts its own nats-server (`NATS_SERVER_BIN`, else
//! `<crate>/.venv/bin/nats-server`) on a free loopback port with a temporary store, and stops
//! it when it ends, on error too. Each scenario gets a fresh stream `BENCH_<n>` (subjects
//! `bench<n>.>`) holding `--messages` messages of `--payload-bytes` bytes, published before the
//! clock starts; only the drain is timed:
//!
//! - **native**: an async-nats durable pull consumer (explicit ack, ack_wait 30s,
//!   max_ack_pending 1024); `fetch().max_messages(100).expires(1s)`, then one confirmed ack
//!   per message (`+ACK` sent as a request, so the server answers once it processed it), all
//!   acks of a fetch concurrently.
//! - **gateway batch**: the gateway in-process; `POST /fetch {"batch":100,"wait_ms":1000}`,
//!   then `POST /messages/ack {"ids":[…]}` (every result must be 204).
//! - **gateway single**: the same fetch, then `POST /messages/{id}/ack` per message (each must
//!   answer 204), the acks of one fetch concurrently.
//!
//! `--batch` changes the 100; `--clients C` runs C drain loops at once per scenario (C = 1 is
//! the headline figure); `--rounds R` repeats the three scenarios, interleaved, and compares
//! the medians; `--scenario` picks some of them (for profiling one path).
//!
//! Every scenario must ack every stream sequence exactly once (a tally by stream sequence), the
//! gateway must report no lease left, and the consumer must end with nothing pending, nothing
//! ack-pending and no redelivery; otherwise the command fails (exit 1). Besides msg/s, the
//! table shows per-fetch round-trip waits and the CPU time of this process (client plus
//! in-process gateway) and of nats-server during each drain. Gateway logs go to stderr at
//! `RUST_LOG` (default `warn`).

/// The integration tests' nats-server fixture (a child on a free port with a temporary
/// store, killed on drop): one copy of that logic for tests and benchmark.
#[path = "../tests/it/support/nats.rs"]
#[allow(dead_code)]
mod nats;

use std::future::IntoFuture as _;
use std::net::SocketAddr;
use std::path::Path;
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
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// How long a freshly spawned nats-server may take to accept TCP connections.
/// How long the gateway may take to answer `/readyz` with 200.
const GATEWAY_READY_DEADLINE: Duration = Duration::from_secs(15);
/// A drain that acks nothing for this long has stalled: fail instead of hanging.
const STALL_DEADLINE: Duration = Duration::from_secs(30);
/// Publish acks awaited together (async-nats refuses more than 5 000 in flight by default).
const PUBLISH_CHUNK: usize = 1_000;
/// The consumer settings both sides use.
const ACK_WAIT: Duration = Duration::from_secs(30);
const MAX_ACK_PENDING: i64 = 1024;
/// How long a fetch (gateway and native alike) may wait for messages. For the native
/// `no_wait` fetch this matters when the consumer is at max_ack_pending (clients × batch
/// above 1024): the server then holds the request, and the messages it did deliver sit
/// unacked in the unfinished batch until the request expires.
const FETCH_WAIT: Duration = Duration::from_secs(1);

/// Drain N messages natively and through the gateway; print msg/s and the ratios.
#[derive(Debug, Parser)]
#[command(name = "bench")]
struct Args {
    /// Messages published and drained per scenario.
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    messages: u64,

    /// Payload size of every message, in bytes.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(0..=1_048_576))]
    payload_bytes: u32,

    /// Concurrent drain loops per scenario (native and gateway alike). Keep clients × batch
    /// within max_ack_pending (1024): beyond it native fetches starve for up to a second
    /// each, while the gateway sizes its pulls to the capacity left.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    clients: u32,

    /// Messages asked for per fetch (native and gateway alike).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1000))]
    batch: u32,

    /// Run the scenarios this many times, interleaved, and compare the medians (steadier
    /// figures on a busy machine).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    rounds: u32,

    /// Run only these scenarios (repeat the flag; default: all three). The ratios need native.
    #[arg(long = "scenario", value_enum)]
    scenarios: Vec<Scenario>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Scenario {
    Native,
    GatewayBatch,
    GatewaySingle,
}

impl Scenario {
    const ALL: [Self; 3] = [Self::Native, Self::GatewayBatch, Self::GatewaySingle];

    fn label(self) -> &'static str {
        match self {
            Self::Native => "native",
            Self::GatewayBatch => "gateway batch",
            Self::GatewaySingle => "gateway single",
        }
    }

    fn detail(self) -> &'static str {
        match self {
            Self::Native => "async-nats fetch + confirmed acks",
            Self::GatewayBatch => "POST /fetch + POST /messages/ack",
            Self::GatewaySingle => "POST /fetch + POST /messages/{id}/ack each",
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

    // Ctrl-C ends the run through the normal error path, so the Drop guards stop nats-server.
    tokio::select! {
        result = bench(&args) => result,
        _ = tokio::signal::ctrl_c() => Err(anyhow!("interrupted")),
    }
}

async fn bench(args: &Args) -> anyhow::Result<()> {
    let binary = nats::nats_server_binary();
    let version = server_version(&binary)?;
    let server = nats::NatsServer::start().await;
    eprintln!("bench: {version} at {}", server.url());

    let client = async_nats::ConnectOptions::new()
        .request_timeout(Some(Duration::from_secs(30)))
        .connect(server.url())
        .await
        .with_context(|| format!("connecting to {}", server.url()))?;
    let js = jetstream::new(client.clone());
    let payload = Bytes::from(vec![b'x'; args.payload_bytes as usize]);

    let scenarios: Vec<Scenario> = Scenario::ALL
        .into_iter()
        .filter(|scenario| args.scenarios.is_empty() || args.scenarios.contains(scenario))
        .collect();
    let runs = (1..=args.rounds).flat_map(|round| scenarios.iter().map(move |s| (round, *s)));
    let mut outcomes = Vec::new();
    for (index, (round, scenario)) in runs.enumerate() {
        let n = index + 1;
        let stream = format!("BENCH_{n}");
        let subject = format!("bench{n}.msg");
        prepare_stream(
            &js,
            &stream,
            &format!("bench{n}.>"),
            &subject,
            args,
            &payload,
        )
        .await?;
        eprintln!(
            "bench: {} (round {round}): draining {} messages …",
            scenario.label(),
            args.messages
        );
        let outcome = match scenario {
            Scenario::Native => drain_native(&client, &js, &stream, args, server.pid()).await,
            Scenario::GatewayBatch | Scenario::GatewaySingle => {
                drain_gateway(scenario, &js, &server.url(), &stream, args, server.pid()).await
            }
        }
        .with_context(|| format!("scenario {} (round {round})", scenario.label()))?;
        eprintln!(
            "bench: {} (round {round}): {:.0} msg/s ({:.3} s)",
            scenario.label(),
            outcome.rate(),
            outcome.seconds
        );
        js.delete_stream(&stream)
            .await
            .with_context(|| format!("deleting stream {stream}"))?;
        outcomes.push(Outcome { round, ..outcome });
    }

    print_report(args, &version, &scenarios, &outcomes);
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

/// Create `stream` and publish `--messages` messages to `subject` (acks awaited in chunks).
async fn prepare_stream(
    js: &jetstream::Context,
    stream: &str,
    subjects: &str,
    subject: &str,
    args: &Args,
    payload: &Bytes,
) -> anyhow::Result<()> {
    js.create_stream(stream::Config {
        name: stream.to_string(),
        subjects: vec![subjects.to_string()],
        ..Default::default()
    })
    .await
    .with_context(|| format!("creating stream {stream}"))?;

    let started = Instant::now();
    let mut remaining = args.messages;
    let mut last_sequence = 0;
    while remaining > 0 {
        let chunk = remaining.min(PUBLISH_CHUNK as u64);
        let mut acks = Vec::with_capacity(chunk as usize);
        for _ in 0..chunk {
            acks.push(
                js.publish(subject.to_string(), payload.clone())
                    .await
                    .with_context(|| format!("publishing to {subject}"))?
                    .into_future(),
            );
        }
        for ack in join_all(acks).await {
            let ack = ack.with_context(|| format!("publish ack from {stream}"))?;
            last_sequence = last_sequence.max(ack.sequence);
        }
        remaining -= chunk;
    }
    ensure!(
        last_sequence == args.messages,
        "stream {stream} ends at sequence {last_sequence} after publishing {} messages",
        args.messages
    );
    let seconds = started.elapsed().as_secs_f64();
    eprintln!(
        "bench: {stream}: published {} messages of {} bytes in {seconds:.3} s ({:.0} msg/s)",
        args.messages,
        args.payload_bytes,
        args.messages as f64 / seconds
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Bookkeeping shared by the drain loops of one scenario
// ---------------------------------------------------------------------------------------------

/// Which stream sequences were acked (each exactly once), when the last one was, and counters.
struct Tally {
    total: u64,
    started: Instant,
    /// The nats-server process, whose CPU time is sampled with ours.
    server_pid: Option<u32>,
    cpu_at_start: CpuSample,
    state: Mutex<TallyState>,
    fetches: AtomicU64,
    fetched: AtomicU64,
    empty_fetches: AtomicU64,
    throttled: AtomicU64,
    redelivered: AtomicU64,
    /// Time spent waiting for non-empty fetch answers and for ack confirmations, summed over
    /// loops.
    fetch_micros: AtomicU64,
    ack_micros: AtomicU64,
}

struct TallyState {
    acked: Vec<bool>,
    count: u64,
    last_progress: Instant,
    done_at: Option<Instant>,
    cpu_at_done: CpuSample,
}

impl Tally {
    fn new(total: u64, server_pid: Option<u32>) -> Self {
        let cpu_at_start = CpuSample::take(server_pid);
        let now = Instant::now();
        Self {
            total,
            started: now,
            server_pid,
            cpu_at_start,
            state: Mutex::new(TallyState {
                acked: vec![false; total as usize],
                count: 0,
                last_progress: now,
                done_at: None,
                cpu_at_done: CpuSample::default(),
            }),
            fetches: AtomicU64::new(0),
            fetched: AtomicU64::new(0),
            empty_fetches: AtomicU64::new(0),
            throttled: AtomicU64::new(0),
            redelivered: AtomicU64::new(0),
            fetch_micros: AtomicU64::new(0),
            ack_micros: AtomicU64::new(0),
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

    /// Count one fetch answer and its deliveries; `delivered` is each message's delivery count.
    fn fetched(&self, delivered: impl Iterator<Item = u64>) {
        let mut messages = 0;
        let mut redelivered = 0;
        for delivered in delivered {
            messages += 1;
            if delivered > 1 {
                redelivered += 1;
            }
        }
        self.fetches.fetch_add(1, Ordering::Relaxed);
        self.fetched.fetch_add(messages, Ordering::Relaxed);
        self.redelivered.fetch_add(redelivered, Ordering::Relaxed);
        if messages == 0 {
            self.empty_fetches.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn time_fetch(&self, since: Instant) {
        let micros = u64::try_from(since.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.fetch_micros.fetch_add(micros, Ordering::Relaxed);
    }

    fn time_acks(&self, since: Instant) {
        let micros = u64::try_from(since.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.ack_micros.fetch_add(micros, Ordering::Relaxed);
    }

    /// Record confirmed acks; an unknown or already acked stream sequence is an error.
    fn acked(&self, sequences: &[u64]) -> anyhow::Result<()> {
        let now = Instant::now();
        let mut state = self.lock();
        for &sequence in sequences {
            ensure!(
                (1..=self.total).contains(&sequence),
                "acked stream sequence {sequence}, outside 1..={}",
                self.total
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
            state.cpu_at_done = CpuSample::take(self.server_pid);
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

    /// Seconds from the start to the last ack; fails unless every sequence was acked once.
    fn finish(&self, scenario: Scenario, clients: u32) -> anyhow::Result<Outcome> {
        let state = self.lock();
        let missing = state.acked.iter().filter(|acked| !**acked).count();
        ensure!(
            state.count == self.total && missing == 0,
            "{} of {} messages acked ({missing} never)",
            state.count,
            self.total
        );
        let done_at = state
            .done_at
            .ok_or_else(|| anyhow!("all messages acked but no completion time recorded"))?;
        Ok(Outcome {
            scenario,
            round: 1,
            clients,
            messages: self.total,
            seconds: (done_at - self.started).as_secs_f64(),
            cpu: state.cpu_at_done.since(&self.cpu_at_start),
            fetches: self.fetches.load(Ordering::Relaxed),
            fetched: self.fetched.load(Ordering::Relaxed),
            empty_fetches: self.empty_fetches.load(Ordering::Relaxed),
            throttled: self.throttled.load(Ordering::Relaxed),
            redelivered: self.redelivered.load(Ordering::Relaxed),
            fetch_seconds: self.fetch_micros.load(Ordering::Relaxed) as f64 / 1e6,
            ack_seconds: self.ack_micros.load(Ordering::Relaxed) as f64 / 1e6,
        })
    }
}

/// CPU seconds (user + system) used so far by this process and by nats-server.
#[derive(Debug, Clone, Copy, Default)]
struct CpuSample {
    bench: Option<f64>,
    server: Option<f64>,
}

impl CpuSample {
    fn take(server_pid: Option<u32>) -> Self {
        Self {
            bench: cpu_seconds("self"),
            server: server_pid.and_then(|pid| cpu_seconds(&pid.to_string())),
        }
    }

    fn since(&self, start: &Self) -> Self {
        let delta = |end: Option<f64>, start: Option<f64>| Some(end? - start?);
        Self {
            bench: delta(self.bench, start.bench),
            server: delta(self.server, start.server),
        }
    }
}

/// CPU seconds a process used, from `/proc/<pid>/stat` (Linux; `None` elsewhere).
fn cpu_seconds(pid: &str) -> Option<f64> {
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
// Scenario a: native async-nats
// ---------------------------------------------------------------------------------------------

async fn drain_native(
    client: &async_nats::Client,
    js: &jetstream::Context,
    stream_name: &str,
    args: &Args,
    server_pid: Option<u32>,
) -> anyhow::Result<Outcome> {
    const CONSUMER: &str = "native";
    let stream = js
        .get_stream(stream_name)
        .await
        .with_context(|| format!("getting stream {stream_name}"))?;
    let consumer: consumer::PullConsumer = stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some(CONSUMER.to_string()),
            ack_policy: consumer::AckPolicy::Explicit,
            ack_wait: ACK_WAIT,
            max_ack_pending: MAX_ACK_PENDING,
            ..Default::default()
        })
        .await
        .context("creating the native pull consumer")?;

    let tally = Arc::new(Tally::new(args.messages, server_pid));
    let batch = args.batch as usize;
    let payload_bytes = args.payload_bytes as usize;
    run_loops(args.clients, |_| {
        native_loop(
            client.clone(),
            consumer.clone(),
            tally.clone(),
            batch,
            payload_bytes,
        )
    })
    .await?;
    let outcome = tally.finish(Scenario::Native, args.clients)?;
    verify_consumer(&stream, CONSUMER, args.messages).await?;
    Ok(outcome)
}

async fn native_loop(
    client: async_nats::Client,
    consumer: consumer::PullConsumer,
    tally: Arc<Tally>,
    batch: usize,
    payload_bytes: usize,
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

        sequences.clear();
        let mut delivered = Vec::with_capacity(messages.len());
        let mut acks = Vec::with_capacity(messages.len());
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
            let reply = message.reply.clone().ok_or_else(|| {
                anyhow!(
                    "stream sequence {} has no reply subject",
                    info.stream_sequence
                )
            })?;
            acks.push(client.request(reply, Bytes::from_static(b"+ACK")));
        }
        tally.fetched(delivered.into_iter());
        if messages.is_empty() {
            tally.check_stall()?;
            // With several loops the others may hold the rest; don't spin on no_wait fetches.
            tokio::time::sleep(Duration::from_millis(2)).await;
            continue;
        }
        tally.time_fetch(fetch_started);
        let acks_started = Instant::now();
        for (ack, sequence) in join_all(acks).await.into_iter().zip(&sequences) {
            ack.map_err(|err| anyhow!("confirmed ack of stream sequence {sequence}: {err}"))?;
        }
        tally.time_acks(acks_started);
        tally.acked(&sequences)?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Scenarios b and c: the gateway, in-process
// ---------------------------------------------------------------------------------------------

/// The gateway's `run` on a spawned task; aborted when dropped without `stop`.
struct InProcessGateway {
    base: String,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<anyhow::Result<()>>>,
}

impl InProcessGateway {
    async fn start(nats_url: &str, stream: &str, consumer: &str) -> anyhow::Result<Self> {
        let flags = [
            "ruststream-nats",
            "--nats-url",
            nats_url,
            "--stream",
            stream,
            "--consumer",
            consumer,
            "--ack-wait",
            "30s",
            "--max-ack-pending",
            "1024",
        ];
        let config = ruststream_nats::Config::try_parse_from(flags)
            .map_err(|err| anyhow!("gateway flags {flags:?}: {err}"))?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the gateway listener")?;
        let addr: SocketAddr = listener.local_addr()?;
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(ruststream_nats::run(config, listener, async move {
            let _ = rx.await;
        }));
        Ok(Self {
            base: format!("http://{addr}"),
            shutdown: Some(tx),
            task: Some(task),
        })
    }

    async fn wait_ready(&mut self, http: &reqwest::Client) -> anyhow::Result<()> {
        let deadline = Instant::now() + GATEWAY_READY_DEADLINE;
        loop {
            if let Ok(response) = http.get(format!("{}/readyz", self.base)).send().await
                && response.status() == reqwest::StatusCode::OK
            {
                return Ok(());
            }
            if self.task.as_ref().is_some_and(JoinHandle::is_finished) {
                let result = self.join().await;
                bail!("the gateway ended before it became ready: {result:?}");
            }
            ensure!(
                Instant::now() < deadline,
                "/readyz did not answer 200 within {GATEWAY_READY_DEADLINE:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Trigger the graceful shutdown and wait for `run` to return Ok.
    async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        tokio::time::timeout(Duration::from_secs(30), self.join())
            .await
            .context("the gateway did not stop within 30s of the shutdown signal")?
    }

    async fn join(&mut self) -> anyhow::Result<()> {
        match self.task.take() {
            Some(task) => task
                .await
                .map_err(|err| anyhow!("gateway task: {err}"))?
                .context("the gateway's run() failed"),
            None => Ok(()),
        }
    }
}

impl Drop for InProcessGateway {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
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

async fn drain_gateway(
    scenario: Scenario,
    js: &jetstream::Context,
    nats_url: &str,
    stream_name: &str,
    args: &Args,
    server_pid: Option<u32>,
) -> anyhow::Result<Outcome> {
    const CONSUMER: &str = "gw";
    // reqwest's TLS has no crypto provider of its own here (ring, as the gateway uses).
    let _ = tokio_rustls::rustls::crypto::ring::default_provider().install_default();
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()
        .context("building the HTTP client")?;
    let mut gateway = InProcessGateway::start(nats_url, stream_name, CONSUMER).await?;
    gateway.wait_ready(&http).await?;

    let tally = Arc::new(Tally::new(args.messages, server_pid));
    let batch = args.batch;
    // Base64 with padding, the gateway's default encoding.
    let data_len = (args.payload_bytes as usize).div_ceil(3) * 4;
    let base = gateway.base.clone();
    run_loops(args.clients, |_| {
        gateway_loop(
            scenario,
            http.clone(),
            base.clone(),
            tally.clone(),
            batch,
            data_len,
        )
    })
    .await?;
    let outcome = tally.finish(scenario, args.clients)?;

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
    ensure!(
        status.leases_in_flight == 0,
        "the gateway still reports {} leases in flight after every message was acked",
        status.leases_in_flight
    );
    let stream = js
        .get_stream(stream_name)
        .await
        .with_context(|| format!("getting stream {stream_name}"))?;
    verify_consumer(&stream, CONSUMER, args.messages).await?;
    gateway.stop().await?;
    Ok(outcome)
}

async fn gateway_loop(
    scenario: Scenario,
    http: reqwest::Client,
    base: String,
    tally: Arc<Tally>,
    batch: u32,
    data_len: usize,
) -> anyhow::Result<()> {
    let fetch_url = format!("{base}/fetch");
    let batch_ack_url = format!("{base}/messages/ack");
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
        let status = response.status();
        if status == reqwest::StatusCode::TOO_MANY_REQUESTS {
            // Only possible when clients × batch exceeds max_ack_pending.
            tally.throttled.fetch_add(1, Ordering::Relaxed);
            tally.check_stall()?;
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        }
        if status != reqwest::StatusCode::OK {
            let body = response.text().await.unwrap_or_default();
            bail!("POST /fetch answered {status}: {body}");
        }
        let reply: FetchReply = response.json().await.context("POST /fetch body")?;
        tally.fetched(reply.messages.iter().map(|message| message.delivered));
        if reply.messages.is_empty() {
            tally.check_stall()?;
            continue;
        }
        tally.time_fetch(fetch_started);
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

        let acks_started = Instant::now();
        match scenario {
            Scenario::GatewayBatch => {
                let ids: Vec<&str> = reply.messages.iter().map(|m| m.id.as_str()).collect();
                let response = http
                    .post(&batch_ack_url)
                    .json(&json!({ "ids": ids }))
                    .send()
                    .await
                    .context("POST /messages/ack")?;
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
            Scenario::GatewaySingle => {
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
            }
            Scenario::Native => unreachable!("the native scenario has its own loop"),
        }
        tally.time_acks(acks_started);
        tally.acked(&sequences)?;
    }
    Ok(())
}

/// The consumer must end with everything delivered and acked, and nothing redelivered.
async fn verify_consumer(
    stream: &jetstream::stream::Stream,
    consumer: &str,
    messages: u64,
) -> anyhow::Result<()> {
    let info = stream
        .consumer_info(consumer)
        .await
        .with_context(|| format!("consumer info of {consumer}"))?;
    ensure!(
        info.num_pending == 0
            && info.num_ack_pending == 0
            && info.num_redelivered == 0
            && info.ack_floor.stream_sequence == messages
            && info.delivered.stream_sequence == messages,
        "consumer {consumer} after the drain: num_pending {}, num_ack_pending {}, \
         num_redelivered {}, ack floor {}, delivered up to {} (expected 0, 0, 0, {messages}, {messages})",
        info.num_pending,
        info.num_ack_pending,
        info.num_redelivered,
        info.ack_floor.stream_sequence,
        info.delivered.stream_sequence
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Report
// ---------------------------------------------------------------------------------------------

struct Outcome {
    scenario: Scenario,
    round: u32,
    clients: u32,
    messages: u64,
    seconds: f64,
    fetches: u64,
    fetched: u64,
    empty_fetches: u64,
    throttled: u64,
    redelivered: u64,
    fetch_seconds: f64,
    ack_seconds: f64,
    /// CPU seconds used during the drain by this process (client and in-process gateway) and
    /// by nats-server, when /proc tells.
    cpu: CpuSample,
}

impl Outcome {
    fn rate(&self) -> f64 {
        self.messages as f64 / self.seconds
    }
}

fn print_report(args: &Args, version: &str, scenarios: &[Scenario], outcomes: &[Outcome]) {
    println!();
    println!(
        "ruststream-nats benchmark: {} messages of {} bytes per scenario, {} client(s), \
         fetch batch {}, {} round(s), {version}",
        args.messages, args.payload_bytes, args.clients, args.batch, args.rounds
    );
    println!();
    println!(
        "{:<15} {:>5} {:>7} {:>9} {:>8} {:>8} {:>8} {:>9} {:>5} {:>8} {:>8} {:>9} {:>8}",
        "scenario",
        "round",
        "clients",
        "messages",
        "seconds",
        "msg/s",
        "fetches",
        "avg/fetch",
        "empty",
        "fetch ms",
        "acks ms",
        "cpu bench",
        "cpu nats",
    );
    let cpu = |seconds: Option<f64>| seconds.map_or_else(|| "-".to_string(), |s| format!("{s:.2}"));
    for outcome in outcomes {
        let non_empty = outcome.fetches - outcome.empty_fetches;
        let per_fetch = |value: f64| {
            if non_empty == 0 {
                0.0
            } else {
                value / non_empty as f64
            }
        };
        println!(
            "{:<15} {:>5} {:>7} {:>9} {:>8.3} {:>8.0} {:>8} {:>9.1} {:>5} {:>8.2} {:>8.2} {:>9} {:>8}",
            outcome.scenario.label(),
            outcome.round,
            outcome.clients,
            outcome.messages,
            outcome.seconds,
            outcome.rate(),
            outcome.fetches,
            per_fetch(outcome.fetched as f64),
            outcome.empty_fetches,
            per_fetch(outcome.fetch_seconds * 1e3),
            per_fetch(outcome.ack_seconds * 1e3),
            cpu(outcome.cpu.bench),
            cpu(outcome.cpu.server),
        );
    }
    println!();
    for scenario in scenarios {
        println!("  {:<15} {}", scenario.label(), scenario.detail());
    }
    println!(
        "  fetch ms, acks ms: mean wait of one loop for a non-empty fetch answer, and for the \
         confirmations of its acks"
    );
    println!(
        "  cpu bench, cpu nats: CPU seconds used during the drain by this process (client and \
         in-process gateway) and by nats-server"
    );
    println!();

    let median = |scenario: Scenario| {
        let mut rates: Vec<f64> = outcomes
            .iter()
            .filter(|outcome| outcome.scenario == scenario)
            .map(Outcome::rate)
            .collect();
        rates.sort_by(f64::total_cmp);
        match rates.len() {
            0 => None,
            n if n % 2 == 1 => Some(rates[n / 2]),
            n => Some((rates[n / 2 - 1] + rates[n / 2]) / 2.0),
        }
    };
    if args.rounds > 1 {
        let medians: Vec<String> = scenarios
            .iter()
            .filter_map(|&scenario| {
                median(scenario).map(|rate| format!("{} {rate:.0}", scenario.label()))
            })
            .collect();
        println!(
            "median msg/s over {} rounds: {}",
            args.rounds,
            medians.join(", ")
        );
    }
    if let Some(native) = median(Scenario::Native) {
        for &scenario in scenarios.iter().filter(|&&s| s != Scenario::Native) {
            let Some(rate) = median(scenario) else {
                continue;
            };
            let target = if scenario == Scenario::GatewayBatch {
                "   (target: >= 0.70)"
            } else {
                ""
            };
            println!(
                "{} / native = {:.2}{target}",
                scenario.label(),
                rate / native
            );
        }
    }
    if u64::from(args.clients) * u64::from(args.batch) > MAX_ACK_PENDING as u64 {
        println!(
            "note: clients × batch = {} exceeds max_ack_pending {MAX_ACK_PENDING}: native \
             fetches wait at the server for capacity, so the ratios flatter the gateway",
            u64::from(args.clients) * u64::from(args.batch)
        );
    }
    for outcome in outcomes {
        if outcome.throttled > 0 || outcome.redelivered > 0 {
            println!(
                "note: {} (round {}): {} fetches answered 429, {} deliveries were redeliveries",
                outcome.scenario.label(),
                outcome.round,
                outcome.throttled,
                outcome.redelivered
            );
        }
    }
}
