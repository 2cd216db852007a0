//! The OpenAPI description of error answers: one reusable response per kind of problem
//! (`#/components/responses/...`), grouped into the sets of refusals each endpoint can give.
//!
//! Each response's status, `type`, `title` and example are taken from the [`Error`] that
//! answers it, so the spec cannot describe a problem differently from how it is sent.
//!
//! May import: as the rest of `http`.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::http::StatusCode;

use utoipa::openapi::example::ExampleBuilder;
use utoipa::openapi::header::HeaderBuilder;
use utoipa::openapi::response::{Response, ResponseBuilder};
use utoipa::openapi::{
    ComponentsBuilder, ContentBuilder, ObjectBuilder, OpenApi, Ref, RefOr, Type,
};
use utoipa::{IntoResponses, Modify, PartialSchema, ToSchema};

use super::body::BODY_LIMIT;
use super::problem::{PROBLEM_JSON, Problem};
use crate::domain::settle::SettleKind;
use crate::error::Error;

/// Every kind of problem a route can answer; the name is the response's component name.
#[derive(Debug, Clone, Copy)]
pub(crate) enum ProblemKind {
    Unauthorized,
    Forbidden,
    BodyTimeout,
    MalformedJson,
    PayloadTooLarge,
    InvalidRequest,
    LeaseNotFound,
    LeaseSettled,
    LeaseGone,
    TooManyLeases,
    Unavailable,
    NotConfirmed,
    PublishPrecondition,
    PublishConflict,
    ConsumerNotFound,
    ConsumerUnsuitable,
    ServerTooOld,
    DeadLetterNotFound,
    RedriveTaskNotFound,
    RedriveOverlaps,
    ScheduleNotFound,
    ScheduleFiring,
}

impl ProblemKind {
    const ALL: [Self; 22] = [
        Self::Unauthorized,
        Self::Forbidden,
        Self::BodyTimeout,
        Self::MalformedJson,
        Self::PayloadTooLarge,
        Self::InvalidRequest,
        Self::LeaseNotFound,
        Self::LeaseSettled,
        Self::LeaseGone,
        Self::TooManyLeases,
        Self::Unavailable,
        Self::NotConfirmed,
        Self::PublishPrecondition,
        Self::PublishConflict,
        Self::ConsumerNotFound,
        Self::ConsumerUnsuitable,
        Self::ServerTooOld,
        Self::DeadLetterNotFound,
        Self::RedriveTaskNotFound,
        Self::RedriveOverlaps,
        Self::ScheduleNotFound,
        Self::ScheduleFiring,
    ];

