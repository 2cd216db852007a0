//! One consumer's series: the labelled families every served consumer shares (registered
//! once, in the process registry) and the handles one consumer resolved from them, so that
//! recording costs an atomic add and never a label lookup.
//!
//! May import: the rest of `metrics` only.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use prometheus::core::{MetricVec, MetricVecBuilder};
use prometheus::{GaugeVec, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec};

use super::history::{Activity, History};
use super::*;

/// The labels every per-consumer series starts with.
const CONSUMER_LABELS: [&str; 2] = ["stream", "consumer"];

/// Scrape-time state of one consumer, read from it when `/metrics` is asked for.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Snapshot {
    pub(crate) leases_in_flight: usize,
    pub(crate) delayed_naks: usize,
    pub(crate) max_ack_pending: usize,
    pub(crate) ack_wait: Duration,
}

/// The per-consumer families, as registered.
pub(super) struct Families {
    leases_in_flight: IntGaugeVec,
    leases_granted: IntCounterVec,
    leases_settled: IntCounterVec,
    leases_expired: IntCounterVec,
    leases_given_back: IntCounterVec,
    deliveries_received: IntCounterVec,
    redeliveries: IntCounterVec,
    deliveries_released: IntCounterVec,
    settled_again: IntCounterVec,
    fetch_wait: HistogramVec,
    fetch_latency: HistogramVec,
    fetches_empty: IntCounterVec,
    fetches_in_progress: IntGaugeVec,
    fetches_refused: IntCounterVec,
    max_ack_pending: IntGaugeVec,
    ack_wait: GaugeVec,
    delayed_naks: IntGaugeVec,
    dead_lettered: IntCounterVec,
    dead_letters_skipped: IntCounterVec,
    settles_forwarded: IntCounterVec,
    forwarded_settles_received: IntCounterVec,
    replicas: IntGaugeVec,
    durability_promise: IntGaugeVec,
    ordering_held: IntGaugeVec,
    ordering_busy_keys: IntGaugeVec,
    ordering_keys_rejected: IntCounterVec,
}

