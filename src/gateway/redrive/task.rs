//! A redrive task's state machine, apart from the NATS it runs against: what its record
//! becomes when a chunk was published, a publish confirmed or refused, a cancel asked for,
//! a claim taken, renewed or let go, and what its holder does next. Everything here is a
//! change of a [`TaskRecord`] in memory; [`super::run`] reads and writes it in the bucket.
//!
//! May import: as the rest of `gateway`.

use std::time::Duration;

use time::OffsetDateTime;
use tokio::time::Instant;

use crate::gateway::DeadLetterId;
use crate::nats::dead_letter_reader::DeadLetter;
use crate::nats::redrive::{Removal, TaskRecord, TaskState};

/// How long a claim holds without being renewed: a killed holder's task is taken over
/// after this, well inside the target's 2-minute duplicate window.
pub(super) const CLAIM_FOR: Duration = Duration::from_secs(10);
/// Messages per chunk at most; fewer at low rates, so that a chunk takes about this long.
const CHUNK_MAX: usize = 256;
const CHUNK_TIME: Duration = Duration::from_millis(250);
/// Chunks in a row failing for want of NATS or the dead-letter stream before the task fails.
pub(super) const FAILED_CHUNKS_MAX: u32 = 60;

pub(super) fn now_ms() -> i64 {
    (OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000) as i64
}

pub(super) fn now_text() -> String {
    let now = OffsetDateTime::now_utc();
    now.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|_| now.to_string())
}

/// How many dead letters a chunk takes at `rate` a second.
pub(super) fn chunk_size(rate: u32) -> usize {
    ((f64::from(rate) * CHUNK_TIME.as_secs_f64()) as usize).clamp(1, CHUNK_MAX)
}

/// Whether some replica's claim on the task is live.
pub(super) fn is_held(record: &TaskRecord) -> bool {
    record.owner.is_some() && record.owner_until.unwrap_or(0) > now_ms()
}

/// The task's claim taken (or renewed) by `me`.
pub(super) fn claim(record: &mut TaskRecord, me: &str) {
    record.owner = Some(me.to_owned());
    renew(record);
}

pub(super) fn renew(record: &mut TaskRecord) {
    record.owner_until = Some(now_ms() + CLAIM_FOR.as_millis() as i64);
}

/// The claim let go: another replica takes the task at once.
pub(super) fn release(record: &mut TaskRecord) {
    record.owner = None;
    record.owner_until = None;
}

/// The task ended as `state`.
pub(super) fn finish(record: &mut TaskRecord, state: TaskState) {
    record.state = state;
    record.finished_at = Some(now_text());
    release(record);
}

/// What the holder of a running task does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Step {
    /// Remove the dead letters whose publish was confirmed: a chunk is finished before
    /// anything else happens, a stop or a cancel too.
    Remove,
    /// End the task as cancelled.
    Cancel,
    /// Let it go for another replica (this one stops).
    Release,
    /// Publish the next chunk.
    Publish,
}

pub(super) fn next_step(record: &TaskRecord, stopping: bool) -> Step {
    if !record.removing.is_empty() {
        Step::Remove
    } else if record.cancel_requested {
        Step::Cancel
    } else if stopping {
        Step::Release
    } else {
        Step::Publish
    }
}

/// A chunk's dead letters, and where the task stands once it is done.
pub(super) struct Chunk {
    pub(super) letters: Vec<DeadLetter>,
    /// What the progress becomes when every letter of it was handled.
    pub(super) after: Progress,
}

