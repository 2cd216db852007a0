//! Redrive: dead letters sent back to where they came from (or to `to_subject`), by a task
//! that lives in NATS, not in a process. A task's record in the redrive bucket says what it
//! takes, how far it got and which replica runs it; every replica watches the bucket and
//! claims, by compare-and-set, a running task nobody holds (a new one, one released at a
//! shutdown, one whose holder stopped renewing its claim: killed). The holder works in
//! chunks: each message published (dedup id of task and dead letter, so a resumed chunk
//! stores nothing twice), its confirmation awaited, then removed from the dead-letter stream;
//! after each chunk the record is written, renewing the claim, which is where a cancel or a
//! lost claim is noticed. Nothing is half-done: a chunk in hand is finished first.
//!
//! May import: as the rest of `gateway`.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use futures::StreamExt as _;
use time::OffsetDateTime;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{error, info, warn};

use crate::error::Error;
use crate::nats::dead_letter_reader::{self, DeadLetter, Filter, FilterWords, Order};
use crate::nats::redrive::{
    self, Removal, StoreProgress, TaskRecord, TaskState, Versioned, Written,
};

use super::{DeadLetterId, Gateway};

/// How long a claim holds without being renewed: a killed holder's task is taken over
/// after this, well inside the target's 2-minute duplicate window.
const CLAIM_FOR: Duration = Duration::from_secs(10);
/// Messages per chunk at most; fewer at low rates, so that a chunk takes about this long.
const CHUNK_MAX: usize = 256;
const CHUNK_TIME: Duration = Duration::from_millis(250);
/// How often a replica without the redrive bucket looks for it.
const BUCKET_LOOKED_FOR_EVERY: Duration = Duration::from_secs(30);
/// How long a cancel waits for the task's holder to finish its chunk.
const CANCEL_WAIT: Duration = Duration::from_secs(10);
/// How long a publish may wait for its confirmation.
const CONFIRM_WITHIN: Duration = Duration::from_secs(5);
/// Removals in flight at once.
const REMOVALS_AT_ONCE: usize = 64;
/// A dry run shows this many of what it matched.
pub(crate) const DRY_RUN_SHOWS: usize = 10;
/// Default and most messages per second.
pub(crate) const DEFAULT_RATE: u32 = 1000;
pub(crate) const MAX_RATE: u32 = 10_000;
/// Chunks in a row failing for want of NATS or the dead-letter stream before the task fails.
const FAILED_CHUNKS_MAX: u32 = 60;

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

/// The redrive tasks this replica runs.
#[derive(Default)]
pub(super) struct Redrives {
    /// Wakes the watcher when this replica made the bucket.
    wake: Notify,
    running: std::sync::Mutex<HashSet<String>>,
    tracker: TaskTracker,
    stop: CancellationToken,
    /// The bucket once found: reading a task is then one direct get, never a stream-info
    /// request queued behind a running redrive's removals at the server's API.
    bucket: std::sync::Mutex<Option<async_nats::jetstream::kv::Store>>,
}

impl Redrives {
    /// Stop every task run here at its chunk's end, each released for another replica.
    pub(super) async fn stop(&self) {
        self.stop.cancel();
        self.tracker.close();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.tracker.wait()).await;
    }
}

fn now_ms() -> i64 {
    (OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000) as i64
}

fn now_text() -> String {
    let now = OffsetDateTime::now_utc();
    now.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|_| now.to_string())
}

fn unavailable(err: anyhow::Error) -> Error {
    Error::Unavailable(format!("{err:#}"))
}

