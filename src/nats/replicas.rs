//! What replicas of the gateway on one consumer share through NATS, under one subject
//! prefix (`--internal-prefix`): forwarded settles go to `<prefix>.<stream>.<consumer>.settle.<instance>`
//! (request/reply, see [`super::forward`]); a small stream, `RUSTSTREAM_SHARED_<stream>_<consumer>`,
//! keeps the last heartbeat of every live replica (`….replica.<instance>`, gone a few seconds
//! after the replica stops beating) and the first answers of keyed fetches
//! (`….idempotency.<digest>`), each with a per-message TTL. No membership protocol of our own:
//! a replica is live while its heartbeat is in the stream. Every record is sealed with the
//! lease key ([`super::trust`]) and opened before it is believed.
//!
//! May import: `config`, `domain`. Nothing of the gateway above the boundary.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use async_nats::HeaderMap;
use async_nats::jetstream::{self, stream};
use bytes::Bytes;
use futures::TryStreamExt as _;
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use crate::domain::lease_id::InstanceId;
use crate::domain::seal::Kind;

use super::API_TIMEOUT;
use super::trust::Trust;

/// A heartbeat sealed longer ago than this is a replay: replicas beat every second, and the
/// stream drops a heartbeat 4 s after it was written.
const HEARTBEAT_MAX_AGE: Duration = Duration::from_secs(10);

/// The subjects of one consumer's replicas, under the internal prefix.
#[derive(Debug, Clone)]
pub(crate) struct Subjects {
    /// `<prefix>.<stream>.<consumer>`
    base: String,
}

impl Subjects {
    pub(crate) fn new(prefix: &str, stream: &str, consumer: &str) -> Self {
        Self {
            base: format!("{prefix}.{stream}.{consumer}"),
        }
    }

    /// Where the owner of a lease listens for settles forwarded by other replicas.
    pub(crate) fn settle(&self, owner: InstanceId) -> String {
        format!("{}.settle.{owner}", self.base)
    }

    pub(crate) fn replica(&self, instance: InstanceId) -> String {
        format!("{}.replica.{instance}", self.base)
    }

    fn replicas(&self) -> String {
        format!("{}.replica.*", self.base)
    }

    fn idempotency(&self, digest: &str) -> String {
        format!("{}.idempotency.{digest}", self.base)
    }

    fn captured(&self) -> Vec<String> {
        vec![self.replicas(), format!("{}.idempotency.*", self.base)]
    }

    /// Whether a subject a stream captures is one of this consumer's (an earlier release's
    /// shared stream captured fewer of them, never others).
    fn owns(&self, captured: &str) -> bool {
        captured
            .strip_prefix(self.base.as_str())
            .is_some_and(|rest| rest.starts_with('.'))
    }
}

/// What a replica says of itself in its heartbeat.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ReplicaRecord {
    pub(crate) instance_id: String,
    #[serde(with = "time::serde::rfc3339")]
    pub(crate) started_at: OffsetDateTime,
    pub(crate) leases_in_flight: usize,
    /// See [`crate::domain::lease_id::LeaseSigner::key_fingerprint`].
    pub(crate) lease_key_fingerprint: String,
    /// Where it listens for HTTP, as it was told (for the operator reading `GET /consumer`).
    pub(crate) listen: String,
}

/// Header carrying a remembered fetch answer's request fingerprint.
const FINGERPRINT_HEADER: &str = "Ruststream-Fingerprint";
/// Header naming the replica that gave a remembered fetch answer (and issued its leases).
const OWNER_HEADER: &str = "Ruststream-Owner";

/// A keyed fetch's first answer, as another replica remembered it.
pub(crate) struct RememberedAnswer {
    /// The request's fingerprint (hex).
    pub(crate) fingerprint: String,
    /// The replica that gave it, as its instance id prints.
    pub(crate) owner: String,
    pub(crate) body: Bytes,
}
/// The stream never holds more than this: heartbeats are tiny, answers are bounded by TTLs.
const MAX_BYTES: i64 = 256 * 1024 * 1024;

/// The shared stream of `stream`/`consumer`: see [`super::gateway_stream_name`].
pub(crate) fn stream_name(stream: &str, consumer: &str) -> String {
    super::gateway_stream_name("RUSTSTREAM_SHARED", stream, consumer)
}

/// The name releases before [`stream_name`] gave the shared stream, which `X_Y`/`c` and
/// `X`/`Y_c` shared: still used where it holds this pair's subjects, so that replicas of
/// both releases meet during a rolling upgrade.
fn legacy_stream_name(stream: &str, consumer: &str) -> String {
    super::legacy_gateway_stream_name("RUSTSTREAM_SHARED", stream, consumer)
}

/// The shared stream of one consumer, as bound.
#[derive(Clone)]
pub(crate) struct Shared {
    js: jetstream::Context,
    stream: stream::Stream,
    subjects: Subjects,
    trust: Arc<Trust>,
}

