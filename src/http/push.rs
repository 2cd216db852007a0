//! `POST /streams/{stream}/consumers/{consumer}/push/pause` and `…/push/resume`: pause a push
//! consumer for the whole fleet, through the server's own consumer pause (so that it
//! survives restarts, and its fetches and streams pause too).
//!
//! May import: as the rest of `http`.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use utoipa::ToSchema;

use super::body::JsonBody;
use super::consumers::ConsumerPath;
use super::dto::rfc3339;
use super::responses::{BodyRefusals, Guarded, NamedNatsRefusals};
use crate::error::Error;
use crate::gateway::{Gateway, Target};

/// `POST …/push/pause` body (optional).
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"until": "2026-12-02T18:00:00Z"}))]
pub(crate) struct PauseBody {
    /// When the pause ends by itself (RFC 3339, in the future); absent: until resumed.
    /// 9999-12-31T23:59:59.999999999Z is refused: it marks a pause until resumed.
    until: Option<String>,
}

/// A push consumer's pause, as the server now has it.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"stream": "ORDERS", "consumer": "hooks", "paused": true, "paused_until": "2026-12-02T18:00:00Z"}))]
pub(crate) struct PauseDto {
    stream: String,
    consumer: String,
    paused: bool,
    /// When the pause ends by itself (RFC 3339); null while not paused, or paused until
    /// resumed.
    paused_until: Option<String>,
}

/// Pause a push consumer: no push, fetch or stream of it leases anything, at any replica,
/// until `until` or a resume (409 `consumer-paused` meanwhile). The pause is the server's
/// (`pause_until`): it holds across restarts of every gateway.
#[utoipa::path(
    post,
    path = "/streams/{stream}/consumers/{consumer}/push/pause",
    operation_id = "pausePush",
    tag = "operations",
    params(ConsumerPath),
    request_body(content = Option<PauseBody>, content_type = "application/json"),
    responses(
        (status = 200, description = "Paused", body = PauseDto),
        Guarded, BodyRefusals, NamedNatsRefusals,
    )
)]
pub(crate) async fn pause(
    State(gateway): State<Arc<Gateway>>,
    path: ConsumerPath,
    JsonBody(body): JsonBody<PauseBody>,
) -> Result<Json<PauseDto>, Error> {
    let until = body
        .until
        .as_deref()
        .map(|until| {
            let at = OffsetDateTime::parse(until, &Rfc3339).map_err(|err| {
                Error::invalid("until", format!("until: not an RFC 3339 time: {err}"))
            })?;
            if at <= OffsetDateTime::now_utc() {
                return Err(Error::invalid("until", "until: must be in the future"));
            }
            Ok(at)
        })
        .transpose()?;
    pause_or_resume(&gateway, &path, until, false).await
}

/// Resume a paused push consumer, for the whole fleet.
#[utoipa::path(
    post,
    path = "/streams/{stream}/consumers/{consumer}/push/resume",
    operation_id = "resumePush",
    tag = "operations",
    params(ConsumerPath),
    responses(
        (status = 200, description = "Resumed", body = PauseDto),
        Guarded, NamedNatsRefusals,
    )
)]
pub(crate) async fn resume(
    State(gateway): State<Arc<Gateway>>,
    path: ConsumerPath,
) -> Result<Json<PauseDto>, Error> {
    pause_or_resume(&gateway, &path, None, true).await
}

async fn pause_or_resume(
    gateway: &Gateway,
    path: &ConsumerPath,
    until: Option<OffsetDateTime>,
    resume: bool,
) -> Result<Json<PauseDto>, Error> {
    let name = path.name();
    if !gateway.pushes().borrow().contains_key(&name) {
        return Err(Error::ConsumerNotFound(format!(
            "consumer {name} has no push table in the consumers file: nothing to pause or resume"
        )));
    }
    let consumer = gateway.consumer(Target::Named(&name)).await?;
    let paused = consumer.pause(until, resume).await?;
    Ok(Json(PauseDto {
        stream: name.stream,
        consumer: name.consumer,
        paused: paused.is_some(),
        paused_until: paused.flatten().map(rfc3339),
    }))
}
