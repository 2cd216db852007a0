//! `POST /dead-letters/redrive`, `GET` and `DELETE /dead-letters/redrive/{task}`: send dead
//! letters back (a filter's or a list of ids), as a task that lives in NATS, runs at one
//! replica at a time and survives restarts; read how far it got; cancel it.
//!
//! May import: as the rest of `http`.

use std::sync::Arc;

use axum::Json;
use axum::extract::{FromRequestParts, Path, State};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::body::RequiredJsonBody;
use super::dead_letters::DeadLetterDto;
use super::dto::Encoding;
use super::responses::{BodyRefusals, Guarded, RedriveRefusals, RedriveTaskRefusals};
use crate::domain::subject::validate_publish_subject;
use crate::error::Error;
use crate::gateway::{
    DeadLetterId, Gateway, REDRIVE_DEFAULT_RATE, REDRIVE_MAX_RATE, Redrive, RedriveRequest,
    Selection,
};
use crate::nats::dead_letter_reader::FilterWords;
use crate::nats::redrive::{TaskRecord, TaskState};

/// Most ids one redrive may name.
const MAX_IDS: usize = 1000;

/// `POST /dead-letters/redrive` body: the filters of `GET /dead-letters`, or `ids`; where to
/// send them; how fast. An empty body (or `{}`) takes every dead letter.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"consumer": "billing", "reason": "terminated", "term_reason": "malformed*", "rate": 500, "dry_run": true}))]
pub(crate) struct RedriveBody {
    /// Only the dead letters of this source stream.
    stream: Option<String>,
    /// Only those of this consumer.
    consumer: Option<String>,
    /// `max_deliveries` or `terminated`.
    #[schema(pattern = "^(max_deliveries|terminated)$")]
    reason: Option<String>,
    /// The term's reason exactly, or with a trailing `*` every reason beginning so.
    term_reason: Option<String>,
    /// Only those dead-lettered at or after this time (RFC 3339).
    since: Option<String>,
    /// Only those dead-lettered before this time (RFC 3339).
    until: Option<String>,
    /// These dead letters (ids as a listing gives them; 1 to 1000), instead of a filter.
    #[schema(min_items = 1, max_items = 1000)]
    ids: Option<Vec<String>>,
    /// Publish them here instead of to the subject each was first published to.
    to_subject: Option<String>,
    /// Messages per second (1 to 10 000; default 1000).
    #[schema(minimum = 1, maximum = 10000)]
    rate: Option<u32>,
    /// Only count what would be sent, and show the first 10.
    #[serde(default)]
    dry_run: bool,
}

/// A redrive task started.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"task": "5f1e0c2a9b7d4e11", "matched": 4000}))]
pub(crate) struct RedriveStartedDto {
    /// Its id, for `GET` and `DELETE /dead-letters/redrive/{task}`.
    task: String,
    /// The dead letters it takes (those there when it was made).
    matched: u64,
}

/// What a redrive would send.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct RedriveDryRunDto {
    /// The dead letters it would take.
    matched: u64,
    /// The first (at most 10) of them, oldest first.
    dead_letters: Vec<DeadLetterDto>,
    dry_run: bool,
}

/// A redrive task as it stands.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"task": "5f1e0c2a9b7d4e11", "state": "running", "matched": 4000, "published": 1250, "removed": 1250, "failed": 0, "started_at": "2026-12-04T08:00:00Z", "finished_at": null, "last_error": null, "to_subject": null, "rate": 1000}))]
pub(crate) struct RedriveTaskDto {
    task: String,
    /// `running`, `done`, `cancelled` or `failed`.
    #[schema(pattern = "^(running|done|cancelled|failed)$")]
    state: String,
    /// The dead letters it takes.
    matched: u64,
    /// Published back, each confirmed by the stream that stored it.
    published: u64,
    /// Removed from the dead-letter stream (each only after its publish was confirmed).
    removed: u64,
    /// Not published: refused by the target (no stream takes the subject, …); left where
    /// they were.
    failed: u64,
    /// RFC 3339.
    started_at: String,
    /// RFC 3339; null while running.
    finished_at: Option<String>,
    /// What went wrong last, if anything did.
    last_error: Option<String>,
    /// Where it publishes; null: to each message's own subject.
    to_subject: Option<String>,
    /// Messages per second.
    rate: u32,
}

impl From<TaskRecord> for RedriveTaskDto {
    fn from(record: TaskRecord) -> Self {
        let state = match record.state {
            TaskState::Running => "running",
            TaskState::Done => "done",
            TaskState::Cancelled => "cancelled",
            TaskState::Failed => "failed",
        };
        Self {
            task: record.task,
            state: state.to_owned(),
            matched: record.matched,
            published: record.published,
            removed: record.removed,
            failed: record.failed,
            started_at: record.started_at,
            finished_at: record.finished_at,
            last_error: record.last_error,
            to_subject: record.to_subject,
            rate: record.rate,
        }
    }
}

