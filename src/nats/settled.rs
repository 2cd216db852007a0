//! The settled records: what every gateway sharing a consumer must never hand out again.
//!
//! nats-server confirms an ack before its consumer state is on disk, so a server killed (or
//! a cluster that loses power) forgets acks it confirmed and delivers those messages again.
//! One process's memory of its confirmed acks dies with it and is never seen by the other
//! replicas. So every confirmed ack or term is also written here, to a stream the gateway
//! makes per consumed stream — `RUSTSTREAM_SETTLED_<stream>_<hash>`, subjects
//! `<prefix>.settled.<stream>.<consumer>`, as many replicas as the consumed stream, file
//! storage, kept for `--settled-retention` — and every gateway reads its consumer's records
//! when it binds and follows new ones live. A message whose write reached the store is, on
//! nats-server, on its way to disk before the PubAck (an R1 stream writes it through at once;
//! a replicated one holds it on a quorum), which the consumer's own state is not.
//!
//! A record is one JSON message for a batch of settles (a batch settle, or single settles
//! arriving together): `{"consumer": "...", "settled": [{"seq": 5, "published_ns": …,
//! "final": "ack"|"term", "reason": "…"}], "void": [{"seq", "published_ns"}]}`. A record is
//! sent alongside the ack it records, not after it; when the ack then goes unconfirmed, a
//! later record voids the entry (`void`), so that the message is handed out again as the
//! non-2xx answer said it may be. Each record names its writer (`Ruststream-Writer`), which
//! skips its own: what it confirmed it already remembers. With a `--lease-key-file` it is sealed with the
//! shared key and a record without a valid seal is dropped (counted): anyone allowed to
//! publish under the prefix could otherwise have messages acked unprocessed. Without one
//! there is no key a successor could share, so records are written and believed unsealed.
//!
//! May import: `config`, `domain`, `metrics`. Nothing of the gateway above the boundary.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer, stream};
use futures::{Stream, StreamExt as _};

use crate::domain::finals::{FleetFloor, MessageKey};
use crate::domain::seal::Kind;

use super::API_TIMEOUT;
use super::seek_mark;
use super::trust::Trust;

mod wire;

use wire::{EntryWire, FloorWire, RecordWire, VoidWire, decode};
pub(crate) use wire::{Opened, Settled};

/// How long the stream drops a second record with the same msg id (a publish retried).
const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);
/// The most settles one record carries (a batch settle is at most 1000 ids).
pub(crate) const MAX_PER_RECORD: usize = 1000;

/// The records stream of every consumer of `stream`.
pub(crate) fn stream_name_of(stream: &str) -> String {
    super::gateway_stream_name_of("RUSTSTREAM_SETTLED", stream)
}

/// The subject of `consumer`'s records.
pub(crate) fn subject_of(prefix: &str, stream: &str, consumer: &str) -> String {
    format!("{prefix}.settled.{stream}.{consumer}")
}

/// The header naming the process (binding) that wrote a record.
const WRITER_HEADER: &str = "Ruststream-Writer";
/// The header with the highest stream sequence a record names, read without opening it.
const MAX_SEQUENCE_HEADER: &str = "Ruststream-Max-Sequence";

/// The records of one consumer: where they are written and read.
pub(crate) struct Records {
    js: jetstream::Context,
    /// The records stream, as found or made at bind: every read and purge goes through it,
    /// with no lookup of its own.
    stream: stream::Stream,
    /// The consumed stream, for the consumer's ack floor.
    consumed: stream::Stream<()>,
    subject: String,
    /// Seals what is written and checks what is read; `None`: unsealed (no shared key).
    trust: Option<Arc<Trust>>,
    consumer: String,
    /// How old a believed record may be: the retention, and a day's slack for clocks.
    believed_for: Duration,
    /// This binding's random name, in each record it writes (it skips its own).
    writer: u64,
    replicas: usize,
}

/// Why the records stream could not be had.
pub(crate) enum EnsureError {
    /// The server refused it (another stream captures the subjects, the name is taken, no
    /// permission): retrying will not help.
    Refused(String),
    /// NATS is unreachable or slow.
    Transient(anyhow::Error),
}

/// Where the records go, and how they are kept.
pub(crate) struct Place<'a> {
    pub(crate) prefix: &'a str,
    pub(crate) stream: &'a str,
    pub(crate) consumer: &'a str,
    /// As many as the consumed stream has.
    pub(crate) replicas: usize,
    pub(crate) retention: Duration,
}