    fn name(self) -> &'static str {
        match self {
            Self::Unauthorized => "Unauthorized",
            Self::Forbidden => "Forbidden",
            Self::BodyTimeout => "BodyTimeout",
            Self::MalformedJson => "MalformedJson",
            Self::PayloadTooLarge => "PayloadTooLarge",
            Self::InvalidRequest => "InvalidRequest",
            Self::LeaseNotFound => "LeaseNotFound",
            Self::LeaseSettled => "LeaseSettled",
            Self::LeaseGone => "LeaseGone",
            Self::TooManyLeases => "TooManyLeases",
            Self::Unavailable => "Unavailable",
            Self::NotConfirmed => "NotConfirmed",
            Self::PublishPrecondition => "PublishPrecondition",
            Self::PublishConflict => "PublishConflict",
            Self::ConsumerNotFound => "ConsumerNotFound",
            Self::ConsumerUnsuitable => "ConsumerUnsuitable",
            Self::ServerTooOld => "ServerTooOld",
            Self::DeadLetterNotFound => "DeadLetterNotFound",
            Self::RedriveTaskNotFound => "RedriveTaskNotFound",
            Self::RedriveOverlaps => "RedriveOverlaps",
            Self::ScheduleNotFound => "ScheduleNotFound",
            Self::ScheduleFiring => "ScheduleFiring",
        }
    }

    fn description(self) -> &'static str {
        match self {
            Self::Unauthorized => {
                "Authentication is on and the request has no valid bearer token (`Authorization: Bearer <token>`)."
            }
            Self::Forbidden => {
                "The bearer token is valid but lacks the scope this endpoint needs (fetch, settle, publish or admin)."
            }
            Self::BodyTimeout => {
                "The request body did not arrive within the body-read timeout; the connection is closed."
            }
            Self::MalformedJson => "The request body is not JSON.",
            Self::PayloadTooLarge => "The request body is larger than 256 KiB.",
            Self::InvalidRequest => {
                "A field (or header) has the wrong type, is out of range, unknown or missing, or an Idempotency-Key was reused with another body; `field` names it."
            }
            Self::LeaseNotFound => {
                "No lease with this id was issued: malformed, forged or unknown."
            }
            Self::LeaseSettled => {
                "The lease was already settled with another outcome (the same action repeated answers as the first time did)."
            }
            Self::LeaseGone => {
                "The lease expired, the message was delivered again (it has a new lease id), or the replica that issued it is gone."
            }
            Self::TooManyLeases => {
                "All `max_ack_pending` leases are out (or, with authentication on, this token has as many fetches waiting as it may); retry after `Retry-After` seconds."
            }
            Self::Unavailable => {
                "NATS is unreachable, the consumer is gone, or the gateway is shutting down; or the consumer is being bound anew because the consumers file changed a setting only a new binding applies (`consumer-rebinding`); or its settles are less durable than `--require-durability` asks (`durability-insufficient`; `field` names the field of its `durability` that falls short). On an ack or term: the server confirmed it, but its record for the fleet could not be stored — retry with the same id."
            }
            Self::NotConfirmed => {
                "The NATS server did not confirm in time; the lease stays valid and retrying is safe."
            }
            Self::ConsumerNotFound => {
                "The path names a consumer this gateway does not serve: no --serve-existing pattern matches it, the server has no such stream or consumer, it was removed from the consumers file, or a name breaks the NATS name rules; the detail says which."
            }
            Self::ConsumerUnsuitable => {
                "The consumer exists but cannot be served: a push consumer, a consumer that is not durable, or one whose ack policy is not explicit (`consumer-unsuitable`; the detail names the setting); or it is paused (`consumer-paused`, with `paused_until` unless it is paused until resumed)."
            }
            Self::DeadLetterNotFound => {
                "No dead letter has this id in a dead-letter stream of this gateway: it was redriven (and removed), removed by the stream's limits, or never was."
            }
            Self::ScheduleNotFound => {
                "No pending schedule has this id: it was cancelled, or it was a one-shot schedule that fired (gone once it fired), or the id is malformed."
            }
            Self::ScheduleFiring => {
                "The schedule is due within a moment (or overdue, as after a server outage): nats-server takes up a due schedule before it fires it, and a delete landing between the two does not stop it, so this cancel would not be sure to. Nothing was changed. Retry after `Retry-After` seconds: a one-shot that fired then answers 404, a recurring one is cancelled."
            }
            Self::RedriveTaskNotFound => {
                "No redrive task has this id (a finished task's record is kept for 7 days)."
            }
            Self::RedriveOverlaps => {
                "A running redrive task (`task`) takes some of the same dead letters: a dead letter is published back at most once, so the new task is not made. Wait until that task ends, or cancel it, and ask again."
            }
            Self::ServerTooOld => {
                "The NATS server lacks what this needs (a consumer reset or a recurring schedule needs nats-server 2.14 or later, an atomic batch or a delayed message 2.12); the detail names its version."
            }
            Self::PublishPrecondition => {
                "An expectation did not hold: `expected_last_sequence` or `expected_last_subject_sequence` (`precondition-failed`, with `last_sequence`: the stream's or the subject's last sequence now), or a `Nats-Expected-*` header (`publish-precondition-failed`). Nothing was stored, and retrying as is cannot succeed."
            }
            Self::PublishConflict => {
                "The stream's configuration does not allow what the message asks for — `setting` names the stream setting that would (`allow_msg_ttl` for a `ttl`: `ttl-not-allowed`; `allow_atomic` for an atomic batch: `atomic-not-allowed`) —, or an atomic batch's msg ids are already stored (`batch-already-stored`: an earlier attempt stored it); for a delayed message or a schedule, a stream not set up for schedules: `schedules-not-allowed` (`allow_msg_schedules`), `schedules-not-set-up` (it does not capture the gateway's schedule subjects), `schedules-would-be-leased` (a consumer's filter takes them; the detail names it). Nothing was stored."
            }
        }
    }

    /// The errors answered as this kind, each an example of it (the first is the main one).
    fn examples(self) -> Vec<Error> {
        match self {
            Self::Unauthorized => vec![
                Error::Unauthorized { invalid: false },
                Error::Unauthorized { invalid: true },
            ],
            Self::Forbidden => vec![Error::Forbidden { scope: "fetch" }],
            Self::BodyTimeout => vec![Error::BodyTimeout {
                timeout: Duration::from_secs(10),
            }],
            Self::MalformedJson => vec![Error::Malformed {
                detail: "the request body is not valid JSON: EOF while parsing an object".into(),
            }],
            Self::PayloadTooLarge => vec![Error::PayloadTooLarge { limit: BODY_LIMIT }],
            Self::InvalidRequest => vec![
                Error::invalid("batch", "batch: must be between 1 and 1000, got 0"),
                Error::invalid(
                    "Idempotency-Key",
                    "Idempotency-Key: already used with a different request body; use a new key",
                ),
            ],
            Self::LeaseNotFound => vec![Error::UnknownLease],
            Self::LeaseSettled => vec![Error::AlreadySettled {
                settled: SettleKind::Ack,
            }],
            Self::LeaseGone => vec![Error::LeaseGone, Error::OwnerGone],
            Self::TooManyLeases => vec![
                Error::AtCapacity {
                    max_ack_pending: 1024,
                    retry_after: Duration::from_secs(3),
                },
                Error::TooManyWaitingFetches {
                    limit: 100,
                    retry_after: Duration::from_secs(1),
                },
            ],
            Self::Unavailable => vec![
                Error::Unavailable("not connected to NATS".into()),
                Error::ShuttingDown,
                Error::Rebinding(
                    "consumer ORDERS/shipping is bound anew with the settings the consumers file now gives it once its live leases have ended; they still settle".into(),
                ),
                Error::DurabilityInsufficient {
                    field: "stream_replicas",
                    detail: "consumer ORDERS/billing is not served: --require-durability replicated is not met: stream_replicas is 1; at least 3 are required".into(),
                },
            ],
            Self::NotConfirmed => vec![Error::TimedOut],
            Self::ConsumerNotFound => vec![Error::ConsumerNotFound(
                "consumer ORDERS/shipping does not exist on the server".into(),
            )],
            Self::ConsumerUnsuitable => vec![
                Error::ConsumerUnsuitable(
                    "consumer ORDERS/shipping is a push consumer (deliver_subject is set); the gateway serves pull consumers only".into(),
                ),
                Error::ConsumerPaused {
                    consumer: "ORDERS/shipping".into(),
                    until: time::OffsetDateTime::from_unix_timestamp(1_796_126_400).ok(),
                },
            ],
            Self::ServerTooOld => vec![Error::NotImplemented(
                "moving a consumer needs nats-server 2.14 or later (its consumer reset); this server is 2.11.9".into(),
            )],
            Self::DeadLetterNotFound => vec![Error::NotFound("no dead letter DLQ:17".into())],
            Self::ScheduleFiring => vec![Error::ScheduleFiring {
                detail: "schedule ORDERS.5f1e0c2a9b7d4e11 is due at 2026-12-07T09:00:00.000Z: too close to its time for a cancel to be sure to stop it; retry after Retry-After seconds (once it fired, a one-shot answers 404)".into(),
                retry_after: Duration::from_secs(1),
            }],
            Self::ScheduleNotFound => vec![Error::NotFound(
                "no pending schedule ORDERS.5f1e0c2a9b7d4e11: it was cancelled, or it fired (a one-shot schedule is gone once it fired)".into(),
            )],
            Self::RedriveTaskNotFound => {
                vec![Error::NotFound("no redrive task \"5f1e0c2a9b7d4e11\"".into())]
            }
            Self::RedriveOverlaps => vec![Error::RedriveOverlaps {
                task: "5f1e0c2a9b7d4e11".into(),
            }],
            Self::PublishPrecondition => vec![
                Error::PublishPrecondition {
                    detail: "the stream refused the message: wrong last sequence: 7 (code 400, error code 10071)"
                        .into(),
                    last_sequence: Some(7),
                    by_header: false,
                },
                Error::PublishPrecondition {
                    detail: "the stream refused the message: wrong last msg ID: 4f1c (code 400, error code 10070)"
                        .into(),
                    last_sequence: None,
                    by_header: true,
                },
            ],
            Self::PublishConflict => vec![
                Error::StreamDisallows {
                    setting: "allow_msg_ttl",
                    detail: "the stream refused the message: per-message TTL is disabled (code 400, error code 10166); set `allow_msg_ttl: true` in the stream's configuration".into(),
                },
                Error::StreamDisallows {
                    setting: "allow_atomic",
                    detail: "the stream refused the message: atomic publish is disabled (code 400, error code 10174); set `allow_atomic: true` in the stream's configuration".into(),
                },
                Error::BatchAlreadyStored(
                    "the stream already has messages with this batch's msg ids (stored by an earlier attempt); nothing was stored now".into(),
                ),
            ],
        }
    }

    fn status(self) -> String {
        self.examples()
            .first()
            .map_or(StatusCode::INTERNAL_SERVER_ERROR, Error::status)
            .as_u16()
            .to_string()
    }

    /// The reusable response: problem+json with its examples, plus `Retry-After` for 429 and 503.
    fn response(self) -> Response {
        let errors = self.examples();
        let problems: Vec<Problem> = errors.iter().map(Error::problem).collect();
        let mut content =
            ContentBuilder::new().schema(Some(Ref::from_schema_name(Problem::name())));
        content = match problems.as_slice() {
            [one] => content.example(serde_json::to_value(one).ok()),
            several => content.examples_from_iter(several.iter().map(|problem| {
                let slug = problem.kind.rsplit(':').next().unwrap_or_default();
                let name = match &problem.field {
                    Some(field) => format!("{slug}-{}", field.to_lowercase()),
                    None => slug.to_owned(),
                };
                let example = ExampleBuilder::new()
                    .summary(problem.title.clone())
                    .value(serde_json::to_value(problem).ok());
                (name, example)
            })),
        };
        let mut response = ResponseBuilder::new()
            .description(self.description())
            .content(PROBLEM_JSON, content.build());
        if problems.iter().any(|problem| problem.retry_after.is_some()) {
            response = response.header(
                "Retry-After",
                HeaderBuilder::new()
                    .schema(Some(
                        ObjectBuilder::new()
                            .schema_type(Type::Integer)
                            .minimum(Some(1)),
                    ))
                    .description(Some(
                        "Whole seconds to wait before retrying (as `retry_after` in the body)",
                    ))
                    .build(),
            );
        }
        if matches!(self, Self::Unauthorized | Self::Forbidden) {
            response = response.header(
                "WWW-Authenticate",
                HeaderBuilder::new()
                    .schema(Some(ObjectBuilder::new().schema_type(Type::String)))
                    .description(Some(
                        "`Bearer realm=\"ruststream-nats\"`, with `error=\"invalid_token\"` or `error=\"insufficient_scope\", scope=\"…\"` (RFC 6750)",
                    ))
                    .build(),
            );
        }
        response.build()
    }

    fn reference(self) -> RefOr<Response> {
        RefOr::Ref(Ref::from_response_name(self.name()))
    }
}

