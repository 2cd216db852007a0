//! `/schedules`: recurring delivery (`POST`, a cron or `@every`), the pending schedules
//! listed (`GET`, admin) and one read or cancelled by id; the answer a delayed publish gets.
//!
//! May import: as the rest of `http`.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Json;
use axum::extract::{Extension, FromRequestParts, Path, State};
use axum::http::StatusCode;
use axum::http::Uri;
use axum::http::request::Parts;
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use utoipa::{IntoParams, ToSchema};

use super::body::JsonBody;
use super::dead_letters::pairs;
use super::dto::{Encoding, HeaderValues, PublishBody};
use super::principal::Principal;
use super::publish::{Prepared, prepare};
use super::responses::{
    BodyRefusals, Guarded, NatsRefusals, QueryRefusals, ScheduleCancelRefusals,
    ScheduleCreateRefusals, ScheduleRefusals,
};
use super::scopes::Scope;
use crate::domain::schedule::{ScheduleId, When, rfc3339};
use crate::error::Error;
use crate::gateway::{Gateway, Scheduled};
use crate::nats::schedules::Schedule;

/// The answer to a delayed publish (`delay` or `deliver_at`).
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"schedule": "ORDERS.5f1e0c2a9b7d4e11", "deliver_at": "2026-12-08T09:00:00.000Z", "stream": "ORDERS", "subject": "orders.charge"}))]
pub(crate) struct ScheduledResponse {
    /// Its id: `GET` or `DELETE /schedules/{id}`.
    pub(crate) schedule: String,
    /// When it is delivered (RFC 3339); a time already past is delivered at once.
    pub(crate) deliver_at: String,
    pub(crate) stream: String,
    /// Where it is delivered.
    pub(crate) subject: String,
}

impl ScheduledResponse {
    pub(crate) fn new(scheduled: Scheduled, subject: String, at: OffsetDateTime) -> Self {
        Self {
            schedule: scheduled.id.to_string(),
            deliver_at: rfc3339(at),
            stream: scheduled.stream,
            subject,
        }
    }
}

/// `POST /schedules` body.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"subject": "orders.reminder", "data": "send the reminder", "cron": "0 0 9 * * 1-5", "time_zone": "Europe/Berlin"}))]
pub(crate) struct ScheduleBody {
    /// Where each firing delivers the message (a subject the stream captures).
    pub(crate) subject: String,
    #[serde(default)]
    pub(crate) data: String,
    pub(crate) encoding: Option<Encoding>,
    #[serde(default)]
    pub(crate) headers: BTreeMap<String, HeaderValues>,
    /// When: a 6-field cron expression (second minute hour day-of-month month
    /// day-of-week), a macro (`@hourly`, `@daily`, `@weekly`, `@monthly`, `@yearly`), or
    /// `@every <duration>` (at least 1s).
    pub(crate) cron: String,
    /// The IANA zone the cron expression is read in (default UTC); not with `@every`.
    pub(crate) time_zone: Option<String>,
}

/// `POST /schedules` answer.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"schedule": "ORDERS.5f1e0c2a9b7d4e11", "next": "2026-12-08T08:00:00.000Z", "stream": "ORDERS", "subject": "orders.reminder"}))]
pub(crate) struct ScheduleCreated {
    pub(crate) schedule: String,
    /// When it fires next (RFC 3339).
    pub(crate) next: Option<String>,
    pub(crate) stream: String,
    pub(crate) subject: String,
}

/// A pending schedule.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"schedule": "ORDERS.5f1e0c2a9b7d4e11", "stream": "ORDERS", "subject": "orders.reminder", "kind": "recurring", "pattern": "0 0 9 * * 1-5", "time_zone": "Europe/Berlin", "next": "2026-12-08T08:00:00.000Z", "created_at": "2026-12-07T17:12:00.000Z"}))]
pub(crate) struct ScheduleDto {
    pub(crate) schedule: String,
    pub(crate) stream: String,
    /// Where it delivers.
    pub(crate) subject: String,
    /// `once` (a delayed message) or `recurring`.
    pub(crate) kind: String,
    /// As nats-server reads it: `@at <time>`, `@every <n>s`, or the cron expression.
    pub(crate) pattern: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) time_zone: Option<String>,
    /// When it fires next (RFC 3339).
    pub(crate) next: Option<String>,
    pub(crate) created_at: String,
}

impl From<Schedule> for ScheduleDto {
    fn from(schedule: Schedule) -> Self {
        let time_zone = match &schedule.when {
            When::Cron { zone, .. } => zone.clone(),
            _ => None,
        };
        Self {
            schedule: schedule.id.to_string(),
            stream: schedule.id.stream.clone(),
            subject: schedule.target,
            kind: if schedule.when.is_recurring() {
                "recurring"
            } else {
                "once"
            }
            .to_owned(),
            pattern: schedule.when.header(),
            time_zone,
            next: schedule
                .when
                .next_after(OffsetDateTime::now_utc(), schedule.made)
                .map(rfc3339),
            created_at: rfc3339(schedule.made),
        }
    }
}

/// `GET /schedules` answer.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct ScheduleList {
    pub(crate) schedules: Vec<ScheduleDto>,
}

