//! One redrive task run at this replica, against NATS: its chunks read from the dead-letter
//! stream, published (paced, each confirmation awaited), removed once confirmed, and its
//! record written back after each chunk (which renews the claim, and is where a cancel or a
//! lost claim is noticed). What each step does to the record is [`super::task`]'s.
//!
//! May import: as the rest of `gateway`.

use std::time::Duration;

use futures::StreamExt as _;
use tracing::{error, info, warn};

use super::task::{self, Chunk, Held, Pacer, Progress, Step};
use crate::gateway::{DeadLetterId, Gateway};
use crate::nats::dead_letter_reader::{self, DeadLetter, Filter, Order};
use crate::nats::redrive::{self, TaskState, Versioned, Written};

/// How long a publish may wait for its confirmation.
const CONFIRM_WITHIN: Duration = Duration::from_secs(5);
/// Removals in flight at once.
const REMOVALS_AT_ONCE: usize = 64;

/// One task run here.
pub(super) struct Run {
    pub(super) gateway: Gateway,
    pub(super) bucket: async_nats::jetstream::kv::Store,
    pub(super) me: String,
    pub(super) versioned: Versioned,
}

impl Run {
    fn task(&self) -> &str {
        &self.versioned.record.task
    }

    pub(super) async fn run_to_the_end(mut self) {
        let chunk_size = task::chunk_size(self.versioned.record.rate);
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
            let outcome = match task::next_step(&self.versioned.record, stop.is_cancelled()) {
                Step::Cancel => {
                    self.finish(TaskState::Cancelled).await;
                    return;
                }
                Step::Release => {
                    self.release().await;
                    return;
                }
                step => match self.gateway.jetstream() {
                    Ok(js) if step == Step::Remove => self.remove_pending(&js).await.map(|()| true),
                    Ok(js) => self.one_chunk(&js, &filter, chunk_size, &mut pacer).await,
                    Err(err) => Err(anyhow::anyhow!("{err}")),
                },
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
                    if failed_chunks >= task::FAILED_CHUNKS_MAX {
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
        if chunk.is_last() {
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
                Ok(_) => task::published(&mut self.versioned.record, letter),
                Err(_) if !self.gateway.0.process.connection.is_connected() => {
                    // Not this message's fault: it is tried again with NATS back.
                    first_unsent.get_or_insert(position);
                }
                Err(err) => {
                    if first_unsent.is_none() {
                        task::refused(&mut self.versioned.record, letter, &err);
                    }
                }
            }
        }
        match first_unsent {
            // Resume at the first one not sent: those after it that were sent are removed
            // (so not found again) or, if their removal failed, stored once by their dedup id.
            Some(position) => {
                task::advance_to_letter(
                    &mut self.versioned.record,
                    &chunk.letters[position],
                    chunk.after,
                );
                anyhow::bail!("NATS went away in the middle of a chunk");
            }
            None => task::advance(&mut self.versioned.record, chunk.after),
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

    /// Renew the claim and write the progress.
    async fn checkpoint(&mut self) -> Held {
        task::renew(&mut self.versioned.record);
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
        task::finish(record, state);
        info!(task = %record.task, ?state, published = record.published, removed = record.removed, failed = record.failed, "redrive task ended");
        self.write().await;
    }

    /// Let go of the task (at a shutdown) so another replica takes it at once.
    async fn release(&mut self) {
        task::release(&mut self.versioned.record);
        if self.write().await == Held::Here {
            info!(task = %self.task(), "redrive task let go at shutdown");
        }
    }
}
