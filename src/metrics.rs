//! Prometheus metrics: every metric's name (the constants below), one registry per gateway,
//! and one-line recording helpers, so the rest of the crate never touches the registry.
//!
//! Why the `prometheus` crate with a registry per gateway, not the `metrics` facade with
//! metrics-exporter-prometheus: the facade records through a process-global recorder (or a
//! thread-local one scoped to a synchronous closure), while the integration tests run many
//! gateways in one process, each of which must count only its own work, across tasks and
//! threads. A `Registry` owned by the gateway, with handles resolved once at start-up, needs
//! no global at all. Its histograms are fixed buckets of atomics, so a recording costs a few
//! atomic adds and an unscraped gateway does not grow (metrics-exporter-prometheus keeps each
//! histogram sample until a scrape or an upkeep task drains it).
//!
//! Gauges that mirror state (leases in flight, max_ack_pending, the NATS connection) are
//! read when `/metrics` is scraped rather than updated on every change: exact, and free on
//! the hot path.
//!
//! May import: nothing of the crate. Usable from every room.

use std::time::Duration;

use axum::http::{Method, StatusCode};
use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
    TextEncoder,
};

/// Leases handed out and not yet settled or expired (gauge).
pub(crate) const LEASES_IN_FLIGHT: &str = "ruststream_leases_in_flight";
/// Leases handed to clients by `POST /fetch` (counter).
pub(crate) const LEASES_GRANTED: &str = "ruststream_leases_granted_total";
/// Settle and extend requests per lease, by `kind` and `result` (counter).
pub(crate) const LEASES_SETTLED: &str = "ruststream_leases_settled_total";
/// Leases that reached `lease_expires_at` unsettled (counter).
pub(crate) const LEASES_EXPIRED: &str = "ruststream_leases_expired_total";
/// Leases given back because the fetch's client hung up before the answer (counter). The
/// published name says "withdrawn": renaming a metric breaks its dashboards.
pub(crate) const LEASES_GIVEN_BACK: &str = "ruststream_leases_withdrawn_total";
/// Deliveries received from the NATS server (counter).
pub(crate) const DELIVERIES_RECEIVED: &str = "ruststream_deliveries_received_total";
/// Deliveries received with `delivered > 1` (counter).
pub(crate) const REDELIVERIES: &str = "ruststream_redeliveries_total";
/// Deliveries nak'd back to the server without ever being leased (counter).
pub(crate) const DELIVERIES_RELEASED: &str = "ruststream_deliveries_released_total";
/// Redeliveries of messages whose ack or term the server had confirmed (and then forgot, in
/// a crash), settled again by the gateway instead of leased, by `kind` (counter).
pub(crate) const SETTLED_AGAIN: &str = "ruststream_redeliveries_settled_again_total";
/// Time a fetch waited in the gateway for messages, from queued to answered (histogram).
pub(crate) const FETCH_WAIT: &str = "ruststream_fetch_wait_seconds";
/// Time to serve a `POST /fetch` answered 200: the wait plus leasing and JSON (histogram).
pub(crate) const FETCH_LATENCY: &str = "ruststream_fetch_latency_seconds";
/// Fetches the gateway is serving now: waiting for messages, or for the first answer of
/// their `Idempotency-Key` (gauge).
pub(crate) const FETCHES_IN_PROGRESS: &str = "ruststream_fetches_in_progress";
/// Fetches answered 200 with no message (counter).
pub(crate) const FETCHES_EMPTY: &str = "ruststream_fetches_empty_total";
/// Fetches refused, by `reason`: `at_capacity` (429), `token_limit` (429, the token's
/// waiting fetches) or `unavailable` (503) (counter).
pub(crate) const FETCHES_REFUSED: &str = "ruststream_fetches_refused_total";
/// 1 while the NATS connection is up, else 0 (gauge).
pub(crate) const NATS_CONNECTED: &str = "ruststream_nats_connected";
/// Times the NATS connection came back after a loss (counter).
pub(crate) const NATS_RECONNECTS: &str = "ruststream_nats_reconnects_total";
/// The consumer's effective max_ack_pending (gauge).
pub(crate) const MAX_ACK_PENDING: &str = "ruststream_max_ack_pending";
/// The consumer's effective ack_wait (gauge).
pub(crate) const ACK_WAIT: &str = "ruststream_ack_wait_seconds";
/// Messages nak'd with a delay and not yet redelivered: they hold a max_ack_pending slot (gauge).
pub(crate) const DELAYED_NAKS: &str = "ruststream_delayed_naks";
/// HTTP requests by `method`, `route` (the matched template) and `status` (counter).
pub(crate) const HTTP_REQUESTS: &str = "ruststream_http_requests_total";
/// HTTP request durations by `method` and `route` (histogram).
pub(crate) const HTTP_REQUEST_DURATION: &str = "ruststream_http_request_duration_seconds";
/// Messages copied to the dead-letter subject and stored there (counter).
pub(crate) const DEAD_LETTERED: &str = "ruststream_dead_lettered_total";
/// Dead-letter advisories not copied, by `reason`: `missing` (the message had already left
/// the stream) or `failed` (publishing kept failing for a minute) (counter).
pub(crate) const DEAD_LETTERS_SKIPPED: &str = "ruststream_dead_letters_skipped_total";
/// Settles (per lease) this replica forwarded to the replica that issued the lease, by
/// `result` (counter).
pub(crate) const SETTLES_FORWARDED: &str = "ruststream_settles_forwarded_total";
/// Settles (per lease) other replicas forwarded to this one, by `result` (counter).
pub(crate) const FORWARDED_SETTLES_RECEIVED: &str = "ruststream_forwarded_settles_received_total";
/// Live replicas on the consumer, this one included, as their heartbeats say (gauge).
pub(crate) const REPLICAS: &str = "ruststream_replicas";
/// Messages under the internal prefix dropped because their seal did not verify (forged,
/// replayed, another lease key, or unsealed), by `kind` (counter).
pub(crate) const INTERNAL_MESSAGES_REJECTED: &str = "ruststream_internal_messages_rejected_total";
/// The `kind` labels of [`INTERNAL_MESSAGES_REJECTED`], each listed from the start.
const INTERNAL_MESSAGE_KINDS: [&str; 4] = [
    "heartbeat",
    "keyed_answer",
    "forwarded_settle",
    "forwarded_answer",
];
/// Always 1, labelled with the gateway's `version` (gauge).
pub(crate) const BUILD_INFO: &str = "ruststream_build_info";