/// Deliver a message again and again: on a cron expression in a zone, or every interval.
/// Each firing delivers `data` and `headers` to `subject`; the schedule itself is a message
/// of the stream that no consumer leases (docs/producers.md says how a stream is set up).
#[utoipa::path(
    post,
    path = "/schedules",
    operation_id = "createSchedule",
    tag = "messages",
    request_body(content = ScheduleBody, content_type = "application/json"),
    responses(
        (status = 201, description = "The schedule is stored; it fires from `next` on", body = ScheduleCreated),
        Guarded, BodyRefusals, ScheduleCreateRefusals,
    )
)]
pub(crate) async fn create(
    State(gateway): State<Arc<Gateway>>,
    JsonBody(body): JsonBody<ScheduleBody>,
) -> Result<(StatusCode, Json<ScheduleCreated>), Error> {
    let when = When::recurring(&body.cron, body.time_zone.as_deref())
        .map_err(|(field, detail)| Error::invalid(field, detail))?;
    let Prepared {
        subject,
        headers,
        payload,
        ..
    } = prepare(PublishBody {
        subject: body.subject,
        data: body.data,
        encoding: body.encoding,
        headers: body.headers,
        ..PublishBody::default()
    })?;
    let scheduled = gateway
        .schedule(subject.clone(), headers, payload, when)
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(ScheduleCreated {
            schedule: scheduled.id.to_string(),
            next: scheduled.next.map(rfc3339),
            stream: scheduled.stream,
            subject,
        }),
    ))
}

/// `GET /schedules` query, as the spec describes it (parsed by hand).
#[derive(IntoParams)]
#[into_params(parameter_in = Query)]
#[expect(
    dead_code,
    reason = "describes the query for the spec; the query is parsed by hand"
)]
pub(crate) struct ListParams {
    /// Only those of this stream (default: every stream the gateway serves a consumer of).
    stream: Option<String>,
    /// Only those delivering to this subject.
    subject: Option<String>,
}

/// The pending schedules, one-shot (delayed messages) and recurring, with when each fires
/// next (at most 1 000 a stream). Needs the `admin` scope.
#[utoipa::path(
    get,
    path = "/schedules",
    operation_id = "listSchedules",
    tag = "messages",
    params(ListParams),
    responses(
        (status = 200, description = "The pending schedules, oldest first", body = ScheduleList),
        Guarded, QueryRefusals, NatsRefusals,
    )
)]
pub(crate) async fn list(
    State(gateway): State<Arc<Gateway>>,
    principal: Option<Extension<Principal>>,
    uri: Uri,
) -> Result<Json<ScheduleList>, Error> {
    if principal.is_some_and(|Extension(principal)| !principal.reaches(Scope::Admin)) {
        return Err(Error::Forbidden { scope: "admin" });
    }
    let (mut stream, mut subject) = (None, None);
    for (name, value) in pairs(uri.query()) {
        match name.as_str() {
            "stream" => stream = Some(value),
            "subject" => subject = Some(value),
            other => {
                return Err(Error::invalid(
                    other,
                    format!("{other}: unknown parameter (stream and subject are taken)"),
                ));
            }
        }
    }
    if let Some(stream) = &stream {
        crate::domain::subject::validate_name(stream)
            .map_err(|why| Error::invalid("stream", format!("stream: {why}")))?;
    }
    let schedules = gateway
        .list_schedules(stream.as_deref(), subject.as_deref())
        .await?;
    Ok(Json(ScheduleList {
        schedules: schedules.into_iter().map(ScheduleDto::from).collect(),
    }))
}

/// The `{id}` path segment.
#[derive(IntoParams)]
#[into_params(names("id"), parameter_in = Path)]
pub(crate) struct ScheduleIdPath(
    /// A schedule's id, as a delayed publish or `POST /schedules` answered it.
    #[param(example = "ORDERS.5f1e0c2a9b7d4e11")]
    String,
);

impl<S: Send + Sync> FromRequestParts<S> for ScheduleIdPath {
    type Rejection = Error;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        Path::<String>::from_request_parts(parts, state)
            .await
            .map(|Path(id)| Self(id))
            .map_err(|_| Error::NotFound("the path names no schedule".into()))
    }
}

fn schedule_id(id: &str) -> Result<ScheduleId, Error> {
    ScheduleId::parse(id).ok_or_else(|| Error::NotFound(format!("no pending schedule {id:?}")))
}

/// A pending schedule.
#[utoipa::path(
    get,
    path = "/schedules/{id}",
    operation_id = "getSchedule",
    tag = "messages",
    params(ScheduleIdPath),
    responses(
        (status = 200, description = "The schedule", body = ScheduleDto),
        Guarded, ScheduleRefusals,
    )
)]
pub(crate) async fn one(
    State(gateway): State<Arc<Gateway>>,
    ScheduleIdPath(id): ScheduleIdPath,
) -> Result<Json<ScheduleDto>, Error> {
    let id = schedule_id(&id)?;
    Ok(Json(gateway.scheduled(&id).await?.into()))
}

/// Cancel a schedule: after this answer it never fires. A schedule that fired first answers
/// 404; one due within a moment answers 409 `schedule-firing` (retry after it).
#[utoipa::path(
    delete,
    path = "/schedules/{id}",
    operation_id = "cancelSchedule",
    tag = "messages",
    params(ScheduleIdPath),
    responses(
        (status = 204, description = "Cancelled: it will not fire"),
        Guarded, ScheduleCancelRefusals,
    )
)]
pub(crate) async fn cancel(
    State(gateway): State<Arc<Gateway>>,
    ScheduleIdPath(id): ScheduleIdPath,
) -> Result<StatusCode, Error> {
    let id = schedule_id(&id)?;
    gateway.cancel_schedule(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}
