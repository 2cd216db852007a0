//! Redrive at the server: the KV bucket that holds every redrive task (so a task outlives
//! the process that started it and is run by one replica at a time, claimed by a
//! compare-and-set on its record) and the register of the running ones (what each takes,
//! so that no two take the same dead letter), and the two steps of sending one dead letter
//! back: publishing it, with a dedup id of its dead-letter stream and sequence, and removing
//! it from the dead-letter stream once that publish was confirmed.
//!
//! May import: `domain`. Nothing of the gateway above the NATS boundary.

use std::time::Duration;

use anyhow::{Context as _, bail};
use async_nats::jetstream::{self, kv};
use async_nats::{HeaderMap, HeaderValue};
use serde::{Deserialize, Serialize};

use super::API_TIMEOUT;
use super::dead_letter_reader::{DeadLetter, FilterWords};

/// The bucket of redrive tasks, one key per task.
pub(crate) const BUCKET: &str = "ruststream_redrive";
/// How long a finished task's record is kept.
const KEPT_FOR: Duration = Duration::from_secs(7 * 24 * 3600);
/// Added to every message a redrive publishes: the dead-letter sequences it was sent back
/// from (one value per redrive it went through), and the task that sent it.
pub(crate) const REDRIVEN_FROM: &str = "Ruststream-Redriven-From";
pub(crate) const REDRIVE_TASK: &str = "Ruststream-Redrive-Task";

/// Where a task stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum TaskState {
    Running,
    Done,
    Cancelled,
    Failed,
}

/// How far a task got in one dead-letter stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct StoreProgress {
    pub(crate) store: String,
    /// The next sequence to look at.
    pub(crate) next: u64,
    /// The last sequence the task takes: what was there when it was made (what is
    /// dead-lettered later, its own messages failing again among them, is not its business).
    pub(crate) last: u64,
}

/// A redrive task as its record in the bucket holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct TaskRecord {
    pub(crate) task: String,
    pub(crate) state: TaskState,
    /// What it takes: a filter, in the words it was given ...
    #[serde(default)]
    pub(crate) filter: FilterWords,
    /// ... or dead-letter ids, with how many of them are done.
    #[serde(default)]
    pub(crate) ids: Option<Vec<String>>,
    #[serde(default)]
    pub(crate) ids_done: usize,
    pub(crate) stores: Vec<StoreProgress>,
    /// Dead letters whose publish was confirmed and that are still to be removed (a holder
    /// killed between the two leaves them here for the next).
    #[serde(default)]
    pub(crate) removing: Vec<Removal>,
    pub(crate) to_subject: Option<String>,
    /// Messages per second.
    pub(crate) rate: u32,
    pub(crate) matched: u64,
    pub(crate) published: u64,
    pub(crate) removed: u64,
    pub(crate) failed: u64,
    pub(crate) started_at: String,
    pub(crate) finished_at: Option<String>,
    pub(crate) last_error: Option<String>,
    /// A cancel was asked for: the holder finishes the chunk in hand, then ends the task as
    /// cancelled (so a cancelled task's counts are final).
    #[serde(default)]
    pub(crate) cancel_requested: bool,
    /// The replica running it, and until when its claim holds without being renewed.
    pub(crate) owner: Option<String>,
    /// Unix milliseconds.
    pub(crate) owner_until: Option<i64>,
}

/// A dead letter to remove: its stream and sequence.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Removal {
    pub(crate) store: String,
    pub(crate) sequence: u64,
}

/// A task record and the bucket revision it was read at (what a compare-and-set names).
#[derive(Debug, Clone)]
pub(crate) struct Versioned {
    pub(crate) record: TaskRecord,
    pub(crate) revision: u64,
}

/// The bucket, when it exists.
pub(crate) async fn bucket(js: &jetstream::Context) -> anyhow::Result<Option<kv::Store>> {
    let stream = format!("KV_{BUCKET}");
    match tokio::time::timeout(API_TIMEOUT, js.get_stream(&stream)).await {
        Err(_) => bail!("timed out looking for the redrive bucket"),
        Ok(Err(err)) if super::is_stream_not_found(&err) => return Ok(None),
        Ok(Err(err)) => {
            return Err(anyhow::Error::new(err).context("looking for the redrive bucket"));
        }
        Ok(Ok(_)) => {}
    }
    // The stream is there: a failure to open it as a bucket is a real one.
    let store = tokio::time::timeout(API_TIMEOUT, js.get_key_value(BUCKET))
        .await
        .context("timed out opening the redrive bucket")?
        .context("opening the redrive bucket")?;
    Ok(Some(store))
}

