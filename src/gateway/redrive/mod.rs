//! Redrive: dead letters sent back to where they came from (or to `to_subject`), by a task
//! that lives in NATS, not in a process. A task's record in the redrive bucket says what it
//! takes, how far it got and which replica runs it. This module starts (or, dry, counts) a
//! task, reads it and cancels it; [`admission`] refuses a task that would take a dead letter
//! a running one takes; [`claims`] decides which replica runs which task, [`run`]
//! runs one against NATS in chunks (each message published with a dedup id, its
//! confirmation awaited, then removed from the dead-letter stream), and [`task`] is the
//! state machine of its record. Nothing is half-done: a chunk in hand is finished first.
//!
//! May import: as the rest of `gateway`.

mod admission;
mod claims;
mod run;
mod task;

pub(super) use claims::Redrives;

use std::time::Duration;

use tokio::time::Instant;
use tracing::info;

use crate::error::Error;
use crate::nats::dead_letter_reader::{self, DeadLetter, Filter, FilterWords, Order};
use crate::nats::redrive::{self, Registered, StoreProgress, TaskRecord, TaskState, Written};

use admission::Asked;

use super::{DeadLetterId, Gateway};

/// How long a cancel waits for the task's holder to finish its chunk.
const CANCEL_WAIT: Duration = Duration::from_secs(10);
/// A dry run shows this many of what it matched.
pub(crate) const DRY_RUN_SHOWS: usize = 10;
/// Default and most messages per second.
pub(crate) const DEFAULT_RATE: u32 = 1000;
pub(crate) const MAX_RATE: u32 = 10_000;

/// What a redrive takes.
#[derive(Debug, Clone)]
pub(crate) enum Selection {
    Filter(FilterWords),
    Ids(Vec<DeadLetterId>),
}

/// A redrive asked for.
#[derive(Debug, Clone)]
pub(crate) struct RedriveRequest {
    pub(crate) selection: Selection,
    pub(crate) to_subject: Option<String>,
    pub(crate) rate: u32,
    pub(crate) dry_run: bool,
}

/// A selection, checked.
enum Chosen<'a> {
    Filter(Filter),
    Ids(&'a [DeadLetterId]),
}

/// What a redrive request came to.
#[derive(Debug)]
pub(crate) enum Redrive {
    /// Nothing sent: what would be, and the first of it.
    DryRun {
        matched: u64,
        first: Vec<DeadLetter>,
    },
    Started {
        task: String,
        matched: u64,
    },
}

/// A 422 when `subject` is the gateway's own plumbing: what replicas exchange under
/// `--internal-prefix` (a redriven message there would be stored by the fleet's stream and
/// read as a replica's message), or a request's reply inbox.
fn refuse_internal(subject: &str, internal_prefix: &str) -> Result<(), Error> {
    let under = |prefix: &str| {
        subject == prefix
            || subject
                .strip_prefix(prefix)
                .is_some_and(|rest| rest.starts_with('.'))
    };
    if under(internal_prefix) {
        return Err(Error::invalid(
            "to_subject",
            format!(
                "to_subject: must not be under the gateway's internal prefix {internal_prefix} (what its replicas exchange)"
            ),
        ));
    }
    if under("_INBOX") {
        return Err(Error::invalid(
            "to_subject",
            "to_subject: must not be a reply inbox (under _INBOX)",
        ));
    }
    Ok(())
}

fn unavailable(err: anyhow::Error) -> Error {
    Error::Unavailable(format!("{err:#}"))
}

