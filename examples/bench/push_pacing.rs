//! `scripts/bench.sh --push`, the pacing rows: an endpoint that takes only so much, and push
//! consumers with nothing to push.
//!
//! - **overload**: the endpoint accepts 500 messages a second (a window of one second: the
//!   first 500 of each second get 204, the rest 429 with `Retry-After: 1`) while a backlog
//!   waits; from 10 s to 40 s the row counts attempts and accepted messages. Then the
//!   endpoint's capacity doubles, and the row times how long until a second accepts at
//!   least 0.9 × 1000.
//! - **idle**: 100 push consumers with nothing to push: the NATS messages a second the
//!   gateway causes (the server's `in_msgs` + `out_msgs`, from its monitoring port, over
//!   `--idle-secs`), and its resident memory against the same gateway serving only its
//!   default consumer.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context as _, ensure};
use async_nats::jetstream::{self, consumer, stream};
use axum::response::IntoResponse as _;
use tokio::time::Instant;

use super::nats;
use super::process_stats::status_kb;
use super::support::{AbortOnDrop, GatewayChild, gateway_binary, http_client};

const STREAM: &str = "PACING";
/// Push consumers of the idle row.
const IDLE_CONSUMERS: usize = 100;
/// The overload row's first capacity, messages a second.
const CAPACITY: u64 = 500;
/// The overload row measures from here…
const MEASURE_FROM: Duration = Duration::from_secs(10);
/// … to here, then doubles the capacity.
const MEASURE_UNTIL: Duration = Duration::from_secs(40);
/// How long the throughput may take to follow the doubled capacity.
const FOLLOW_WITHIN: Duration = Duration::from_secs(30);

/// The overload endpoint's books: a window of one second.
struct Capacity {
    per_second: AtomicU64,
    window: Mutex<(Instant, u64)>,
    attempts: AtomicU64,
    accepted: AtomicU64,
    /// Accepted messages of each whole second since the start.
    per_second_accepted: Mutex<Vec<u64>>,
    started: Instant,
}

impl Capacity {
    fn admit(&self) -> bool {
        self.attempts.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        let Ok(mut window) = self.window.lock() else {
            return false;
        };
        if now.duration_since(window.0) >= Duration::from_secs(1) {
            *window = (now, 0);
        }
        if window.1 >= self.per_second.load(Ordering::Relaxed) {
            return false;
        }
        window.1 += 1;
        drop(window);
        self.accepted.fetch_add(1, Ordering::Relaxed);
        let second = now.duration_since(self.started).as_secs() as usize;
        if let Ok(mut seconds) = self.per_second_accepted.lock() {
            if seconds.len() <= second {
                seconds.resize(second + 1, 0);
            }
            seconds[second] += 1;
        }
        true
    }
}

async fn limited_endpoint(capacity: Arc<Capacity>) -> anyhow::Result<(String, AbortOnDrop)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .context("binding the endpoint")?;
    let url = format!("http://{}/hook", listener.local_addr()?);
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(move || {
            let capacity = capacity.clone();
            async move {
                if capacity.admit() {
                    axum::http::StatusCode::NO_CONTENT.into_response()
                } else {
                    (
                        axum::http::StatusCode::TOO_MANY_REQUESTS,
                        [("retry-after", "1")],
                    )
                        .into_response()
                }
            }
        }),
    );
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok((url, AbortOnDrop(task)))
}

/// A gateway serving the consumers of `entries` (a consumers file's text) and no default one.
async fn gateway_with(
    args: &super::args::Args,
    nats_url: &str,
    entries: &str,
) -> anyhow::Result<(GatewayChild, tempfile::TempDir)> {
    super::support::gateway_with(args, nats_url, STREAM, entries).await
}

