//! What replicas of the gateway on one consumer share through NATS, under one subject
//! prefix (`--internal-prefix`): forwarded settles go to `<prefix>.<stream>.<consumer>.settle.<instance>`
//! (request/reply, see [`super::forward`]); a small stream, `RUSTSTREAM_SHARED_<stream>_<consumer>`,
//! keeps the last heartbeat of every live replica (`….replica.<instance>`, gone a few seconds
//! after the replica stops beating) and the first answers of keyed fetches
//! (`….idempotency.<digest>`), each with a per-message TTL. No membership protocol of our own:
//! a replica is live while its heartbeat is in the stream.
//!
//! May import: `config`, `domain`. Nothing of the gateway above the boundary.

use std::time::Duration;

use anyhow::Context as _;
use async_nats::HeaderMap;
use async_nats::jetstream::{self, stream};
use bytes::Bytes;
use futures::TryStreamExt as _;
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use crate::domain::lease_id::InstanceId;

use super::API_TIMEOUT;

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

    fn replica(&self, instance: InstanceId) -> String {
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

/// The shared stream of `stream`/`consumer`: `RUSTSTREAM_SHARED_<stream>_<consumer>`, or,
/// where that is longer than NATS allows, the prefix and a hash of both names.
pub(crate) fn stream_name(stream: &str, consumer: &str) -> String {
    super::gateway_stream_name("RUSTSTREAM_SHARED", stream, consumer)
}

/// The shared stream of one consumer, as bound.
#[derive(Clone)]
pub(crate) struct Shared {
    js: jetstream::Context,
    stream: stream::Stream,
    subjects: Subjects,
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
    ) -> anyhow::Result<Self> {
        let name = stream_name(stream, consumer);
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
        })
    }

    /// Say this replica is live for `ttl` more.
    pub(crate) async fn announce(
        &self,
        instance: InstanceId,
        record: &ReplicaRecord,
        ttl: Duration,
    ) -> anyhow::Result<()> {
        let payload = serde_json::to_vec(record).context("encoding the heartbeat")?;
        self.put(
            &self.subjects.replica(instance),
            HeaderMap::new(),
            payload.into(),
            ttl,
        )
        .await
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
                match serde_json::from_slice::<ReplicaRecord>(&message.payload) {
                    Ok(record) => records.push(record),
                    Err(err) => tracing::debug!(%subject, error = %err, "unreadable heartbeat"),
                }
            }
            anyhow::Ok(records)
        };
        tokio::time::timeout(API_TIMEOUT, listing)
            .await
            .context("timed out listing the replicas")?
    }

    /// The answer first given to a keyed fetch, by any replica.
    pub(crate) async fn remembered_answer(
        &self,
        digest: &str,
    ) -> anyhow::Result<Option<RememberedAnswer>> {
        let subject = self.subjects.idempotency(digest);
        let found = tokio::time::timeout(API_TIMEOUT, self.last(&subject))
            .await
            .context("timed out reading a remembered answer")??;
        Ok(found.and_then(|message| {
            Some(RememberedAnswer {
                fingerprint: message.headers.get(FINGERPRINT_HEADER)?.as_str().to_owned(),
                owner: message.headers.get(OWNER_HEADER)?.as_str().to_owned(),
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
        let mut headers = HeaderMap::new();
        headers.insert(FINGERPRINT_HEADER, fingerprint);
        headers.insert(OWNER_HEADER, owner.to_string().as_str());
        self.put(&self.subjects.idempotency(digest), headers, body, ttl)
            .await
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