impl Gateway {
    /// Start (or, dry, count) a redrive.
    pub(crate) async fn redrive(&self, request: RedriveRequest) -> Result<Redrive, Error> {
        // Bad input is refused before anything is asked of NATS.
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
        let (matched, first, progress) = match &chosen {
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
                (matched, first, progress)
            }
            Chosen::Ids(ids) => {
                let mut matched = 0;
                let mut first = Vec::new();
                for id in *ids {
                    if !stores.contains(&id.store) {
                        continue;
                    }
                    if let Some(letter) = dead_letter_reader::get(&js, &id.store, id.sequence)
                        .await
                        .map_err(unavailable)?
                    {
                        matched += 1;
                        if first.len() < DRY_RUN_SHOWS {
                            first.push(letter);
                        }
                    }
                }
                (matched, first, Vec::new())
            }
        };
        if request.dry_run {
            return Ok(Redrive::DryRun { matched, first });
        }
        let bucket = match self.known_bucket() {
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
        self.keep_bucket(&bucket);
        let task = format!("{:016x}", rand::random::<u64>());
        let (filter, ids) = match request.selection {
            Selection::Filter(words) => (words, None),
            Selection::Ids(ids) => (
                FilterWords::default(),
                Some(ids.iter().map(ToString::to_string).collect()),
            ),
        };
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
            started_at: now_text(),
            finished_at: None,
            last_error: None,
            owner: None,
            owner_until: None,
        };
        redrive::create(&bucket, &record)
            .await
            .map_err(unavailable)?;
        info!(%task, matched, "redrive task made");
        self.0.redrives.wake.notify_one();
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
        if let Some(bucket) = self.known_bucket() {
            return Ok(bucket);
        }
        let bucket = redrive::bucket(&js)
            .await
            .map_err(unavailable)?
            .ok_or_else(|| task_not_found(task))?;
        self.keep_bucket(&bucket);
        Ok(bucket)
    }

    fn known_bucket(&self) -> Option<async_nats::jetstream::kv::Store> {
        self.bucket_mut(|bucket| bucket.clone())
    }

    fn keep_bucket(&self, found: &async_nats::jetstream::kv::Store) {
        self.bucket_mut(|bucket| *bucket = Some(found.clone()));
    }

    fn bucket_mut<T>(
        &self,
        change: impl FnOnce(&mut Option<async_nats::jetstream::kv::Store>) -> T,
    ) -> T {
        let mut bucket = self
            .0
            .redrives
            .bucket
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        change(&mut bucket)
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
            let held = record.owner.is_some() && record.owner_until.unwrap_or(0) > now_ms();
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
                record.state = TaskState::Cancelled;
                record.finished_at = Some(now_text());
                record.owner = None;
                record.owner_until = None;
            }
            if let Written::At(_) = redrive::update(&bucket, &versioned.record, versioned.revision)
                .await
                .map_err(unavailable)?
            {
                info!(%task, "redrive task cancel asked for");
            }
        }
    }

    /// Watch the redrive bucket until `stop`, claiming and running the tasks nobody holds.
    pub(super) async fn keep_redriving(self, stop: CancellationToken) {
        let me = self.0.process.instance.to_string();
        loop {
            let bucket = match self.jetstream() {
                Ok(js) => match self.known_bucket() {
                    Some(bucket) => Some(bucket),
                    None => redrive::bucket(&js).await.ok().flatten(),
                },
                Err(_) => None,
            };
            let Some(bucket) = bucket else {
                // No bucket yet: look again now and then (an idle gateway's only cost here),
                // or at once when one is made here (its first task is run here then).
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = self.0.redrives.wake.notified() => {}
                    () = tokio::time::sleep(BUCKET_LOOKED_FOR_EVERY) => {}
                }
                continue;
            };
            // With history: the tasks made before this replica started are claimed too.
            let mut watch = match bucket.watch_with_history(">").await {
                Ok(watch) => watch,
                Err(err) => {
                    // Perhaps deleted: found again (or not) from scratch.
                    self.bucket_mut(|bucket| *bucket = None);
                    warn!(error = %err, "cannot watch the redrive bucket; trying again");
                    tokio::select! {
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                    continue;
                }
            };
            let mut known: HashMap<String, Versioned> = HashMap::new();
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    entry = watch.next() => match entry {
                        Some(Ok(entry)) => {
                            if entry.operation == async_nats::jetstream::kv::Operation::Put {
                                if let Ok(versioned) = redrive::decode(&entry) {
                                    known.insert(entry.key.clone(), versioned);
                                }
                            } else {
                                known.remove(&entry.key);
                            }
                            if let Some(versioned) = known.get(&entry.key) {
                                self.claim(&bucket, versioned.clone(), &me).await;
                            }
                        }
                        Some(Err(err)) => {
                            warn!(error = %err, "the redrive bucket's watch failed; watching again");
                            break;
                        }
                        None => break,
                    },
                    _ = tick.tick() => {
                        known.retain(|_, versioned| versioned.record.state == TaskState::Running);
                        for versioned in known.values() {
                            self.claim(&bucket, versioned.clone(), &me).await;
                        }
                    }
                }
            }
        }
    }

    /// Take `versioned` and run it here, when nobody holds it and it is running.
    async fn claim(
        &self,
        bucket: &async_nats::jetstream::kv::Store,
        mut versioned: Versioned,
        me: &str,
    ) {
        let record = &versioned.record;
        let held = record.owner.is_some() && record.owner_until.unwrap_or(0) > now_ms();
        if record.state != TaskState::Running || held || self.0.redrives.stop.is_cancelled() {
            return;
        }
        let task = record.task.clone();
        if !self.running_mut(|running| running.insert(task.clone())) {
            return;
        }
        versioned.record.owner = Some(me.to_owned());
        versioned.record.owner_until = Some(now_ms() + CLAIM_FOR.as_millis() as i64);
        match redrive::update(bucket, &versioned.record, versioned.revision).await {
            Ok(Written::At(revision)) => {
                versioned.revision = revision;
                info!(%task, "running the redrive task here");
                let gateway = self.clone();
                let bucket = bucket.clone();
                let me = me.to_owned();
                self.0.redrives.tracker.spawn(async move {
                    let run = Run {
                        gateway: gateway.clone(),
                        bucket,
                        me,
                        versioned,
                    };
                    run.run_to_the_end().await;
                    gateway.running_mut(|running| running.remove(&task));
                });
            }
            Ok(Written::Conflict) | Err(_) => {
                self.running_mut(|running| running.remove(&task));
            }
        }
    }

    fn running_mut<T>(&self, change: impl FnOnce(&mut HashSet<String>) -> T) -> T {
        let mut running = self
            .0
            .redrives
            .running
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        change(&mut running)
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

/// Publishes at most `rate` a second on average.
struct Pacer {
    rate: f64,
    started: Instant,
    sent: u64,
}

impl Pacer {
    fn new(rate: u32) -> Self {
        Self {
            rate: f64::from(rate.max(1)),
            started: Instant::now(),
            sent: 0,
        }
    }

    async fn wait(&mut self) {
        let due = self.started + Duration::from_secs_f64(self.sent as f64 / self.rate);
        // Within a millisecond is on time: the timer is no finer than that.
        if due > Instant::now() + Duration::from_millis(1) {
            tokio::time::sleep_until(due).await;
        }
        self.sent += 1;
    }
}

/// One task run here.
struct Run {
    gateway: Gateway,
    bucket: async_nats::jetstream::kv::Store,
    me: String,
    versioned: Versioned,
}

/// A chunk's dead letters, and where the task stands once it is done.
struct Chunk {
    letters: Vec<DeadLetter>,
    /// What the progress becomes when every letter of it was handled.
    after: Progress,
}

#[derive(Debug, Clone, Copy)]
enum Progress {
    /// In filter mode: this store's next sequence.
    Store { index: usize, next: u64 },
    /// In id mode: ids done.
    Ids(usize),
    /// Nothing left.
    Done,
}

/// Whose the task is after a write of its record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Held {
    /// Still this replica's to run.
    Here,
    /// Claimed by another replica (this one's claim lapsed), or ended there.
    Elsewhere,
}