/// The `route` label of a request that matched no route: never the raw path, which would
/// make a new series per lease id or per probe.
pub(crate) const UNMATCHED_ROUTE: &str = "unmatched";

/// Seconds: 1 ms to 30 s, the range of both a settle round trip and the longest long poll.
const DURATION_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// What was asked of a lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SettleAction {
    Ack,
    Nak,
    Term,
    InProgress,
}

impl SettleAction {
    const ALL: [Self; 4] = [Self::Ack, Self::Nak, Self::Term, Self::InProgress];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Ack => "ack",
            Self::Nak => "nak",
            Self::Term => "term",
            Self::InProgress => "in_progress",
        }
    }
}

/// How a settle (or extension) of one lease ended, as the `result` label says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SettleOutcome {
    /// Confirmed by the server.
    Ok,
    /// The same settle again: answered as the first time, nothing sent.
    Repeated,
    /// 409: settled before with a different outcome.
    AlreadySettled,
    /// 410: expired, superseded, or from an earlier binding of the consumer.
    Gone,
    /// 404: never issued here (malformed or forged).
    Unknown,
    /// 504: the server's confirmation did not come in time.
    Timeout,
    /// 503: NATS unreachable or the consumer gone.
    Unavailable,
    /// Anything else.
    Error,
}