/// The bucket, made when there is none yet (with as many replicas as `replicas`).
pub(crate) async fn bucket_or_make(
    js: &jetstream::Context,
    replicas: usize,
) -> anyhow::Result<kv::Store> {
    if let Some(store) = bucket(js).await? {
        return Ok(store);
    }
    let config = kv::Config {
        bucket: BUCKET.to_owned(),
        description: "ruststream-nats redrive tasks".to_owned(),
        history: 1,
        max_age: KEPT_FOR,
        num_replicas: replicas.max(1),
        ..Default::default()
    };
    // Two replicas making it at once make the same bucket: the server answers both.
    tokio::time::timeout(API_TIMEOUT, js.create_key_value(config))
        .await
        .context("timed out making the redrive bucket")?
        .context("making the redrive bucket")
}

/// The task `task`, if there is one.
pub(crate) async fn read(store: &kv::Store, task: &str) -> anyhow::Result<Option<Versioned>> {
    let entry = tokio::time::timeout(API_TIMEOUT, store.entry(task))
        .await
        .context("timed out reading the task")?
        .context("reading the task")?;
    match entry {
        Some(entry) if entry.operation == kv::Operation::Put => decode(&entry).map(Some),
        _ => Ok(None),
    }
}

/// The record an entry holds.
pub(crate) fn decode(entry: &kv::Entry) -> anyhow::Result<Versioned> {
    let record = serde_json::from_slice(&entry.value).context("an unreadable task record")?;
    Ok(Versioned {
        record,
        revision: entry.revision,
    })
}

/// Write a new task; fails when one of its id exists.
pub(crate) async fn create(store: &kv::Store, record: &TaskRecord) -> anyhow::Result<u64> {
    let value = serde_json::to_vec(record).context("encoding the task")?;
    tokio::time::timeout(API_TIMEOUT, store.create(&record.task, value.into()))
        .await
        .context("timed out writing the task")?
        .context("writing the task")
}

/// What a compare-and-set came to.
#[derive(Debug)]
pub(crate) enum Written {
    /// Written: the new revision.
    At(u64),
    /// The record changed since `revision` (another replica, a cancel).
    Conflict,
}

/// Write `record` if the task is still at `revision`.
pub(crate) async fn update(
    store: &kv::Store,
    record: &TaskRecord,
    revision: u64,
) -> anyhow::Result<Written> {
    let value = serde_json::to_vec(record).context("encoding the task")?;
    match tokio::time::timeout(
        API_TIMEOUT,
        store.update(&record.task, value.into(), revision),
    )
    .await
    .context("timed out writing the task")?
    {
        Ok(revision) => Ok(Written::At(revision)),
        Err(err) if err.kind() == kv::UpdateErrorKind::WrongLastRevision => Ok(Written::Conflict),
        Err(err) => Err(anyhow::Error::new(err).context("writing the task")),
    }
}

/// The key of the register of running tasks: no task's id (those hold no dot).
const REGISTER_KEY: &str = "register.running";

/// The tasks that may be running, each with what it takes: written by compare-and-set
/// before a task's record is made, so of two tasks asked for at once the second sees the
/// first. Ended tasks are left out when it is next written.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Register {
    pub(crate) tasks: Vec<Registered>,
}

/// A task in the register: what it takes, as its record will say when it is made.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Registered {
    pub(crate) task: String,
    #[serde(default)]
    pub(crate) filter: FilterWords,
    #[serde(default)]
    pub(crate) ids: Option<Vec<String>>,
    #[serde(default)]
    pub(crate) stores: Vec<StoreProgress>,
    /// Unix milliseconds: an entry whose record never came is dropped after a while.
    pub(crate) made_at_ms: i64,
}

/// The register and its revision (`None`: not written yet).
pub(crate) async fn read_register(store: &kv::Store) -> anyhow::Result<(Register, Option<u64>)> {
    let entry = tokio::time::timeout(API_TIMEOUT, store.entry(REGISTER_KEY))
        .await
        .context("timed out reading the register of redrive tasks")?
        .context("reading the register of redrive tasks")?;
    match entry {
        Some(entry) if entry.operation == kv::Operation::Put => {
            let register = serde_json::from_slice(&entry.value)
                .context("an unreadable register of redrive tasks")?;
            Ok((register, Some(entry.revision)))
        }
        _ => Ok((Register::default(), None)),
    }
}

/// Write the register if it is still at `revision` (`None`: if there is none).
pub(crate) async fn write_register(
    store: &kv::Store,
    register: &Register,
    revision: Option<u64>,
) -> anyhow::Result<Written> {
    let value: bytes::Bytes = serde_json::to_vec(register)
        .context("encoding the register")?
        .into();
    let context = "writing the register of redrive tasks";
    let timed_out = "timed out writing the register of redrive tasks";
    match revision {
        Some(revision) => {
            match tokio::time::timeout(API_TIMEOUT, store.update(REGISTER_KEY, value, revision))
                .await
                .context(timed_out)?
            {
                Ok(revision) => Ok(Written::At(revision)),
                Err(err) if err.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                    Ok(Written::Conflict)
                }
                Err(err) => Err(anyhow::Error::new(err).context(context)),
            }
        }
        None => match tokio::time::timeout(API_TIMEOUT, store.create(REGISTER_KEY, value))
            .await
            .context(timed_out)?
        {
            Ok(revision) => Ok(Written::At(revision)),
            Err(err) if err.kind() == kv::CreateErrorKind::AlreadyExists => Ok(Written::Conflict),
            Err(err) => Err(anyhow::Error::new(err).context(context)),
        },
    }
}

