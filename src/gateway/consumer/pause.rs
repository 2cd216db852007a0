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

/// The pause as this replica knows it: until when (`None`: not paused), and how many times
/// it changed the pause itself. A step reads the server with the count it saw before
/// asking: an answer from before this replica paused or resumed the consumer is older than
/// that change and is not applied after it (it would undo the resume until the next read,
/// and an idle push consumer reads nothing: its worker would wait, refused as paused).
#[derive(Debug, Default)]
pub(super) struct PauseView {
    until: Option<OffsetDateTime>,
    changes_here: u64,
}

impl PauseView {
    /// The mark a read of the server starts from.
    fn mark(&self) -> u64 {
        self.changes_here
    }

    /// A change made here, as the server confirmed it.
    fn changed_here(&mut self, until: Option<OffsetDateTime>) {
        self.until = until;
        self.changes_here += 1;
    }

    /// What a read begun at `mark` says; whether it was taken (not when a change was made
    /// here since the read began).
    fn read(&mut self, mark: u64, until: Option<OffsetDateTime>) -> bool {
        if mark != self.changes_here {
            return false;
        }
        self.until = until;
        true
    }
}

/// Whether a pause until `until` is the gateway's pause until resumed.
pub(crate) fn is_until_resumed(until: OffsetDateTime) -> bool {
    until == UNTIL_RESUMED
}

impl Consumer {
    /// Until when the consumer is paused, while it is (`Some(None)`: until resumed).
    pub(crate) fn paused(&self) -> Option<Option<OffsetDateTime>> {
        let until = self.paused.lock().ok().and_then(|paused| paused.until)?;
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

    /// The mark to read the server's view of the pause with ([`Consumer::follow_pause`]).
    pub(super) fn pause_mark(&self) -> u64 {
        self.paused.lock().map_or(0, |view| view.mark())
    }

    /// What the server says of the pause (`paused`, `pause_until`), read at each step from
    /// `mark`: ignored when this replica paused or resumed the consumer since.
    pub(super) fn follow_pause(&self, mark: u64, paused: bool, until: Option<OffsetDateTime>) {
        let was_paused = self.paused().is_some();
        let taken = self
            .paused
            .lock()
            .is_ok_and(|mut view| view.read(mark, until.filter(|_| paused)));
        if taken && was_paused != paused {
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
        if let Ok(mut view) = self.paused.lock() {
            view.changed_here(now);
        }
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
    fn a_read_from_before_a_change_made_here_is_not_applied_after_it() {
        let paused = OffsetDateTime::parse("2030-01-01T00:00:00Z", &Rfc3339).expect("RFC 3339");
        let mut view = PauseView::default();
        assert!(
            view.read(view.mark(), Some(paused)),
            "a read with nothing in between"
        );
        // A step asks the server while the consumer is still paused there...
        let mark = view.mark();
        // ...a resume here is confirmed meanwhile...
        view.changed_here(None);
        // ...and the step's answer, paused, comes after it: too old to apply.
        assert!(!view.read(mark, Some(paused)));
        assert_eq!(view.until, None, "still resumed");
        // The next step's read is taken.
        assert!(view.read(view.mark(), None));
    }

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
