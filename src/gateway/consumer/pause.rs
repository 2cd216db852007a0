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

/// A pause this far ahead is a pause until resumed: the server wants a date.
pub(crate) const UNTIL_RESUMED_YEAR: i32 = 9999;

impl Consumer {
    /// Until when the consumer is paused, while it is (`Some(None)`: until resumed).
    pub(crate) fn paused(&self) -> Option<Option<OffsetDateTime>> {
        let until = self.paused.lock().ok().and_then(|paused| *paused)?;
        if until <= OffsetDateTime::now_utc() {
            return None;
        }
        Some((until.year() < UNTIL_RESUMED_YEAR).then_some(until))
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
        let bound = self.connected()?;
        let asked = if resume {
            None
        } else {
            Some(until.unwrap_or_else(until_resumed))
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

/// The date a pause until resumed is given to the server.
fn until_resumed() -> OffsetDateTime {
    OffsetDateTime::new_utc(
        time::Date::from_calendar_date(UNTIL_RESUMED_YEAR, time::Month::December, 31)
            .unwrap_or(time::Date::MAX),
        time::Time::MIDNIGHT,
    )
}
