//! Operational endpoints: liveness, readiness and the API description.
//!
//! May import: as the rest of `http`.

use std::sync::{Arc, LazyLock};

use axum::Json;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;

use super::dto::HealthDto;
use super::responses::NatsRefusals;
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
