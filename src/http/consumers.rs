//! The consumer resources: `GET /consumer` (the default one), `GET /consumers` (every
//! served one), `GET /streams/{stream}/consumers/{consumer}` and its recent activity
//! (`…/history`), and the path segments that name a consumer, for these and the named fetch.
//!
//! May import: as the rest of `http`.

use std::sync::Arc;

use axum::Json;
use axum::extract::{FromRequestParts, Path, State};
use axum::http::request::Parts;
use serde::Serialize;
use utoipa::{IntoParams, ToSchema};

use super::dto::{
    ConsumerConfigDto, ConsumerDto, ConsumersDto, DurabilityDto, PushDto, PushFailureDto,
    ReplicaDto, ServedConsumerDto, rfc3339,
};
use super::responses::{Guarded, NamedNatsRefusals, NatsRefusals};
use crate::domain::consumers::ConsumerName;
use crate::error::Error;
use crate::gateway::{Consumer, Gateway, Target};

/// The `{stream}` and `{consumer}` path segments. Segments that are not text name no
/// consumer: 404 as problem+json rather than axum's plain-text rejection.
#[derive(IntoParams)]
#[into_params(names("stream", "consumer"), parameter_in = Path)]
pub(crate) struct ConsumerPath(
    /// The JetStream stream.
    #[param(example = "ORDERS")]
    String,
    /// The consumer's (durable) name.
    #[param(example = "shipping")]
    String,
);

impl ConsumerPath {
    pub(crate) fn name(&self) -> ConsumerName {
        ConsumerName::new(&self.0, &self.1)
    }
}

impl<S: Send + Sync> FromRequestParts<S> for ConsumerPath {
    type Rejection = Error;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        Path::<(String, String)>::from_request_parts(parts, state)
            .await
            .map(|Path((stream, consumer))| Self(stream, consumer))
            .map_err(|_| Error::ConsumerNotFound("the path names no consumer".into()))
    }
}

/// The consumer: its effective config, the server's counters and the gateway's leases.
#[utoipa::path(
    get,
    path = "/consumer",
    operation_id = "getConsumer",
    tag = "operations",
    responses(
        (status = 200, description = "Consumer state", body = ConsumerDto),
        Guarded, NatsRefusals,
    )
)]
pub(crate) async fn consumer(
    State(gateway): State<Arc<Gateway>>,
) -> Result<Json<ConsumerDto>, Error> {
    let consumer = gateway.consumer(Target::Default).await?;
    describe(&consumer).await.map(Json)
}

/// One served consumer: what `GET /consumer` answers for the default one.
#[utoipa::path(
    get,
    path = "/streams/{stream}/consumers/{consumer}",
    operation_id = "getNamedConsumer",
    tag = "operations",
    params(ConsumerPath),
    responses(
        (status = 200, description = "Consumer state", body = ConsumerDto),
        Guarded, NamedNatsRefusals,
    )
)]
pub(crate) async fn named_consumer(
    State(gateway): State<Arc<Gateway>>,
    path: ConsumerPath,
) -> Result<Json<ConsumerDto>, Error> {
    let consumer = gateway.consumer(Target::Named(&path.name())).await?;
    describe(&consumer).await.map(Json)
}

/// A consumer's activity at this replica over the last fifteen minutes.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct HistoryDto {
    stream: String,
    consumer: String,
    /// Each bucket's span (10).
    bucket_seconds: u64,
    /// Oldest first; the last one is the current, unfinished one. Fewer than 90 while the
    /// replica is younger than fifteen minutes.
    buckets: Vec<HistoryBucketDto>,
}

/// What one ten-second bucket counted at this replica.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"starts_at": "2026-12-04T08:00:00Z", "delivered": 120, "acked": 112, "naked": 6, "terminated": 2, "dead_lettered": 2}))]
pub(crate) struct HistoryBucketDto {
    /// RFC 3339.
    starts_at: String,
    /// Deliveries received from the server (redeliveries among them).
    delivered: u64,
    /// Acks, naks and terms confirmed by the server.
    acked: u64,
    naked: u64,
    terminated: u64,
    /// Messages copied to the dead-letter subject.
    dead_lettered: u64,
}

/// What a consumer did at this replica over the last fifteen minutes, in ten-second
/// buckets: deliveries, acks, naks, terms and dead letters (the console's chart).
#[utoipa::path(
    get,
    path = "/streams/{stream}/consumers/{consumer}/history",
    operation_id = "getConsumerHistory",
    tag = "operations",
    params(ConsumerPath),
    responses(
        (status = 200, description = "Its recent activity here", body = HistoryDto),
        Guarded, NamedNatsRefusals,
    )
)]
pub(crate) async fn history(
    State(gateway): State<Arc<Gateway>>,
    path: ConsumerPath,
) -> Result<Json<HistoryDto>, Error> {
    let name = path.name();
    let consumer = gateway.consumer(Target::Named(&name)).await?;
    let buckets = consumer
        .metrics()
        .history()
        .buckets()
        .into_iter()
        .map(|bucket| HistoryBucketDto {
            starts_at: rfc3339(bucket.starts_at),
            delivered: bucket.delivered,
            acked: bucket.acked,
            naked: bucket.naked,
            terminated: bucket.terminated,
            dead_lettered: bucket.dead_lettered,
        })
        .collect();
    Ok(Json(HistoryDto {
        stream: name.stream,
        consumer: name.consumer,
        bucket_seconds: crate::metrics::history::BUCKET.as_secs(),
        buckets,
    }))
}

