//! `POST /messages/...`: settle (ack, nak, term) or extend leases, one or many at a time.
//!
//! May import: as the rest of `http`.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::{FromRequestParts, Path, State};
use axum::http::StatusCode;
use axum::http::request::Parts;
use utoipa::IntoParams;

use super::body::JsonBody;
use super::dto::{
    BatchAckBody, BatchNakBody, BatchResponse, BatchResult, BatchTermBody, ExtendResponse, NakBody,
    TermBody, rfc3339,
};
use super::responses::{BodyRefusals, Guarded, LeaseRefusals};
use crate::domain::consumers::ConsumerName;
use crate::domain::settle::AckCommand;
use crate::error::Error;
use crate::gateway::Gateway;
use crate::http::auth::Principal;
use crate::http::scopes::Scope;

const MAX_IDS: usize = 1000;

/// The `{id}` path segment. One that is not even valid text names no lease: 404 as
/// problem+json rather than axum's plain-text rejection.
#[derive(IntoParams)]
#[into_params(names("id"), parameter_in = Path)]
pub(crate) struct LeaseIdPath(
    /// Lease id from `POST /fetch`.
    #[param(
        example = "Al8MKp5B07fIAAAAAQAAAAAAAAABAAAAAAAAAAEAAAAAAAAAARjYLSCjdiMgmjxR4HstTxjG4Ct9laHzTg"
    )]
    String,
);

impl<S: Send + Sync> FromRequestParts<S> for LeaseIdPath {
    type Rejection = Error;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        Path::<String>::from_request_parts(parts, state)
            .await
            .map(|Path(id)| Self(id))
            .map_err(|_| Error::UnknownLease)
    }
}
const MAX_DELAY_MS: u64 = 604_800_000;
const MAX_REASON_CHARS: usize = 1024;

/// Acknowledge a message: it will not be delivered again.
///
/// Answers 204 only once the NATS server confirmed the ack.
#[utoipa::path(
    post,
    path = "/messages/{id}/ack",
    operation_id = "ackMessage",
    tag = "leases",
    params(LeaseIdPath),
    responses(
        (status = 204, description = "Acked (confirmed by the server)"),
        Guarded, LeaseRefusals,
    )
)]
pub(crate) async fn ack(
    State(gateway): State<Arc<Gateway>>,
    settler: Settler,
    LeaseIdPath(id): LeaseIdPath,
) -> Result<StatusCode, Error> {
    settle(&gateway, &settler, &id, AckCommand::Ack).await
}

/// Negatively acknowledge a message: redeliver it (after `delay_ms`, if given).
#[utoipa::path(
    post,
    path = "/messages/{id}/nak",
    operation_id = "nakMessage",
    tag = "leases",
    params(LeaseIdPath),
    request_body(content = Option<NakBody>, content_type = "application/json"),
    responses(
        (status = 204, description = "Nak'd (confirmed by the server)"),
        Guarded, BodyRefusals, LeaseRefusals,
    )
)]
pub(crate) async fn nak(
    State(gateway): State<Arc<Gateway>>,
    settler: Settler,
    LeaseIdPath(id): LeaseIdPath,
    JsonBody(body): JsonBody<NakBody>,
) -> Result<StatusCode, Error> {
    settle(&gateway, &settler, &id, nak_command(body.delay_ms)?).await
}

/// Terminate a message: never deliver it again (with an optional reason).
///
/// With a dead-letter subject configured, on a stream that deletes the message on term
/// (work-queue or interest retention), the message is copied there first; a copy that
/// cannot be stored answers 503 and sends no term (the lease stays valid).
#[utoipa::path(
    post,
    path = "/messages/{id}/term",
    operation_id = "termMessage",
    tag = "leases",
    params(LeaseIdPath),
    request_body(content = Option<TermBody>, content_type = "application/json"),
    responses(
        (status = 204, description = "Terminated (confirmed by the server)"),
        Guarded, BodyRefusals, LeaseRefusals,
    )
)]
pub(crate) async fn term(
    State(gateway): State<Arc<Gateway>>,
    settler: Settler,
    LeaseIdPath(id): LeaseIdPath,
    JsonBody(body): JsonBody<TermBody>,
) -> Result<StatusCode, Error> {
    settle(&gateway, &settler, &id, term_command(body.reason)?).await
}

/// Report work in progress: restart the lease (and the server's ack timer).
#[utoipa::path(
    post,
    path = "/messages/{id}/in-progress",
    operation_id = "extendLease",
    tag = "leases",
    params(LeaseIdPath),
    responses(
        (status = 200, description = "Lease extended", body = ExtendResponse),
        Guarded, LeaseRefusals,
    )
)]
pub(crate) async fn in_progress(
    State(gateway): State<Arc<Gateway>>,
    settler: Settler,
    LeaseIdPath(id): LeaseIdPath,
) -> Result<Json<ExtendResponse>, Error> {
    let expires_at = gateway.extend(&id, &|name| settler.may(name)).await?;
    Ok(Json(ExtendResponse {
        lease_expires_at: rfc3339(expires_at),
    }))
}

