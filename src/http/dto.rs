//! Request and response bodies of the HTTP API, with their OpenAPI schemas.
//!
//! May import: as the rest of `http`.

use std::collections::BTreeMap;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use utoipa::ToSchema;

use crate::domain::delivery::Leased;
use crate::domain::wall_clock;

/// How `data` is encoded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Encoding {
    /// Standard base64 (RFC 4648, with padding). Always possible.
    #[default]
    Base64,
    /// The payload as a UTF-8 string (only when the payload is valid UTF-8).
    Utf8,
}

/// An optional integer that may also be spelled as an integral float (`5000.0`): JSON Schema
/// counts that as an integer, and so do encoders that keep every number a float. A fraction,
/// or a value out of `T`'s range, is refused (422, naming the field).
fn integral<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: TryFrom<i64> + TryFrom<u64>,
{
    use serde::de::Error as _;
    let Some(number) = Option::<serde_json::Number>::deserialize(deserializer)? else {
        return Ok(None);
    };
    let out_of_range = || D::Error::custom(format!("{number} is out of range"));
    if let Some(value) = number.as_u64() {
        return T::try_from(value).map(Some).map_err(|_| out_of_range());
    }
    if let Some(value) = number.as_i64() {
        return T::try_from(value).map(Some).map_err(|_| out_of_range());
    }
    match number.as_f64() {
        // 2^63 and beyond do not fit any target here; below it the cast is exact.
        Some(value) if value.fract() == 0.0 && value.abs() < 2f64.powi(63) => {
            T::try_from(value as i64)
                .map(Some)
                .map_err(|_| out_of_range())
        }
        _ => Err(D::Error::custom(format!(
            "invalid type: {number} is not an integer"
        ))),
    }
}

/// `POST /fetch` body; every field is optional. (The defaults are in the descriptions, not
/// as schema `default`s: openapi-typescript would make such fields required.)
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"batch": 10, "wait_ms": 5000, "encoding": "utf8"}))]
pub(crate) struct FetchBody {
    /// Most messages to lease (1..=1000, default 10).
    #[schema(minimum = 1, maximum = 1000)]
    #[serde(default, deserialize_with = "integral")]
    pub(crate) batch: Option<u32>,
    /// How long to wait while no message is available (0..=30000 ms, default 5000).
    #[schema(minimum = 0, maximum = 30000)]
    #[serde(default, deserialize_with = "integral")]
    pub(crate) wait_ms: Option<u64>,
    /// Stop before the payloads would exceed this many bytes (at least one message is
    /// always returned).
    #[schema(minimum = 1)]
    // Signed, as the schema's int64 says: a larger number is refused (422), not taken.
    #[serde(default, deserialize_with = "integral")]
    pub(crate) max_bytes: Option<i64>,
    /// Encoding of `data` (default base64).
    pub(crate) encoding: Option<Encoding>,
}

/// One leased message.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({
    "id": "Al8MKp5B07fIAAAAAQAAAAAAAAABAAAAAAAAAAEAAAAAAAAAARjYLSCjdiMgmjxR4HstTxjG4Ct9laHzTg",
    "subject": "orders.created",
    "data": "hello",
    "encoding": "utf8",
    "headers": {},
    "stream": "ORDERS",
    "consumer": "billing",
    "stream_sequence": 1,
    "consumer_sequence": 1,
    "delivered": 1,
    "pending": 0,
    "published_at": "2026-11-30T12:00:00.123456789Z",
    "lease_expires_at": "2026-11-30T12:00:29.123456789Z"
}))]
pub(crate) struct MessageDto {
    /// Lease id: opaque, URL-safe; settle the message with it.
    pub(crate) id: String,
    /// The subject. When it is not UTF-8 (NATS stores any bytes a publisher sends), this is
    /// its lossy form, each invalid sequence replaced by U+FFFD, and `subject_base64` holds
    /// the exact bytes.
    pub(crate) subject: String,
    /// Present only when the subject is not UTF-8: its exact bytes, standard base64
    /// (RFC 4648, with padding).
    // Left out rather than null when absent, so never null in the schema either.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub(crate) subject_base64: Option<String>,
    /// The payload, encoded as `encoding` says.
    pub(crate) data: String,
    pub(crate) encoding: Encoding,
    /// NATS headers; a header may repeat. Empty when `headers_base64` is present.
    pub(crate) headers: BTreeMap<String, Vec<String>>,
    /// Present only when the message's header block is not UTF-8 `Name: value` lines (a value
    /// or name that is not UTF-8, a line without a colon, an invalid name — NATS stores any
    /// block a publisher sends): the whole block exactly as stored, from its `NATS/1.0` line
    /// through the blank line that ends it, standard base64 (RFC 4648, with padding). Such a
    /// message is leased like any other; its `headers` is then empty. The same holds for a
    /// block naming a header `Async-Nats-Unparsed-Headers`, `Async-Nats-Unparsed-Subject` or
    /// `Async-Nats-Unparsed-Reply` (reserved by the gateway's NATS client).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub(crate) headers_base64: Option<String>,
    pub(crate) stream: String,
    pub(crate) consumer: String,
    pub(crate) stream_sequence: u64,
    pub(crate) consumer_sequence: u64,
    /// Delivery attempt, from 1.
    pub(crate) delivered: u64,
    /// Messages left for the consumer after this one, as the server saw it.
    pub(crate) pending: u64,
    /// When the message was published (RFC 3339).
    pub(crate) published_at: String,
    /// When the lease ends (RFC 3339): settle or extend before then. Never later than the
    /// server's redelivery.
    pub(crate) lease_expires_at: String,
}