impl Records {
    /// Make the records stream of `place.stream` (or find it as made), and the handle of
    /// `place.consumer`'s records in it.
    pub(crate) async fn ensure(
        js: &jetstream::Context,
        place: &Place<'_>,
        trust: Option<Arc<Trust>>,
    ) -> Result<Self, EnsureError> {
        let name = stream_name_of(place.stream);
        let subjects = vec![format!("{}.settled.{}.*", place.prefix, place.stream)];
        let wanted = stream::Config {
            name: name.clone(),
            description: Some(
                "ruststream-nats: confirmed acks and terms, so that no gateway hands those messages out again (made by the gateway)"
                    .to_owned(),
            ),
            subjects: subjects.clone(),
            retention: stream::RetentionPolicy::Limits,
            discard: stream::DiscardPolicy::Old,
            max_age: place.retention,
            duplicate_window: DUPLICATE_WINDOW,
            storage: stream::StorageType::File,
            num_replicas: place.replicas.max(1),
            ..Default::default()
        };
        let found = match tokio::time::timeout(API_TIMEOUT, js.get_or_create_stream(wanted)).await {
            Err(_) => {
                return Err(EnsureError::Transient(anyhow::anyhow!(
                    "timed out setting up the settled records stream {name}"
                )));
            }
            Ok(Err(err)) => {
                use jetstream::context::CreateStreamErrorKind;
                return Err(match err.kind() {
                    CreateStreamErrorKind::JetStream(_) => {
                        EnsureError::Refused(format!("setting up the stream {name}: {err}"))
                    }
                    _ => EnsureError::Transient(
                        anyhow::Error::new(err).context(format!("setting up the stream {name}")),
                    ),
                });
            }
            Ok(Ok(found)) => found,
        };
        let current = &found.cached_info().config;
        if current.subjects != subjects {
            // Not ours to rewrite: whoever made it would lose what it holds.
            return Err(EnsureError::Refused(format!(
                "stream {name} exists capturing {:?}, not the settled records' {subjects:?}",
                current.subjects
            )));
        }
        let replicas = current.num_replicas.max(1);
        let consumed = js
            .get_stream_no_info(place.stream)
            .await
            .map_err(|err| EnsureError::Refused(format!("the stream {}: {err}", place.stream)))?;
        Ok(Self {
            js: js.clone(),
            stream: found,
            consumed,
            subject: subject_of(place.prefix, place.stream, place.consumer),
            trust,
            consumer: place.consumer.to_owned(),
            believed_for: place.retention + Duration::from_secs(24 * 60 * 60),
            writer: rand::random(),
            replicas,
        })
    }

    /// How many replicas the records stream has.
    pub(crate) fn replicas(&self) -> usize {
        self.replicas
    }

    /// Store one record of `ended` and `voided` (at most [`MAX_PER_RECORD`] together); `Ok`
    /// once the stream confirmed it, within `timeout`.
    pub(crate) async fn store(
        &self,
        ended: &[Settled],
        voided: &[MessageKey],
        timeout: Duration,
    ) -> anyhow::Result<()> {
        let record = RecordWire {
            consumer: &self.consumer,
            settled: ended.iter().map(EntryWire::of).collect(),
            void: voided.iter().map(VoidWire::of).collect(),
            floor: None,
        };
        let max_sequence = ended
            .iter()
            .map(|(message, _)| message)
            .chain(voided)
            .map(|message| message.stream_sequence)
            .max()
            .unwrap_or(0);
        // No msg id: a record is never sent twice, and one stored twice says the same thing;
        // the stream's dedup would cost the server a lookup per record for nothing.
        self.write(&record, None, max_sequence, timeout).await?;
        Ok(())
    }

    /// Store a floor record: every message under `floor` ended, as read under the consumer's
    /// seek `mark` (`None`: it was never moved); `Ok` with its sequence in the records
    /// stream. Every gateway writing the same floor under the same mark writes one record
    /// (the same msg id).
    pub(crate) async fn store_floor(
        &self,
        floor: FleetFloor,
        mark: Option<&str>,
    ) -> anyhow::Result<u64> {
        let record = RecordWire {
            consumer: &self.consumer,
            settled: Vec::new(),
            void: Vec::new(),
            floor: Some(FloorWire {
                seq: floor.stream_sequence,
                published_by_ns: floor.published_by_unix_nanos,
                mark: Some(mark.unwrap_or_default().to_owned()),
            }),
        };
        // After a move the replay may reach the same floor again within the duplicate
        // window: its record is a new one, not a duplicate of one the move forgot. The
        // mark is hashed: anyone may set a consumer's metadata.
        let msg_id = match mark {
            None => format!("floor-{}", floor.stream_sequence),
            Some(mark) => format!(
                "floor-{}-{}",
                floor.stream_sequence,
                super::sha256_hex(mark.as_bytes(), 8)
            ),
        };
        self.write(&record, Some(&msg_id), floor.stream_sequence, API_TIMEOUT)
            .await
    }

