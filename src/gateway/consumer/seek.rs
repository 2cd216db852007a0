//! Rewinding a consumer (`POST …/seek`): the stream sequence a target names, what a move
//! there re-delivers or skips, and the move itself, after which every live lease of the
//! consumer is void (410) at every replica and what ended through a gateway before may be
//! delivered again, as the move means. The replica that moves the consumer leaves a mark in
//! its metadata; the others see it change at their next step (within a second) and do the
//! same.
//!
//! May import: as the rest of `gateway`.

use std::sync::Arc;
use std::time::Duration;

use time::OffsetDateTime;
use tokio::time::Instant;
use tracing::{info, warn};

use super::Consumer;
use crate::error::Error;
use crate::nats::bind::Bound;
use crate::nats::{seek, seek_mark};

/// How long a move's answer waits for the consumer to be bound again (a moment, usually).
const REBOUND_WITHIN: Duration = Duration::from_secs(5);

/// Where to move a consumer.
#[derive(Debug, Clone, Copy)]
pub(crate) enum SeekTarget {
    /// This stream sequence is the next delivered.
    Sequence(u64),
    /// The first message stored at or after this time is.
    Time(OffsetDateTime),
    /// The stream's first message is.
    Beginning,
    /// Only what is published from now on is delivered.
    End,
}

/// A move, made or (dry run) not.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Seek {
    /// The next stream sequence the consumer delivers.
    pub(crate) sequence: u64,
    /// Messages it delivered before that it delivers again (its filter applied).
    pub(crate) redelivers: u64,
    /// Messages it has not delivered yet that it never will.
    pub(crate) skips: u64,
}

impl Consumer {
    /// Move the consumer to `target` (or, `dry_run`, only say what that would do).
    pub(crate) async fn seek(&self, target: SeekTarget, dry_run: bool) -> Result<Seek, Error> {
        let bound = self.connected()?;
        let version = seek::server_version(&bound);
        if !seek::supports_reset(&version) {
            return Err(Error::NotImplemented(format!(
                "moving a consumer needs nats-server {}.{} or later (its consumer reset); this server is {version}",
                seek::RESET_SINCE.0,
                seek::RESET_SINCE.1
            )));
        }
        let unavailable = |err: anyhow::Error| Error::Unavailable(format!("{err:#}"));
        let (position, info) = seek::position(&bound).await.map_err(unavailable)?;
        let after_last = position.last + 1;
        let sequence = match target {
            // Further would skip what is not even published yet, silently.
            SeekTarget::Sequence(sequence) if sequence > after_last => {
                return Err(Error::invalid(
                    "sequence",
                    format!(
                        "sequence: {sequence} is past the end of stream {}, whose last sequence is {}; {after_last} (its end) is the furthest a consumer can move",
                        info.stream_name, position.last
                    ),
                ));
            }
            SeekTarget::Sequence(sequence) => sequence,
            SeekTarget::Beginning => position.first.max(1),
            SeekTarget::End => after_last,
            SeekTarget::Time(at) => {
                seek::first_at_or_after(&bound.jetstream, &info.stream_name, at)
                    .await
                    .map_err(unavailable)?
                    .unwrap_or(after_last)
            }
        };
        let from_target = if sequence > position.last {
            0
        } else {
            seek::pending_from(&bound, &info, sequence)
                .await
                .map_err(unavailable)?
        };
        let moved = Seek {
            sequence,
            redelivers: from_target.saturating_sub(position.pending),
            skips: position.pending.saturating_sub(from_target),
        };
        if dry_run {
            return Ok(moved);
        }
        // From its first mark to its last the move runs to its end whatever the client does:
        // cut off half-way (the client gone), it would leave this replica's memory of what
        // ended before the move.
        let this = self.clone();
        let moving = tokio::spawn(async move { this.make_move(bound, info, sequence).await });
        moving
            .await
            .map_err(|err| Error::Unavailable(format!("the move stopped half-way: {err}")))??;
        info!(consumer = %self.name(), sequence, redelivers = moved.redelivers, skips = moved.skips, "moved the consumer; its live leases are void");
        self.rebound_after_move().await;
        Ok(moved)
    }

