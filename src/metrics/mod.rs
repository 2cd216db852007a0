//! Prometheus metrics: every metric's name (the constants below), one registry per gateway
//! process, and one-line recording helpers, so the rest of the crate never touches the
//! registry. Process-wide series (HTTP, the NATS connection) are here; the per-consumer ones,
//! labelled `stream` and `consumer`, in [`consumer`].
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

mod consumer;
pub(crate) mod history;
mod push;

use std::sync::Arc;
use std::time::Duration;

use axum::http::{Method, StatusCode};
use prometheus::{
    GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

pub(crate) use consumer::{Metrics, Snapshot};
pub(crate) use push::PushFamilies;

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
/// What the gateway promises of a settle answered 2xx (gauge): 2 every gateway on the
/// consumer (`fleet`), 1 this process (`process`), 0 not known (`none`).
pub(crate) const DURABILITY_PROMISE: &str = "ruststream_durability_promise";
/// Messages of an ordered consumer held until their key is free (gauge).
pub(crate) const ORDERING_HELD: &str = "ruststream_ordering_held";
/// Ordering keys of an ordered consumer with a message out (gauge).
pub(crate) const ORDERING_BUSY_KEYS: &str = "ruststream_ordering_busy_keys";
/// Messages whose ordering key was longer than 1 KiB, leased unordered (counter).
pub(crate) const ORDERING_KEYS_REJECTED: &str = "ruststream_ordering_keys_rejected_total";
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
/// Consumers served, by `source`: `default`, `file` or `existing` (gauge).
pub(crate) const CONSUMERS: &str = "ruststream_consumers";
/// The `source` labels of [`CONSUMERS`], each listed from the start.
pub(crate) const CONSUMER_SOURCES: [&str; 3] = ["default", "file", "existing"];
/// Trace spans dropped: the export queue was full, or their export failed (counter).
pub(crate) const TRACE_SPANS_DROPPED: &str = "ruststream_trace_spans_dropped_total";
/// Trace spans the OTLP collector accepted (counter).
pub(crate) const TRACE_SPANS_EXPORTED: &str = "ruststream_trace_spans_exported_total";
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

/// The process's metrics: the one registry, the process-wide series, and the families every
/// consumer's [`Metrics`] resolves its handles from.
pub(crate) struct ProcessMetrics {
    registry: Registry,
    families: Arc<consumer::Families>,
    nats_connected: IntGauge,
    nats_reconnects: IntCounter,
    http_requests: IntCounterVec,
    http_request_duration: HistogramVec,
    internal_messages_rejected: IntCounterVec,
    consumers: IntGaugeVec,
    trace_spans_dropped: IntCounter,
    trace_spans_exported: IntCounter,
    push: PushFamilies,
}

/// What the trace exporter counted, read at each scrape (process-wide counts: the exporter
/// is one per process).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SpanCounts {
    pub(crate) dropped: u64,
    pub(crate) exported: u64,
}

impl Default for ProcessMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl ProcessMetrics {
    /// A fresh registry with every process-wide series registered (counters at 0), so a
    /// first scrape already lists them all and rates work from the start.
    pub(crate) fn new() -> Self {
        let registry = Registry::new();
        let reg = Registrar(&registry);
        let families = Arc::new(consumer::Families::register(&reg));
        let build_info = reg.gauge_vec(
            BUILD_INFO,
            "Always 1; the version label names the running build",
            &["version"],
        );
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        let internal_messages_rejected = reg.counter_vec(
            INTERNAL_MESSAGES_REJECTED,
            "Messages under the internal prefix dropped because their seal did not verify (forged, replayed, another lease key, or unsealed), by kind",
            &["kind"],
        );
        for kind in INTERNAL_MESSAGE_KINDS {
            internal_messages_rejected.with_label_values(&[kind]);
        }
        let consumers = reg.gauge_vec(
            CONSUMERS,
            "Consumers served, by source: default (--stream/--consumer), file (--consumers-file) or existing (--serve-existing, bound now)",
            &["source"],
        );
        for source in CONSUMER_SOURCES {
            consumers.with_label_values(&[source]);
        }
        Self {
            nats_connected: reg.gauge(NATS_CONNECTED, "1 while the NATS connection is up, else 0"),
            nats_reconnects: reg.counter(
                NATS_RECONNECTS,
                "Times the NATS connection came back after it was lost",
            ),
            http_requests: reg.counter_vec(
                HTTP_REQUESTS,
                "HTTP requests by method, route (the matched template) and status",
                &["method", "route", "status"],
            ),
            http_request_duration: reg.histogram_vec(
                HTTP_REQUEST_DURATION,
                "Seconds from receiving an HTTP request to its response, by method and route",
                &["method", "route"],
            ),
            trace_spans_dropped: reg.counter(
                TRACE_SPANS_DROPPED,
                "Trace spans dropped because the export queue was full or their export failed (0 while tracing is off)",
            ),
            trace_spans_exported: reg.counter(
                TRACE_SPANS_EXPORTED,
                "Trace spans the OTLP collector accepted (0 while tracing is off)",
            ),
            internal_messages_rejected,
            consumers,
            push: PushFamilies::register(&reg),
            families,
            registry,
        }
    }