    async fn write(
        &self,
        record: &RecordWire<'_>,
        msg_id: Option<&str>,
        max_sequence: u64,
        timeout: Duration,
    ) -> anyhow::Result<u64> {
        let payload = serde_json::to_vec(record).context("encoding a settled record")?;
        let mut headers = HeaderMap::new();
        if let Some(msg_id) = msg_id {
            headers.insert("Nats-Msg-Id", msg_id);
        }
        headers.insert(WRITER_HEADER, format!("{:016x}", self.writer).as_str());
        headers.insert(MAX_SEQUENCE_HEADER, max_sequence.to_string().as_str());
        if let Some(trust) = &self.trust {
            trust.seal(
                Kind::SettledRecord,
                &self.subject,
                &[&payload],
                &mut headers,
            );
        }
        let stored = async {
            self.js
                .publish_with_headers(self.subject.clone(), headers, payload.into())
                .await
                .context("sending a settled record")?
                .await
                .context("storing a settled record")
        };
        let stored = tokio::time::timeout(timeout, stored)
            .await
            .context("timed out storing a settled record")??;
        Ok(stored.sequence)
    }

    /// The consumer's ack floor now, as a floor record would say it (`None`: nothing acked
    /// yet, or the server does not say when), and its seek mark now.
    pub(crate) async fn consumer_floor(
        &self,
    ) -> anyhow::Result<(Option<FleetFloor>, Option<String>)> {
        let info = self.consumer_info().await?;
        let floor = &info.ack_floor;
        // Every message under the floor was acked by its last activity, so published
        // before it (both on the server's clock).
        let floor = floor
            .last_active
            .filter(|_| floor.stream_sequence > 0)
            .map(|acked_by| FleetFloor {
                stream_sequence: floor.stream_sequence,
                published_by_unix_nanos: i64::try_from(acked_by.unix_timestamp_nanos())
                    .unwrap_or(i64::MAX),
            });
        Ok((floor, seek_mark::mark_of(&info).map(str::to_owned)))
    }

    /// The consumer's seek mark now (`None`: it was never moved, or made again since).
    pub(crate) async fn seek_mark(&self) -> anyhow::Result<Option<String>> {
        let info = self.consumer_info().await?;
        Ok(seek_mark::mark_of(&info).map(str::to_owned))
    }

    /// Whether to believe a floor record written under the seek mark `written_under`
    /// (`None`: by a release before marks, believed as it always was). One under another
    /// mark than the consumer's now had its floor seen before a move at another replica
    /// (which forgot every record before it) and was written after the move: it speaks of
    /// the consumer before, and would settle the replay unseen. A consumer with no mark now
    /// was never moved, or was made again (its metadata gone): what its records say of its
    /// floor holds, whatever mark they were written under.
    pub(crate) async fn floor_believed(&self, written_under: Option<&str>) -> anyhow::Result<bool> {
        let Some(written_under) = written_under else {
            return Ok(true);
        };
        Ok(self
            .seek_mark()
            .await?
            .is_none_or(|now| now == written_under))
    }

    async fn consumer_info(&self) -> anyhow::Result<consumer::Info> {
        tokio::time::timeout(API_TIMEOUT, self.consumed.consumer_info(&self.consumer))
            .await
            .context("timed out reading the consumer's state")?
            .context("reading the consumer's state")
    }

    /// Drop the consumer's records stored before the records stream's sequence `keep_from`
    /// (they name only messages under a floor record stored after them).
    pub(crate) async fn drop_before(&self, keep_from: u64) -> anyhow::Result<()> {
        tokio::time::timeout(
            API_TIMEOUT,
            self.stream
                .purge()
                .filter(self.subject.clone())
                .sequence(keep_from),
        )
        .await
        .context("timed out dropping settled records")?
        .context("dropping settled records")?;
        Ok(())
    }

