//! The push series: every attempt to deliver to an endpoint by its result, how long the
//! endpoint took, and each push consumer's window and requests in flight — labelled with
//! the consumer's stream and name, registered once per process.
//!
//! May import: as the rest of `metrics`.

use std::time::Duration;

use prometheus::{HistogramVec, IntCounterVec, IntGaugeVec};

use super::Registrar;

/// Push attempts by `stream`, `consumer` and `result` (counter).
pub(crate) const PUSH_REQUESTS: &str = "ruststream_push_requests_total";
/// Seconds from sending a push request to its answer (or failure), by consumer (histogram).
pub(crate) const PUSH_REQUEST_DURATION: &str = "ruststream_push_request_duration_seconds";
/// A push consumer's window: the requests it may have in flight now (gauge).
pub(crate) const PUSH_WINDOW: &str = "ruststream_push_window";
/// A push consumer's requests in flight now (gauge).
pub(crate) const PUSH_IN_FLIGHT: &str = "ruststream_push_in_flight";

/// The process's push families.
#[derive(Clone)]
pub(crate) struct PushFamilies {
    requests: IntCounterVec,
    duration: HistogramVec,
    window: IntGaugeVec,
    in_flight: IntGaugeVec,
}

impl PushFamilies {
    pub(super) fn register(reg: &Registrar<'_>) -> Self {
        let labels = ["stream", "consumer"];
        Self {
            requests: reg.counter_vec(
                PUSH_REQUESTS,
                "Push attempts by result: ack, later, nak, term (what the answer settled), throttled (429/503), timeout, connect_error, error",
                &["stream", "consumer", "result"],
            ),
            duration: reg.histogram_vec(
                PUSH_REQUEST_DURATION,
                "Seconds from sending a push request to its answer or failure",
                &labels,
            ),
            window: reg.gauge_vec(
                PUSH_WINDOW,
                "Push requests a consumer may have in flight now (its adaptive window)",
                &labels,
            ),
            in_flight: reg.gauge_vec(PUSH_IN_FLIGHT, "Push requests in flight now", &labels),
        }
    }

    /// One attempt of `stream`/`consumer` ended with `result` after `took`.
    pub(crate) fn attempt(&self, stream: &str, consumer: &str, result: &str, took: Duration) {
        self.requests
            .with_label_values(&[stream, consumer, result])
            .inc();
        self.duration
            .with_label_values(&[stream, consumer])
            .observe(took.as_secs_f64());
    }

    /// The consumer's window and requests in flight now.
    pub(crate) fn state(&self, stream: &str, consumer: &str, window: usize, in_flight: usize) {
        let labels = [stream, consumer];
        self.window
            .with_label_values(&labels)
            .set(i64::try_from(window).unwrap_or(i64::MAX));
        self.in_flight
            .with_label_values(&labels)
            .set(i64::try_from(in_flight).unwrap_or(i64::MAX));
    }

    /// The consumer no longer pushes: its gauges go (its counters stay, as counters do).
    pub(crate) fn forget(&self, stream: &str, consumer: &str) {
        let labels = [stream, consumer];
        let _ = self.window.remove_label_values(&labels);
        let _ = self.in_flight.remove_label_values(&labels);
    }
}