/// The consumers this gateway serves: the default one, those of the consumers file, and
/// the existing ones bound now.
#[utoipa::path(
    get,
    path = "/consumers",
    operation_id = "listConsumers",
    tag = "operations",
    responses(
        (status = 200, description = "The served consumers, by stream and name", body = ConsumersDto),
        Guarded,
    )
)]
pub(crate) async fn consumers(State(gateway): State<Arc<Gateway>>) -> Json<ConsumersDto> {
    Json(ConsumersDto {
        consumers: gateway
            .list()
            .await
            .into_iter()
            .map(|listing| ServedConsumerDto {
                stream: listing.name.stream,
                name: listing.name.consumer,
                source: listing.source.as_str().to_owned(),
                bound: listing.bound,
                leases_in_flight: listing.leases_in_flight,
            })
            .collect(),
    })
}

/// A consumer's state as `GET /consumer` shows it.
async fn describe(consumer: &Consumer) -> Result<ConsumerDto, Error> {
    let status = consumer.status().await?;
    let info = status.info;
    let config = info.config;
    let mut filter_subjects = config.filter_subjects.clone();
    if !config.filter_subject.is_empty() {
        filter_subjects.insert(0, config.filter_subject.clone());
    }
    Ok(ConsumerDto {
        name: info.name,
        stream: info.stream_name,
        config: ConsumerConfigDto {
            durable: config.durable_name.is_some(),
            deliver_policy: json_name(&config.deliver_policy),
            ack_policy: json_name(&config.ack_policy),
            ack_wait: humantime::format_duration(config.ack_wait).to_string(),
            ack_wait_ms: u64::try_from(config.ack_wait.as_millis()).unwrap_or(u64::MAX),
            max_ack_pending: config.max_ack_pending,
            max_deliver: config.max_deliver,
            filter_subject: (filter_subjects.len() == 1).then(|| filter_subjects[0].clone()),
            filter_subjects,
            max_waiting: config.max_waiting,
        },
        num_pending: info.num_pending,
        num_ack_pending: info.num_ack_pending,
        num_redelivered: info.num_redelivered,
        num_waiting: info.num_waiting,
        leases_in_flight: status.leases_in_flight,
        ordering_key: status.ordering_key,
        held: status.held,
        busy_keys: status.busy_keys,
        instance_id: consumer.instance().to_string(),
        durability: durability_of(consumer),
        replicas: consumer
            .replicas()
            .into_iter()
            .map(|replica| ReplicaDto {
                instance_id: replica.instance_id,
                started_at: replica
                    .started_at
                    .format(&time::format_description::well_known::Rfc3339)
                    .unwrap_or_default(),
                leases_in_flight: replica.leases_in_flight,
                listen: replica.listen,
                lease_key_matches: replica.lease_key_matches,
                this_replica: replica.this_replica,
                pinned: replica.pinned,
            })
            .collect(),
        push: consumer.push_status().map(|push| PushDto {
            url: push.url,
            state: push.state.as_str().to_owned(),
            window: push.window,
            in_flight: push.in_flight,
            last_success_at: push.last_success_at.map(rfc3339),
            last_failure: push.last_failure.map(|failure| PushFailureDto {
                at: rfc3339(failure.at),
                status: failure.status,
                error: failure.error,
            }),
        }),
    })
}

/// A consumer's durability as its binding found it ("none" while unbound).
fn durability_of(consumer: &Consumer) -> DurabilityDto {
    match consumer.durability() {
        Some(facts) => DurabilityDto {
            stream_replicas: facts.stream_replicas,
            consumer_replicas: facts.consumer_replicas,
            promise: facts.promise().as_str().to_owned(),
            warnings: facts.warnings(),
            server_sync: facts.server_sync.describe(),
            settled_record_replicas: facts.settled_record_replicas.unwrap_or(0),
            storage: facts.storage,
            persist_mode: facts.persist_mode,
        },
        None => DurabilityDto {
            stream_replicas: 0,
            consumer_replicas: 0,
            storage: String::new(),
            persist_mode: String::new(),
            server_sync: "unknown".to_owned(),
            settled_record_replicas: 0,
            promise: crate::domain::durability::Promise::None.as_str().to_owned(),
            warnings: vec!["not bound: nothing is known of the consumer's durability".to_owned()],
        },
    }
}

/// The name NATS itself uses for an enum value (`deliver_policy` is flattened with its
/// options, so take the `deliver_policy` member when there is one).
fn json_name<T: serde::Serialize>(value: &T) -> String {
    match serde_json::to_value(value) {
        Ok(serde_json::Value::String(name)) => name,
        Ok(serde_json::Value::Object(map)) => map
            .get("deliver_policy")
            .and_then(|name| name.as_str())
            .map_or_else(
                || serde_json::Value::Object(map.clone()).to_string(),
                str::to_owned,
            ),
        Ok(other) => other.to_string(),
        Err(_) => String::new(),
    }
}