    /// The records stream's sequence of the consumer's last record (0: none): a reader that
    /// has read up to it knows every record written before this call.
    pub(crate) async fn last_sequence(&self) -> anyhow::Result<u64> {
        let stream = &self.stream;
        // From the stream's leader (a direct get may come from a replica behind it).
        let last = tokio::time::timeout(
            API_TIMEOUT,
            stream.get_last_raw_message_by_subject(&self.subject),
        )
        .await
        .context("timed out reading the last settled record")?;
        match last {
            Ok(message) => Ok(message.sequence),
            Err(err)
                if matches!(
                    err.kind(),
                    jetstream::stream::LastRawMessageErrorKind::NoMessageFound
                ) =>
            {
                Ok(0)
            }
            Err(err) => Err(anyhow::Error::new(err).context("reading the last settled record")),
        }
    }

    /// Every record of the consumer from the records stream's sequence `from` on (1: all),
    /// then new ones as they are stored: each as its sequence and what it says (nothing for
    /// a record of this binding's own, or one not believed or not understood). Ends on an
    /// error.
    pub(crate) async fn read_from(
        self: &Arc<Self>,
        from: u64,
    ) -> anyhow::Result<impl Stream<Item = anyhow::Result<(u64, Opened)>> + use<>> {
        let stream = &self.stream;
        let deliver_policy = if from <= 1 {
            consumer::DeliverPolicy::All
        } else {
            consumer::DeliverPolicy::ByStartSequence {
                start_sequence: from,
            }
        };
        let reader = tokio::time::timeout(
            API_TIMEOUT,
            stream.create_consumer(consumer::push::OrderedConfig {
                deliver_subject: self.js.client().new_inbox(),
                filter_subject: self.subject.clone(),
                deliver_policy,
                ..Default::default()
            }),
        )
        .await
        .context("timed out opening a reader of the settled records")?
        .context("opening a reader of the settled records")?;
        let messages = reader
            .messages()
            .await
            .context("reading the settled records")?;
        let records = Arc::clone(self);
        Ok(messages.map(move |message| {
            let message = message.context("reading the settled records")?;
            let sequence = message
                .info()
                .map(|info| info.stream_sequence)
                .map_err(|err| anyhow::anyhow!("a settled record without its metadata: {err}"))?;
            Ok((sequence, records.open(&message)))
        }))
    }

    /// What a record read back says, if it is another writer's, believed and understood.
    fn open(&self, message: &async_nats::Message) -> Opened {
        let writer = message
            .headers
            .as_ref()
            .and_then(|headers| headers.get(WRITER_HEADER));
        if writer.is_some_and(|writer| u64::from_str_radix(writer.as_str(), 16) == Ok(self.writer))
        {
            // Its own: every settle in it this binding confirmed it remembers already, and
            // one it did not confirm it never took as ended. What it names still counts for
            // compaction: a record naming a message above the floor is kept, whoever wrote it.
            let max_sequence = message
                .headers
                .as_ref()
                .and_then(|headers| headers.get(MAX_SEQUENCE_HEADER))
                .and_then(|value| value.as_str().parse().ok())
                .unwrap_or_else(|| decode(&message.payload).max_sequence);
            return Opened {
                max_sequence,
                ..Opened::default()
            };
        }
        // No release ever wrote records unsealed under a key: `--accept-unsigned-replicas`
        // does not extend to them (a forged record acks messages nobody processed).
        let sealed = message
            .headers
            .as_ref()
            .is_some_and(|headers| headers.get(crate::domain::seal::HEADER).is_some());
        if let Some(trust) = &self.trust
            && (!sealed
                || !trust.believe(
                    Kind::SettledRecord,
                    &self.subject,
                    &[&message.payload],
                    message.headers.as_ref(),
                    self.believed_for,
                    None,
                ))
        {
            return Opened::default();
        }
        decode(&message.payload)
    }

    /// Forget every record of the consumer (it was moved on purpose: what it delivers again
    /// is meant to be handled again).
    pub(crate) async fn forget(&self) -> anyhow::Result<()> {
        let stream = &self.stream;
        tokio::time::timeout(API_TIMEOUT, stream.purge().filter(self.subject.clone()))
            .await
            .context("timed out purging the settled records")?
            .context("purging the settled records")?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_of_the_stream_and_the_subject() {
        assert!(stream_name_of("ORDERS").starts_with("RUSTSTREAM_SETTLED_ORDERS_"));
        assert_eq!(
            subject_of("_RUSTSTREAM", "ORDERS", "billing"),
            "_RUSTSTREAM.settled.ORDERS.billing"
        );
    }
}