impl Gateway {
    /// Start (or, dry, count) a redrive.
    pub(crate) async fn redrive(&self, mut request: RedriveRequest) -> Result<Redrive, Error> {
        // Bad input is refused before anything is asked of NATS.
        if let Some(subject) = &request.to_subject {
            refuse_internal(subject, &self.0.process.config.internal_prefix)?;
        }
        // An id named twice is one dead letter, taken once (as a batch settle does).
        if let Selection::Ids(ids) = &mut request.selection {
            let mut seen = std::collections::HashSet::new();
            ids.retain(|id| seen.insert(id.to_string()));
        }
        let chosen = match &request.selection {
            Selection::Filter(words) => Chosen::Filter(
                Filter::from_words(words).map_err(|bad| Error::invalid(bad.field, bad.detail))?,
            ),
            Selection::Ids(ids) => Chosen::Ids(ids),
        };
        let js = self.jetstream()?;
        let stores = self.dead_letter_stores().await?;
        // The bucket gets as many replicas as the dead-letter streams have.
        let mut replicas = None;
        let (matched, first, progress, letters) = match &chosen {
            Chosen::Filter(filter) => {
                let mut matched = 0;
                let mut first = Vec::new();
                let mut progress = Vec::new();
                for store in &stores {
                    let (last, store_replicas) = dead_letter_reader::extent(&js, store)
                        .await
                        .map_err(unavailable)?;
                    replicas = replicas.max(Some(store_replicas));
                    matched += dead_letter_reader::count(&js, store, filter, last)
                        .await
                        .map_err(unavailable)?;
                    if first.len() < DRY_RUN_SHOWS {
                        let mut budget = dead_letter_reader::SCAN_BUDGET;
                        let page = dead_letter_reader::page(
                            &js,
                            store,
                            Order::OldestFirst,
                            None,
                            filter,
                            DRY_RUN_SHOWS - first.len(),
                            &mut budget,
                        )
                        .await
                        .map_err(unavailable)?;
                        first.extend(page.letters.into_iter().filter(|l| l.sequence <= last));
                    }
                    progress.push(StoreProgress {
                        store: store.clone(),
                        next: 0,
                        last,
                    });
                }
                (matched, first, progress, Vec::new())
            }
            Chosen::Ids(ids) => {
                let mut letters = Vec::new();
                for id in *ids {
                    if !stores.contains(&id.store) {
                        continue;
                    }
                    if let Some(letter) = dead_letter_reader::get(&js, &id.store, id.sequence)
                        .await
                        .map_err(unavailable)?
                    {
                        letters.push(letter);
                    }
                }
                let first = letters.iter().take(DRY_RUN_SHOWS).cloned().collect();
                (letters.len() as u64, first, Vec::new(), letters)
            }
        };
        if request.dry_run {
            return Ok(Redrive::DryRun { matched, first });
        }
        let bucket = match self.0.redrives.known_bucket() {
            Some(bucket) => bucket,
            None => {
                let replicas = match (replicas, stores.first()) {
                    (Some(replicas), _) => replicas,
                    (None, Some(store)) => {
                        dead_letter_reader::extent(&js, store)
                            .await
                            .map_err(unavailable)?
                            .1
                    }
                    (None, None) => 1,
                };
                redrive::bucket_or_make(&js, replicas)
                    .await
                    .map_err(unavailable)?
            }
        };
        self.0.redrives.keep_bucket(&bucket);
        let task = format!("{:016x}", rand::random::<u64>());
        let (filter, ids) = match &request.selection {
            Selection::Filter(words) => (words.clone(), None),
            Selection::Ids(ids) => (
                FilterWords::default(),
                Some(ids.iter().map(ToString::to_string).collect::<Vec<_>>()),
            ),
        };
        // No dead letter is taken by two running tasks: refused (409) when one overlaps.
        let entry = Registered {
            task: task.clone(),
            filter: filter.clone(),
            ids: ids.clone(),
            stores: progress.clone(),
            made_at_ms: task::now_ms(),
        };
        let asked = Asked {
            filter: match &chosen {
                Chosen::Filter(filter) => Some(filter),
                Chosen::Ids(_) => None,
            },
            ranges: &progress,
            letters: &letters,
        };
        admission::admit(&js, &bucket, entry, &asked).await?;
        let record = TaskRecord {
            task: task.clone(),
            state: TaskState::Running,
            filter,
            ids,
            ids_done: 0,
            stores: progress,
            removing: Vec::new(),
            cancel_requested: false,
            to_subject: request.to_subject,
            rate: request.rate,
            matched,
            published: 0,
            removed: 0,
            failed: 0,
            started_at: task::now_text(),
            finished_at: None,
            last_error: None,
            owner: None,
            owner_until: None,
        };
        if let Err(err) = redrive::create(&bucket, &record).await {
            admission::withdraw(&bucket, &task).await;
            return Err(unavailable(err));
        }
        info!(%task, matched, "redrive task made");
        self.0.redrives.made_one();
        Ok(Redrive::Started { task, matched })
    }

