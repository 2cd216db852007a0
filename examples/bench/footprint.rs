//! `--footprint`: the gateway's memory (`VmRSS`) idle, while `--polls` long polls (or idle
//! event streams) wait, and after they ended and their connections closed.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context as _, ensure};
use async_nats::jetstream::{self, stream};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::args::Args;
use super::process_stats::{open_sockets, status_kb};
use super::support::{GatewayChild, STREAM, gateway_binary, http_client, start_nats_server};

pub(crate) async fn footprint(args: &Args) -> anyhow::Result<()> {
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
