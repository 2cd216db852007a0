//! Shared fixtures: a real nats-server per test (alone or a cluster), the gateway in process
//! or as the binary, the typed client every test talks to it through, the setup builder, and
//! polling helpers (`wait_until`, `wait_for`) so no test sleeps in place of a condition.

pub mod client;
pub mod cluster;
pub mod endpoint;
pub mod gateway;
pub mod metrics;
pub mod nats;
pub mod otlp;
pub mod pki;
pub mod setup;
pub mod streams;

use std::future::Future;
use std::time::Duration;

use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use tokio::time::Instant;

pub use client::{Action, Client, FetchRequest, Msg, Reply};
pub use gateway::{Gateway, GatewayProcess};
pub use metrics::Scrape;
pub use nats::{Js, NatsServer};
pub use setup::{STREAM, Setup};

/// Poll `condition` every 50 ms until it holds; panic naming `what` after `timeout`.
pub async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    wait_for(what, timeout, || {
        let check = condition();
        async move { check.await.then_some(()) }
    })
    .await;
}

/// Poll `probe` every 50 ms until it yields `Some`; panic naming `what` after `timeout`.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = probe().await {
            return value;
        }
        if Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting until {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A deadline for polling loops that keep state between tries (where a closure cannot).
pub struct Deadline {
    what: String,
    timeout: Duration,
    at: Instant,
}

impl Deadline {
    pub fn after(what: impl Into<String>, timeout: Duration) -> Self {
        Self {
            what: what.into(),
            timeout,
            at: Instant::now() + timeout,
        }
    }

    /// Panic if the deadline has passed, else pause 50 ms before the next try.
    pub async fn tick(&self) {
        self.tick_seeing("").await;
    }

    /// As `tick`, with what the last try saw in the panic message.
    pub async fn tick_seeing(&self, seen: impl std::fmt::Display) {
        if Instant::now() >= self.at {
            panic!(
                "timed out after {:?} waiting until {}; last seen: {seen}",
                self.timeout, self.what
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Check `condition` every 100 ms for `period`; panic naming `what` the first time it fails.
pub async fn assert_stays<F, Fut>(what: &str, period: Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let end = Instant::now() + period;
    loop {
        assert!(
            condition().await,
            "expected {what} to hold throughout {period:?}"
        );
        if Instant::now() >= end {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Parse an RFC 3339 timestamp or panic with it.
pub fn rfc3339(text: &str) -> OffsetDateTime {
    OffsetDateTime::parse(text, &Rfc3339)
        .unwrap_or_else(|err| panic!("{text:?} is not RFC 3339: {err}"))
}

/// Sleep until the wall clock is past `at` (plus `margin`): the condition *is* the time.
pub async fn sleep_past(at: OffsetDateTime, margin: Duration) {
    let left = at - OffsetDateTime::now_utc();
    let left = Duration::try_from(left).unwrap_or_default();
    tokio::time::sleep(left + margin).await;
}

/// A fresh nats-server with the `ORDERS` stream (`orders.>`), and a JetStream client on it.
pub async fn server_with_stream() -> (NatsServer, Js) {
    let server = NatsServer::start().await;
    let js = Js::connect(&server.url()).await;
    js.create_stream(STREAM, &["orders.>"]).await;
    (server, js)
}

/// The server's num_ack_pending for the gateway's consumer.
pub async fn server_ack_pending(js: &Js, gateway: &Gateway) -> usize {
    js.consumer_info(&gateway.stream, &gateway.consumer)
        .await
        .num_ack_pending
}

/// Fetch (polling, bounded) until `count` messages in total have been leased.
pub async fn fetch_count(gateway: &Client, count: usize, timeout: Duration) -> Vec<Msg> {
    let deadline = Deadline::after(format!("{count} messages are fetched"), timeout);
    let mut got = Vec::new();
    while got.len() < count {
        got.extend(gateway.fetch_n((count - got.len()) as u64, 500).await);
        if got.len() < count {
            deadline
                .tick_seeing(format_args!("{} so far", got.len()))
                .await;
        }
    }
    got
}

/// A lease-key file for replicas that must know each other's lease ids and seals.
pub fn shared_key() -> tempfile::NamedTempFile {
    use std::io::Write as _;
    let mut key = tempfile::NamedTempFile::new().expect("temp key file");
    write!(key, "replicas share this lease key: 0123456789!").expect("write key");
    key
}

/// A gateway of the default consumer `billing` plus the consumers file `entries` (written
/// into the returned directory, as `consumers.toml`, to be changed by the test).
pub async fn with_consumers_file(
    server: &NatsServer,
    entries: &str,
) -> (Gateway, tempfile::TempDir) {
    let dir = nats::files_dir();
    let path = dir.path().join("consumers.toml");
    std::fs::write(&path, entries).expect("write the consumers file");
    let gateway = Setup::defaults()
        .flag("--consumers-file", path.display().to_string())
        .ready(&server.url())
        .await;
    (gateway, dir)
}
