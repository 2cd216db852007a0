//! Admission of a redrive task: a task is made only when no running one could take any of
//! the same dead letters, so that two redrives asked for at once (a double click) never
//! publish a dead letter twice — the second is refused with 409 naming the first. The
//! running tasks, each with what it takes, are listed in the register of the redrive bucket,
//! written by compare-and-set before a task's record is made: of two requests at once, the
//! second to write reads the first's entry.
//!
//! Two tasks overlap when a dead letter still to be done by the running one (not yet past
//! its progress, or published and not yet removed) could be taken by the new one: filters
//! apart by one of their words (another consumer, reason, …) never do; ids are compared
//! with the running task's filter or ids, on the dead letters themselves.
//!
//! May import: as the rest of `gateway`.

use std::collections::HashSet;
use std::time::Duration;

use futures::StreamExt as _;

use super::task::now_ms;
use crate::error::Error;
use crate::gateway::DeadLetterId;
use crate::nats::dead_letter_reader::{self, DeadLetter, Filter};
use crate::nats::redrive::{self, Register, Registered, StoreProgress, TaskRecord, TaskState};
use crate::nats::redrive::{Removal, Written};

/// How long a registered task without a record stands for one being made (its maker writes
/// the record right after the register); older, its maker stopped before that.
const MAKING_WITHIN: Duration = Duration::from_secs(30);
/// Tries at the register's compare-and-set before the request gives up (503).
const WRITES_TRIED: usize = 20;
/// Dead letters read at once when a running task's ids are compared with a new filter.
const READS_AT_ONCE: usize = 16;

type Bucket = async_nats::jetstream::kv::Store;

/// What a task takes that it has not done yet.
struct Taking {
    /// Filter mode: the filter, and per dead-letter stream the sequences left.
    filter: Option<Filter>,
    ranges: Vec<StoreProgress>,
    /// Id mode: the ids left; either mode: those published and not removed yet.
    letters: HashSet<(String, u64)>,
}

impl Taking {
    fn of(filter: Option<Filter>, ranges: Vec<StoreProgress>, ids: &[String]) -> Self {
        let letters = ids
            .iter()
            .filter_map(|id| DeadLetterId::parse(id))
            .map(|id| (id.store, id.sequence))
            .collect();
        Self {
            filter,
            ranges,
            letters,
        }
    }

    /// What a running task's record says it still takes.
    fn of_record(record: &TaskRecord) -> Self {
        let mut taking = match &record.ids {
            Some(ids) => Self::of(None, Vec::new(), ids.get(record.ids_done..).unwrap_or(&[])),
            // A filter that does not read (it did when the task was made) takes everything.
            None => Self::of(
                Some(Filter::from_words(&record.filter).unwrap_or_default()),
                record.stores.clone(),
                &[],
            ),
        };
        taking.letters.extend(
            record
                .removing
                .iter()
                .map(|Removal { store, sequence }| (store.clone(), *sequence)),
        );
        taking
    }

    /// What a registered task whose record is not written yet takes: all it was made with.
    fn of_entry(entry: &Registered) -> Self {
        match &entry.ids {
            Some(ids) => Self::of(None, Vec::new(), ids),
            None => Self::of(
                Some(Filter::from_words(&entry.filter).unwrap_or_default()),
                entry.stores.clone(),
                &[],
            ),
        }
    }

    /// Whether `sequence` of `store` is among the filter's sequences left.
    fn in_range(&self, store: &str, sequence: u64) -> bool {
        self.ranges
            .iter()
            .any(|range| range.store == store && (range.next..=range.last).contains(&sequence))
    }

    /// Whether this filter task could take `letter`.
    fn takes(&self, letter: &DeadLetter) -> bool {
        self.letters
            .contains(&(letter.store.clone(), letter.sequence))
            || self.filter.as_ref().is_some_and(|filter| {
                filter.matches(letter) && self.in_range(&letter.store, letter.sequence)
            })
    }
}

