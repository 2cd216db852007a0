//! Message schedules as values: when a schedule fires (`@at`, `@every`, a 6-field cron in an
//! IANA zone), how nats-server spells it in `Nats-Schedule`, when it fires next, and where the
//! gateway keeps a stream's schedules (`<prefix>.schedule.<stream>.<token>`, subjects no
//! consumer should lease).

use std::str::FromStr;
use std::time::Duration;

use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

/// The header nats-server reads a schedule from.
pub(crate) const SCHEDULE_HEADER: &str = "Nats-Schedule";
/// The subject a schedule's message is delivered to.
pub(crate) const TARGET_HEADER: &str = "Nats-Schedule-Target";
/// The IANA zone a cron schedule is read in.
pub(crate) const TIME_ZONE_HEADER: &str = "Nats-Schedule-Time-Zone";
/// Added by the gateway to a one-shot schedule: when it was due (RFC 3339), kept on the
/// delivered message.
pub(crate) const SCHEDULED_AT_HEADER: &str = "Ruststream-Scheduled-At";

/// The shortest `@every` nats-server takes.
const MIN_EVERY: Duration = Duration::from_secs(1);

/// When a schedule fires.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum When {
    /// Once, at this time.
    At(OffsetDateTime),
    /// Every interval, from when it was made.
    Every(Duration),
    /// A 6-field cron expression (seconds first) or a macro (`@hourly`…), in a zone (UTC
    /// when none).
    Cron {
        expression: String,
        zone: Option<String>,
    },
}

