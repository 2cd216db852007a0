//! What a push endpoint's answer means, and how fast to push next: the settle an answer asks
//! for, the backoff of a retry, the window of requests in flight and the pace — pure state
//! and time, so that every rule can be tested without a server or an endpoint.
//!
//! May import: the rest of `domain` only.

mod directive;

use std::time::{Duration, SystemTime};

use time::OffsetDateTime;
use tokio::time::Instant;

pub(crate) use directive::{Settle, Unreadable, asked_for, batch_result, cut, endpoint_reason};

/// How one attempt ended, as far as the rules care.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Outcome<'a> {
    /// The endpoint answered with `status`; its `Ruststream-Settle` and `Retry-After`
    /// headers, if it sent them.
    Answered {
        status: u16,
        settle: Option<&'a str>,
        retry_after: Option<&'a str>,
    },
    /// No answer within the push timeout.
    TimedOut,
    /// No connection: refused, reset, unreachable, a TLS failure.
    ConnectFailed,
    /// Any other failure to send or to read the answer.
    Failed,
}

/// What an answer says of the endpoint's capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pace {
    /// It took the request: the window may grow.
    Took,
    /// It said it is overloaded (429, 503): the window shrinks, and at a window of one the
    /// send rate backs off.
    Refused,
    /// It failed as an overloaded endpoint does (a timeout, no connection, a 5xx): the
    /// window shrinks.
    Struggled,
    /// It answered, and nothing in the answer speaks of load (a 404, a 400).
    Neutral,
}

/// An answer, judged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Verdict {
    pub(crate) settle: Settle,
    /// The `result` label of the push metrics.
    pub(crate) result: &'static str,
    pub(crate) pace: Pace,
    /// Every request to the endpoint waits this long (its `Retry-After`, capped).
    pub(crate) hold: Option<Duration>,
    /// The answer's `Ruststream-Settle` could not be read: the message was nak'd with the
    /// backoff rather than settled as the status alone would have it.
    pub(crate) unreadable: bool,
}

/// The retry schedule of a push consumer: exponential, full jitter.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Retries {
    pub(crate) initial: Duration,
    pub(crate) max: Duration,
    pub(crate) after_max: Duration,
}

impl Retries {
    /// The delay before the next attempt of a message delivered `delivered` times: uniformly
    /// random below `initial × 2^(delivered−1)`, capped at `max`; `unit` is a random number
    /// in [0, 1).
    pub(crate) fn backoff(&self, delivered: u64, unit: f64) -> Duration {
        let doublings = u32::try_from(delivered.saturating_sub(1).min(40)).unwrap_or(40);
        let ceiling = self
            .initial
            .checked_mul(1u32 << doublings.min(31))
            .unwrap_or(self.max)
            .min(self.max);
        ceiling.mul_f64(unit.clamp(0.0, 1.0))
    }
}

/// Judge one attempt of a message delivered `delivered` times.
pub(crate) fn judge(
    outcome: Outcome<'_>,
    delivered: u64,
    retries: &Retries,
    now: SystemTime,
    unit: f64,
) -> Verdict {
    let backoff = || Settle::Nak(retries.backoff(delivered, unit));
    let (status, settle, retry_after) = match outcome {
        Outcome::Answered {
            status,
            settle,
            retry_after,
        } => (status, settle, retry_after),
        Outcome::TimedOut => return verdict(backoff(), "timeout", Pace::Struggled, None),
        Outcome::ConnectFailed => {
            return verdict(backoff(), "connect_error", Pace::Struggled, None);
        }
        Outcome::Failed => return verdict(backoff(), "error", Pace::Struggled, None),
    };
    let success = (200..300).contains(&status);
    let asked = settle.map(|value| asked_for(value, success));
    let refused = matches!(status, 429 | 503);
    let hold = if refused {
        retry_after
            .and_then(|value| retry_after_delay(value, now))
            .map(|delay| delay.min(retries.after_max))
    } else {
        None
    };
    let pace = if success {
        Pace::Took
    } else if refused {
        Pace::Refused
    } else if status >= 500 {
        Pace::Struggled
    } else {
        Pace::Neutral
    };
    // A refusal's nak waits out its `Retry-After` too.
    let refused_nak = || {
        let backoff = retries.backoff(delivered, unit);
        Settle::Nak(hold.map_or(backoff, |hold| hold.max(backoff)))
    };
    match asked {
        Some(Ok(Some(settle))) => {
            let result = result_of(&settle);
            return verdict(settle, result, pace, hold);
        }
        // A directive the gateway cannot read is never taken for an ack (nor for a term):
        // the message comes back after the backoff, and the endpoint's author is told.
        Some(Err(Unreadable)) => {
            let (settle, result) = if refused {
                (refused_nak(), "throttled")
            } else {
                (backoff(), "nak")
            };
            let mut verdict = verdict(settle, result, pace, hold);
            verdict.unreadable = true;
            return verdict;
        }
        // None, or a `later` on a status that cannot leave a message leased.
        Some(Ok(None)) | None => {}
    }
    let settle = match status {
        200..=299 => Settle::Ack,
        400 | 413 | 415 | 422 => Settle::Term(format!("push: HTTP {status}")),
        429 | 503 => refused_nak(),
        _ => backoff(),
    };
    let result = if refused {
        "throttled"
    } else {
        result_of(&settle)
    };
    verdict(settle, result, pace, hold)
}

