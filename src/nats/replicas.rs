//! What replicas of the gateway share through NATS, under one subject prefix
//! (`--internal-prefix`). Forwarded settles go to the owner of a lease on
//! `<prefix>.<stream>.<consumer>.settle.<instance>` (request/reply, see [`super::forward`]; one
//! subscription per process takes them all). One stream per fleet, `RUSTSTREAM_FLEET`
//! (another prefix: `RUSTSTREAM_FLEET_<hash>`), keeps the last heartbeat of every live
//! replica process (`<prefix>.fleet.replica.<instance>`, listing the consumers it is busy
//! on, gone a few seconds after the replica stops beating) and the first answers of keyed
//! fetches (`<prefix>.fleet.idempotency.<digest>`, the digest naming the consumer), each
//! with a per-message TTL: what replicas exchange grows with the replicas, not with the
//! consumers. No membership protocol of our own: a replica is live while its heartbeat is in
//! the stream. Every record is sealed with the lease key ([`super::trust`]) and opened
//! before it is believed.
//!
//! Releases before the fleet stream kept a stream per consumer,
//! `RUSTSTREAM_SHARED_<stream>_<consumer>`, with the same records under
//! `<prefix>.<stream>.<consumer>`: where one exists it is read and written as well (never
//! made), so that replicas of both releases see each other during a rolling upgrade.
//!
//! May import: `config`, `domain`. Nothing of the gateway above the boundary.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
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

    /// The fleet's: `<prefix>.fleet`, one token short of any consumer's subjects, so the
    /// fleet stream never overlaps a per-consumer stream of an earlier release.
    pub(crate) fn fleet(prefix: &str) -> Self {
        Self {
            base: format!("{prefix}.fleet"),
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
    /// In the fleet stream: the consumers it is busy on now (an idle one is left out, as it
    /// holds no lease). Absent from a per-consumer stream's records.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) consumers: Vec<BusyOn>,
    /// It reads lease ids that carry their expiry (version 4); absent from an earlier
    /// release's heartbeat, which does not.
    #[serde(default)]
    pub(crate) reads_expiring_lease_ids: bool,
}

impl ReplicaRecord {
    /// Whether it is pinned to `stream`/`consumer` (an ordered consumer).
    pub(crate) fn pinned_to(&self, stream: &str, consumer: &str) -> bool {
        self.consumers
            .iter()
            .any(|busy| busy.pinned && busy.stream == stream && busy.consumer == consumer)
    }

    /// Its leases of `stream`/`consumer`, if it is busy on that consumer.
    pub(crate) fn busy_on(&self, stream: &str, consumer: &str) -> Option<usize> {
        self.consumers
            .iter()
            .find(|busy| busy.stream == stream && busy.consumer == consumer)
            .map(|busy| busy.leases_in_flight)
    }
}

/// A consumer a replica is busy on, as its heartbeat lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct BusyOn {
    pub(crate) stream: String,
    pub(crate) consumer: String,
    pub(crate) leases_in_flight: usize,
    /// It is the replica pinned to this ordered consumer: the one that leases it, to which
    /// the others forward fetches and streams.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(crate) pinned: bool,
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

/// The fleet stream of the replicas under `prefix`.
pub(crate) fn fleet_stream_name(prefix: &str) -> String {
    if prefix == crate::config::DEFAULT_INTERNAL_PREFIX {
        return "RUSTSTREAM_FLEET".to_owned();
    }
    // A prefix of several tokens has dots, which stream names may not: a hash, unambiguous.
    format!(
        "RUSTSTREAM_FLEET_{}",
        super::sha256_hex(prefix.as_bytes(), 8)
    )
}

/// The names earlier releases gave one consumer's shared stream: the oldest (ambiguous:
/// `X_Y`/`c` and `X`/`Y_c` shared it) and the one with a hash.
fn per_consumer_stream_names(stream: &str, consumer: &str) -> [String; 2] {
    [
        super::legacy_gateway_stream_name("RUSTSTREAM_SHARED", stream, consumer),
        super::gateway_stream_name("RUSTSTREAM_SHARED", stream, consumer),
    ]
}

/// The fleet stream, set up by the first binding of a durable consumer and then kept.
#[derive(Default)]
pub(crate) struct FleetStream(tokio::sync::OnceCell<Arc<Shared>>);

impl FleetStream {
    pub(crate) fn get(&self) -> Option<&Arc<Shared>> {
        self.0.get()
    }

    /// The fleet stream, made or checked now if it was not yet (see [`Shared::fleet`]).
    pub(crate) async fn ensure(
        &self,
        js: &jetstream::Context,
        prefix: &str,
        replicas: usize,
        trust: &Arc<Trust>,
    ) -> anyhow::Result<&Arc<Shared>> {
        self.0
            .get_or_try_init(|| async {
                Shared::fleet(js, prefix, replicas, trust.clone())
                    .await
                    .map(Arc::new)
            })
            .await
    }
}

/// What replicas share, in one stream: the fleet's, or one consumer's of an earlier release.
#[derive(Clone)]
pub(crate) struct Shared {
    js: jetstream::Context,
    stream: stream::Stream,
    subjects: Subjects,
    trust: Arc<Trust>,
    /// The fleet stream (keyed answers of every consumer, so their digests name it).
    fleet: bool,
    /// A per-consumer stream that was deleted (the roll is over): no longer written.
    gone: Arc<AtomicBool>,
}

impl Shared {
    /// Create the fleet stream, or bring it to the config wanted; `replicas`: as many as the
    /// first consumed stream has, so it is as available as that one.
    pub(crate) async fn fleet(
        js: &jetstream::Context,
        prefix: &str,
        replicas: usize,
        trust: Arc<Trust>,
    ) -> anyhow::Result<Self> {
        let subjects = Subjects::fleet(prefix);
        let name = fleet_stream_name(prefix);
        let wanted = stream::Config {
            name: name.clone(),
            description: Some(
                "ruststream-nats: live replicas and their keyed fetch answers (made by the gateway)"
                    .to_owned(),
            ),
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
            .context("timed out setting up the fleet stream")?
            .with_context(|| format!("setting up the fleet stream {name}"))?;
        let current = found.cached_info().config.clone();
        if current.subjects != wanted.subjects {
            // Not ours to rewrite: whoever made it would lose what it holds.
            anyhow::bail!(
                "stream {name} exists capturing {:?}, not the replicas' subjects {:?}; leaving it as it is",
                current.subjects,
                wanted.subjects
            );
        }
        if !current.allow_message_ttl
            || !current.allow_direct
            || current.max_messages_per_subject != 1
        {
            anyhow::bail!(
                "stream {name} exists without per-message TTLs, direct gets or one message per subject; leaving it as it is"
            );
        }
        Ok(Self {
            js: js.clone(),
            stream: found,
            subjects,
            trust,
            fleet: true,
            gone: Arc::default(),
        })
    }

    /// The shared stream an earlier release made for `stream`/`consumer`, if there is one
    /// holding this pair's subjects (a stream of the oldest name may belong to another pair
    /// whose names run together the same way: that one is not this pair's).
    pub(crate) async fn per_consumer(
        js: &jetstream::Context,
        prefix: &str,
        stream: &str,
        consumer: &str,
        trust: Arc<Trust>,
    ) -> anyhow::Result<Option<Self>> {
        let subjects = Subjects::new(prefix, stream, consumer);
        for name in per_consumer_stream_names(stream, consumer) {
            let found = tokio::time::timeout(API_TIMEOUT, js.get_stream(&name))
                .await
                .context("timed out looking up a per-consumer shared stream")?;
            let existing = match found {
                Ok(existing) => existing,
                Err(err) if super::is_stream_not_found(&err) => continue,
                Err(err) => {
                    return Err(
                        anyhow::Error::new(err).context(format!("looking up stream {name}"))
                    );
                }
            };
            let captured = &existing.cached_info().config.subjects;
            if !captured.is_empty() && captured.iter().all(|subject| subjects.owns(subject)) {
                return Ok(Some(Self {
                    js: js.clone(),
                    stream: existing,
                    subjects,
                    trust,
                    fleet: false,
                    gone: Arc::default(),
                }));
            }
        }
        Ok(None)
    }

    /// Whether this is a per-consumer stream that was deleted since: then it is let be.
    pub(crate) fn is_gone(&self) -> bool {
        self.gone.load(Ordering::Relaxed)
    }

    /// Look whether a per-consumer stream still exists, after writing to it failed; once it
    /// does not, it is no longer written or read.
    pub(crate) async fn look_again(&self) {
        let name = self.stream.cached_info().config.name.clone();
        if let Ok(Err(err)) = tokio::time::timeout(API_TIMEOUT, self.js.get_stream(&name)).await
            && super::is_stream_not_found(&err)
        {
            tracing::info!(stream = %name, "the shared stream of an earlier release is gone: no longer written");
            self.gone.store(true, Ordering::Relaxed);
        }
    }

    /// Where a keyed fetch's answer is filed: by its digest alone in a per-consumer stream,
    /// with the consumer's names mixed in in the fleet's.
    pub(crate) fn answer_key(&self, stream: &str, consumer: &str, digest: &str) -> String {
        if !self.fleet {
            return digest.to_owned();
        }
        super::sha256_hex(format!("{stream}\n{consumer}\n{digest}").as_bytes(), 32)
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

    /// Claim `key` (one subject token) for the whole fleet: `true` for the first claim
    /// within the stream's duplicate window (2 min), `false` for any later one at any
    /// replica — the stream drops a second message with the same `Nats-Msg-Id`.
    pub(crate) async fn claim_once(&self, key: &str, ttl: Duration) -> anyhow::Result<bool> {
        let subject = self.subjects.idempotency(&format!("claim-{key}"));
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", format!("claim-{key}").as_str());
        let seconds = ttl.as_secs_f64().ceil().max(1.0);
        headers.insert("Nats-TTL", format!("{seconds}s").as_str());
        let stored = async {
            self.js
                .publish_with_headers(subject.clone(), headers, Bytes::new())
                .await?
                .await
        };
        let ack = tokio::time::timeout(API_TIMEOUT, stored)
            .await
            .context("timed out claiming in the fleet stream")?
            .with_context(|| format!("storing {subject}"))?;
        Ok(!ack.duplicate)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fleet_stream_is_named_after_the_prefix() {
        assert_eq!(fleet_stream_name("_RUSTSTREAM"), "RUSTSTREAM_FLEET");
        let other = fleet_stream_name("team.a");
        assert!(other.starts_with("RUSTSTREAM_FLEET_"), "{other}");
        assert_ne!(other, fleet_stream_name("team_a"));
    }

    #[test]
    fn the_fleets_subjects_are_one_token_short_of_any_consumers() {
        let fleet = Subjects::fleet("_RUSTSTREAM").captured();
        assert_eq!(
            fleet,
            [
                "_RUSTSTREAM.fleet.replica.*",
                "_RUSTSTREAM.fleet.idempotency.*"
            ]
        );
        // A consumer named like the fleet's subjects has a token more: no overlap.
        let consumer = Subjects::new("_RUSTSTREAM", "fleet", "replica");
        assert_eq!(
            consumer.replica(InstanceId::parse("00000000000000a1").expect("id")),
            "_RUSTSTREAM.fleet.replica.replica.00000000000000a1"
        );
    }
}
