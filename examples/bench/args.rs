//! The command line of the benchmark: every flag of `bench`, and the value kinds of
//! `--scenario`, `--native-ack` and `--push-row`.

use std::path::PathBuf;

use clap::Parser;

/// Drain messages natively and through the gateway; print docs/benchmark.md's table.
#[derive(Debug, Parser)]
#[command(name = "bench")]
pub(crate) struct Args {
    /// Messages drained per run (the stream holds twice as many).
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u64).range(100..=5_000_000))]
    pub(crate) messages: u64,

    /// Payload size of every message, in bytes.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(0..=1_048_576))]
    pub(crate) payload_bytes: u32,

    /// Concurrent client counts of the gateway runs (comma-separated). Keep the largest
    /// × batch within max_ack_pending (1024).
    #[arg(long, value_delimiter = ',', default_value = "1,4,8",
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub(crate) clients: Vec<u32>,

    /// Messages asked for per fetch (native and gateway alike).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub(crate) batch: u32,

    /// Rounds; every figure is the median over them (ratios are taken within a round).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub(crate) rounds: u32,

    /// Sequential fetch-1 + ack pairs of the latency run.
    #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u64).range(10..=100_000))]
    pub(crate) latency_samples: u64,

    /// Run only these kinds of run (repeat the flag; default: all). The ratios need native.
    #[arg(long = "scenario", value_enum)]
    pub(crate) scenarios: Vec<Kind>,

    /// How the native loop confirms its acks.
    #[arg(long, value_enum, default_value_t = NativeAck::DoubleAck)]
    pub(crate) native_ack: NativeAck,

    /// The gateway binary (default: target/release/ruststream-nats of this crate).
    #[arg(long)]
    pub(crate) gateway_bin: Option<PathBuf>,

    /// Extra flags for every gateway run (e.g. `--gateway-flag=--log-format=json`).
    #[arg(long = "gateway-flag", allow_hyphen_values = true)]
    pub(crate) gateway_flags: Vec<String>,

    /// Environment variables for every gateway run, `KEY=VALUE` (e.g. `RUST_LOG=warn`,
    /// `TOKIO_WORKER_THREADS=1`).
    #[arg(long = "gateway-env", value_parser = parse_env)]
    pub(crate) gateway_env: Vec<(String, String)>,

    /// Keep the gateway logs (and print where they are) instead of deleting them.
    #[arg(long)]
    pub(crate) keep_logs: bool,

    /// Measure memory instead: idle long polls against an empty stream.
    #[arg(long)]
    pub(crate) footprint: bool,

    /// Instead of the drains: one gateway serving `--consumer-count` existing consumers on
    /// `--streams` streams, each fetched once, then idle for `--idle-secs`, and one of them
    /// drained beside a gateway of that consumer alone (docs/benchmark.md, "Many consumers").
    #[arg(long)]
    pub(crate) consumers: bool,

    /// Instead of the drains: push delivery (batch 1 and 100) against a native forwarder in
    /// the same run, and publish → request latency (docs/benchmark.md, "Push delivery").
    #[arg(long)]
    pub(crate) push: bool,

    /// Instead of the drains: `--messages` dead letters listed a page of 1 000 at a time and
    /// redriven at rate 10 000 against a native loop, and the console's first load
    /// (docs/benchmark.md, "Dead letters and the console").
    #[arg(long)]
    pub(crate) day_two: bool,

    /// Instead of the drains: the publish side — `--messages` published in batches of 100
    /// (4 clients; plain and atomic) and one by one (8 clients), and `--schedules` one-shot
    /// schedules (docs/benchmark.md, "Producers").
    #[arg(long)]
    pub(crate) producers: bool,

    /// One-shot schedules made by `--producers`, due over 20 s.
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub(crate) schedules: u64,

    /// Instead of the drains: `--messages` over 1 000 keys drained by 8 workers (handler
    /// 1 ms) ordered per key against unordered, and with one stuck key (docs/benchmark.md,
    /// "Ordered per key").
    #[arg(long)]
    pub(crate) ordering: bool,

    /// Instead of the drains: the ordering ledger — `--messages` over 1 000 keys through two
    /// replicas, the pinned one killed -9 and nats-server killed -9 on the way
    /// (docs/benchmark.md, "Ordered per key").
    #[arg(long)]
    pub(crate) ordering_ledger: bool,

    /// `--ordering-ledger` with nats-server at its default sync_interval (not `always`).
    #[arg(long)]
    pub(crate) default_sync: bool,

    /// Instead of the drains: a gateway bound to a consumer whose settled records hold
    /// `--messages` settles, timed from start to ready against one with none
    /// (docs/benchmark.md, "Exactly once").
    #[arg(long)]
    pub(crate) records_load: bool,

    /// The rows `--push` measures (all when not given).
    #[arg(long = "push-row", value_enum)]
    pub(crate) push_rows: Vec<PushRow>,

    /// Consumers of `--consumers`, spread over `--streams`.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub(crate) consumer_count: u32,

    /// Streams of `--consumers`.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub(crate) streams: u32,

    /// How long `--consumers` leaves them all idle before measuring.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub(crate) idle_secs: u64,

    /// Long polls opened at once by `--footprint`.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..=60_000))]
    pub(crate) polls: u32,

    /// `--footprint` with idle Server-Sent Event streams (`GET /events`) instead of long
    /// polls, as many as `--polls`, held open until all are, then closed.
    #[arg(long)]
    pub(crate) streams_not_polls: bool,

    /// `wait_ms` of each long poll of `--footprint`.
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u64).range(1_000..=30_000))]
    pub(crate) poll_wait_ms: u64,
}

fn parse_env(text: &str) -> Result<(String, String), String> {
    text.split_once('=')
        .map(|(key, value)| (key.to_string(), value.to_string()))
        .ok_or_else(|| format!("{text:?} is not KEY=VALUE"))
}

/// A row of `--push`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum PushRow {
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
pub(crate) enum NativeAck {
    /// `Message::double_ack`: a subscription per ack.
    DoubleAck,
    /// `Client::request(reply, "+ACK")`: the client's shared inbox.
    Request,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Kind {
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