fn verdict(settle: Settle, result: &'static str, pace: Pace, hold: Option<Duration>) -> Verdict {
    Verdict {
        settle,
        result,
        pace,
        hold,
        unreadable: false,
    }
}

fn result_of(settle: &Settle) -> &'static str {
    match settle {
        Settle::Ack => "ack",
        Settle::Later => "later",
        Settle::Nak(_) => "nak",
        Settle::Term(_) => "term",
    }
}

/// `Retry-After` (RFC 9110): delay-seconds or an HTTP date; a date past is no delay.
pub(crate) fn retry_after_delay(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// Where a push window starts: a handful of requests, grown from there.
pub(crate) const WINDOW_START: usize = 4;

/// The window of requests in flight to one endpoint: additive increase (one more for every
/// window's worth of requests taken), multiplicative decrease (halved on a sign of overload,
/// at most once per window of requests, never below one), never above the most allowed.
#[derive(Debug, Clone)]
pub(crate) struct Window {
    size: usize,
    most: usize,
    taken: usize,
    /// Counts the decreases: a request sent before the last one cannot cause another (a
    /// burst of failures from one overload halves the window once, not down to one).
    epoch: u64,
}

impl Window {
    pub(crate) fn new(most: usize) -> Self {
        Self {
            size: WINDOW_START.min(most.max(1)),
            most: most.max(1),
            taken: 0,
            epoch: 0,
        }
    }

    pub(crate) fn size(&self) -> usize {
        self.size
    }

    /// What a request sent now remembers, to say when it was sent.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// A new most (a changed `max_in_flight`, another replica's share).
    pub(crate) fn limit(&mut self, most: usize) {
        self.most = most.max(1);
        self.size = self.size.min(self.most);
    }

    /// Learn from a request sent in `epoch`.
    pub(crate) fn learn(&mut self, pace: Pace, epoch: u64) {
        match pace {
            Pace::Took => {
                self.taken += 1;
                if self.taken >= self.size {
                    self.taken = 0;
                    self.size = (self.size + 1).min(self.most);
                }
            }
            Pace::Refused | Pace::Struggled if epoch == self.epoch => {
                self.size = (self.size / 2).max(1);
                self.taken = 0;
                self.epoch += 1;
            }
            Pace::Refused | Pace::Struggled | Pace::Neutral => {}
        }
    }
}

/// The pace of requests when even a window of one is refused: the gap between two requests
/// grows by half on each refusal at a window of one and shrinks by a tenth on each request
/// taken. The two balance where one attempt in five is refused (0.2 × ln 1.5 = 0.8 × ln
/// 1/0.9): an endpoint refusing more is sent less, one refusing less is sent more.
#[derive(Debug, Clone, Default)]
pub(crate) struct Pacer {
    gap: Duration,
}

/// The longest gap between two requests the pacer keeps.
const MOST_GAP: Duration = Duration::from_secs(10);

impl Pacer {
    pub(crate) fn gap(&self) -> Duration {
        self.gap
    }

    pub(crate) fn learn(&mut self, pace: Pace, window: usize) {
        match pace {
            Pace::Refused if window <= 1 => {
                self.gap = self
                    .gap
                    .mul_f64(1.5)
                    .clamp(Duration::from_millis(1), MOST_GAP);
            }
            Pace::Took => {
                self.gap = self.gap.saturating_sub(self.gap / 10);
                if self.gap < Duration::from_micros(100) {
                    self.gap = Duration::ZERO;
                }
            }
            _ => {}
        }
    }
}

/// A token bucket: at most `per_second` requests a second, a tenth of a second's worth at
/// once.
#[derive(Debug, Clone)]
pub(crate) struct RateLimit {
    per_second: f64,
    tokens: f64,
    last: Instant,
}

impl RateLimit {
    pub(crate) fn new(per_second: f64, now: Instant) -> Self {
        Self {
            per_second,
            tokens: 1.0,
            last: now,
        }
    }

    fn burst(&self) -> f64 {
        (self.per_second / 10.0).max(1.0)
    }

    /// A new rate (a changed `rate_limit`, another replica's share).
    pub(crate) fn set(&mut self, per_second: f64) {
        self.per_second = per_second;
        self.tokens = self.tokens.min(self.burst());
    }

    /// Take `count` tokens if there are, else how long until there will be.
    pub(crate) fn take(&mut self, count: usize, now: Instant) -> Result<(), Duration> {
        if self.per_second <= 0.0 {
            return Ok(());
        }
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + elapsed * self.per_second).min(self.burst().max(count as f64));
        let wanted = count as f64;
        if self.tokens >= wanted {
            self.tokens -= wanted;
            return Ok(());
        }
        Err(Duration::from_secs_f64(
            (wanted - self.tokens) / self.per_second,
        ))
    }
}