impl MessageDto {
    pub(crate) fn new(leased: Leased, wanted: Encoding) -> Self {
        let delivery = leased.delivery;
        let (data, encoding) = match (wanted, std::str::from_utf8(&delivery.payload)) {
            (Encoding::Utf8, Ok(text)) => (text.to_owned(), Encoding::Utf8),
            _ => (STANDARD.encode(&delivery.payload), Encoding::Base64),
        };
        let mut headers = BTreeMap::new();
        if let Some(map) = &delivery.headers {
            for (name, values) in map.iter() {
                headers.insert(
                    name.to_string(),
                    values.iter().map(ToString::to_string).collect(),
                );
            }
        }
        Self {
            id: leased.id,
            subject: delivery.subject.to_string(),
            subject_base64: delivery.unparsed.subject.map(|raw| STANDARD.encode(raw)),
            data,
            encoding,
            headers,
            headers_base64: delivery.unparsed.headers.map(|raw| STANDARD.encode(raw)),
            stream: delivery.stream,
            consumer: delivery.consumer,
            stream_sequence: delivery.coordinates.key.stream_sequence,
            consumer_sequence: delivery.coordinates.consumer_sequence,
            delivered: delivery.coordinates.key.delivered,
            pending: delivery.pending,
            published_at: rfc3339(delivery.published_at),
            lease_expires_at: rfc3339(wall_clock(leased.expires_at)),
        }
    }
}

pub(crate) fn rfc3339(at: OffsetDateTime) -> String {
    at.format(&Rfc3339).unwrap_or_else(|_| at.to_string())
}

/// `POST /fetch` answer.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct FetchResponse {
    /// Leased messages; empty when none arrived within `wait_ms`.
    pub(crate) messages: Vec<MessageDto>,
}

/// `POST /messages/{id}/nak` body (optional).
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"delay_ms": 5000}))]
pub(crate) struct NakBody {
    /// Redeliver no sooner than this many milliseconds from now (0..=604800000).
    #[schema(minimum = 0, maximum = 604_800_000)]
    #[serde(default, deserialize_with = "integral")]
    pub(crate) delay_ms: Option<u64>,
}

/// `POST /messages/{id}/term` body (optional).
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"reason": "invalid order"}))]
pub(crate) struct TermBody {
    /// Why the message is terminated; shown in the server's MSG_TERMINATED advisory
    /// (at most 1024 characters, one line).
    #[schema(max_length = 1024, pattern = "^[^\\r\\n]*$")]
    pub(crate) reason: Option<String>,
}

/// `POST /messages/ack` body.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"ids": ["Al8MKp5B07fI…", "Al8MKp5B07fC…"]}))]
pub(crate) struct BatchAckBody {
    /// Lease ids (1..=1000).
    #[schema(min_items = 1, max_items = 1000)]
    pub(crate) ids: Vec<String>,
}

/// `POST /messages/nak` body.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"ids": ["Al8MKp5B07fI…"], "delay_ms": 5000}))]
pub(crate) struct BatchNakBody {
    /// Lease ids (1..=1000).
    #[schema(min_items = 1, max_items = 1000)]
    pub(crate) ids: Vec<String>,
    /// As for a single nak.
    #[schema(minimum = 0, maximum = 604_800_000)]
    #[serde(default, deserialize_with = "integral")]
    pub(crate) delay_ms: Option<u64>,
}