fn labels(extra: &[&'static str]) -> Vec<&'static str> {
    CONSUMER_LABELS.iter().chain(extra).copied().collect()
}

impl Families {
    pub(super) fn register(reg: &Registrar<'_>) -> Self {
        let plain = labels(&[]);
        Self {
            leases_in_flight: reg.gauge_vec(
                LEASES_IN_FLIGHT,
                "Leases handed out and not yet settled or expired",
                &plain,
            ),
            leases_granted: reg.counter_vec(
                LEASES_GRANTED,
                "Leases handed to clients by POST /fetch",
                &plain,
            ),
            leases_settled: reg.counter_vec(
                LEASES_SETTLED,
                "Settle and in-progress requests per lease, by kind (ack, nak, term, in_progress) and result",
                &labels(&["kind", "result"]),
            ),
            leases_expired: reg.counter_vec(
                LEASES_EXPIRED,
                "Leases that reached lease_expires_at unsettled (the server redelivers them)",
                &plain,
            ),
            leases_given_back: reg.counter_vec(
                LEASES_GIVEN_BACK,
                "Leases given back because the fetch's client hung up before the answer",
                &plain,
            ),
            deliveries_received: reg.counter_vec(
                DELIVERIES_RECEIVED,
                "Deliveries received from the NATS server",
                &plain,
            ),
            redeliveries: reg.counter_vec(
                REDELIVERIES,
                "Deliveries received with delivered > 1 (redeliveries)",
                &plain,
            ),
            deliveries_released: reg.counter_vec(
                DELIVERIES_RELEASED,
                "Deliveries nak'd back to the server without ever being leased (nobody fetched them in time, or shutdown)",
                &plain,
            ),
            settled_again: reg.counter_vec(
                SETTLED_AGAIN,
                "Redeliveries of messages whose ack or term the server had confirmed (and forgot in a crash), settled again by the gateway instead of leased; source: this process confirmed it, or another gateway (or an earlier life of this one) whose record was read back",
                &labels(&["kind", "source"]),
            ),
            fetch_wait: reg.histogram_vec(
                FETCH_WAIT,
                "Seconds a fetch waited in the gateway for messages, from queued to answered",
                &plain,
            ),
            fetch_latency: reg.histogram_vec(
                FETCH_LATENCY,
                "Seconds to serve a POST /fetch answered 200, including leasing and JSON encoding",
                &plain,
            ),
            fetches_empty: reg.counter_vec(
                FETCHES_EMPTY,
                "Fetches answered 200 with no message",
                &plain,
            ),
            fetches_in_progress: reg.gauge_vec(
                FETCHES_IN_PROGRESS,
                "Fetches being served now: waiting for messages, or for the first answer of their Idempotency-Key",
                &plain,
            ),
            fetches_refused: reg.counter_vec(
                FETCHES_REFUSED,
                "Fetches refused: at_capacity (429, max_ack_pending slots taken), token_limit (429, the token's waiting fetches) or unavailable (503)",
                &labels(&["reason"]),
            ),
            max_ack_pending: reg.gauge_vec(
                MAX_ACK_PENDING,
                "The consumer's effective max_ack_pending: most leases out at once",
                &plain,
            ),
            ack_wait: reg.float_gauge_vec(
                ACK_WAIT,
                "The consumer's effective ack_wait in seconds",
                &plain,
            ),
            delayed_naks: reg.gauge_vec(
                DELAYED_NAKS,
                "Messages nak'd with a delay and not yet redelivered; each holds a max_ack_pending slot",
                &plain,
            ),
            dead_lettered: reg.counter_vec(
                DEAD_LETTERED,
                "Messages copied to the dead-letter subject (max_deliver exhausted or terminated)",
                &plain,
            ),
            dead_letters_skipped: reg.counter_vec(
                DEAD_LETTERS_SKIPPED,
                "Dead-letter advisories not copied: missing (the message had left the stream) or failed (publishing kept failing)",
                &labels(&["reason"]),
            ),
            settles_forwarded: reg.counter_vec(
                SETTLES_FORWARDED,
                "Settles (per lease) forwarded to the replica that issued the lease, by result",
                &labels(&["result"]),
            ),
            forwarded_settles_received: reg.counter_vec(
                FORWARDED_SETTLES_RECEIVED,
                "Settles (per lease) other replicas forwarded to this one, by result",
                &labels(&["result"]),
            ),
            replicas: reg.gauge_vec(
                REPLICAS,
                "Live replicas on the consumer, this one included, as their heartbeats say",
                &plain,
            ),
            durability_promise: reg.gauge_vec(
                DURABILITY_PROMISE,
                "What a settle answered 2xx promises: 2 no gateway on the consumer hands the message out again (fleet), 1 this process does not (process), 0 not known (none)",
                &plain,
            ),
            ordering_held: reg.gauge_vec(
                ORDERING_HELD,
                "Messages of an ordered consumer held until their key is free (they count against max_ack_pending)",
                &plain,
            ),
            ordering_busy_keys: reg.gauge_vec(
                ORDERING_BUSY_KEYS,
                "Ordering keys of an ordered consumer with a message out",
                &plain,
            ),
            ordering_keys_rejected: reg.counter_vec(
                ORDERING_KEYS_REJECTED,
                "Messages whose ordering key was longer than 1 KiB, leased unordered",
                &plain,
            ),
        }
    }
}

/// A labelled counter made on first use. Most results never happen to most consumers, and a
/// series costs some 600 bytes whether it counts or not: of a thousand idle consumers' 32
/// settle series each, the 28 that say something went wrong are made when it first does.
#[derive(Default)]
struct OnFirstUse(OnceLock<IntCounter>);

impl OnFirstUse {
    /// One that exists (at 0) from the start.
    fn made(counter: IntCounter) -> Self {
        let made = OnceLock::new();
        let _ = made.set(counter);
        Self(made)
    }

    fn get(&self, make: impl FnOnce() -> IntCounter) -> &IntCounter {
        self.0.get_or_init(make)
    }
}

/// The series of one counter family by settle result: `ok` from the start, the others on
/// first use.
type ByOutcome = [OnFirstUse; SettleOutcome::ALL.len()];

fn by_outcome(ok: impl FnOnce() -> IntCounter) -> ByOutcome {
    let mut series = ByOutcome::default();
    series[SettleOutcome::Ok as usize] = OnFirstUse::made(ok());
    series
}

/// One consumer's metrics: handles into the shared families, labelled with its stream and
/// consumer. The series of what every consumer does (leases, deliveries, fetches, settles
/// with result `ok`, its settings) exist (at 0) from the start, so rates work from the first
/// scrape; those of what most consumers never see (other settle results, forwarded settles,
/// refusals, skipped dead letters, settles repeated, ordering) appear on first use: a
/// thousand idle consumers' unused series would cost megabytes.
pub(crate) struct Metrics {
    families: Arc<Families>,
    stream: String,
    consumer: String,
    leases_in_flight: IntGauge,
    leases_granted: IntCounter,
    /// Indexed by `SettleAction as usize`, then `SettleOutcome as usize`.
    leases_settled: [ByOutcome; SettleAction::ALL.len()],
    leases_expired: IntCounter,
    leases_given_back: IntCounter,
    deliveries_received: IntCounter,
    redeliveries: IntCounter,
    deliveries_released: IntCounter,
    /// By kind (ack, term) and source (process, fleet).
    settled_again: [[OnFirstUse; 2]; 2],
    fetch_wait: prometheus::Histogram,
    fetch_latency: prometheus::Histogram,
    fetches_empty: IntCounter,
    fetches_in_progress: IntGauge,
    fetches_refused_at_capacity: OnFirstUse,
    fetches_refused_unavailable: OnFirstUse,
    fetches_refused_token_limit: OnFirstUse,
    max_ack_pending: IntGauge,
    ack_wait: prometheus::Gauge,
    delayed_naks: IntGauge,
    dead_lettered: IntCounter,
    dead_letters_missing: OnFirstUse,
    dead_letters_failed: OnFirstUse,
    /// Indexed by `SettleOutcome as usize`.
    settles_forwarded: ByOutcome,
    forwarded_settles_received: ByOutcome,
    replicas: IntGauge,
    durability_promise: IntGauge,
    /// Made by an ordered consumer's gate, on its first use.
    ordering_held: OnceLock<IntGauge>,
    ordering_busy_keys: OnceLock<IntGauge>,
    ordering_keys_rejected: OnFirstUse,
    /// The last fifteen minutes of deliveries and settles, for the console's chart.
    history: History,
}

/// Counts one fetch in `ruststream_fetches_in_progress` while it lives.
pub(crate) struct InProgress<'a>(&'a IntGauge);

impl Drop for InProgress<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl Metrics {
    pub(super) fn new(families: Arc<Families>, stream: &str, consumer: &str) -> Self {
        let f = &families;
        let counter = |vec: &IntCounterVec, extra: &[&str]| {
            let values: Vec<&str> = [stream, consumer].iter().chain(extra).copied().collect();
            vec.with_label_values(&values)
        };
        let gauge = |vec: &IntGaugeVec| vec.with_label_values(&[stream, consumer]);
        let histogram = |vec: &HistogramVec| vec.with_label_values(&[stream, consumer]);
        let ok = SettleOutcome::Ok.as_str();
        let leases_settled = SettleAction::ALL
            .map(|action| by_outcome(|| counter(&f.leases_settled, &[action.as_str(), ok])));
        let metrics = Self {
            stream: stream.to_owned(),
            consumer: consumer.to_owned(),
            leases_in_flight: gauge(&f.leases_in_flight),
            leases_granted: counter(&f.leases_granted, &[]),
            leases_settled,
            leases_expired: counter(&f.leases_expired, &[]),
            leases_given_back: counter(&f.leases_given_back, &[]),
            deliveries_received: counter(&f.deliveries_received, &[]),
            redeliveries: counter(&f.redeliveries, &[]),
            deliveries_released: counter(&f.deliveries_released, &[]),
            settled_again: Default::default(),
            fetch_wait: histogram(&f.fetch_wait),
            fetch_latency: histogram(&f.fetch_latency),
            fetches_empty: counter(&f.fetches_empty, &[]),
            fetches_in_progress: gauge(&f.fetches_in_progress),
            fetches_refused_at_capacity: OnFirstUse::default(),
            fetches_refused_unavailable: OnFirstUse::default(),
            fetches_refused_token_limit: OnFirstUse::default(),
            max_ack_pending: gauge(&f.max_ack_pending),
            ack_wait: f.ack_wait.with_label_values(&[stream, consumer]),
            delayed_naks: gauge(&f.delayed_naks),
            dead_lettered: counter(&f.dead_lettered, &[]),
            dead_letters_missing: OnFirstUse::default(),
            dead_letters_failed: OnFirstUse::default(),
            // Only replicas forward: made on first use, as every result.
            settles_forwarded: ByOutcome::default(),
            forwarded_settles_received: ByOutcome::default(),
            replicas: gauge(&f.replicas),
            durability_promise: gauge(&f.durability_promise),
            ordering_held: OnceLock::new(),
            ordering_busy_keys: OnceLock::new(),
            ordering_keys_rejected: OnFirstUse::default(),
            history: History::default(),
            families: families.clone(),
        };
        metrics.replicas(1);
        metrics
    }

    /// Take this consumer's series out of the exposition (it is no longer served): what it
    /// counted is gone with it, as with any process that stops.
    pub(crate) fn forget(&self) {
        let f = &self.families;
        let pair = [self.stream.as_str(), self.consumer.as_str()];
        remove(&f.leases_in_flight, &pair, &[]);
        remove(&f.leases_granted, &pair, &[]);
        remove(&f.leases_expired, &pair, &[]);
        remove(&f.leases_given_back, &pair, &[]);
        remove(&f.deliveries_received, &pair, &[]);
        remove(&f.redeliveries, &pair, &[]);
        remove(&f.deliveries_released, &pair, &[]);
        remove(&f.fetch_wait, &pair, &[]);
        remove(&f.fetch_latency, &pair, &[]);
        remove(&f.fetches_empty, &pair, &[]);
        remove(&f.fetches_in_progress, &pair, &[]);
        remove(&f.max_ack_pending, &pair, &[]);
        remove(&f.ack_wait, &pair, &[]);
        remove(&f.delayed_naks, &pair, &[]);
        remove(&f.dead_lettered, &pair, &[]);
        remove(&f.replicas, &pair, &[]);
        remove(&f.durability_promise, &pair, &[]);
        remove(&f.ordering_held, &pair, &[]);
        remove(&f.ordering_busy_keys, &pair, &[]);
        remove(&f.ordering_keys_rejected, &pair, &[]);
        for action in SettleAction::ALL {
            for outcome in SettleOutcome::ALL {
                remove(
                    &f.leases_settled,
                    &pair,
                    &[action.as_str(), outcome.as_str()],
                );
            }
        }
        for outcome in SettleOutcome::ALL {
            remove(&f.settles_forwarded, &pair, &[outcome.as_str()]);
            remove(&f.forwarded_settles_received, &pair, &[outcome.as_str()]);
        }
        for kind in ["ack", "term"] {
            for source in ["process", "fleet"] {
                remove(&f.settled_again, &pair, &[kind, source]);
            }
        }
        for reason in ["at_capacity", "unavailable", "token_limit"] {
            remove(&f.fetches_refused, &pair, &[reason]);
        }
        for reason in ["missing", "failed"] {
            remove(&f.dead_letters_skipped, &pair, &[reason]);
        }
    }

    /// Set the gauges that mirror state, before a scrape.
    pub(crate) fn take_in(&self, snapshot: Snapshot) {
        let gauge = |value: usize| i64::try_from(value).unwrap_or(i64::MAX);
        self.leases_in_flight.set(gauge(snapshot.leases_in_flight));
        self.delayed_naks.set(gauge(snapshot.delayed_naks));
        self.max_ack_pending.set(gauge(snapshot.max_ack_pending));
        self.ack_wait.set(snapshot.ack_wait.as_secs_f64());
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

    /// The series of `family` for `extra` labels, made now if this is its first use.
    fn labelled<'a>(
        &self,
        series: &'a OnFirstUse,
        family: &IntCounterVec,
        extra: &[&str],
    ) -> &'a IntCounter {
        series.get(|| {
            let values: Vec<&str> = [self.stream.as_str(), self.consumer.as_str()]
                .iter()
                .chain(extra)
                .copied()
                .collect();
            family.with_label_values(&values)
        })
    }

    /// A settle of one lease forwarded to its owner came to `outcome`.
    pub(crate) fn settle_forwarded(&self, outcome: SettleOutcome) {
        let series = &self.settles_forwarded[outcome as usize];
        self.labelled(
            series,
            &self.families.settles_forwarded,
            &[outcome.as_str()],
        )
        .inc();
    }

    /// A settle of one lease forwarded here by another replica came to `outcome`.
    pub(crate) fn forwarded_settle_received(&self, outcome: SettleOutcome) {
        let series = &self.forwarded_settles_received[outcome as usize];
        let family = &self.families.forwarded_settles_received;
        self.labelled(series, family, &[outcome.as_str()]).inc();
    }

    /// An ordered consumer's held messages and busy keys.
    pub(crate) fn ordering(&self, held: usize, busy_keys: usize) {
        let pair = [self.stream.as_str(), self.consumer.as_str()];
        let f = &self.families;
        self.ordering_held
            .get_or_init(|| f.ordering_held.with_label_values(&pair))
            .set(i64::try_from(held).unwrap_or(i64::MAX));
        self.ordering_busy_keys
            .get_or_init(|| f.ordering_busy_keys.with_label_values(&pair))
            .set(i64::try_from(busy_keys).unwrap_or(i64::MAX));
    }

    /// A message's ordering key was too long to be one.
    pub(crate) fn ordering_key_rejected(&self) {
        let family = &self.families.ordering_keys_rejected;
        self.labelled(&self.ordering_keys_rejected, family, &[])
            .inc();
    }

    /// What a settle answered 2xx promises (see [`DURABILITY_PROMISE`]).
    pub(crate) fn durability_promise(&self, level: i64) {
        self.durability_promise.set(level);
    }

    /// How many replicas are live, this one included.
    pub(crate) fn replicas(&self, count: usize) {
        self.replicas.set(i64::try_from(count).unwrap_or(i64::MAX));
    }

    pub(crate) fn settled(&self, action: SettleAction, outcome: SettleOutcome) {
        if outcome == SettleOutcome::Ok {
            match action {
                SettleAction::Ack => self.history.record(Activity::Acked, 1),
                SettleAction::Nak => self.history.record(Activity::Naked, 1),
                SettleAction::Term => self.history.record(Activity::Terminated, 1),
                SettleAction::InProgress => {}
            }
        }
        let series = &self.leases_settled[action as usize][outcome as usize];
        let labels = [action.as_str(), outcome.as_str()];
        self.labelled(series, &self.families.leases_settled, &labels)
            .inc();
    }

    /// A delivery arrived from the server; `delivered` is its delivery count.
    pub(crate) fn delivery_received(&self, delivered: u64) {
        self.deliveries_received.inc();
        self.history.record(Activity::Delivered, 1);
        if delivered > 1 {
            self.redeliveries.inc();
        }
    }

    pub(crate) fn delivery_released(&self) {
        self.deliveries_released.inc();
    }

    /// A redelivery of a message acked (`term`: terminated) before was settled again;
    /// `by_fleet`: that ack or term was known from another gateway's record (or an earlier
    /// life of this one), not confirmed by this process.
    pub(crate) fn settled_again(&self, term: bool, by_fleet: bool) {
        let kind = if term { "term" } else { "ack" };
        let source = if by_fleet { "fleet" } else { "process" };
        let series = &self.settled_again[usize::from(term)][usize::from(by_fleet)];
        self.labelled(series, &self.families.settled_again, &[kind, source])
            .inc();
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
        let (series, reason) = match refusal {
            FetchRefusal::AtCapacity => (&self.fetches_refused_at_capacity, "at_capacity"),
            FetchRefusal::Unavailable => (&self.fetches_refused_unavailable, "unavailable"),
            FetchRefusal::TokenLimit => (&self.fetches_refused_token_limit, "token_limit"),
        };
        self.labelled(series, &self.families.fetches_refused, &[reason])
            .inc();
    }

    /// A message was stored in the dead-letter stream.
    pub(crate) fn dead_lettered(&self) {
        self.dead_lettered.inc();
        self.history.record(Activity::DeadLettered, 1);
    }

    /// The last fifteen minutes of this consumer's activity here.
    pub(crate) fn history(&self) -> &History {
        &self.history
    }

    /// A dead-letter advisory named a message no longer in the stream.
    pub(crate) fn dead_letter_missing(&self) {
        let family = &self.families.dead_letters_skipped;
        self.labelled(&self.dead_letters_missing, family, &["missing"])
            .inc();
    }

    /// A dead letter could not be published.
    pub(crate) fn dead_letter_failed(&self) {
        let family = &self.families.dead_letters_skipped;
        self.labelled(&self.dead_letters_failed, family, &["failed"])
            .inc();
    }
}

/// Remove one labelled series (`pair` then `extra`) from its family; absent is fine.
fn remove<T: MetricVecBuilder>(vec: &MetricVec<T>, pair: &[&str; 2], extra: &[&str]) {
    let values: Vec<&str> = pair.iter().chain(extra).copied().collect();
    let _ = vec.remove_label_values(&values);
}