/// The id the target stream deduplicates a redriven message on: the dead letter's own (its
/// dead-letter stream and sequence), whatever task sends it, so a task resumed after a
/// crash, or two tasks that took the same dead letter, store it once (within that stream's
/// duplicate window, 2 minutes by default).
pub(crate) fn dedup_id(letter: &DeadLetter) -> String {
    format!("ruststream-redrive:{}:{}", letter.store, letter.sequence)
}

/// The headers a redriven message is published with: the original's own, but for its
/// `Nats-*` publish directives (a dedup id, an expected sequence: they would act on this
/// publish), with where it was sent back from and by which task.
pub(crate) fn republished_headers(task: &str, letter: &DeadLetter) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (name, values) in letter.headers.iter() {
        let text: &str = name.as_ref();
        if text.len() >= 5 && text[..5].eq_ignore_ascii_case("nats-") {
            continue;
        }
        if text.eq_ignore_ascii_case(REDRIVE_TASK) {
            continue;
        }
        for value in values {
            headers.append(name.clone(), value.clone());
        }
    }
    headers.append(
        REDRIVEN_FROM,
        HeaderValue::from(letter.sequence.to_string().as_str()),
    );
    if let Ok(value) = task.parse::<HeaderValue>() {
        headers.insert(REDRIVE_TASK, value);
    }
    headers.insert("Nats-Msg-Id", dedup_id(letter).as_str());
    headers
}

/// Publish `letter` back to `subject`; the future resolves when a stream stored it.
pub(crate) async fn publish(
    js: &jetstream::Context,
    task: &str,
    letter: &DeadLetter,
    subject: &str,
) -> anyhow::Result<jetstream::context::PublishAckFuture> {
    tokio::time::timeout(
        API_TIMEOUT,
        js.publish_with_headers(
            subject.to_owned(),
            republished_headers(task, letter),
            letter.payload.clone(),
        ),
    )
    .await
    .context("timed out publishing")?
    .context("publishing")
}

/// Remove a dead letter from its stream: done also when it is gone already. Removed, not
/// erased: the server's default for a message delete overwrites the message in its block
/// (a secure erase), some twenty times slower, for a copy whose original lives on.
pub(crate) async fn remove(
    js: &jetstream::Context,
    store: &str,
    sequence: u64,
) -> anyhow::Result<()> {
    let answer: serde_json::Value = tokio::time::timeout(
        API_TIMEOUT,
        js.request(
            format!("STREAM.MSG.DELETE.{store}"),
            &serde_json::json!({"seq": sequence, "no_erase": true}),
        ),
    )
    .await
    .context("timed out removing the dead letter")?
    .context("removing the dead letter")?;
    match answer.get("error") {
        None if answer["success"] == true => Ok(()),
        // Gone already: 10057 (no message at that sequence), 10037 (no message found) or
        // 10043 (sequence not found: removed before, by another removal or the stream's
        // limits). Whoever removed it, it is not there: what a removal is for.
        Some(error) if [10057, 10037, 10043].contains(&error["err_code"].as_u64().unwrap_or(0)) => {
            Ok(())
        }
        _ => bail!("removing the dead letter: {answer}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use time::OffsetDateTime;

    #[test]
    fn a_redriven_message_keeps_its_headers_and_its_history() {
        let mut original = HeaderMap::new();
        original.insert("X-Trace", "t-1");
        original.insert("Nats-Msg-Id", "order-7");
        original.insert("Nats-Expected-Last-Sequence", "3");
        original.insert(REDRIVEN_FROM, "4");
        original.insert(REDRIVE_TASK, "old");
        let letter = DeadLetter {
            store: "DLQ".into(),
            sequence: 17,
            dead_lettered_at: OffsetDateTime::UNIX_EPOCH,
            reason: "terminated".into(),
            term_reason: None,
            stream: "ORDERS".into(),
            consumer: "billing".into(),
            stream_sequence: 7,
            subject: "orders.7".into(),
            deliveries: 1,
            published_at: None,
            payload: Bytes::new(),
            headers: original,
        };
        let headers = republished_headers("t42", &letter);
        assert_eq!(headers.get("X-Trace").map(HeaderValue::as_str), Some("t-1"));
        assert!(headers.get("Nats-Expected-Last-Sequence").is_none());
        let history: Vec<&str> = headers
            .get_all(REDRIVEN_FROM)
            .map(HeaderValue::as_str)
            .collect();
        assert_eq!(history, ["4", "17"]);
        assert_eq!(
            headers.get(REDRIVE_TASK).map(HeaderValue::as_str),
            Some("t42")
        );
        assert_eq!(
            headers.get("Nats-Msg-Id").map(HeaderValue::as_str),
            Some("ruststream-redrive:DLQ:17")
        );
    }
}