/// `POST /messages/term` body.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"ids": ["Al8MKp5B07fI…"], "reason": "invalid order"}))]
pub(crate) struct BatchTermBody {
    /// Lease ids (1..=1000).
    #[schema(min_items = 1, max_items = 1000)]
    pub(crate) ids: Vec<String>,
    /// As for a single term.
    #[schema(max_length = 1024, pattern = "^[^\\r\\n]*$")]
    pub(crate) reason: Option<String>,
}

/// The outcome for one id of a batch settle.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct BatchResult {
    pub(crate) id: String,
    /// What the single-lease endpoint would have answered: 204, 404, 409, 410, 503 or 504.
    pub(crate) status: u16,
    /// Why it failed; null on success.
    pub(crate) detail: Option<String>,
}

/// Batch settle answer, in request order.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"results": [
    {"id": "Al8MKp5B07fI…", "status": 204, "detail": null},
    {"id": "bogus", "status": 404, "detail": "no lease with this id was issued by this gateway"}
]}))]
pub(crate) struct BatchResponse {
    pub(crate) results: Vec<BatchResult>,
}

/// `POST /messages/{id}/in-progress` answer.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"lease_expires_at": "2026-11-30T12:01:02.5Z"}))]
pub(crate) struct ExtendResponse {
    /// The lease's new end (RFC 3339).
    pub(crate) lease_expires_at: String,
}

/// A header value, or several.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(untagged)]
pub(crate) enum HeaderValues {
    One(String),
    Many(Vec<String>),
}

/// `POST /publish` body.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"subject": "orders.created", "data": "hello"}))]
pub(crate) struct PublishBody {
    /// A concrete subject the stream captures (no wildcards).
    pub(crate) subject: String,
    /// The payload, encoded as `encoding` says.
    #[serde(default)]
    pub(crate) data: String,
    /// Encoding of `data` (default utf8 here, for typing at a shell).
    pub(crate) encoding: Option<Encoding>,
    /// NATS headers (e.g. `Nats-Msg-Id` for de-duplication).
    #[serde(default)]
    pub(crate) headers: BTreeMap<String, HeaderValues>,
    /// The message's ordering key (1 to 1024 bytes), written as its
    /// `Ruststream-Ordering-Key` header: a consumer ordered by `header` leases the messages
    /// of one key one at a time, in stream order.
    pub(crate) ordering_key: Option<String>,
    /// De-duplication id (the `Nats-Msg-Id` header, 1 to 1024 bytes): the stream stores a
    /// message with an id it has seen within its duplicate window only once (`duplicate:
    /// true` then).
    pub(crate) msg_id: Option<String>,
    /// How long the stream keeps the message (the `Nats-TTL` header): whole seconds as a
    /// duration (`30s`, `10m`, `1h30m`, `2`), at least 1 s, or `never`. The stream must
    /// allow it (`allow_msg_ttl`), else 409 `ttl-not-allowed`.
    #[schema(example = "10m")]
    pub(crate) ttl: Option<String>,
    /// Store only if the stream's last sequence is this one (`Nats-Expected-Last-Sequence`;
    /// 0: the stream is empty), else 412 `precondition-failed` with `last_sequence`.
    #[serde(default, deserialize_with = "stream_sequence")]
    pub(crate) expected_last_sequence: Option<u64>,
    /// Store only if the last message on this subject has this sequence
    /// (`Nats-Expected-Last-Subject-Sequence`; 0: none yet), else 412
    /// `precondition-failed` with the subject's `last_sequence`.
    #[serde(default, deserialize_with = "stream_sequence")]
    pub(crate) expected_last_subject_sequence: Option<u64>,
    /// Deliver the message this long from now (`90s`, `24h`) instead of at once: it is
    /// stored now as a schedule and delivered to `subject` then (`202`). Needs a stream set
    /// up for schedules (docs/producers.md).
    #[schema(example = "24h")]
    pub(crate) delay: Option<String>,
    /// Deliver the message at this time (RFC 3339) instead of at once; a time past is
    /// delivered at once. Not with `delay`.
    #[schema(example = "2026-12-24T09:00:00+01:00")]
    pub(crate) deliver_at: Option<String>,
}