impl SettleOutcome {
    const ALL: [Self; 8] = [
        Self::Ok,
        Self::Repeated,
        Self::AlreadySettled,
        Self::Gone,
        Self::Unknown,
        Self::Timeout,
        Self::Unavailable,
        Self::Error,
    ];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Repeated => "repeated",
            Self::AlreadySettled => "already_settled",
            Self::Gone => "gone",
            Self::Unknown => "unknown",
            Self::Timeout => "timeout",
            Self::Unavailable => "unavailable",
            Self::Error => "error",
        }
    }
}

/// Counts one fetch in `ruststream_fetches_in_progress` while it lives.
pub(crate) struct InProgress<'a>(&'a IntGauge);

impl Drop for InProgress<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Why a fetch was refused (`reason` of `ruststream_fetches_refused_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FetchRefusal {
    /// Every max_ack_pending slot is taken (429).
    AtCapacity,
    /// The token has as many fetches waiting as it may (429).
    TokenLimit,
    /// NATS unreachable, consumer gone, or shutting down (503).
    Unavailable,
}

/// Scrape-time state, read from the gateway when `/metrics` is asked for.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Snapshot {
    pub(crate) leases_in_flight: usize,
    pub(crate) delayed_naks: usize,
    pub(crate) max_ack_pending: usize,
    pub(crate) ack_wait: Duration,
    pub(crate) nats_connected: bool,
}

/// One gateway's metrics: its own registry and a handle per series.
pub(crate) struct Metrics {
    registry: Registry,
    leases_in_flight: IntGauge,
    leases_granted: IntCounter,
    /// Indexed by `SettleAction as usize`, then `SettleOutcome as usize`.
    leases_settled: Vec<Vec<IntCounter>>,
    leases_expired: IntCounter,
    leases_given_back: IntCounter,
    deliveries_received: IntCounter,
    redeliveries: IntCounter,
    deliveries_released: IntCounter,
    settled_again_ack: IntCounter,
    settled_again_term: IntCounter,
    fetch_wait: Histogram,
    fetch_latency: Histogram,
    fetches_empty: IntCounter,
    fetches_in_progress: IntGauge,
    fetches_refused_at_capacity: IntCounter,
    fetches_refused_unavailable: IntCounter,
    fetches_refused_token_limit: IntCounter,
    nats_connected: IntGauge,
    nats_reconnects: IntCounter,
    max_ack_pending: IntGauge,
    ack_wait: prometheus::Gauge,
    delayed_naks: IntGauge,
    http_requests: IntCounterVec,
    http_request_duration: HistogramVec,
    dead_lettered: IntCounter,
    dead_letters_missing: IntCounter,
    dead_letters_failed: IntCounter,
    /// Indexed by `SettleOutcome as usize`.
    settles_forwarded: Vec<IntCounter>,
    forwarded_settles_received: Vec<IntCounter>,
    replicas: IntGauge,
    internal_messages_rejected: IntCounterVec,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A fresh registry with every series registered (counters at 0), so a first scrape
    /// already lists them all and rates work from the start.
    pub(crate) fn new() -> Self {
        let registry = Registry::new();
        let reg = Registrar(&registry);
        let settled = reg.counter_vec(
            LEASES_SETTLED,
            "Settle and in-progress requests per lease, by kind (ack, nak, term, in_progress) and result",
            &["kind", "result"],
        );
        let leases_settled = SettleAction::ALL
            .iter()
            .map(|action| {
                SettleOutcome::ALL
                    .iter()
                    .map(|outcome| settled.with_label_values(&[action.as_str(), outcome.as_str()]))
                    .collect()
            })
            .collect();
        let refused = reg.counter_vec(
            FETCHES_REFUSED,
            "Fetches refused: at_capacity (429, max_ack_pending slots taken), token_limit (429, the token's waiting fetches) or unavailable (503)",
            &["reason"],
        );
        let settled_again = reg.counter_vec(
            SETTLED_AGAIN,
            "Redeliveries of messages whose ack or term the server had confirmed (and forgot in a crash), settled again by the gateway instead of leased",
            &["kind"],
        );
        let dead_letters_skipped = reg.counter_vec(
            DEAD_LETTERS_SKIPPED,
            "Dead-letter advisories not copied: missing (the message had left the stream) or failed (publishing kept failing)",
            &["reason"],
        );
        let build_info = reg.gauge_vec(
            BUILD_INFO,
            "Always 1; the version label names the running build",
            &["version"],
        );
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        let by_outcome = |vec: IntCounterVec| -> Vec<IntCounter> {
            SettleOutcome::ALL
                .iter()
                .map(|outcome| vec.with_label_values(&[outcome.as_str()]))
                .collect()
        };
        let settles_forwarded = by_outcome(reg.counter_vec(
            SETTLES_FORWARDED,
            "Settles (per lease) forwarded to the replica that issued the lease, by result",
            &["result"],
        ));
        let forwarded_settles_received = by_outcome(reg.counter_vec(
            FORWARDED_SETTLES_RECEIVED,
            "Settles (per lease) other replicas forwarded to this one, by result",
            &["result"],
        ));
        let internal_messages_rejected = reg.counter_vec(
            INTERNAL_MESSAGES_REJECTED,
            "Messages under the internal prefix dropped because their seal did not verify (forged, replayed, another lease key, or unsealed), by kind",
            &["kind"],
        );
        for kind in INTERNAL_MESSAGE_KINDS {
            internal_messages_rejected.with_label_values(&[kind]);
        }
        let ack_wait = prometheus::Gauge::with_opts(Opts::new(
            ACK_WAIT,
            "The consumer's effective ack_wait in seconds",
        ))
        .expect("valid metric options");
        reg.register(ack_wait.clone());
        Self {
            leases_in_flight: reg.gauge(
                LEASES_IN_FLIGHT,
                "Leases handed out and not yet settled or expired",
            ),
            leases_granted: reg.counter(LEASES_GRANTED, "Leases handed to clients by POST /fetch"),
            leases_settled,
            leases_expired: reg.counter(
                LEASES_EXPIRED,
                "Leases that reached lease_expires_at unsettled (the server redelivers them)",
            ),
            leases_given_back: reg.counter(
                LEASES_GIVEN_BACK,
                "Leases given back because the fetch's client hung up before the answer",
            ),
            deliveries_received: reg.counter(
                DELIVERIES_RECEIVED,
                "Deliveries received from the NATS server",
            ),
            redeliveries: reg.counter(
                REDELIVERIES,
                "Deliveries received with delivered > 1 (redeliveries)",
            ),
            deliveries_released: reg.counter(
                DELIVERIES_RELEASED,
                "Deliveries nak'd back to the server without ever being leased (nobody fetched them in time, or shutdown)",
            ),
            settled_again_ack: settled_again.with_label_values(&["ack"]),
            settled_again_term: settled_again.with_label_values(&["term"]),
            fetch_wait: reg.histogram(
                FETCH_WAIT,
                "Seconds a fetch waited in the gateway for messages, from queued to answered",
            ),
            fetch_latency: reg.histogram(
                FETCH_LATENCY,
                "Seconds to serve a POST /fetch answered 200, including leasing and JSON encoding",
            ),
            fetches_empty: reg.counter(FETCHES_EMPTY, "Fetches answered 200 with no message"),
            fetches_in_progress: reg.gauge(
                FETCHES_IN_PROGRESS,
                "Fetches being served now: waiting for messages, or for the first answer of their Idempotency-Key",
            ),
            fetches_refused_at_capacity: refused.with_label_values(&["at_capacity"]),
            fetches_refused_unavailable: refused.with_label_values(&["unavailable"]),
            fetches_refused_token_limit: refused.with_label_values(&["token_limit"]),
            nats_connected: reg.gauge(NATS_CONNECTED, "1 while the NATS connection is up, else 0"),
            nats_reconnects: reg.counter(
                NATS_RECONNECTS,
                "Times the NATS connection came back after it was lost",
            ),
            max_ack_pending: reg.gauge(
                MAX_ACK_PENDING,
                "The consumer's effective max_ack_pending: most leases out at once",
            ),
            ack_wait,
            delayed_naks: reg.gauge(
                DELAYED_NAKS,
                "Messages nak'd with a delay and not yet redelivered; each holds a max_ack_pending slot",
            ),
            http_requests: reg.counter_vec(
                HTTP_REQUESTS,
                "HTTP requests by method, route (the matched template) and status",
                &["method", "route", "status"],
            ),
            http_request_duration: {
                let vec = HistogramVec::new(
                    HistogramOpts::new(
                        HTTP_REQUEST_DURATION,
                        "Seconds from receiving an HTTP request to its response, by method and route",
                    )
                    .buckets(DURATION_BUCKETS.to_vec()),
                    &["method", "route"],
                )
                .expect("valid metric options");
                reg.register(vec.clone());
                vec
            },
            dead_lettered: reg.counter(
                DEAD_LETTERED,
                "Messages copied to the dead-letter subject (max_deliver exhausted or terminated)",
            ),
            dead_letters_missing: dead_letters_skipped.with_label_values(&["missing"]),
            dead_letters_failed: dead_letters_skipped.with_label_values(&["failed"]),
            settles_forwarded,
            forwarded_settles_received,
            replicas: reg.gauge(
                REPLICAS,
                "Live replicas on the consumer, this one included, as their heartbeats say",
            ),
            internal_messages_rejected,
            registry,
        }
    }

    // ---- recording: one line at each call site ----------------------------------------------

    pub(crate) fn leases_granted(&self, count: usize) {
        self.leases_granted.inc_by(count as u64);
    }

    /// Leases found past their expiry (the lease table notices lazily; a scrape makes it look).
    pub(crate) fn leases_expired(&self, count: u64) {
        self.leases_expired.inc_by(count);
    }

    pub(crate) fn leases_given_back(&self, count: usize) {
        self.leases_given_back.inc_by(count as u64);
    }

    /// A settle of one lease forwarded to its owner came to `outcome`.
    pub(crate) fn settle_forwarded(&self, outcome: SettleOutcome) {
        self.settles_forwarded[outcome as usize].inc();
    }

    /// A settle of one lease forwarded here by another replica came to `outcome`.
    pub(crate) fn forwarded_settle_received(&self, outcome: SettleOutcome) {
        self.forwarded_settles_received[outcome as usize].inc();
    }

    /// The counter of rejected internal messages, for whoever opens them.
    pub(crate) fn internal_messages_rejected(&self) -> IntCounterVec {
        self.internal_messages_rejected.clone()
    }

    /// How many replicas are live, this one included.
    pub(crate) fn replicas(&self, count: usize) {
        self.replicas.set(i64::try_from(count).unwrap_or(i64::MAX));
    }

    pub(crate) fn settled(&self, action: SettleAction, outcome: SettleOutcome) {
        self.leases_settled[action as usize][outcome as usize].inc();
    }

    /// A delivery arrived from the server; `delivered` is its delivery count.
    pub(crate) fn delivery_received(&self, delivered: u64) {
        self.deliveries_received.inc();
        if delivered > 1 {
            self.redeliveries.inc();
        }
    }

    pub(crate) fn delivery_released(&self) {
        self.deliveries_released.inc();
    }

    /// A redelivery of a message acked (`term`: terminated) before was settled again.
    pub(crate) fn settled_again(&self, term: bool) {
        if term {
            self.settled_again_term.inc();
        } else {
            self.settled_again_ack.inc();
        }
    }

    pub(crate) fn fetch_waited(&self, wait: Duration) {
        self.fetch_wait.observe(wait.as_secs_f64());
    }

    /// A fetch is being served until the guard is dropped.
    pub(crate) fn fetch_in_progress(&self) -> InProgress<'_> {
        self.fetches_in_progress.inc();
        InProgress(&self.fetches_in_progress)
    }

    /// A fetch answered 200 with `messages` messages after `latency`.
    pub(crate) fn fetch_served(&self, latency: Duration, messages: usize) {
        self.fetch_latency.observe(latency.as_secs_f64());
        if messages == 0 {
            self.fetches_empty.inc();
        }
    }

    /// A fetch the gateway refused.
    pub(crate) fn fetch_refused(&self, refusal: FetchRefusal) {
        match refusal {
            FetchRefusal::AtCapacity => self.fetches_refused_at_capacity.inc(),
            FetchRefusal::Unavailable => self.fetches_refused_unavailable.inc(),
            FetchRefusal::TokenLimit => self.fetches_refused_token_limit.inc(),
        }
    }

    /// A message was stored in the dead-letter stream.
    pub(crate) fn dead_lettered(&self) {
        self.dead_lettered.inc();
    }

    /// A dead-letter advisory named a message no longer in the stream.
    pub(crate) fn dead_letter_missing(&self) {
        self.dead_letters_missing.inc();
    }

    /// A dead letter could not be published.
    pub(crate) fn dead_letter_failed(&self) {
        self.dead_letters_failed.inc();
    }

    pub(crate) fn nats_reconnected(&self) {
        self.nats_reconnects.inc();
    }

    /// One HTTP request answered; `route` is the matched template or [`UNMATCHED_ROUTE`].
    pub(crate) fn http_request(
        &self,
        method: &Method,
        route: &str,
        status: StatusCode,
        took: Duration,
    ) {
        let method = method.as_str();
        self.http_requests
            .with_label_values(&[method, route, status.as_str()])
            .inc();
        self.http_request_duration
            .with_label_values(&[method, route])
            .observe(took.as_secs_f64());
    }

    // ---- scraping --------------------------------------------------------------------------

    /// The Prometheus text exposition (format 0.0.4), after taking in `snapshot`.
    pub(crate) fn render(&self, snapshot: Snapshot) -> String {
        let gauge = |value: usize| i64::try_from(value).unwrap_or(i64::MAX);
        self.leases_in_flight.set(gauge(snapshot.leases_in_flight));
        self.delayed_naks.set(gauge(snapshot.delayed_naks));
        self.max_ack_pending.set(gauge(snapshot.max_ack_pending));
        self.ack_wait.set(snapshot.ack_wait.as_secs_f64());
        self.nats_connected.set(i64::from(snapshot.nats_connected));
        let mut text = String::new();
        if let Err(err) = TextEncoder::new().encode_utf8(&self.registry.gather(), &mut text) {
            // Only a malformed metric could cause this, and every one is built above.
            tracing::error!(error = %err, "encoding the metrics failed");
        }
        text
    }
}

/// The content type of [`Metrics::render`]'s output (as Prometheus' own exporters send it).
pub(crate) const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Builds and registers metrics. Names and help texts are constants of this module, so a
/// failure here is a programming error caught by the first test that starts a gateway.
struct Registrar<'a>(&'a Registry);

impl Registrar<'_> {
    fn register<M: prometheus::core::Collector + 'static>(&self, metric: M) {
        self.0
            .register(Box::new(metric))
            .expect("each metric registered once");
    }

    fn counter(&self, name: &str, help: &str) -> IntCounter {
        let counter = IntCounter::new(name, help).expect("valid metric options");
        self.register(counter.clone());
        counter
    }

    fn counter_vec(&self, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
        let vec = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric options");
        self.register(vec.clone());
        vec
    }

    fn gauge(&self, name: &str, help: &str) -> IntGauge {
        let gauge = IntGauge::new(name, help).expect("valid metric options");
        self.register(gauge.clone());
        gauge
    }

    fn gauge_vec(&self, name: &str, help: &str, labels: &[&str]) -> prometheus::IntGaugeVec {
        let vec = prometheus::IntGaugeVec::new(Opts::new(name, help), labels)
            .expect("valid metric options");
        self.register(vec.clone());
        vec
    }

    fn histogram(&self, name: &str, help: &str) -> Histogram {
        let histogram =
            Histogram::with_opts(HistogramOpts::new(name, help).buckets(DURATION_BUCKETS.to_vec()))
                .expect("valid metric options");
        self.register(histogram.clone());
        histogram
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn every_series_is_listed_from_the_start() {
        let text = Metrics::new().render(Snapshot::default());
        for name in [
            LEASES_IN_FLIGHT,
            LEASES_GRANTED,
            LEASES_SETTLED,
            LEASES_EXPIRED,
            LEASES_GIVEN_BACK,
            DELIVERIES_RECEIVED,
            REDELIVERIES,
            DELIVERIES_RELEASED,
            SETTLED_AGAIN,
            FETCH_WAIT,
            FETCH_LATENCY,
            FETCHES_EMPTY,
            FETCHES_IN_PROGRESS,
            FETCHES_REFUSED,
            NATS_CONNECTED,
            NATS_RECONNECTS,
            MAX_ACK_PENDING,
            ACK_WAIT,
            DELAYED_NAKS,
            BUILD_INFO,
        ] {
            assert!(
                text.contains(&format!("# TYPE {name} ")),
                "{name} missing:\n{text}"
            );
        }
        assert_eq!(
            value(
                &text,
                r#"ruststream_leases_settled_total{kind="in_progress",result="timeout"}"#
            ),
            Some(0.0)
        );
    }

    /// The metrics page's table (docs/metrics.md, linked from the README) names every
    /// metric, with its type.
    #[test]
    fn the_metrics_page_lists_every_metric() {
        let page = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/metrics.md"),
        )
        .expect("read docs/metrics.md");
        let text = Metrics::new().render(Snapshot::default());
        let missing: Vec<&str> = text
            .lines()
            .filter_map(|line| line.strip_prefix("# TYPE "))
            .filter(|declared| {
                let (name, kind) = declared.split_once(' ').unwrap_or((declared, ""));
                !page.contains(&format!("| `{name}` | {kind} |"))
            })
            .collect();
        assert!(
            missing.is_empty(),
            "docs/metrics.md's metrics table lacks rows `| `name` | type |` for: {missing:?}"
        );
    }

    #[test]
    fn recordings_show_in_the_text() {
        let metrics = Metrics::new();
        metrics.settled(SettleAction::Nak, SettleOutcome::Gone);
        metrics.settled(SettleAction::Nak, SettleOutcome::Gone);
        metrics.delivery_received(1);
        metrics.delivery_received(3);
        metrics.fetch_served(Duration::from_millis(3), 0);
        metrics.fetch_refused(FetchRefusal::AtCapacity);
        metrics.http_request(
            &Method::POST,
            "/messages/{id}/ack",
            StatusCode::GONE,
            Duration::from_millis(2),
        );
        metrics.leases_expired(2);
        let text = metrics.render(Snapshot {
            leases_in_flight: 7,
            nats_connected: true,
            ack_wait: Duration::from_millis(1500),
            ..Snapshot::default()
        });
        let expect = [
            (
                r#"ruststream_leases_settled_total{kind="nak",result="gone"}"#,
                2.0,
            ),
            ("ruststream_deliveries_received_total", 2.0),
            ("ruststream_redeliveries_total", 1.0),
            ("ruststream_fetches_empty_total", 1.0),
            ("ruststream_fetch_latency_seconds_count", 1.0),
            (
                r#"ruststream_fetch_latency_seconds_bucket{le="0.005"}"#,
                1.0,
            ),
            (
                r#"ruststream_fetch_latency_seconds_bucket{le="0.0025"}"#,
                0.0,
            ),
            (
                r#"ruststream_fetches_refused_total{reason="at_capacity"}"#,
                1.0,
            ),
            (
                r#"ruststream_http_requests_total{method="POST",route="/messages/{id}/ack",status="410"}"#,
                1.0,
            ),
            ("ruststream_leases_in_flight", 7.0),
            ("ruststream_leases_expired_total", 2.0),
            ("ruststream_nats_connected", 1.0),
            ("ruststream_ack_wait_seconds", 1.5),
        ];
        for (series, want) in expect {
            assert_eq!(value(&text, series), Some(want), "{series} in:\n{text}");
        }
    }
}
