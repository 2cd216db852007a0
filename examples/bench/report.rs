//! The drains' report: a line per run and round, then docs/benchmark.md's table of medians
//! over the rounds, each figure with its target.

use super::args::{Args, Kind, NativeAck};
use super::outcome::{Outcome, Run};
use super::stats::median;
use super::streaming::SSE_ACK_BATCH;

pub(crate) fn print_report(args: &Args, version: &str, runs: &[Run], outcomes: &[Outcome]) {
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