/// Why a recurring schedule is refused: the field at fault and the reason.
pub(crate) type Refusal = (&'static str, String);

impl When {
    /// A recurring schedule from `POST /schedules`'s `cron` and `time_zone`.
    pub(crate) fn recurring(cron: &str, time_zone: Option<&str>) -> Result<Self, Refusal> {
        let cron = cron.trim();
        if let Some(interval) = cron.strip_prefix("@every ") {
            if time_zone.is_some() {
                return Err((
                    "time_zone",
                    "time_zone: an @every schedule has no zone (it counts from when it was made)"
                        .into(),
                ));
            }
            let every = humantime::parse_duration(interval.trim()).map_err(|_| {
                (
                    "cron",
                    format!("cron: {interval:?} is not a duration (e.g. 5m, 1h30m)"),
                )
            })?;
            if every < MIN_EVERY || every.subsec_nanos() != 0 {
                return Err((
                    "cron",
                    "cron: an @every interval is whole seconds, at least 1s".into(),
                ));
            }
            return Ok(Self::Every(every));
        }
        if let Some(zone) = time_zone
            && chrono_tz::Tz::from_str(zone).is_err()
        {
            return Err((
                "time_zone",
                format!("time_zone: {zone:?} is not an IANA time zone (e.g. Europe/Berlin)"),
            ));
        }
        if !cron.starts_with('@') && cron.split_whitespace().count() != 6 {
            return Err((
                "cron",
                "cron: 6 fields (second minute hour day-of-month month day-of-week), a macro such as @hourly or @daily, or @every <duration>".into(),
            ));
        }
        parse_cron(cron).map_err(|why| ("cron", format!("cron: {why}")))?;
        Ok(Self::Cron {
            expression: cron.to_owned(),
            zone: time_zone.map(str::to_owned),
        })
    }

    /// Read back a schedule's `Nats-Schedule` (and zone) header.
    pub(crate) fn from_header(pattern: &str, zone: Option<&str>) -> Option<Self> {
        if let Some(at) = pattern.strip_prefix("@at ") {
            return OffsetDateTime::parse(at.trim(), &Rfc3339)
                .ok()
                .map(Self::At);
        }
        if let Some(interval) = pattern.strip_prefix("@every ") {
            return humantime::parse_duration(interval.trim())
                .ok()
                .map(Self::Every);
        }
        Some(Self::Cron {
            expression: pattern.to_owned(),
            zone: zone.map(str::to_owned),
        })
    }

    /// How `Nats-Schedule` spells it.
    pub(crate) fn header(&self) -> String {
        match self {
            Self::At(at) => format!("@at {}", rfc3339(*at)),
            Self::Every(every) => format!("@every {}s", every.as_secs()),
            Self::Cron { expression, .. } => expression.clone(),
        }
    }

    /// Whether it fires more than once.
    pub(crate) fn is_recurring(&self) -> bool {
        !matches!(self, Self::At(_))
    }

    /// When it fires next after `now` (a schedule made at `made`); `None` when it never
    /// will again.
    pub(crate) fn next_after(
        &self,
        now: OffsetDateTime,
        made: OffsetDateTime,
    ) -> Option<OffsetDateTime> {
        match self {
            Self::At(at) => Some(*at),
            Self::Every(every) => {
                let every = time::Duration::try_from(*every).ok()?;
                if every <= time::Duration::ZERO {
                    return None;
                }
                let elapsed = now - made;
                let periods = if elapsed <= time::Duration::ZERO {
                    1
                } else {
                    (elapsed.whole_nanoseconds() / every.whole_nanoseconds()) + 1
                };
                Some(made + every * i32::try_from(periods).ok()?)
            }
            Self::Cron { expression, zone } => {
                let cron = parse_cron(expression).ok()?;
                let zone = match zone {
                    Some(zone) => chrono_tz::Tz::from_str(zone).ok()?,
                    None => chrono_tz::UTC,
                };
                let now = chrono::DateTime::from_timestamp(now.unix_timestamp(), now.nanosecond())?
                    .with_timezone(&zone);
                let next = cron.find_next_occurrence(&now, false).ok()?;
                OffsetDateTime::from_unix_timestamp(next.timestamp()).ok()
            }
        }
    }
}

/// nats-server takes up a due schedule and only then fires it; a delete landing in between
/// is confirmed and does not stop the fire. So a cancel is sure only when its delete is
/// confirmed before the next fire time, less this allowance for the gateway's clock running
/// behind the server's.
pub(crate) const CLOCK_SKEW: Duration = Duration::from_millis(100);
/// The least time before a fire a delete is sent with (its round trip and [`CLOCK_SKEW`]).
pub(crate) const CANCEL_LEAD: Duration = Duration::from_millis(250);
/// How late the server may fire an occurrence (it takes up due schedules a few times a
/// second): a recurring schedule due this long ago may not have fired yet.
pub(crate) const FIRES_LATE: Duration = Duration::from_millis(500);

/// When a cancel can be sure to stop a schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CancelWindow {
    /// Delete it now: confirmed before `deadline`, no fire follows.
    Now { deadline: OffsetDateTime },
    /// A recurring schedule firing about now: decide again at this time, after the fire.
    After(OffsetDateTime),
    /// A one-shot due now or overdue: it fires (or is firing); nothing to stop.
    Firing { due: OffsetDateTime },
}

impl When {
    /// When a cancel at `now` can be sure to stop this schedule (made at `made`).
    pub(crate) fn cancel_window(&self, now: OffsetDateTime, made: OffsetDateTime) -> CancelWindow {
        // The earliest fire still to come: a recurring occurrence due a moment ago may not
        // have fired yet.
        let Some(next) = self.next_after(now - FIRES_LATE, made) else {
            return CancelWindow::Now {
                deadline: now + Duration::from_secs(3600),
            };
        };
        if next > now + CANCEL_LEAD {
            return CancelWindow::Now {
                deadline: next - CLOCK_SKEW,
            };
        }
        match self {
            Self::At(_) => CancelWindow::Firing { due: next },
            _ => CancelWindow::After(next + FIRES_LATE),
        }
    }
}

fn parse_cron(expression: &str) -> Result<croner::Cron, String> {
    croner::parser::CronParser::builder()
        .seconds(croner::parser::Seconds::Required)
        .build()
        .parse(expression)
        .map_err(|err| err.to_string())
}