    /// A redrive task as it stands.
    pub(crate) async fn redrive_task(&self, task: &str) -> Result<TaskRecord, Error> {
        let bucket = self.bucket_of(task).await?;
        redrive::read(&bucket, task)
            .await
            .map_err(unavailable)?
            .map(|versioned| versioned.record)
            .ok_or_else(|| task_not_found(task))
    }

    /// The bucket that would hold `task`; 404 when `task` cannot be a task's id or there is
    /// no bucket (no task was ever made).
    async fn bucket_of(&self, task: &str) -> Result<async_nats::jetstream::kv::Store, Error> {
        let js = self.jetstream()?;
        if !is_task_id(task) {
            return Err(task_not_found(task));
        }
        if let Some(bucket) = self.0.redrives.known_bucket() {
            return Ok(bucket);
        }
        let bucket = redrive::bucket(&js)
            .await
            .map_err(unavailable)?
            .ok_or_else(|| task_not_found(task))?;
        self.0.redrives.keep_bucket(&bucket);
        Ok(bucket)
    }

    /// Cancel a running task: its holder finishes the chunk in hand (published and removed),
    /// ends the task as cancelled and is waited for, so the answer's counts are final. A task
    /// nobody holds (its holder killed) is ended at once; a finished one is answered as it is.
    pub(crate) async fn cancel_redrive(&self, task: &str) -> Result<TaskRecord, Error> {
        let bucket = self.bucket_of(task).await?;
        let deadline = Instant::now() + CANCEL_WAIT;
        loop {
            let Some(mut versioned) = redrive::read(&bucket, task).await.map_err(unavailable)?
            else {
                return Err(task_not_found(task));
            };
            let record = &mut versioned.record;
            if record.state != TaskState::Running {
                return Ok(versioned.record);
            }
            let held = task::is_held(record);
            if held && record.cancel_requested && Instant::now() < deadline {
                // Asked; its holder ends it at its chunk's end.
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            if held && !record.cancel_requested {
                record.cancel_requested = true;
            } else {
                // Nobody runs it (or its holder did not answer in time): ended here.
                record.cancel_requested = true;
                task::finish(record, TaskState::Cancelled);
            }
            if let Written::At(_) = redrive::update(&bucket, &versioned.record, versioned.revision)
                .await
                .map_err(unavailable)?
            {
                info!(%task, "redrive task cancel asked for");
            }
        }
    }
}

fn task_not_found(task: &str) -> Error {
    Error::NotFound(format!("no redrive task {task:?}"))
}

/// Whether `task` could be a task's id (what a bucket key may be).
fn is_task_id(task: &str) -> bool {
    !task.is_empty()
        && task.len() <= 64
        && task
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_redrive_into_the_gateways_plumbing_is_refused() {
        for subject in [
            "_RUSTSTREAM",
            "_RUSTSTREAM.fleet.replica.x",
            "_INBOX",
            "_INBOX.abc.1",
        ] {
            let refused = refuse_internal(subject, "_RUSTSTREAM").expect_err(subject);
            assert!(
                matches!(&refused, Error::Invalid { field: Some(field), .. } if field == "to_subject"),
                "{subject}: {refused:?}"
            );
        }
        for subject in ["orders.again", "_RUSTSTREAMING.x", "_INBOXES.x", "x._INBOX"] {
            assert!(refuse_internal(subject, "_RUSTSTREAM").is_ok(), "{subject}");
        }
        assert!(refuse_internal("ops.gw.fleet", "ops.gw").is_err());
    }
}