/// A stream sequence in a body: 0 to 2^63 - 1, as the spec's int64 says; a larger one is
/// refused with the body (in a batch, the whole request: it does not match the spec).
fn stream_sequence<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<u64>, D::Error> {
    let sequence = Option::<u64>::deserialize(deserializer)?;
    match sequence {
        Some(sequence) if i64::try_from(sequence).is_err() => Err(serde::de::Error::custom(
            format!("at most {} (2^63 - 1), got {sequence}", i64::MAX),
        )),
        sequence => Ok(sequence),
    }
}

/// `POST /publish` answer.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"stream": "ORDERS", "sequence": 42, "duplicate": false}))]
pub(crate) struct PublishResponse {
    pub(crate) stream: String,
    /// The message's stream sequence.
    pub(crate) sequence: u64,
    /// The stream already had a message with this `Nats-Msg-Id`.
    pub(crate) duplicate: bool,
}

/// Effective consumer settings.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct ConsumerConfigDto {
    pub(crate) durable: bool,
    pub(crate) deliver_policy: String,
    pub(crate) ack_policy: String,
    /// ack_wait as a duration string (e.g. `30s`).
    pub(crate) ack_wait: String,
    pub(crate) ack_wait_ms: u64,
    pub(crate) max_ack_pending: i64,
    /// -1: unlimited.
    pub(crate) max_deliver: i64,
    /// The filter subject, when the consumer has exactly one.
    pub(crate) filter_subject: Option<String>,
    pub(crate) filter_subjects: Vec<String>,
    pub(crate) max_waiting: i64,
}

/// `GET /consumer` answer.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({
    "name": "billing",
    "stream": "ORDERS",
    "config": {
        "durable": true,
        "deliver_policy": "all",
        "ack_policy": "explicit",
        "ack_wait": "30s",
        "ack_wait_ms": 30000,
        "max_ack_pending": 1024,
        "max_deliver": -1,
        "filter_subject": null,
        "filter_subjects": [],
        "max_waiting": 512
    },
    "num_pending": 12,
    "num_ack_pending": 3,
    "num_redelivered": 0,
    "num_waiting": 0,
    "leases_in_flight": 3,
    "ordering_key": "subject:2",
    "held": 4,
    "busy_keys": 3,
    "instance_id": "5f0c2a9e41d3b7c8",
    "durability": {
        "stream_replicas": 1,
        "consumer_replicas": 1,
        "storage": "file",
        "persist_mode": "default",
        "server_sync": "2m",
        "settled_record_replicas": 1,
        "promise": "fleet",
        "warnings": [
            "R1 stream at a sync interval of 2m: a published 201 can be lost on power failure (Jepsen NATS 2.12.1)",
            "consumer R1: acks are confirmed before they are stored (the gateway's records keep them)"
        ]
    },
    "replicas": [
        {
            "instance_id": "5f0c2a9e41d3b7c8",
            "started_at": "2026-11-30T09:00:00Z",
            "leases_in_flight": 3,
            "listen": "0.0.0.0:8080",
            "lease_key_matches": true,
            "this_replica": true,
            "pinned": true
        },
        {
            "instance_id": "a17e03c95b6d2f18",
            "started_at": "2026-11-30T09:00:02Z",
            "leases_in_flight": 5,
            "listen": "0.0.0.0:8080",
            "lease_key_matches": true,
            "this_replica": false,
            "pinned": false
        }
    ]
}))]
pub(crate) struct ConsumerDto {
    pub(crate) name: String,
    pub(crate) stream: String,
    pub(crate) config: ConsumerConfigDto,
    /// Messages not yet delivered (server).
    pub(crate) num_pending: u64,
    /// Delivered, not yet acked (server).
    pub(crate) num_ack_pending: usize,
    pub(crate) num_redelivered: usize,
    /// Pull requests waiting at the server.
    pub(crate) num_waiting: usize,
    /// Live leases held by clients of this gateway.
    pub(crate) leases_in_flight: usize,
    /// Where its messages carry their ordering key (`subject:<n>`, `header:<Name>`, or
    /// `header` for the `Ruststream-Ordering-Key` header): then at most one message per key
    /// is leased at a time, in stream order. `null`: unordered.
    pub(crate) ordering_key: Option<String>,
    /// Messages this replica holds until their key is free (they count against
    /// max_ack_pending); 0 when unordered.
    pub(crate) held: usize,
    /// Keys with a message out (leased, or due again after a nak or an expiry).
    pub(crate) busy_keys: usize,
    /// This replica: the instance its lease ids name (random per process).
    pub(crate) instance_id: String,
    /// The live replicas on this consumer, this one included, oldest first, as their
    /// heartbeats (every second) say.
    pub(crate) replicas: Vec<ReplicaDto>,
    /// How durable its settles are, and what a 2xx for an ack or term promises.
    pub(crate) durability: DurabilityDto,
    /// Its push delivery, as this replica runs it; absent when it has no push table.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub(crate) push: Option<PushDto>,
}