/// RFC 3339 in UTC with milliseconds, as schedules are written and shown.
pub(crate) fn rfc3339(at: OffsetDateTime) -> String {
    let at = at.to_offset(time::UtcOffset::UTC);
    let millis = at.millisecond();
    let at = at
        .replace_nanosecond(u32::from(millis) * 1_000_000)
        .unwrap_or(at);
    at.format(&Rfc3339).unwrap_or_default()
}

/// The subjects where the gateway keeps `stream`'s schedules: the stream must capture them,
/// and no consumer should lease them.
pub(crate) fn namespace(prefix: &str, stream: &str) -> String {
    format!("{prefix}.schedule.{stream}.>")
}

/// A schedule's own subject, and its id (`<stream>.<token>`) as the API names it.
pub(crate) fn subject_of(prefix: &str, id: &ScheduleId) -> String {
    format!("{prefix}.schedule.{}.{}", id.stream, id.token)
}

/// A schedule's id: its stream and a token of its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ScheduleId {
    pub(crate) stream: String,
    pub(crate) token: String,
}

impl ScheduleId {
    /// A new id on `stream`.
    pub(crate) fn new(stream: &str) -> Self {
        Self {
            stream: stream.to_owned(),
            token: format!("{:016x}", rand::random::<u64>()),
        }
    }

    /// The id of the schedule of a message with msg id `msg_id` on `stream`: always the
    /// same, so that a retried publish, which the stream refuses as a duplicate of the
    /// schedule it stored, is answered with that schedule's id (the first 64 bits of the
    /// SHA-256 of the msg id).
    pub(crate) fn of_msg_id(stream: &str, msg_id: &str) -> Self {
        use sha2::Digest as _;
        let digest = sha2::Sha256::digest(msg_id.as_bytes());
        let token = digest[..8]
            .iter()
            .map(|byte| format!("{byte:02x}"))
            .collect();
        Self {
            stream: stream.to_owned(),
            token,
        }
    }

    /// The id a schedule subject names, if it is one of the gateway's.
    pub(crate) fn of_subject(prefix: &str, subject: &str) -> Option<Self> {
        let rest = subject.strip_prefix(prefix)?.strip_prefix(".schedule.")?;
        Self::parse(rest)
    }

    /// `<stream>.<token>` as the API names it; `None` for anything else.
    pub(crate) fn parse(id: &str) -> Option<Self> {
        let (stream, token) = id.rsplit_once('.')?;
        let valid_token = token.len() == 16 && token.bytes().all(|b| b.is_ascii_hexdigit());
        let valid_stream = super::subject::validate_name(stream).is_ok();
        (valid_token && valid_stream).then(|| Self {
            stream: stream.to_owned(),
            token: token.to_owned(),
        })
    }
}