pub(crate) async fn overload(args: &super::args::Args, nats_url: &str) -> anyhow::Result<()> {
    let client = async_nats::connect(nats_url).await?;
    let js = jetstream::new(client);
    js.create_stream(stream::Config {
        name: STREAM.into(),
        subjects: vec!["pacing.>".into()],
        ..Default::default()
    })
    .await?;
    // Enough for the whole row at full speed: 40 s at 500/s and 30 s at 1000/s.
    let backlog = 60_000;
    let payload = bytes::Bytes::from(vec![b'x'; args.payload_bytes as usize]);
    let mut acks = Vec::new();
    for _ in 0..backlog {
        acks.push(js.publish("pacing.load", payload.clone()).await?);
        if acks.len() == super::support::PUBLISH_CHUNK {
            for ack in acks.drain(..) {
                ack.await?;
            }
        }
    }
    for ack in acks {
        ack.await?;
    }
    let capacity = Arc::new(Capacity {
        per_second: AtomicU64::new(CAPACITY),
        window: Mutex::new((Instant::now(), 0)),
        attempts: AtomicU64::new(0),
        accepted: AtomicU64::new(0),
        per_second_accepted: Mutex::new(Vec::new()),
        started: Instant::now(),
    });
    let (url, _endpoint) = limited_endpoint(capacity.clone()).await?;
    let (gateway, _dir) = gateway_with(
        args,
        nats_url,
        &format!(
            "[[consumer]]\nstream = \"{STREAM}\"\nname = \"overload\"\nfilter_subject = \"pacing.load\"\n\n[consumer.push]\nurl = \"{url}\"\n"
        ),
    )
    .await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while capacity.attempts.load(Ordering::Relaxed) == 0 {
        ensure!(Instant::now() < deadline, "no push arrived");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let first = Instant::now();
    tokio::time::sleep_until(first + MEASURE_FROM).await;
    let (attempts_from, accepted_from) = (
        capacity.attempts.load(Ordering::Relaxed),
        capacity.accepted.load(Ordering::Relaxed),
    );
    tokio::time::sleep_until(first + MEASURE_UNTIL).await;
    let attempts = capacity.attempts.load(Ordering::Relaxed) - attempts_from;
    let accepted = capacity.accepted.load(Ordering::Relaxed) - accepted_from;
    let seconds = (MEASURE_UNTIL - MEASURE_FROM).as_secs_f64();

    capacity.per_second.store(2 * CAPACITY, Ordering::Relaxed);
    let doubled_at = Instant::now();
    let since_start = doubled_at.duration_since(capacity.started).as_secs() as usize;
    let followed = loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let seconds = capacity
            .per_second_accepted
            .lock()
            .map(|seconds| seconds.clone())
            .unwrap_or_default();
        // The first whole second after the change that accepted ≥ 0.9 × the new capacity.
        let now = Instant::now().duration_since(capacity.started).as_secs() as usize;
        let hit = (since_start + 1..now)
            .find(|second| seconds.get(*second).copied().unwrap_or(0) * 10 >= 9 * 2 * CAPACITY);
        if let Some(second) = hit {
            break Some(capacity.started + Duration::from_secs(second as u64 + 1) - doubled_at);
        }
        if doubled_at.elapsed() > FOLLOW_WITHIN + Duration::from_secs(5) {
            break None;
        }
    };
    gateway.stop().await?;
    println!(
        "push overload (endpoint takes {CAPACITY}/s, 429 Retry-After: 1 beyond), 10–40 s: accepted {:.0}/s ({:.2} of {CAPACITY}/s), attempts ÷ accepted {:.2}",
        accepted as f64 / seconds,
        accepted as f64 / seconds / CAPACITY as f64,
        attempts as f64 / accepted.max(1) as f64,
    );
    match followed {
        Some(took) => println!(
            "push overload, capacity doubled: a second at ≥ 0.9 × {}/s after {:.1} s",
            2 * CAPACITY,
            took.as_secs_f64()
        ),
        None => println!(
            "push overload, capacity doubled: no second at ≥ 0.9 × {}/s within {} s",
            2 * CAPACITY,
            FOLLOW_WITHIN.as_secs() + 5
        ),
    }
    Ok(())
}

/// The server's `in_msgs` + `out_msgs`.
pub(crate) async fn server_messages(http: &reqwest::Client, monitor: &str) -> anyhow::Result<u64> {
    let varz: serde_json::Value = http
        .get(format!("{monitor}/varz"))
        .send()
        .await?
        .json()
        .await?;
    let count = |field: &str| varz[field].as_u64().unwrap_or(0);
    Ok(count("in_msgs") + count("out_msgs"))
}