    /// The series of one consumer, labelled with its stream and name.
    pub(crate) fn for_consumer(&self, stream: &str, consumer: &str) -> Metrics {
        Metrics::new(self.families.clone(), stream, consumer)
    }

    /// The push series.
    pub(crate) fn push(&self) -> &PushFamilies {
        &self.push
    }

    /// The counter of rejected internal messages, for whoever opens them.
    pub(crate) fn internal_messages_rejected(&self) -> IntCounterVec {
        self.internal_messages_rejected.clone()
    }

    pub(crate) fn nats_reconnected(&self) {
        self.nats_reconnects.inc();
    }

    /// How many consumers of `source` are served now.
    pub(crate) fn consumers(&self, source: &str, count: usize) {
        self.consumers
            .with_label_values(&[source])
            .set(i64::try_from(count).unwrap_or(i64::MAX));
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

    /// The Prometheus text exposition (format 0.0.4); every consumer took in its snapshot
    /// before.
    pub(crate) fn render(&self, nats_connected: bool, spans: SpanCounts) -> String {
        self.nats_connected.set(i64::from(nats_connected));
        catch_up(&self.trace_spans_dropped, spans.dropped);
        catch_up(&self.trace_spans_exported, spans.exported);
        let mut text = String::new();
        if let Err(err) = TextEncoder::new().encode_utf8(&self.registry.gather(), &mut text) {
            // Only a malformed metric could cause this, and every one is built above.
            tracing::error!(error = %err, "encoding the metrics failed");
        }
        text
    }
}

/// Bring `counter` up to `total`, a count kept elsewhere (never down: a counter only grows).
fn catch_up(counter: &IntCounter, total: u64) {
    let behind = total.saturating_sub(counter.get());
    if behind > 0 {
        counter.inc_by(behind);
    }
}

/// The content type of [`ProcessMetrics::render`]'s output (as Prometheus' own exporters send it).
pub(crate) const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Builds and registers metrics. Names and help texts are constants of this module, so a
/// failure here is a programming error caught by the first test that starts a gateway.
pub(super) struct Registrar<'a>(&'a Registry);

impl Registrar<'_> {
    pub(super) fn register<M: prometheus::core::Collector + 'static>(&self, metric: M) {
        self.0
            .register(Box::new(metric))
            .expect("each metric registered once");
    }

    pub(super) fn counter(&self, name: &str, help: &str) -> IntCounter {
        let counter = IntCounter::new(name, help).expect("valid metric options");
        self.register(counter.clone());
        counter
    }

    pub(super) fn counter_vec(&self, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
        let vec = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric options");
        self.register(vec.clone());
        vec
    }

    pub(super) fn gauge(&self, name: &str, help: &str) -> IntGauge {
        let gauge = IntGauge::new(name, help).expect("valid metric options");
        self.register(gauge.clone());
        gauge
    }

    pub(super) fn gauge_vec(&self, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
        let vec = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric options");
        self.register(vec.clone());
        vec
    }

    pub(super) fn float_gauge_vec(&self, name: &str, help: &str, labels: &[&str]) -> GaugeVec {
        let vec = GaugeVec::new(Opts::new(name, help), labels).expect("valid metric options");
        self.register(vec.clone());
        vec
    }

    pub(super) fn histogram_vec(&self, name: &str, help: &str, labels: &[&str]) -> HistogramVec {
        let vec = HistogramVec::new(
            HistogramOpts::new(name, help).buckets(DURATION_BUCKETS.to_vec()),
            labels,
        )
        .expect("valid metric options");
        self.register(vec.clone());
        vec
    }
}

#[cfg(test)]
mod tests;