impl Run {
    fn task(&self) -> &str {
        &self.versioned.record.task
    }

    async fn run_to_the_end(mut self) {
        let chunk_size = ((f64::from(self.versioned.record.rate) * CHUNK_TIME.as_secs_f64())
            as usize)
            .clamp(1, CHUNK_MAX);
        let filter = match Filter::from_words(&self.versioned.record.filter) {
            Ok(filter) => filter,
            Err(bad) => {
                self.versioned.record.last_error = Some(bad.detail);
                self.finish(TaskState::Failed).await;
                return;
            }
        };
        let mut pacer = Pacer::new(self.versioned.record.rate);
        let mut failed_chunks = 0;
        let stop = self.gateway.0.redrives.stop.clone();
        loop {
            // Removals left from the chunk before (here, or by a holder that was killed) come
            // first: a chunk is finished before anything else happens, a stop or a cancel too.
            let removing = !self.versioned.record.removing.is_empty();
            if !removing && self.versioned.record.cancel_requested {
                self.finish(TaskState::Cancelled).await;
                return;
            }
            if !removing && stop.is_cancelled() {
                self.release().await;
                return;
            }
            let outcome = match self.gateway.jetstream() {
                Ok(js) if removing => self.remove_pending(&js).await.map(|()| true),
                Ok(js) => self.one_chunk(&js, &filter, chunk_size, &mut pacer).await,
                Err(err) => Err(anyhow::anyhow!("{err}")),
            };
            match outcome {
                Ok(true) => failed_chunks = 0,
                Ok(false) => {
                    self.finish(TaskState::Done).await;
                    return;
                }
                Err(err) => {
                    failed_chunks += 1;
                    warn!(task = %self.task(), error = %format!("{err:#}"), "a redrive chunk failed; trying again");
                    self.versioned.record.last_error = Some(format!("{err:#}"));
                    if failed_chunks >= FAILED_CHUNKS_MAX {
                        error!(task = %self.task(), error = %format!("{err:#}"), "the redrive task cannot go on");
                        self.finish(TaskState::Failed).await;
                        return;
                    }
                    tokio::select! {
                        () = stop.cancelled() => {}
                        () = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                }
            }
            if self.checkpoint().await == Held::Elsewhere {
                return;
            }
        }
    }

    /// Publish the next chunk and mark what was stored for removal: `false` when nothing
    /// was left.
    async fn one_chunk(
        &mut self,
        js: &async_nats::jetstream::Context,
        filter: &Filter,
        size: usize,
        pacer: &mut Pacer,
    ) -> anyhow::Result<bool> {
        let chunk = self.next_chunk(js, filter, size).await?;
        if let Progress::Done = chunk.after
            && chunk.letters.is_empty()
        {
            return Ok(false);
        }
        let task = self.task().to_owned();
        let to_subject = self.versioned.record.to_subject.clone();
        // Publish the chunk, paced, without waiting for each confirmation in turn.
        let mut pending = Vec::with_capacity(chunk.letters.len());
        for letter in &chunk.letters {
            pacer.wait().await;
            let subject = to_subject.as_deref().unwrap_or(&letter.subject);
            let sent = if subject.is_empty() {
                Err(anyhow::anyhow!(
                    "the dead letter names no subject to send it back to"
                ))
            } else {
                redrive::publish(js, &task, letter, subject).await
            };
            pending.push(sent);
        }
        let mut first_unsent = None;
        for (position, sent) in pending.into_iter().enumerate() {
            let letter = &chunk.letters[position];
            let stored = match sent {
                Ok(ack) => tokio::time::timeout(CONFIRM_WITHIN, ack)
                    .await
                    .map_err(|_| anyhow::anyhow!("timed out waiting for the confirmation"))
                    .and_then(|ack| ack.map_err(|err| anyhow::anyhow!("not stored: {err}"))),
                Err(err) => Err(err),
            };
            match stored {
                // Stored now, or before by this task (a duplicate of its dedup id): either
                // way this task's publish of it, counted once.
                Ok(_) => {
                    self.versioned.record.published += 1;
                    self.versioned.record.removing.push(Removal {
                        store: letter.store.clone(),
                        sequence: letter.sequence,
                    });
                }
                Err(_) if !self.gateway.0.process.connection.is_connected() => {
                    // Not this message's fault: it is tried again with NATS back.
                    first_unsent.get_or_insert(position);
                }
                Err(err) => {
                    if first_unsent.is_none() {
                        self.versioned.record.failed += 1;
                        self.versioned.record.last_error =
                            Some(format!("dead letter {}: {err:#}", DeadLetterId::of(letter)));
                    }
                }
            }
        }
        match first_unsent {
            // Resume at the first one not sent: those after it that were sent are removed
            // (so not found again) or, if their removal failed, stored once by their dedup id.
            Some(position) => {
                self.advance_to_letter(&chunk.letters[position], chunk.after);
                anyhow::bail!("NATS went away in the middle of a chunk");
            }
            None => self.advance(chunk.after),
        }
        Ok(true)
    }

    /// Remove the dead letters whose publish was confirmed. Those whose removal failed stay
    /// marked, for the next try.
    async fn remove_pending(&mut self, js: &async_nats::jetstream::Context) -> anyhow::Result<()> {
        let pending = std::mem::take(&mut self.versioned.record.removing);
        let removals = futures::stream::iter(pending.into_iter().map(|removal| async move {
            let removed = redrive::remove(js, &removal.store, removal.sequence).await;
            (removal, removed)
        }))
        .buffer_unordered(REMOVALS_AT_ONCE)
        .collect::<Vec<_>>()
        .await;
        let mut failure = None;
        for (removal, removed) in removals {
            match removed {
                Ok(()) => self.versioned.record.removed += 1,
                Err(err) => {
                    self.versioned.record.removing.push(removal);
                    failure = Some(err);
                }
            }
        }
        failure.map_or(Ok(()), Err)
    }

    /// The dead letters to handle next and where that leaves the task.
    async fn next_chunk(
        &mut self,
        js: &async_nats::jetstream::Context,
        filter: &Filter,
        size: usize,
    ) -> anyhow::Result<Chunk> {
        let record = &self.versioned.record;
        if let Some(ids) = &record.ids {
            let take: Vec<&String> = ids.iter().skip(record.ids_done).take(size).collect();
            if take.is_empty() {
                return Ok(Chunk {
                    letters: Vec::new(),
                    after: Progress::Done,
                });
            }
            let stores = self
                .gateway
                .dead_letter_stores()
                .await
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            let mut letters = Vec::new();
            for id in &take {
                let Some(id) = DeadLetterId::parse(id) else {
                    continue;
                };
                if !stores.contains(&id.store) {
                    continue;
                }
                if let Some(letter) = dead_letter_reader::get(js, &id.store, id.sequence).await? {
                    letters.push(letter);
                }
            }
            return Ok(Chunk {
                letters,
                after: Progress::Ids(record.ids_done + take.len()),
            });
        }
        for (index, store) in record.stores.iter().enumerate() {
            if store.next > store.last {
                continue;
            }
            let mut budget = dead_letter_reader::SCAN_BUDGET;
            let page = dead_letter_reader::page(
                js,
                &store.store,
                Order::OldestFirst,
                Some(store.next),
                filter,
                size,
                &mut budget,
            )
            .await?;
            let letters: Vec<DeadLetter> = page
                .letters
                .into_iter()
                .filter(|letter| letter.sequence <= store.last)
                .collect();
            let next = match (letters.last(), page.next) {
                (Some(last), _) => last.sequence + 1,
                (None, Some(next)) => next,
                (None, None) => store.last + 1,
            };
            return Ok(Chunk {
                letters,
                after: Progress::Store {
                    index,
                    next: next.max(store.next),
                },
            });
        }
        Ok(Chunk {
            letters: Vec::new(),
            after: Progress::Done,
        })
    }

    fn advance(&mut self, to: Progress) {
        let record = &mut self.versioned.record;
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
    fn advance_to_letter(&mut self, letter: &DeadLetter, after: Progress) {
        let at = match after {
            Progress::Store { index, .. } => Progress::Store {
                index,
                next: letter.sequence,
            },
            // The ids before this one's id are done.
            Progress::Ids(_) => {
                let record = &self.versioned.record;
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
        self.advance(at);
    }

    /// Renew the claim and write the progress.
    async fn checkpoint(&mut self) -> Held {
        self.versioned.record.owner_until = Some(now_ms() + CLAIM_FOR.as_millis() as i64);
        self.write().await
    }

    /// Write the record as it is here, and say whose the task is now. A cancel asked for
    /// meanwhile is taken in (the task ends at the next chunk's start).
    async fn write(&mut self) -> Held {
        loop {
            match redrive::update(
                &self.bucket,
                &self.versioned.record,
                self.versioned.revision,
            )
            .await
            {
                Ok(Written::At(revision)) => {
                    self.versioned.revision = revision;
                    return Held::Here;
                }
                Ok(Written::Conflict) => {}
                Err(err) => {
                    // NATS away: go on; the claim is renewed at the next chunk, or lost.
                    warn!(task = %self.task(), error = %format!("{err:#}"), "could not write the redrive task's progress");
                    return Held::Here;
                }
            }
            let Ok(Some(now)) = redrive::read(&self.bucket, self.task()).await else {
                return Held::Elsewhere;
            };
            if now.record.owner.as_deref() != Some(self.me.as_str())
                || now.record.state != TaskState::Running
            {
                info!(task = %self.task(), "the redrive task is run or ended elsewhere now");
                return Held::Elsewhere;
            }
            if now.record.cancel_requested && !self.versioned.record.cancel_requested {
                info!(task = %self.task(), "the redrive task's cancel was asked for; it ends once the chunk in hand is done");
                self.versioned.record.cancel_requested = true;
            }
            self.versioned.revision = now.revision;
        }
    }

    async fn finish(&mut self, state: TaskState) {
        let record = &mut self.versioned.record;
        record.state = state;
        record.finished_at = Some(now_text());
        record.owner = None;
        record.owner_until = None;
        info!(task = %record.task, ?state, published = record.published, removed = record.removed, failed = record.failed, "redrive task ended");
        self.write().await;
    }

    /// Let go of the task (at a shutdown) so another replica takes it at once.
    async fn release(&mut self) {
        self.versioned.record.owner = None;
        self.versioned.record.owner_until = None;
        if self.write().await == Held::Here {
            info!(task = %self.task(), "redrive task let go at shutdown");
        }
    }
}