/// A new task, as admission compares it.
pub(super) struct Asked<'a> {
    /// Filter mode: the filter and the sequences it takes per dead-letter stream.
    pub(super) filter: Option<&'a Filter>,
    pub(super) ranges: &'a [StoreProgress],
    /// Id mode: the dead letters its ids name that exist.
    pub(super) letters: &'a [DeadLetter],
}

/// Enter `entry` in the register, unless a running task overlaps what `asked` takes: then
/// 409 naming that task. The task's record is to be made right after.
pub(super) async fn admit(
    js: &async_nats::jetstream::Context,
    bucket: &Bucket,
    entry: Registered,
    asked: &Asked<'_>,
) -> Result<(), Error> {
    for _ in 0..WRITES_TRIED {
        let (register, revision) = redrive::read_register(bucket).await.map_err(unavailable)?;
        let mut kept = Vec::with_capacity(register.tasks.len() + 1);
        for registered in register.tasks {
            let taking = match redrive::read(bucket, &registered.task)
                .await
                .map_err(unavailable)?
            {
                Some(versioned) if versioned.record.state == TaskState::Running => {
                    Taking::of_record(&versioned.record)
                }
                // Ended: its entry goes.
                Some(_) => continue,
                None if now_ms() - registered.made_at_ms < MAKING_WITHIN.as_millis() as i64 => {
                    Taking::of_entry(&registered)
                }
                None => continue,
            };
            if overlaps(js, asked, &taking).await? {
                return Err(Error::RedriveOverlaps {
                    task: registered.task,
                });
            }
            kept.push(registered);
        }
        kept.push(entry.clone());
        let register = Register { tasks: kept };
        if let Written::At(_) = redrive::write_register(bucket, &register, revision)
            .await
            .map_err(unavailable)?
        {
            return Ok(());
        }
        // Written meanwhile (another task admitted, or one pruned): read and compare again.
    }
    Err(Error::Unavailable(
        "too many redrive tasks asked for at once; try again".into(),
    ))
}

/// Take `task` out of the register (its record could not be made); a failure is left to
/// the next admission, which drops an entry whose record never came.
pub(super) async fn withdraw(bucket: &Bucket, task: &str) {
    for _ in 0..WRITES_TRIED {
        let Ok((mut register, revision)) = redrive::read_register(bucket).await else {
            return;
        };
        register.tasks.retain(|registered| registered.task != task);
        match redrive::write_register(bucket, &register, revision).await {
            Ok(Written::Conflict) => {}
            _ => return,
        }
    }
}

/// Whether the new task could take a dead letter the running one (`taking`) still takes.
async fn overlaps(
    js: &async_nats::jetstream::Context,
    asked: &Asked<'_>,
    taking: &Taking,
) -> Result<bool, Error> {
    if asked.letters.iter().any(|letter| taking.takes(letter)) {
        return Ok(true);
    }
    let Some(filter) = asked.filter else {
        return Ok(false);
    };
    if let Some(running) = &taking.filter {
        let ranges_meet = asked.ranges.iter().any(|asked| {
            taking.ranges.iter().any(|running| {
                running.store == asked.store
                    && running.next <= asked.last
                    && asked.next <= running.last
            })
        });
        if ranges_meet && filter.may_share(running) {
            return Ok(true);
        }
    }
    // The running task's ids (and removals) within the new filter's reach: read, compared.
    let within: Vec<(String, u64)> = taking
        .letters
        .iter()
        .filter(|(store, sequence)| {
            asked
                .ranges
                .iter()
                .any(|range| range.store == *store && (range.next..=range.last).contains(sequence))
        })
        .cloned()
        .collect();
    let mut reads = futures::stream::iter(within)
        .map(|(store, sequence)| {
            let js = js.clone();
            async move { dead_letter_reader::get(&js, &store, sequence).await }
        })
        .buffer_unordered(READS_AT_ONCE);
    while let Some(read) = reads.next().await {
        if read
            .map_err(unavailable)?
            .is_some_and(|letter| filter.matches(&letter))
        {
            return Ok(true);
        }
    }
    Ok(false)
}

fn unavailable(err: anyhow::Error) -> Error {
    Error::Unavailable(format!("{err:#}"))
}