impl Shared {
    /// Create the shared stream, or bring it to the config wanted; `replicas`: as many as
    /// the consumed stream has, so it is as available as that one.
    pub(crate) async fn ensure(
        js: &jetstream::Context,
        subjects: Subjects,
        stream: &str,
        consumer: &str,
        replicas: usize,
        trust: Arc<Trust>,
    ) -> anyhow::Result<Self> {
        let name = match Self::legacy(js, &subjects, stream, consumer).await? {
            Some(legacy) => legacy,
            None => stream_name(stream, consumer),
        };
        let wanted = stream::Config {
            name: name.clone(),
            description: Some(format!(
                "ruststream-nats: replicas of {stream}/{consumer} and their keyed fetch answers (made by the gateway)"
            )),
            subjects: subjects.captured(),
            retention: stream::RetentionPolicy::Limits,
            discard: stream::DiscardPolicy::Old,
            max_messages_per_subject: 1,
            max_bytes: MAX_BYTES,
            // Every message carries its own TTL; this bounds one whose TTL header was lost.
            max_age: Duration::from_secs(24 * 60 * 60),
            allow_message_ttl: true,
            allow_direct: true,
            storage: stream::StorageType::File,
            num_replicas: replicas.max(1),
            ..Default::default()
        };
        let found = tokio::time::timeout(API_TIMEOUT, js.get_or_create_stream(wanted.clone()))
            .await
            .context("timed out setting up the shared stream")?
            .with_context(|| format!("setting up the shared stream {name}"))?;
        let mut stream = found;
        let current = stream.cached_info().config.clone();
        if !current
            .subjects
            .iter()
            .all(|subject| subjects.owns(subject))
        {
            // Not ours to rewrite: whoever made it would lose what its replicas share.
            anyhow::bail!(
                "stream {name} exists capturing {:?}, not this consumer's replica subjects {:?}; leaving it as it is",
                current.subjects,
                wanted.subjects
            );
        }
        if current.subjects != wanted.subjects
            || !current.allow_message_ttl
            || !current.allow_direct
            || current.max_messages_per_subject != 1
        {
            tokio::time::timeout(API_TIMEOUT, js.update_stream(wanted))
                .await
                .context("timed out updating the shared stream")?
                .with_context(|| format!("updating the shared stream {name}"))?;
            stream = tokio::time::timeout(API_TIMEOUT, js.get_stream(&name))
                .await
                .context("timed out reading the shared stream")?
                .with_context(|| format!("reading the shared stream {name}"))?;
        }
        Ok(Self {
            js: js.clone(),
            stream,
            subjects,
            trust,
        })
    }

    /// The legacy name of the shared stream, where a stream of that name captures this
    /// consumer's replica subjects (made by an earlier release); `None` where there is no
    /// such stream, or it belongs to another pair whose names run together the same way.
    async fn legacy(
        js: &jetstream::Context,
        subjects: &Subjects,
        stream: &str,
        consumer: &str,
    ) -> anyhow::Result<Option<String>> {
        let name = legacy_stream_name(stream, consumer);
        let found = tokio::time::timeout(API_TIMEOUT, js.get_stream(&name))
            .await
            .context("timed out looking up the shared stream")?;
        match found {
            Ok(existing) => {
                let captured = &existing.cached_info().config.subjects;
                if captured.iter().all(|subject| subjects.owns(subject)) {
                    return Ok(Some(name));
                }
                tracing::error!(
                    stream = %name,
                    captured = ?captured,
                    "a stream with the shared stream's old name belongs to another stream and consumer whose names run together the same way; using {} instead",
                    stream_name(stream, consumer)
                );
                Ok(None)
            }
            Err(err) if super::is_stream_not_found(&err) => Ok(None),
            Err(err) => Err(anyhow::Error::new(err).context(format!("looking up stream {name}"))),
        }
    }

    /// Say this replica is live for `ttl` more.
    pub(crate) async fn announce(
        &self,
        instance: InstanceId,
        record: &ReplicaRecord,
        ttl: Duration,
    ) -> anyhow::Result<()> {
        let payload = serde_json::to_vec(record).context("encoding the heartbeat")?;
        let subject = self.subjects.replica(instance);
        let mut headers = HeaderMap::new();
        self.trust
            .seal(Kind::Heartbeat, &subject, &[&payload], &mut headers);
        self.put(&subject, headers, payload.into(), ttl).await
    }

    /// This replica stops: others stop counting it at once instead of after its TTL.
    pub(crate) async fn withdraw(&self, instance: InstanceId) -> anyhow::Result<()> {
        tokio::time::timeout(
            API_TIMEOUT,
            self.stream.purge().filter(self.subjects.replica(instance)),
        )
        .await
        .context("timed out withdrawing the heartbeat")?
        .context("withdrawing the heartbeat")?;
        Ok(())
    }