/// Adds every problem response (and the problem schema) to the document's components, so
/// the sets below can refer to them.
pub(crate) struct ProblemResponses;

impl Modify for ProblemResponses {
    fn modify(&self, openapi: &mut OpenApi) {
        let components = openapi.components.take().unwrap_or_default();
        let mut builder =
            ComponentsBuilder::from(components).schema(Problem::name(), Problem::schema());
        for kind in ProblemKind::ALL {
            builder = builder.response(kind.name(), kind.response());
        }
        openapi.components = Some(builder.build());
    }
}

fn refusals(kinds: &[ProblemKind]) -> BTreeMap<String, RefOr<Response>> {
    kinds
        .iter()
        .map(|kind| (kind.status(), kind.reference()))
        .collect()
}

/// Declares a set of refusals: a type to name in `#[utoipa::path(responses(...))]`.
macro_rules! refusal_sets {
    ($($(#[$doc:meta])* $set:ident = [$($kind:ident),*];)*) => {
    /// Every set, for the test that no two kinds in one set share a status.
    #[cfg(test)]
    const SETS: &[&[ProblemKind]] = &[$(&[$(ProblemKind::$kind),*]),*];
    $(
        $(#[$doc])*
        pub(crate) struct $set;

        impl IntoResponses for $set {
            fn responses() -> BTreeMap<String, RefOr<Response>> {
                refusals(&[$(ProblemKind::$kind),*])
            }
        }
    )*};
}

refusal_sets! {
    /// What every protected endpoint (all but the probes and the docs) can refuse before
    /// its handler runs: no valid token (401), or a token without the scope (403).
    Guarded = [Unauthorized, Forbidden];
    /// An endpoint reading a JSON body: too slow, not JSON, too large, or a bad field.
    BodyRefusals = [BodyTimeout, MalformedJson, PayloadTooLarge, InvalidRequest];
    /// An endpoint settling or extending one lease by its id.
    LeaseRefusals = [LeaseNotFound, LeaseSettled, LeaseGone, Unavailable, NotConfirmed];
    /// `POST /fetch` beyond its body: no slot free, or no NATS.
    FetchRefusals = [TooManyLeases, Unavailable, ConsumerUnsuitable];
    /// An endpoint that needs the NATS server.
    NatsRefusals = [Unavailable];
    /// An endpoint reading its query string: a parameter out of range or unknown.
    QueryRefusals = [InvalidRequest];
    /// `POST /publish` beyond its body: an expectation header that did not hold, or no NATS.
    PublishRefusals = [PublishPrecondition, PublishConflict, ServerTooOld, Unavailable];
    /// `POST /schedules` beyond its body: a stream not set up for schedules, a server
    /// without recurring ones, or no NATS.
    ScheduleCreateRefusals = [PublishConflict, ServerTooOld, Unavailable];
    /// `GET` or `DELETE /schedules/{id}`: no such pending schedule, or no NATS.
    ScheduleRefusals = [Unavailable, ScheduleNotFound];
    /// `DELETE /schedules/{id}`: as [`ScheduleRefusals`], and a schedule too close to its
    /// fire time to be sure a cancel stops it.
    ScheduleCancelRefusals = [Unavailable, ScheduleNotFound, ScheduleFiring];
    /// `POST /publish/batch` beyond its body: as [`PublishRefusals`], for an atomic batch
    /// also a server without atomic batches.
    PublishBatchRefusals = [PublishPrecondition, PublishConflict, ServerTooOld, Unavailable];
    /// A route naming its consumer, with the refusals of `POST /fetch` beyond its body.
    NamedFetchRefusals = [TooManyLeases, Unavailable, ConsumerNotFound, ConsumerUnsuitable];
    /// A route naming its consumer that needs the NATS server.
    NamedNatsRefusals = [Unavailable, ConsumerNotFound, ConsumerUnsuitable];
    /// `POST …/seek` beyond its body: a server without the consumer reset, or as
    /// [`NamedNatsRefusals`].
    SeekRefusals = [Unavailable, ConsumerNotFound, ConsumerUnsuitable, ServerTooOld];
    /// `GET /dead-letters/{id}`: no such dead letter, or no NATS.
    DeadLetterRefusals = [Unavailable, DeadLetterNotFound];
    /// `POST /dead-letters/redrive` beyond its body: a running task takes some of the same
    /// dead letters, or no NATS.
    RedriveRefusals = [Unavailable, RedriveOverlaps];
    /// `GET` or `DELETE /dead-letters/redrive/{task}`: no such task, or no NATS.
    RedriveTaskRefusals = [Unavailable, RedriveTaskNotFound];
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_has_its_own_status_within_a_set() {
        for kind in ProblemKind::ALL {
            for error in kind.examples() {
                assert_eq!(
                    error.status().as_u16().to_string(),
                    kind.status(),
                    "{kind:?}: {error:?}"
                );
            }
        }
        for set in SETS {
            let mut statuses: Vec<_> = set.iter().map(|kind| kind.status()).collect();
            statuses.sort();
            statuses.dedup();
            assert_eq!(
                statuses.len(),
                set.len(),
                "two kinds of problem would share a status code in one response set: {set:?}"
            );
        }
    }
}
