//! `--records-load`: how long a gateway takes to bind a consumer whose settled records hold
//! `--messages` settles above its ack floor (the exactly-once row of docs/benchmark.md). The
//! records are written as the gateway writes them, 1 000 settles each; the gateway is then
//! started and timed from its spawn to `/readyz` (it serves only once every record is read),
//! against the same start for a consumer with no records, each `--rounds` times in the same
//! run.

use std::time::Duration;

use anyhow::{Context as _, ensure};
use async_nats::jetstream::{self, stream};
use futures::TryStreamExt as _;
use tokio::time::Instant;

use super::nats;
use super::stats::median;
use super::support::{GatewayChild, gateway_binary, http_client, server_version};

const STREAM: &str = "LOAD";
const LOADED: &str = "loaded";
const EMPTY: &str = "empty";
/// Settles per record, as a batch settle of 1 000 ids writes them.
const PER_RECORD: u64 = 1_000;

pub(crate) async fn run(args: &super::args::Args) -> anyhow::Result<()> {
    let server = nats::NatsServer::start().await;
    let version = server_version(&nats::nats_server_binary())?;
    let client = async_nats::ConnectOptions::new()
        .request_timeout(Some(Duration::from_secs(30)))
        .connect(server.url())
        .await?;
    let js = jetstream::new(client);
    js.create_stream(stream::Config {
        name: STREAM.into(),
        subjects: vec!["load.>".into()],
        ..Default::default()
    })
    .await?;
    let logs = tempfile::Builder::new()
        .prefix("bench-records-")
        .tempdir()?;
    let http = http_client()?;
    let binary = gateway_binary(args)?;
    let start = |consumer: &'static str, round: u32| {
        let log = logs.path().join(format!("{consumer}-{round}.log"));
        let http = http.clone();
        let binary = binary.clone();
        let url = server.url();
        let env = args.gateway_env.clone();
        async move {
            let started = Instant::now();
            let gateway =
                GatewayChild::start_on(&binary, &url, (STREAM, consumer), &[], &env, log, &http)
                    .await?;
            let elapsed = started.elapsed();
            gateway.stop().await?;
            anyhow::Ok(elapsed)
        }
    };
    // The first starts make both consumers and the records stream.
    start(LOADED, 0).await?;
    start(EMPTY, 0).await?;
    let count = args.messages;
    write_records(&js, count).await?;
    eprintln!("bench --records-load: {version}; {count} settles in the records of one consumer");

    let (mut loaded, mut empty) = (Vec::new(), Vec::new());
    for round in 1..=args.rounds {
        let with = start(LOADED, round).await?;
        let without = start(EMPTY, round).await?;
        eprintln!(
            "bench --records-load (round {round}): ready in {:.0} ms with the records, {:.0} ms without",
            with.as_secs_f64() * 1e3,
            without.as_secs_f64() * 1e3
        );
        loaded.push(with.as_secs_f64() * 1e3);
        empty.push(without.as_secs_f64() * 1e3);
    }
    let (loaded, empty) = (
        median(loaded).unwrap_or_default(),
        median(empty).unwrap_or_default(),
    );
    println!(
        "| a replica binding a consumer with {count} settled records pending: start to ready (median of {}) | {loaded:.0} ms ({empty:.0} ms without records: {:.0} ms to load them) | load ≤ 1 s |",
        args.rounds,
        loaded - empty
    );
    Ok(())
}

/// Write `count` settles (stream sequences 1..=count, all above the consumer's floor of 0)
/// to the consumer's records, unsealed, as a gateway without a lease key writes them.
async fn write_records(js: &jetstream::Context, count: u64) -> anyhow::Result<()> {
    let names: Vec<String> = js.stream_names().try_collect().await?;
    let records = names
        .into_iter()
        .find(|name| name.starts_with(&format!("RUSTSTREAM_SETTLED_{STREAM}_")))
        .context("the gateway made no settled records stream")?;
    let subject = format!("_RUSTSTREAM.settled.{STREAM}.{LOADED}");
    let published_ns = i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_nanos(),
    )?;
    let mut acks = Vec::new();
    let mut first = 1;
    while first <= count {
        let last = (first + PER_RECORD - 1).min(count);
        let settled: Vec<serde_json::Value> = (first..=last)
            .map(
                |seq| serde_json::json!({"seq": seq, "published_ns": published_ns, "final": "ack"}),
            )
            .collect();
        let record = serde_json::json!({"consumer": LOADED, "settled": settled});
        acks.push(
            js.publish(subject.clone(), serde_json::to_vec(&record)?.into())
                .await?,
        );
        first = last + 1;
    }
    for ack in acks {
        ack.await?;
    }
    let info = js.get_stream(&records).await?.info().await?.state.messages;
    ensure!(
        info >= count.div_ceil(PER_RECORD),
        "the records stored: {info}"
    );
    Ok(())
}