    /// Mark the move under way, forget the records, move the consumer to `sequence`, mark
    /// the move done.
    async fn make_move(
        &self,
        bound: Arc<Bound>,
        info: async_nats::jetstream::consumer::Info,
        sequence: u64,
    ) -> Result<(), Error> {
        let unavailable = |err: anyhow::Error| Error::Unavailable(format!("{err:#}"));
        // No floor record read from the consumer before the move is written after it here;
        // the marks tell the other replicas (see `nats::seek_mark`).
        let still = self.state.hold_still().await;
        // The mark first: if it cannot be left, nothing has changed. The others void their
        // leases and what ended as they see it, and again at the second mark: what they
        // took on in between is of the consumer before the move.
        let move_id =
            seek_mark::new_move(OffsetDateTime::now_utc().unix_timestamp_nanos(), sequence);
        seek::leave_mark(&bound, &info, Some(&seek_mark::under_way(&move_id)))
            .await
            .map_err(unavailable)?;
        // What the records say ended would be settled again when the move delivers it
        // anew: forgotten first.
        if let Some(records) = &bound.settled_records
            && let Err(err) = records.forget().await
        {
            // Nothing moved: the mark it had goes back, so that floor records are written
            // and believed under it again (every replica voids its leases on the way there
            // and back: a failed move is rare, and a void lease's message is only delivered
            // again).
            if let Err(put_back) = seek::leave_mark(&bound, &info, None).await {
                warn!(consumer = %self.name(), error = %format!("{put_back:#}"), "a failed move could not put the consumer's mark back; floor records wait a minute");
            }
            return Err(unavailable(err));
        }
        let reset = seek::reset(&bound, &info.stream_name, sequence).await;
        // Moved, or not known not to be (a reset that timed out may have been applied): the
        // safe side either way is a move, here and in the mark.
        self.state.moved();
        drop(still);
        if let Err(err) = seek::leave_mark(&bound, &info, Some(&move_id)).await {
            warn!(consumer = %self.name(), error = %format!("{err:#}"), "moved the consumer but could not mark the move done; floor records wait a minute");
        }
        self.saw_mark(Some(move_id));
        reset.map_err(unavailable)
    }

    /// At each step: a mark another replica left (a move) voids what this one holds.
    pub(super) fn follow_moves(&self, info: &async_nats::jetstream::consumer::Info) {
        // Each of a move's two marks voids: what was taken on between them is of the
        // consumer before the move.
        let mark = seek_mark::mark_of(info).map(str::to_owned);
        let Ok(mut seen) = self.seek_mark.lock() else {
            return;
        };
        let moved = seen.as_ref().is_some_and(|seen| *seen != mark);
        *seen = Some(mark);
        drop(seen);
        if moved {
            warn!(consumer = %self.name(), "the consumer was moved (a seek at another replica); every live lease here is void");
            self.state.moved();
        }
    }

    /// Wait (a little) until the consumer is bound again in the epoch the move began, so
    /// that a fetch sent on the answer is served rather than told to retry.
    async fn rebound_after_move(&self) {
        let epoch = self.state.epoch();
        let deadline = Instant::now() + REBOUND_WITHIN;
        let mut bindings = self.bound.clone();
        while Instant::now() < deadline {
            let rebound = self
                .bound
                .borrow()
                .as_ref()
                .is_some_and(|bound| bound.epoch == epoch);
            if rebound && self.readiness().is_ok() {
                return;
            }
            let _ = tokio::time::timeout_at(
                deadline.min(Instant::now() + super::READY_POLL),
                bindings.changed(),
            )
            .await;
        }
    }

    fn saw_mark(&self, mark: Option<String>) {
        if let Ok(mut seen) = self.seek_mark.lock() {
            *seen = Some(mark);
        }
    }
}