/// A push consumer's state, as `GET …/consumers/{consumer}` shows it.
#[derive(Debug, Clone)]
pub(crate) struct PushStatus {
    /// The endpoint without user, password or query.
    pub(crate) url: String,
    pub(crate) state: PushState,
    pub(crate) window: usize,
    pub(crate) in_flight: usize,
    pub(crate) last_success_at: Option<OffsetDateTime>,
    pub(crate) last_failure: Option<PushFailure>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PushState {
    Running,
    /// Paused at the server (`…/push/pause`): nothing is leased until it is resumed.
    Paused,
    /// Held back by a `Retry-After`, or failing since its last success.
    BackingOff,
}

impl PushState {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Paused => "paused",
            Self::BackingOff => "backing_off",
        }
    }
}

/// The last attempt that failed: the status it was answered with, or why none came.
#[derive(Debug, Clone)]
pub(crate) struct PushFailure {
    pub(crate) at: OffsetDateTime,
    pub(crate) status: Option<u16>,
    pub(crate) error: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    const RETRIES: Retries = Retries {
        initial: Duration::from_secs(1),
        max: Duration::from_secs(600),
        after_max: Duration::from_secs(300),
    };

    fn answered(status: u16, settle: Option<&str>, retry_after: Option<&str>) -> Verdict {
        judge(
            Outcome::Answered {
                status,
                settle,
                retry_after,
            },
            1,
            &RETRIES,
            SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000),
            0.5,
        )
    }

    #[test]
    fn each_class_of_answer_settles_as_the_contract_says() {
        assert_eq!(answered(204, None, None).settle, Settle::Ack);
        assert_eq!(answered(200, Some("later"), None).settle, Settle::Later);
        for poison in [400, 413, 415, 422] {
            let verdict = answered(poison, None, None);
            assert_eq!(verdict.settle, Settle::Term(format!("push: HTTP {poison}")));
            assert_eq!(verdict.pace, Pace::Neutral);
        }
        let throttled = answered(429, None, Some("7"));
        assert_eq!(throttled.settle, Settle::Nak(Duration::from_secs(7)));
        assert_eq!(throttled.hold, Some(Duration::from_secs(7)));
        assert_eq!(throttled.pace, Pace::Refused);
        let busy = answered(503, None, None);
        assert_eq!(busy.settle, Settle::Nak(Duration::from_millis(500)));
        assert_eq!(busy.hold, None);
        assert_eq!(answered(500, None, None).pace, Pace::Struggled);
        assert_eq!(answered(404, None, None).pace, Pace::Neutral);
        assert_eq!(
            answered(302, None, None).settle,
            Settle::Nak(Duration::from_millis(500))
        );
        for failure in [Outcome::TimedOut, Outcome::ConnectFailed] {
            let verdict = judge(failure, 3, &RETRIES, SystemTime::now(), 0.5);
            assert_eq!(verdict.settle, Settle::Nak(Duration::from_secs(2)));
            assert_eq!(verdict.pace, Pace::Struggled);
        }
    }

    #[test]
    fn the_endpoint_may_say_what_to_do_on_any_status() {
        assert_eq!(answered(500, Some("ack"), None).settle, Settle::Ack);
        assert_eq!(
            answered(200, Some("nak; delay=2500"), None).settle,
            Settle::Nak(Duration::from_millis(2500))
        );
        assert_eq!(
            answered(503, Some("term; reason=bad order"), None).settle,
            Settle::Term("bad order".into())
        );
        // `later` only with a 2xx: elsewhere the status decides.
        assert_eq!(answered(500, Some("later"), None).result, "nak");
        assert_eq!(answered(400, Some("later"), None).result, "term");
    }

    #[test]
    fn a_settle_header_that_cannot_be_read_is_unreadable_never_an_ack() {
        for value in [
            "nak; delay=-5",
            "nak; delay=1.5",
            "nak; delay=300ms",
            "nak; delay=+5",
            "nak; delay=",
            "nak; delay=99999999999999999999999",
            "nak; delay=604800001",
            "nak; wait=5",
            "nak; 5",
            "retry",
            "soon",
            "",
            "ack; now=1",
            "later; for=5",
            "term; why=bad",
            "ack, nak",
        ] {
            assert_eq!(asked_for(value, true), Err(Unreadable), "{value:?}");
            let verdict = answered(200, Some(value), None);
            assert_eq!(
                verdict.settle,
                Settle::Nak(Duration::from_millis(500)),
                "{value:?}: nak'd with the backoff"
            );
            assert!(verdict.unreadable, "{value:?}");
            assert_eq!(verdict.result, "nak");
        }
        // On a refusal the nak still waits out the Retry-After; a poison status does not
        // term what the endpoint may have meant to keep.
        let refused = answered(429, Some("retry"), Some("7"));
        assert_eq!(refused.settle, Settle::Nak(Duration::from_secs(7)));
        assert_eq!(refused.hold, Some(Duration::from_secs(7)));
        assert_eq!(
            answered(422, Some("retry"), None).settle,
            Settle::Nak(Duration::from_millis(500))
        );
        assert!(!answered(204, None, None).unreadable);
        assert!(!answered(204, Some("ack"), None).unreadable);
    }

    #[test]
    fn retry_after_is_seconds_or_a_date_and_is_capped() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        assert_eq!(
            retry_after_delay("120", now),
            Some(Duration::from_secs(120))
        );
        let later = httpdate::fmt_http_date(now + Duration::from_secs(30));
        assert_eq!(
            retry_after_delay(&later, now),
            Some(Duration::from_secs(30))
        );
        assert_eq!(retry_after_delay("soon", now), None);
        let capped = answered(429, None, Some("86400"));
        assert_eq!(capped.hold, Some(Duration::from_secs(300)));
    }

    #[test]
    fn backoff_doubles_per_delivery_up_to_its_cap_with_full_jitter() {
        assert_eq!(RETRIES.backoff(1, 0.999_999).as_millis(), 999);
        assert_eq!(RETRIES.backoff(4, 0.5), Duration::from_secs(4));
        assert_eq!(RETRIES.backoff(200, 0.5), Duration::from_secs(300));
        assert_eq!(RETRIES.backoff(3, 0.0), Duration::ZERO);
    }

    #[test]
    fn the_window_grows_by_one_per_window_and_halves_once_per_overload() {
        let mut window = Window::new(64);
        assert_eq!(window.size(), 4);
        for _ in 0..4 {
            window.learn(Pace::Took, window.epoch());
        }
        assert_eq!(window.size(), 5);
        let sent_in = window.epoch();
        // Five requests in flight fail from one overload: one halving.
        for _ in 0..5 {
            window.learn(Pace::Refused, sent_in);
        }
        assert_eq!(window.size(), 2);
        window.learn(Pace::Struggled, window.epoch());
        window.learn(Pace::Struggled, window.epoch());
        window.learn(Pace::Struggled, window.epoch());
        assert_eq!(window.size(), 1);
        window.limit(1);
        for _ in 0..10 {
            window.learn(Pace::Took, window.epoch());
        }
        assert_eq!(window.size(), 1);
    }

    #[test]
    fn at_a_window_of_one_refusals_slow_the_pace_and_successes_speed_it_up() {
        let mut pacer = Pacer::default();
        pacer.learn(Pace::Refused, 2);
        assert_eq!(pacer.gap(), Duration::ZERO);
        pacer.learn(Pace::Refused, 1);
        pacer.learn(Pace::Refused, 1);
        assert_eq!(pacer.gap(), Duration::from_micros(1500));
        // Refused one in four: slower and slower; one in six: faster and faster.
        let settle = |refused_every: usize| {
            let mut pacer = Pacer::default();
            pacer.learn(Pace::Refused, 1);
            for attempt in 1..=600 {
                let pace = if attempt % refused_every == 0 {
                    Pace::Refused
                } else {
                    Pace::Took
                };
                pacer.learn(pace, 1);
            }
            pacer.gap()
        };
        assert_eq!(settle(4), MOST_GAP);
        assert!(settle(6) <= Duration::from_millis(2), "{:?}", settle(6));
        for _ in 0..100 {
            pacer.learn(Pace::Took, 1);
        }
        assert_eq!(pacer.gap(), Duration::ZERO);
    }

    #[test]
    fn the_rate_limit_lets_through_its_rate() {
        let start = Instant::now();
        let mut limit = RateLimit::new(100.0, start);
        let mut taken = 0;
        let mut at = start;
        while at < start + Duration::from_secs(2) {
            match limit.take(1, at) {
                Ok(()) => taken += 1,
                Err(wait) => at += wait,
            }
        }
        assert!((195..=212).contains(&taken), "{taken}");
    }
}
