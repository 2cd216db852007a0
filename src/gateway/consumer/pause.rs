//! A consumer paused at the server (`pause_until`): what every replica reads of it each step
//! and what a fetch, a stream or a push is told while it lasts; and the pause and resume
//! themselves.
//!
//! May import: as the rest of `gateway`.

use time::OffsetDateTime;

use super::Consumer;
use crate::dispatch::Command;
use crate::error::Error;
use crate::nats;

/// What a pause until resumed is given to the server, which wants a date: the last instant
/// RFC 3339 can write, 9999-12-31T23:59:59.999999999Z, which the server keeps to the
/// nanosecond and every replica (and a restarted one) reads back as "until resumed". A user
/// may pause until any other time, 9999-12-31 included, and is told that time; this one
/// alone is refused as an `until` (see [`is_until_resumed`]).
pub(crate) const UNTIL_RESUMED: OffsetDateTime = OffsetDateTime::new_utc(
    match time::Date::from_calendar_date(9999, time::Month::December, 31) {
        Ok(date) => date,
        Err(_) => panic!("9999-12-31 is a date"),
    },
    match time::Time::from_hms_nano(23, 59, 59, 999_999_999) {
        Ok(time) => time,
        Err(_) => panic!("23:59:59.999999999 is a time"),
    },
);

/// Whether a pause until `until` is the gateway's pause until resumed.
pub(crate) fn is_until_resumed(until: OffsetDateTime) -> bool {
    until == UNTIL_RESUMED
}

impl Consumer {
    /// Until when the consumer is paused, while it is (`Some(None)`: until resumed).
    pub(crate) fn paused(&self) -> Option<Option<OffsetDateTime>> {
        let until = self.paused.lock().ok().and_then(|paused| *paused)?;
        if until <= OffsetDateTime::now_utc() {
            return None;
        }
        Some((!is_until_resumed(until)).then_some(until))
    }

    /// 409 consumer-paused while the consumer is paused.
    pub(crate) fn refuse_if_paused(&self) -> Result<(), Error> {
        match self.paused() {
            Some(until) => Err(Error::ConsumerPaused {
                consumer: self.name().to_string(),
                until,
            }),
            None => Ok(()),
        }
    }

    /// What the server says of the pause (`paused`, `pause_until`), read at each step.
    pub(super) fn follow_pause(&self, paused: bool, until: Option<OffsetDateTime>) {
        let was_paused = self.paused().is_some();
        if let Ok(mut held) = self.paused.lock() {
            *held = until.filter(|_| paused);
        }
        if was_paused != paused {
            self.pull_anew();
        }
    }

    /// A pull open while the consumer was paused is never served, not even after the resume
    /// (see [`Command::Resumed`]): the long ones are ended, to be made anew. Best effort — a full command queue is a busy
    /// dispatcher, whose short pulls are made anew within a second anyway.
    fn pull_anew(&self) {
        let _ = self.commands.try_send(Command::Resumed);
    }

    /// Pause the consumer at the server until `until` (`None`: until resumed), or resume
    /// it (`resume`): every replica stops leasing within a step.
    pub(crate) async fn pause(
        &self,
        until: Option<OffsetDateTime>,
        resume: bool,
    ) -> Result<Option<Option<OffsetDateTime>>, Error> {
        if until.is_some_and(is_until_resumed) {
            return Err(Error::invalid(
                "until",
                "until: 9999-12-31T23:59:59.999999999Z is how the gateway marks a pause until resumed; leave `until` out for that, or give another time",
            ));
        }
        let bound = self.connected()?;
        let asked = if resume {
            None
        } else {
            Some(until.unwrap_or(UNTIL_RESUMED))
        };
        let now = nats::publish::pause_consumer(&bound, &self.name().stream, asked)
            .await
            .map_err(|err| Error::Unavailable(format!("{err:#}")))?;
        self.follow_pause(now.is_some(), now);
        // Whether or not this replica had seen the state it changes.
        self.pull_anew();
        Ok(self.paused())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use time::format_description::well_known::Rfc3339;

    #[test]
    fn only_the_mark_itself_is_until_resumed() {
        let written = UNTIL_RESUMED.format(&Rfc3339).expect("RFC 3339");
        assert_eq!(written, "9999-12-31T23:59:59.999999999Z");
        assert_eq!(
            OffsetDateTime::parse(&written, &Rfc3339).ok(),
            Some(UNTIL_RESUMED)
        );
        assert!(is_until_resumed(UNTIL_RESUMED));
        for other in [
            "9999-12-31T00:00:00Z",
            "9999-12-31T23:59:59Z",
            "9999-12-31T23:59:59.999999998Z",
            "2030-01-01T00:00:00Z",
        ] {
            let at = OffsetDateTime::parse(other, &Rfc3339).expect("RFC 3339");
            assert!(!is_until_resumed(at), "{other}");
        }
    }
}