impl std::fmt::Display for ScheduleId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.stream, self.token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(text: &str) -> OffsetDateTime {
        OffsetDateTime::parse(text, &Rfc3339).expect("RFC 3339")
    }

    #[test]
    fn a_message_id_names_one_schedule() {
        let id = ScheduleId::of_msg_id("ORDERS", "charge-41");
        assert_eq!(id, ScheduleId::of_msg_id("ORDERS", "charge-41"));
        assert_ne!(id, ScheduleId::of_msg_id("ORDERS", "charge-42"));
        assert_eq!(id.token.len(), 16);
        assert!(id.token.chars().all(|c| c.is_ascii_hexdigit()));
        assert_eq!(ScheduleId::parse(&id.to_string()), Some(id));
    }

    #[test]
    fn a_cancel_deletes_only_when_sure_to_beat_the_next_fire() {
        let now = at("2026-12-07T10:00:00Z");
        let due = |text: &str| When::At(at(text));
        assert_eq!(
            due("2026-12-07T10:00:01Z").cancel_window(now, now),
            CancelWindow::Now {
                deadline: at("2026-12-07T10:00:00.900Z")
            }
        );
        // Due in a moment, or overdue (the server down, or late): it fires; not stopped.
        for firing in ["2026-12-07T10:00:00.200Z", "2026-12-07T09:59:00Z"] {
            assert_eq!(
                due(firing).cancel_window(now, now),
                CancelWindow::Firing { due: at(firing) }
            );
        }
        // Every second from 09:59:00: the fire at 10:00:00 may be under way (late), so wait
        // until it is surely over, then beat the one at 10:00:01.
        let every = When::Every(Duration::from_secs(1));
        let made = at("2026-12-07T09:59:00Z");
        assert_eq!(
            every.cancel_window(now, made),
            CancelWindow::After(at("2026-12-07T10:00:00.500Z"))
        );
        assert_eq!(
            every.cancel_window(at("2026-12-07T10:00:00.500Z"), made),
            CancelWindow::Now {
                deadline: at("2026-12-07T10:00:00.900Z")
            }
        );
        assert_eq!(
            every.cancel_window(at("2026-12-07T10:00:00.600Z"), made),
            CancelWindow::Now {
                deadline: at("2026-12-07T10:00:00.900Z")
            }
        );
        assert_eq!(
            every.cancel_window(at("2026-12-07T10:00:00.800Z"), made),
            CancelWindow::After(at("2026-12-07T10:00:01.500Z"))
        );
    }

    #[test]
    fn recurring_schedules_are_checked_before_the_server_sees_them() {
        assert_eq!(
            When::recurring("@every 5m", None),
            Ok(When::Every(Duration::from_secs(300)))
        );
        assert_eq!(
            When::recurring("@every 5m", None).map(|w| w.header()),
            Ok("@every 300s".into())
        );
        for (cron, zone, field) in [
            ("@every 500ms", None, "cron"),
            ("@every soon", None, "cron"),
            ("@every 1m", Some("Europe/Berlin"), "time_zone"),
            ("0 9 * * 1-5", None, "cron"),
            ("0 0 9 * * MON-FRI", Some("Mars/Olympus"), "time_zone"),
            ("0 0 99 * * *", None, "cron"),
        ] {
            assert_eq!(
                When::recurring(cron, zone).map_err(|(field, _)| field),
                Err(field),
                "{cron:?} in {zone:?}"
            );
        }
        assert!(When::recurring("0 0 9 * * 1-5", Some("Europe/Berlin")).is_ok());
        assert!(When::recurring("@hourly", None).is_ok());
    }

    #[test]
    fn the_next_time_follows_the_zone_and_the_interval() {
        let now = at("2026-12-07T07:30:00Z");
        // 09:00 in Berlin in winter is 08:00 UTC.
        let berlin = When::recurring("0 0 9 * * *", Some("Europe/Berlin")).expect("valid");
        assert_eq!(
            berlin.next_after(now, now),
            Some(at("2026-12-07T08:00:00Z"))
        );
        let every = When::Every(Duration::from_secs(60));
        let made = at("2026-12-07T07:00:10Z");
        assert_eq!(
            every.next_after(now, made),
            Some(at("2026-12-07T07:30:10Z"))
        );
        let at = When::At(made);
        assert_eq!(When::from_header(&at.header(), None), Some(at));
    }

    #[test]
    fn ids_name_their_stream_and_nothing_else() {
        let id = ScheduleId::new("ORDERS");
        assert_eq!(ScheduleId::parse(&id.to_string()), Some(id.clone()));
        assert_eq!(
            ScheduleId::of_subject("_RS", &subject_of("_RS", &id)),
            Some(id)
        );
        for bad in [
            "",
            "ORDERS",
            "ORDERS.xyz",
            "ORDERS.0123456789abcdeg",
            "a b.0123456789abcdef",
        ] {
            assert_eq!(ScheduleId::parse(bad), None, "{bad:?}");
        }
    }
}