/// Acknowledge many messages; each id gets the answer the single endpoint would give.
#[utoipa::path(
    post,
    path = "/messages/ack",
    operation_id = "ackMessages",
    tag = "leases",
    request_body(content = BatchAckBody, content_type = "application/json"),
    responses(
        (status = 200, description = "One result per id, in request order", body = BatchResponse),
        Guarded, BodyRefusals,
    )
)]
pub(crate) async fn ack_many(
    State(gateway): State<Arc<Gateway>>,
    settler: Settler,
    JsonBody(body): JsonBody<BatchAckBody>,
) -> Result<Json<BatchResponse>, Error> {
    settle_many(&gateway, &settler, body.ids, AckCommand::Ack).await
}

/// Nak many messages; each id gets the answer the single endpoint would give.
#[utoipa::path(
    post,
    path = "/messages/nak",
    operation_id = "nakMessages",
    tag = "leases",
    request_body(content = BatchNakBody, content_type = "application/json"),
    responses(
        (status = 200, description = "One result per id, in request order", body = BatchResponse),
        Guarded, BodyRefusals,
    )
)]
pub(crate) async fn nak_many(
    State(gateway): State<Arc<Gateway>>,
    settler: Settler,
    JsonBody(body): JsonBody<BatchNakBody>,
) -> Result<Json<BatchResponse>, Error> {
    settle_many(&gateway, &settler, body.ids, nak_command(body.delay_ms)?).await
}

/// Terminate many messages; each id gets the answer the single endpoint would give.
#[utoipa::path(
    post,
    path = "/messages/term",
    operation_id = "termMessages",
    tag = "leases",
    request_body(content = BatchTermBody, content_type = "application/json"),
    responses(
        (status = 200, description = "One result per id, in request order", body = BatchResponse),
        Guarded, BodyRefusals,
    )
)]
pub(crate) async fn term_many(
    State(gateway): State<Arc<Gateway>>,
    settler: Settler,
    JsonBody(body): JsonBody<BatchTermBody>,
) -> Result<Json<BatchResponse>, Error> {
    settle_many(&gateway, &settler, body.ids, term_command(body.reason)?).await
}

/// Who settles: the caller's token, whose `settle` scopes say on which consumers.
pub(crate) struct Settler(Option<Principal>);

impl Settler {
    /// Whether the caller may settle leases of `name` (always, with authentication off).
    pub(crate) fn may(&self, name: &ConsumerName) -> bool {
        self.0
            .as_ref()
            .is_none_or(|principal| principal.allows_on(Scope::Settle, name))
    }

    /// Whether the caller may settle on any consumer at all.
    pub(crate) fn reaches_any(&self) -> bool {
        self.0
            .as_ref()
            .is_none_or(|principal| principal.reaches(Scope::Settle))
    }

    pub(crate) fn of(principal: Option<Principal>) -> Self {
        Self(principal)
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Settler {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        Ok(Self(parts.extensions.get::<Principal>().cloned()))
    }
}

/// Settle one lease: 204 once the server confirmed.
async fn settle(
    gateway: &Gateway,
    settler: &Settler,
    id: &str,
    command: AckCommand,
) -> Result<StatusCode, Error> {
    gateway
        .settle(id, &command, &|name| settler.may(name))
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Settle every id concurrently (see [`Gateway::settle_many`]).
async fn settle_many(
    gateway: &Gateway,
    settler: &Settler,
    ids: Vec<String>,
    command: AckCommand,
) -> Result<Json<BatchResponse>, Error> {
    if ids.is_empty() || ids.len() > MAX_IDS {
        return Err(Error::invalid(
            "ids",
            format!("ids: must hold 1 to {MAX_IDS} lease ids, got {}", ids.len()),
        ));
    }
    let outcomes = gateway
        .settle_many(&ids, &command, &|name| settler.may(name))
        .await;
    let results = ids
        .into_iter()
        .zip(outcomes)
        .map(|(id, outcome)| match outcome {
            Ok(()) => BatchResult {
                id,
                status: StatusCode::NO_CONTENT.as_u16(),
                detail: None,
            },
            Err(err) => BatchResult {
                id,
                status: err.status().as_u16(),
                detail: Some(err.public_detail()),
            },
        })
        .collect();
    Ok(Json(BatchResponse { results }))
}

pub(super) fn nak_command(delay_ms: Option<u64>) -> Result<AckCommand, Error> {
    match delay_ms {
        Some(ms) if ms > MAX_DELAY_MS => Err(Error::invalid(
            "delay_ms",
            format!("delay_ms: must be between 0 and {MAX_DELAY_MS}, got {ms}"),
        )),
        Some(0) | None => Ok(AckCommand::Nak { delay: None }),
        Some(ms) => Ok(AckCommand::Nak {
            delay: Some(Duration::from_millis(ms)),
        }),
    }
}

pub(super) fn term_command(reason: Option<String>) -> Result<AckCommand, Error> {
    match reason {
        Some(reason) if reason.chars().count() > MAX_REASON_CHARS => Err(Error::invalid(
            "reason",
            format!("reason: must be at most {MAX_REASON_CHARS} characters"),
        )),
        // The reason travels in the ack payload, which NATS treats as one line.
        Some(reason) if reason.contains(['\r', '\n']) => {
            Err(Error::invalid("reason", "reason: must be a single line"))
        }
        Some(reason) if reason.trim().is_empty() => Ok(AckCommand::Term { reason: None }),
        reason => Ok(AckCommand::Term { reason }),
    }
}