/// How durable a consumer's settles are (see docs/guarantees.md#durability).
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct DurabilityDto {
    pub(crate) stream_replicas: usize,
    pub(crate) consumer_replicas: usize,
    /// `file` or `memory`.
    pub(crate) storage: String,
    /// The stream's `persist_mode`: `default` or `async`.
    pub(crate) persist_mode: String,
    /// The server's sync policy, from `--nats-monitor-url`: `always`, the interval
    /// (`2m`), or `unknown`.
    pub(crate) server_sync: String,
    /// Replicas of the settled records stream; 0 without one.
    pub(crate) settled_record_replicas: usize,
    /// `fleet`: no gateway on the consumer hands out again a message whose ack or term it
    /// answered 2xx; `process`: only this process does not; `none`: not bound, unknown.
    #[schema(pattern = "^(fleet|process|none)$")]
    pub(crate) promise: String,
    /// The weak links, weakest first.
    pub(crate) warnings: Vec<String>,
}

/// A push consumer's delivery, as one replica runs it.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct PushDto {
    /// The endpoint, without user, password or query.
    pub(crate) url: String,
    /// `running`, `paused`, or `backing_off` (held by a `Retry-After`, or failing since its
    /// last success).
    pub(crate) state: String,
    /// Requests it may have in flight now (its adaptive window).
    pub(crate) window: usize,
    /// Requests in flight now.
    pub(crate) in_flight: usize,
    /// When an attempt last succeeded (RFC 3339); null before the first.
    pub(crate) last_success_at: Option<String>,
    /// The last attempt that failed; null before the first.
    pub(crate) last_failure: Option<PushFailureDto>,
}

/// A failed push attempt: the status it was answered with, or why no answer came.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct PushFailureDto {
    /// RFC 3339.
    pub(crate) at: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub(crate) status: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    pub(crate) error: Option<String>,
}

/// `GET /consumers` answer.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"consumers": [
    {"stream": "ORDERS", "name": "billing", "source": "default", "bound": true, "leases_in_flight": 3},
    {"stream": "ORDERS", "name": "shipping", "source": "file", "bound": true, "leases_in_flight": 0}
]}))]
pub(crate) struct ConsumersDto {
    /// By stream, then name.
    pub(crate) consumers: Vec<ServedConsumerDto>,
}

/// One served consumer.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct ServedConsumerDto {
    pub(crate) stream: String,
    pub(crate) name: String,
    /// `default` (--stream/--consumer), `file` (--consumers-file) or `existing`
    /// (--serve-existing, bound on first use).
    #[schema(pattern = "^(default|file|existing)$")]
    pub(crate) source: String,
    /// Bound to the server now.
    pub(crate) bound: bool,
    /// Live leases held by clients of this gateway.
    pub(crate) leases_in_flight: usize,
}

/// A live replica of the gateway on the same consumer.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct ReplicaDto {
    pub(crate) instance_id: String,
    /// RFC 3339.
    pub(crate) started_at: String,
    /// Live leases its clients hold.
    pub(crate) leases_in_flight: usize,
    /// Its `--listen` address, as it was given.
    pub(crate) listen: String,
    /// Whether it signs lease ids with this replica's key: always `true`, since a replica
    /// with another key cannot seal its heartbeat for this one and is not listed (it is
    /// logged as an error instead; give every replica the same `--lease-key-file`).
    pub(crate) lease_key_matches: bool,
    /// This entry is the replica that answered.
    pub(crate) this_replica: bool,
    /// It is pinned to this ordered consumer: it leases its messages, and the others
    /// forward fetches and streams to it. Always false on an unordered consumer.
    pub(crate) pinned: bool,
}

/// `GET /healthz` and `GET /readyz` answer (a readiness failure is a problem: 503).
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"status": "ok"}))]
pub(crate) struct HealthDto {
    /// Always `ok`.
    pub(crate) status: String,
}