impl Chunk {
    /// Nothing is left to take.
    pub(super) fn is_last(&self) -> bool {
        matches!(self.after, Progress::Done) && self.letters.is_empty()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Progress {
    /// In filter mode: this store's next sequence.
    Store { index: usize, next: u64 },
    /// In id mode: ids done.
    Ids(usize),
    /// Nothing left.
    Done,
}

/// A publish of `letter` the target confirmed (stored now, or before: a duplicate of its
/// dedup id): counted once, and marked for removal.
pub(super) fn published(record: &mut TaskRecord, letter: &DeadLetter) {
    record.published += 1;
    record.removing.push(Removal {
        store: letter.store.clone(),
        sequence: letter.sequence,
    });
}

/// A publish of `letter` the target refused: it stays where it was.
pub(super) fn refused(record: &mut TaskRecord, letter: &DeadLetter, why: &anyhow::Error) {
    record.failed += 1;
    record.last_error = Some(format!("dead letter {}: {why:#}", DeadLetterId::of(letter)));
}

pub(super) fn advance(record: &mut TaskRecord, to: Progress) {
    match to {
        Progress::Store { index, next } => {
            if let Some(store) = record.stores.get_mut(index) {
                store.next = next;
            }
        }
        Progress::Ids(done) => record.ids_done = done,
        Progress::Done => {}
    }
}

/// Progress up to (not past) `letter` of a chunk that would have led to `after`.
pub(super) fn advance_to_letter(record: &mut TaskRecord, letter: &DeadLetter, after: Progress) {
    let at = match after {
        Progress::Store { index, .. } => Progress::Store {
            index,
            next: letter.sequence,
        },
        // The ids before this one's id are done.
        Progress::Ids(_) => {
            let id = DeadLetterId::of(letter).to_string();
            let position = record
                .ids
                .as_ref()
                .and_then(|ids| ids.iter().skip(record.ids_done).position(|i| *i == id))
                .unwrap_or(0);
            Progress::Ids(record.ids_done + position)
        }
        Progress::Done => Progress::Done,
    };
    advance(record, at);
}

/// Whose the task is after a write of its record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Held {
    /// Still this replica's to run.
    Here,
    /// Claimed by another replica (this one's claim lapsed), or ended there.
    Elsewhere,
}

/// Publishes at most `rate` a second on average.
pub(super) struct Pacer {
    rate: f64,
    started: Instant,
    sent: u64,
}

impl Pacer {
    pub(super) fn new(rate: u32) -> Self {
        Self {
            rate: f64::from(rate.max(1)),
            started: Instant::now(),
            sent: 0,
        }
    }

    pub(super) async fn wait(&mut self) {
        let due = self.started + Duration::from_secs_f64(self.sent as f64 / self.rate);
        // Within a millisecond is on time: the timer is no finer than that.
        if due > Instant::now() + Duration::from_millis(1) {
            tokio::time::sleep_until(due).await;
        }
        self.sent += 1;
    }
}

#[cfg(test)]
mod tests {
    use async_nats::HeaderMap;
    use bytes::Bytes;

    use super::*;
    use crate::nats::dead_letter_reader::FilterWords;

    fn record(ids: &[&str]) -> TaskRecord {
        TaskRecord {
            task: "t1".into(),
            state: TaskState::Running,
            filter: FilterWords::default(),
            ids: Some(ids.iter().map(|id| (*id).to_owned()).collect()),
            ids_done: 0,
            stores: Vec::new(),
            removing: Vec::new(),
            cancel_requested: false,
            to_subject: None,
            rate: 1000,
            matched: ids.len() as u64,
            published: 0,
            removed: 0,
            failed: 0,
            started_at: now_text(),
            finished_at: None,
            last_error: None,
            owner: None,
            owner_until: None,
        }
    }

    fn letter(sequence: u64) -> DeadLetter {
        DeadLetter {
            store: "DLQ".into(),
            sequence,
            dead_lettered_at: OffsetDateTime::UNIX_EPOCH,
            reason: "terminated".into(),
            term_reason: None,
            stream: "ORDERS".into(),
            consumer: "billing".into(),
            stream_sequence: sequence,
            subject: "orders.x".into(),
            deliveries: 1,
            published_at: None,
            payload: Bytes::new(),
            headers: HeaderMap::new(),
        }
    }

    #[test]
    fn a_chunk_in_hand_is_finished_before_a_cancel_or_a_stop() {
        let mut task = record(&["DLQ:1", "DLQ:2"]);
        assert_eq!(next_step(&task, false), Step::Publish);
        assert_eq!(next_step(&task, true), Step::Release);
        task.cancel_requested = true;
        assert_eq!(next_step(&task, true), Step::Cancel);
        published(&mut task, &letter(1));
        assert_eq!(next_step(&task, true), Step::Remove);
        assert_eq!(task.published, 1);
    }

    #[test]
    fn an_interrupted_chunk_resumes_at_its_first_unsent_id() {
        let mut task = record(&["DLQ:1", "DLQ:2", "DLQ:3"]);
        advance_to_letter(&mut task, &letter(2), Progress::Ids(3));
        assert_eq!(task.ids_done, 1);
        advance(&mut task, Progress::Ids(3));
        assert_eq!(task.ids_done, 3);
    }

    #[test]
    fn a_claim_holds_until_let_go_or_lapsed() {
        let mut task = record(&["DLQ:1"]);
        assert!(!is_held(&task));
        claim(&mut task, "replica-a");
        assert!(is_held(&task));
        task.owner_until = Some(now_ms() - 1);
        assert!(!is_held(&task), "a lapsed claim holds nothing");
        claim(&mut task, "replica-b");
        finish(&mut task, TaskState::Done);
        assert!(!is_held(&task) && task.finished_at.is_some());
        assert_eq!(chunk_size(1), 1);
        assert_eq!(chunk_size(10_000), CHUNK_MAX);
    }
}
