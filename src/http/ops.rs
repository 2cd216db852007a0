//! Operational endpoints: liveness, readiness and the consumer's state.
//!
//! May import: as the rest of `http`.

use std::sync::{Arc, LazyLock};

use axum::Json;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;

use super::dto::{ConsumerConfigDto, ConsumerDto, HealthDto, ReplicaDto};
use super::responses::{Guarded, NatsRefusals};
use crate::error::Error;
use crate::gateway::Gateway;

/// Liveness: the process serves HTTP.
#[utoipa::path(
    get,
    path = "/healthz",
    operation_id = "getHealth",
    tag = "operations",
    responses((status = 200, description = "Alive", body = HealthDto))
)]
pub(crate) async fn healthz() -> Json<HealthDto> {
    Json(HealthDto {
        status: "ok".into(),
    })
}

/// Readiness: connected to NATS, bound to the consumer, and listening for the settles other
/// replicas forward to this one.
#[utoipa::path(
    get,
    path = "/readyz",
    operation_id = "getReadiness",
    tag = "operations",
    responses(
        (status = 200, description = "Ready", body = HealthDto),
        NatsRefusals,
    )
)]
pub(crate) async fn readyz(State(gateway): State<Arc<Gateway>>) -> Result<Json<HealthDto>, Error> {
    // The detail is generic (callers are unauthenticated): the log says where NATS is.
    gateway.readiness()?;
    Ok(Json(HealthDto {
        status: "ok".into(),
    }))
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
    let status = gateway.status().await?;
    let info = status.info;
    let config = info.config;
    let mut filter_subjects = config.filter_subjects.clone();
    if !config.filter_subject.is_empty() {
        filter_subjects.insert(0, config.filter_subject.clone());
    }
    Ok(Json(ConsumerDto {
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
        instance_id: gateway.instance().to_string(),
        replicas: gateway
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
            })
            .collect(),
    }))
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

/// This API's OpenAPI 3.1 description (the committed `openapi/openapi.json`).
#[utoipa::path(
    get,
    path = "/openapi.json",
    operation_id = "getOpenApi",
    tag = "operations",
    responses((status = 200, description = "The OpenAPI document", body = Object))
)]
pub(crate) async fn openapi_json() -> impl IntoResponse {
    // Assembled once: the document does not change while the process runs.
    static SPEC: LazyLock<Vec<u8>> =
        LazyLock::new(|| serde_json::to_vec(&super::openapi()).unwrap_or_default());
    (
        [(header::CONTENT_TYPE, "application/json")],
        SPEC.as_slice(),
    )
}