/// NATS messages a second while `idle` lasts, and the gateway's resident memory after it.
async fn idle_cost(
    http: &reqwest::Client,
    monitor: &str,
    pid: u32,
    idle: Duration,
) -> anyhow::Result<(f64, f64)> {
    let before = server_messages(http, monitor).await?;
    tokio::time::sleep(idle).await;
    let after = server_messages(http, monitor).await?;
    let rss_mb = status_kb(pid, "VmRSS").unwrap_or(0) as f64 / 1024.0;
    Ok(((after - before) as f64 / idle.as_secs_f64(), rss_mb))
}

pub(crate) async fn idle(args: &super::args::Args) -> anyhow::Result<()> {
    let monitor_port = nats::free_port();
    let server =
        nats::NatsServer::with_config(&format!("http: \"127.0.0.1:{monitor_port}\"")).await;
    let monitor = format!("http://127.0.0.1:{monitor_port}");
    let client = async_nats::connect(server.url()).await?;
    let js = jetstream::new(client);
    js.create_stream(stream::Config {
        name: STREAM.into(),
        subjects: vec!["pacing.>".into()],
        ..Default::default()
    })
    .await?;
    let http = http_client()?;
    let idle = Duration::from_secs(args.idle_secs);
    // Once the consumers are bound, their first pulls made, and fallen silent (10 s after
    // their last lease or request).
    let settle = Duration::from_secs(15);

    let plain_dir = tempfile::Builder::new().prefix("bench-pacing-").tempdir()?;
    let plain = GatewayChild::start_on(
        &gateway_binary(args)?,
        &server.url(),
        (STREAM, "plain"),
        &[],
        &args.gateway_env,
        plain_dir.path().join("gateway.log"),
        &http,
    )
    .await?;
    tokio::time::sleep(settle).await;
    let (plain_rate, plain_rss) = idle_cost(&http, &monitor, plain.pid, idle).await?;
    plain.stop().await?;

    let requests = Arc::new(AtomicU64::new(0));
    let (url, _endpoint) = counting_endpoint(requests.clone()).await?;
    let entries: String = (0..IDLE_CONSUMERS)
        .map(|n| {
            format!(
                "[[consumer]]\nstream = \"{STREAM}\"\nname = \"idle{n}\"\nfilter_subject = \"pacing.idle.{n}\"\n\n[consumer.push]\nurl = \"{url}\"\n\n"
            )
        })
        .collect();
    let (pushing, _dir) = gateway_with(args, &server.url(), &entries).await?;
    let stream = js.get_stream(STREAM).await?;
    let deadline = Instant::now() + Duration::from_secs(60);
    for n in 0..IDLE_CONSUMERS {
        while stream
            .get_consumer::<consumer::pull::Config>(&format!("idle{n}"))
            .await
            .is_err()
        {
            ensure!(Instant::now() < deadline, "consumer idle{n} was not made");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    tokio::time::sleep(settle).await;
    let (push_rate, push_rss) = idle_cost(&http, &monitor, pushing.pid, idle).await?;
    // Still pushing: one message to one of them arrives.
    js.publish("pacing.idle.7", "wake".into()).await?.await?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while requests.load(Ordering::Relaxed) == 0 {
        ensure!(
            Instant::now() < deadline,
            "an idle push consumer did not push"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    pushing.stop().await?;
    println!(
        "push idle, {IDLE_CONSUMERS} push consumers over {} s: {push_rate:.1} NATS messages/s (a gateway with only its default consumer: {plain_rate:.1}); RSS {push_rss:.1} MB, {:.1} MB over that gateway's {plain_rss:.1} MB",
        idle.as_secs(),
        push_rss - plain_rss
    );
    Ok(())
}

async fn counting_endpoint(requests: Arc<AtomicU64>) -> anyhow::Result<(String, AbortOnDrop)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .context("binding the endpoint")?;
    let url = format!("http://{}/hook", listener.local_addr()?);
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(move || {
            let requests = requests.clone();
            async move {
                requests.fetch_add(1, Ordering::Relaxed);
                axum::http::StatusCode::NO_CONTENT
            }
        }),
    );
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok((url, AbortOnDrop(task)))
}