/// Send dead letters back: those a filter takes (as `GET /dead-letters` filters) or those
/// `ids` name (an id named again counts once), each published again with its original
/// payload and headers (plus `Ruststream-Redriven-From` and `Ruststream-Redrive-Task`, and a
/// `Nats-Msg-Id` of its dead-letter stream and sequence, so nothing is stored twice) to its
/// original subject or `to_subject` (never one under the gateway's internal prefix or
/// `_INBOX`), at `rate` a second, and removed from the dead-letter stream once its publish
/// was confirmed. The task takes the dead letters there now (not those that come later); it
/// runs at one replica at a time and goes on after a restart. A task that would take a dead
/// letter a running task takes is refused (409, naming that task). `dry_run` sends nothing.
#[utoipa::path(
    post,
    path = "/dead-letters/redrive",
    operation_id = "redriveDeadLetters",
    tag = "operations",
    request_body(content = RedriveBody, content_type = "application/json"),
    responses(
        (status = 202, description = "The task is made and runs", body = RedriveStartedDto),
        (status = 200, description = "Dry run: what it would send", body = RedriveDryRunDto),
        Guarded, BodyRefusals, RedriveRefusals,
    )
)]
pub(crate) async fn redrive(
    State(gateway): State<Arc<Gateway>>,
    RequiredJsonBody(body): RequiredJsonBody<RedriveBody>,
) -> Result<Response, Error> {
    let request = request_of(body)?;
    match gateway.redrive(request).await? {
        Redrive::DryRun { matched, first } => Ok(Json(RedriveDryRunDto {
            matched,
            dead_letters: first
                .into_iter()
                .map(|letter| DeadLetterDto::new(letter, Encoding::default()))
                .collect(),
            dry_run: true,
        })
        .into_response()),
        Redrive::Started { task, matched } => Ok((
            StatusCode::ACCEPTED,
            Json(RedriveStartedDto { task, matched }),
        )
            .into_response()),
    }
}

/// The redrive a body asks for, or a 422 naming the field at fault.
fn request_of(body: RedriveBody) -> Result<RedriveRequest, Error> {
    let words = FilterWords {
        stream: body.stream,
        consumer: body.consumer,
        reason: body.reason,
        term_reason: body.term_reason,
        since: body.since,
        until: body.until,
    };
    // Filters are checked where they are read (a bad word is 422 there); with ids none may
    // be given at all.
    let selection = match body.ids {
        None => Selection::Filter(words),
        Some(_) if words != FilterWords::default() => {
            return Err(Error::invalid(
                "ids",
                "ids: give either ids or filters (stream, consumer, reason, term_reason, since, until), not both",
            ));
        }
        Some(ids) if ids.is_empty() || ids.len() > MAX_IDS => {
            return Err(Error::invalid(
                "ids",
                format!("ids: 1 to {MAX_IDS} ids, got {}", ids.len()),
            ));
        }
        Some(ids) => Selection::Ids(
            ids.iter()
                .map(|id| {
                    DeadLetterId::parse(id).ok_or_else(|| {
                        Error::invalid("ids", format!("ids: {id:?} is not a dead letter's id"))
                    })
                })
                .collect::<Result<_, _>>()?,
        ),
    };
    if let Some(subject) = &body.to_subject {
        validate_publish_subject(subject)
            .map_err(|why| Error::invalid("to_subject", format!("to_subject: {why}")))?;
    }
    let rate = body.rate.unwrap_or(REDRIVE_DEFAULT_RATE);
    if !(1..=REDRIVE_MAX_RATE).contains(&rate) {
        return Err(Error::invalid(
            "rate",
            format!("rate: 1 to {REDRIVE_MAX_RATE} messages a second, got {rate}"),
        ));
    }
    Ok(RedriveRequest {
        selection,
        to_subject: body.to_subject,
        rate,
        dry_run: body.dry_run,
    })
}

/// The `{task}` path segment.
#[derive(IntoParams)]
#[into_params(names("task"), parameter_in = Path)]
pub(crate) struct TaskPath(
    /// A redrive task's id, as `POST /dead-letters/redrive` answered it.
    #[param(example = "5f1e0c2a9b7d4e11")]
    String,
);

impl<S: Send + Sync> FromRequestParts<S> for TaskPath {
    type Rejection = Error;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        Path::<String>::from_request_parts(parts, state)
            .await
            .map(|Path(task)| Self(task))
            .map_err(|_| Error::NotFound("the path names no redrive task".into()))
    }
}

/// A redrive task: its state and counts.
#[utoipa::path(
    get,
    path = "/dead-letters/redrive/{task}",
    operation_id = "getRedriveTask",
    tag = "operations",
    params(TaskPath),
    responses(
        (status = 200, description = "The task", body = RedriveTaskDto),
        Guarded, RedriveTaskRefusals,
    )
)]
pub(crate) async fn task(
    State(gateway): State<Arc<Gateway>>,
    TaskPath(task): TaskPath,
) -> Result<Json<RedriveTaskDto>, Error> {
    Ok(Json(gateway.redrive_task(&task).await?.into()))
}

/// Cancel a redrive task. What it published stays published (and removed from the
/// dead-letter stream); the messages in hand are finished first, so nothing is half-done.
/// A task that ended is answered as it is.
#[utoipa::path(
    delete,
    path = "/dead-letters/redrive/{task}",
    operation_id = "cancelRedriveTask",
    tag = "operations",
    params(TaskPath),
    responses(
        (status = 200, description = "The task, cancelled (or as it ended)", body = RedriveTaskDto),
        Guarded, RedriveTaskRefusals,
    )
)]
pub(crate) async fn cancel(
    State(gateway): State<Arc<Gateway>>,
    TaskPath(task): TaskPath,
) -> Result<Json<RedriveTaskDto>, Error> {
    Ok(Json(gateway.cancel_redrive(&task).await?.into()))
}