    /// Every live replica's last heartbeat (this one's included).
    pub(crate) async fn replicas(&self) -> anyhow::Result<Vec<ReplicaRecord>> {
        let listing = async {
            let subjects: Vec<(String, usize)> = self
                .stream
                .info_with_subjects(self.subjects.replicas())
                .await?
                .try_collect()
                .await?;
            let mut records = Vec::with_capacity(subjects.len());
            for (subject, _) in subjects {
                let Some(message) = self.last(&subject).await? else {
                    continue; // its TTL ran out between the listing and the read
                };
                if let Some(record) = self.believed_heartbeat(&message) {
                    records.push(record);
                }
            }
            anyhow::Ok(records)
        };
        tokio::time::timeout(API_TIMEOUT, listing)
            .await
            .context("timed out listing the replicas")?
    }

    /// The live heartbeat of one replica, if it has one this replica believes.
    pub(crate) async fn heartbeat_of(
        &self,
        instance: InstanceId,
    ) -> anyhow::Result<Option<ReplicaRecord>> {
        let subject = self.subjects.replica(instance);
        let found = tokio::time::timeout(API_TIMEOUT, self.last(&subject))
            .await
            .context("timed out reading a heartbeat")??;
        Ok(found.and_then(|message| self.believed_heartbeat(&message)))
    }

    /// A heartbeat read from the stream, if its seal holds and it names its own sender.
    fn believed_heartbeat(
        &self,
        message: &jetstream::message::StreamMessage,
    ) -> Option<ReplicaRecord> {
        let subject = message.subject.as_str();
        let record = match serde_json::from_slice::<ReplicaRecord>(&message.payload) {
            Ok(record) => record,
            Err(err) => {
                tracing::debug!(%subject, error = %err, "unreadable heartbeat");
                return None;
            }
        };
        let claimed = InstanceId::parse(&record.instance_id)?;
        self.trust
            .believe(
                Kind::Heartbeat,
                subject,
                &[&message.payload],
                Some(&message.headers),
                HEARTBEAT_MAX_AGE,
                Some(claimed),
            )
            .then_some(record)
    }

    /// The answer first given to a keyed fetch, by any replica, if it was sealed at most
    /// `max_age` ago.
    pub(crate) async fn remembered_answer(
        &self,
        digest: &str,
        max_age: Duration,
    ) -> anyhow::Result<Option<RememberedAnswer>> {
        let subject = self.subjects.idempotency(digest);
        let found = tokio::time::timeout(API_TIMEOUT, self.last(&subject))
            .await
            .context("timed out reading a remembered answer")??;
        Ok(found.and_then(|message| {
            let fingerprint = message.headers.get(FINGERPRINT_HEADER)?.as_str().to_owned();
            let owner = message.headers.get(OWNER_HEADER)?.as_str().to_owned();
            self.trust
                .believe(
                    Kind::KeyedAnswer,
                    &subject,
                    &[fingerprint.as_bytes(), owner.as_bytes(), &message.payload],
                    Some(&message.headers),
                    max_age,
                    Some(InstanceId::parse(&owner)?),
                )
                .then_some(RememberedAnswer {
                    fingerprint,
                    owner,
                    body: message.payload,
                })
        }))
    }

    /// Remember a keyed fetch's answer for `ttl`, for a retry reaching another replica.
    pub(crate) async fn remember_answer(
        &self,
        digest: &str,
        owner: InstanceId,
        fingerprint: &str,
        body: Bytes,
        ttl: Duration,
    ) -> anyhow::Result<()> {
        let subject = self.subjects.idempotency(digest);
        let owner = owner.to_string();
        let mut headers = HeaderMap::new();
        headers.insert(FINGERPRINT_HEADER, fingerprint);
        headers.insert(OWNER_HEADER, owner.as_str());
        self.trust.seal(
            Kind::KeyedAnswer,
            &subject,
            &[fingerprint.as_bytes(), owner.as_bytes(), &body],
            &mut headers,
        );
        self.put(&subject, headers, body, ttl).await
    }

    async fn put(
        &self,
        subject: &str,
        mut headers: HeaderMap,
        payload: Bytes,
        ttl: Duration,
    ) -> anyhow::Result<()> {
        // Whole seconds, at least one: the server's TTL granularity.
        let seconds = ttl.as_secs_f64().ceil().max(1.0);
        headers.insert("Nats-TTL", format!("{seconds}s").as_str());
        let stored = async {
            self.js
                .publish_with_headers(subject.to_owned(), headers, payload)
                .await?
                .await
        };
        tokio::time::timeout(API_TIMEOUT, stored)
            .await
            .context("timed out storing in the shared stream")?
            .with_context(|| format!("storing {subject}"))?;
        Ok(())
    }

    async fn last(
        &self,
        subject: &str,
    ) -> anyhow::Result<Option<jetstream::message::StreamMessage>> {
        match self.stream.direct_get_last_for_subject(subject).await {
            Ok(message) => Ok(Some(message)),
            Err(err) if matches!(err.kind(), stream::DirectGetErrorKind::NotFound) => Ok(None),
            Err(err) => Err(anyhow::Error::new(err).context(format!("reading {subject}"))),
        }
    }
}
