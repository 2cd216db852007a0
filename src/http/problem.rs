//! RFC 9457 problem+json responses for every error a client can see.
//!
//! May import: as the rest of `http`.

use axum::body::Body;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

use crate::error::Error;

pub(crate) const PROBLEM_JSON: &str = "application/problem+json";

/// What internal NATS subjects contain; no client-facing detail may show one.
const INTERNAL_SUBJECT_MARKERS: [&str; 4] = ["$JS.", "$SYS.", "_INBOX.", "$KV."];

/// An RFC 9457 problem details object.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[schema(example = json!({
    "type": "urn:ruststream-nats:problem:lease-gone",
    "title": "Lease gone",
    "status": 410,
    "detail": "the lease is no longer valid: it expired or the message was delivered again",
    "instance": "/messages/Al8MKp5B07fI/ack"
}))]
pub(crate) struct Problem {
    /// A URI naming the kind of problem; stable, usable for dispatching in clients.
    #[serde(rename = "type")]
    #[schema(format = "uri")]
    pub(crate) kind: String,
    /// Short summary of the kind of problem.
    pub(crate) title: String,
    /// The HTTP status code.
    #[schema(minimum = 400, maximum = 599)]
    pub(crate) status: u16,
    /// What went wrong in this occurrence.
    pub(crate) detail: String,
    /// The request path this occurrence answered.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(format = "uri-reference")]
    pub(crate) instance: Option<String>,
    /// The request field at fault, for validation errors.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) field: Option<String>,
    /// Seconds until a retry can succeed (mirrors the Retry-After header), for 429 and 503.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1)]
    pub(crate) retry_after: Option<u64>,
    /// Until when the consumer is paused (RFC 3339), for `consumer-paused`; absent when it
    /// is paused until resumed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) paused_until: Option<String>,
    /// The running redrive task in the way, for `redrive-overlaps`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) task: Option<String>,
    /// For a failed publish precondition: the sequence the server compared with — the
    /// stream's last sequence (`expected_last_sequence`), or the subject's
    /// (`expected_last_subject_sequence`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) last_sequence: Option<u64>,
    /// The stream setting that would allow what was refused (`allow_msg_ttl`,
    /// `allow_atomic`, `allow_msg_schedules`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) setting: Option<String>,
}

impl Error {
    /// The HTTP status for this error.
    pub(crate) fn status(&self) -> StatusCode {
        match self {
            Self::Malformed { .. } | Self::BadRequest { .. } => StatusCode::BAD_REQUEST,
            Self::Invalid { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            Self::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::UnknownLease | Self::NotFound(_) | Self::ConsumerNotFound(_) => {
                StatusCode::NOT_FOUND
            }
            Self::ConsumerUnsuitable(_)
            | Self::ConsumerPaused { .. }
            | Self::StreamDisallows { .. }
            | Self::BatchAlreadyStored(_)
            | Self::ScheduleFiring { .. } => StatusCode::CONFLICT,
            Self::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            Self::NotImplemented(_) => StatusCode::NOT_IMPLEMENTED,
            Self::LeaseGone | Self::OwnerGone => StatusCode::GONE,
            Self::AlreadySettled { .. } | Self::RedriveOverlaps { .. } => StatusCode::CONFLICT,
            Self::AtCapacity { .. } | Self::TooManyWaitingFetches { .. } => {
                StatusCode::TOO_MANY_REQUESTS
            }
            Self::Unauthorized { .. } => StatusCode::UNAUTHORIZED,
            Self::Forbidden { .. } => StatusCode::FORBIDDEN,
            Self::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            Self::Unavailable(_)
            | Self::Rebinding(_)
            | Self::ShuttingDown
            | Self::ClientGone
            | Self::DurabilityInsufficient { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Self::TimedOut => StatusCode::GATEWAY_TIMEOUT,
            Self::PublishPrecondition { .. } => StatusCode::PRECONDITION_FAILED,
            Self::UriTooLong { .. } => StatusCode::URI_TOO_LONG,
            Self::HeadersTooLarge { .. } => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
        }
    }

    fn slug_and_title(&self) -> (&'static str, &'static str) {
        match self {
            Self::Malformed { .. } => ("malformed-json", "Malformed JSON"),
            Self::BadRequest { .. } => ("bad-request", "Bad request"),
            Self::Invalid { .. } => ("invalid-request", "Invalid request"),
            Self::PayloadTooLarge { .. } => ("payload-too-large", "Request body too large"),
            Self::UnknownLease => ("lease-not-found", "Lease not found"),
            Self::NotFound(_) => ("not-found", "Not found"),
            Self::ConsumerNotFound(_) => ("consumer-not-found", "Consumer not found"),
            Self::ConsumerUnsuitable(_) => ("consumer-unsuitable", "Consumer unsuitable"),
            Self::ConsumerPaused { .. } => ("consumer-paused", "Consumer paused"),
            Self::MethodNotAllowed(_) => ("method-not-allowed", "Method not allowed"),
            Self::NotImplemented(_) => ("server-too-old", "NATS server too old"),
            Self::LeaseGone | Self::OwnerGone => ("lease-gone", "Lease gone"),
            Self::AlreadySettled { .. } => ("lease-settled", "Lease already settled"),
            Self::RedriveOverlaps { .. } => ("redrive-overlaps", "Redrive overlaps a running one"),
            Self::AtCapacity { .. } => ("too-many-leases", "Too many leases in flight"),
            Self::Unavailable(_) => ("unavailable", "NATS unavailable"),
            Self::DurabilityInsufficient { .. } => {
                ("durability-insufficient", "Durability insufficient")
            }
            Self::Rebinding(_) => ("consumer-rebinding", "Consumer being bound anew"),
            Self::ShuttingDown => ("shutting-down", "Shutting down"),
            Self::ClientGone => ("client-gone", "Client closed the connection"),
            Self::UriTooLong { .. } => ("uri-too-long", "Request URI too long"),
            Self::HeadersTooLarge { .. } => ("headers-too-large", "Request headers too large"),
            Self::Unauthorized { .. } => ("unauthorized", "Authentication required"),
            Self::Forbidden { .. } => ("forbidden", "Scope missing"),
            Self::TooManyWaitingFetches { .. } => {
                ("too-many-waiting-fetches", "Too many waiting fetches")
            }
            Self::BodyTimeout { .. } => ("body-timeout", "Request body too slow"),
            Self::TimedOut => ("not-confirmed", "Settle not confirmed in time"),
            // The header form kept the type it has always had; the fields name the plainer one.
            Self::PublishPrecondition {
                by_header: true, ..
            } => ("publish-precondition-failed", "Publish expectation failed"),
            Self::PublishPrecondition {
                by_header: false, ..
            } => ("precondition-failed", "Precondition failed"),
            Self::BatchAlreadyStored(_) => ("batch-already-stored", "Batch already stored"),
            Self::ScheduleFiring { .. } => ("schedule-firing", "Schedule about to fire"),
            Self::StreamDisallows { setting, .. } => match *setting {
                "allow_msg_ttl" => ("ttl-not-allowed", "Stream does not allow per-message TTL"),
                "allow_atomic" => ("atomic-not-allowed", "Stream does not allow atomic batches"),
                "subjects" => (
                    "schedules-not-set-up",
                    "Stream does not capture the schedule subjects",
                ),
                "filter_subject" => (
                    "schedules-would-be-leased",
                    "A consumer would lease the schedules",
                ),
                _ => (
                    "schedules-not-allowed",
                    "Stream does not allow message schedules",
                ),
            },
        }
    }

    /// Whole seconds to wait before retrying a 429, a 503 or a cancel of a schedule about to
    /// fire, never zero.
    fn retry_after_secs(&self) -> Option<u64> {
        match self {
            // A 503 is an outage of this gateway's NATS connection (or its shutdown): a
            // second is enough for a client to try again, here or at another replica.
            Self::Unavailable(_) | Self::Rebinding(_) | Self::ShuttingDown => Some(1),
            // Held until the operator changes something; the binding is tried again within
            // a minute.
            Self::DurabilityInsufficient { .. } => Some(30),
            Self::AtCapacity { retry_after, .. }
            | Self::TooManyWaitingFetches { retry_after, .. }
            | Self::ScheduleFiring { retry_after, .. } => {
                let secs = retry_after.as_secs() + u64::from(retry_after.subsec_nanos() > 0);
                Some(secs.max(1))
            }
            _ => None,
        }
    }

    /// The detail as a client may see it: any word naming an internal NATS subject (the
    /// JetStream API, acks, inboxes, system events), which an error from the NATS client
    /// could carry, is replaced. A safety net: the texts we write never name one.
    pub(crate) fn public_detail(&self) -> String {
        let detail = self.to_string();
        if !INTERNAL_SUBJECT_MARKERS
            .iter()
            .any(|marker| detail.contains(marker))
        {
            return detail;
        }
        detail
            .split(' ')
            .map(|word| {
                if INTERNAL_SUBJECT_MARKERS
                    .iter()
                    .any(|marker| word.contains(marker))
                {
                    "<internal subject>"
                } else {
                    word
                }
            })
            .collect::<Vec<_>>()
            .join(" ")
    }

    pub(crate) fn problem(&self) -> Problem {
        let (slug, title) = self.slug_and_title();
        Problem {
            kind: format!("urn:ruststream-nats:problem:{slug}"),
            title: title.to_owned(),
            status: self.status().as_u16(),
            detail: self.public_detail(),
            instance: None,
            field: match self {
                Self::Invalid { field, .. } => field.clone(),
                Self::DurabilityInsufficient { field, .. } => Some((*field).to_owned()),
                _ => None,
            },
            retry_after: self.retry_after_secs(),
            paused_until: match self {
                Self::ConsumerPaused {
                    until: Some(until), ..
                } => until
                    .format(&time::format_description::well_known::Rfc3339)
                    .ok(),
                _ => None,
            },
            task: match self {
                Self::RedriveOverlaps { task } => Some(task.clone()),
                _ => None,
            },
            last_sequence: match self {
                Self::PublishPrecondition { last_sequence, .. } => *last_sequence,
                _ => None,
            },
            setting: match self {
                Self::StreamDisallows { setting, .. } => Some((*setting).to_owned()),
                _ => None,
            },
        }
    }
}

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let problem = self.problem();
        let body = serde_json::to_vec(&problem).unwrap_or_default();
        let mut response = (self.status(), body).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(secs) = problem.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        // RFC 6750: say which scheme is wanted, and why a token was refused.
        let challenge = match &self {
            Self::Unauthorized { invalid: false } => {
                Some("Bearer realm=\"ruststream-nats\"".to_owned())
            }
            Self::Unauthorized { invalid: true } => {
                Some("Bearer realm=\"ruststream-nats\", error=\"invalid_token\"".to_owned())
            }
            Self::Forbidden { scope } => Some(format!(
                "Bearer realm=\"ruststream-nats\", error=\"insufficient_scope\", scope=\"{scope}\""
            )),
            _ => None,
        };
        if let Some(challenge) = challenge.and_then(|value| HeaderValue::from_str(&value).ok()) {
            headers.insert(header::WWW_AUTHENTICATE, challenge);
        }
        if matches!(self, Self::BodyTimeout { .. }) {
            // The rest of the body may still be on its way: do not read it as a next request.
            headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        // For `name_instance`, which knows the request; the handler that failed does not.
        response.extensions_mut().insert(problem);
        response
    }
}

/// [`tower_http::catch_panic`]'s answer when a handler panicked: a problem+json 500 instead
/// of a dropped connection. The panic's message goes to the log only: it may name internals.
pub(crate) fn panic_response(panic: Box<dyn std::any::Any + Send + 'static>) -> Response {
    let message = panic
        .downcast_ref::<&str>()
        .map(|message| (*message).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_default();
    tracing::error!(panic = %message, "a request handler panicked");
    let problem = Problem {
        kind: "urn:ruststream-nats:problem:internal".into(),
        title: "Internal error".into(),
        status: StatusCode::INTERNAL_SERVER_ERROR.as_u16(),
        detail: "the gateway failed while answering this request; the failure is logged".into(),
        instance: None,
        field: None,
        retry_after: None,
        paused_until: None,
        task: None,
        last_sequence: None,
        setting: None,
    };
    let body = serde_json::to_vec(&problem).unwrap_or_default();
    let mut response = (
        StatusCode::INTERNAL_SERVER_ERROR,
        [(header::CONTENT_TYPE, PROBLEM_JSON)],
        body,
    )
        .into_response();
    response.extensions_mut().insert(problem);
    response
}

/// Names the request's `path` as the `instance` of a problem answer (the router's outermost
/// middleware calls this on every answer; others pass through untouched).
pub(crate) fn name_instance(response: Response, path: &str) -> Response {
    if response.extensions().get::<Problem>().is_none() {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    match parts.extensions.remove::<Problem>() {
        Some(mut problem) => {
            problem.instance = Some(path.to_owned());
            parts.headers.remove(header::CONTENT_LENGTH);
            let body = serde_json::to_vec(&problem).unwrap_or_default();
            Response::from_parts(parts, Body::from(body))
        }
        None => Response::from_parts(parts, body),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::extract::Request;
    use axum::middleware::Next;

    /// A panic becomes a problem+json 500 that does not repeat the panic's message; behind
    /// `name_instance` (as in the router) it names the request path.
    #[tokio::test]
    async fn a_panicking_handler_answers_a_problem_500_without_internals() {
        use tower_service::Service as _;
        let mut app = axum::Router::new()
            .route(
                "/boom",
                axum::routing::get(|| async {
                    if std::hint::black_box(true) {
                        panic!("secret internal state 0xdeadbeef");
                    }
                }),
            )
            .layer(tower_http::catch_panic::CatchPanicLayer::custom(
                panic_response,
            ))
            .layer(axum::middleware::from_fn(
                |request: Request, next: Next| async move {
                    let path = request.uri().path().to_owned();
                    name_instance(next.run(request).await, &path)
                },
            ));
        let request = Request::builder()
            .uri("/boom")
            .body(Body::empty())
            .expect("request");
        let response = app
            .call(request)
            .await
            .expect("an answer, not a dropped connection");
        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(
            response
                .headers()
                .get(header::CONTENT_TYPE)
                .map(|v| v.as_bytes()),
            Some(PROBLEM_JSON.as_bytes())
        );
        let body = axum::body::to_bytes(response.into_body(), 64 * 1024)
            .await
            .expect("body");
        let problem: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
        assert_eq!(problem["status"], 500, "{problem}");
        assert_eq!(problem["instance"], "/boom", "{problem}");
        let text = String::from_utf8_lossy(&body);
        assert!(
            !text.contains("deadbeef") && !text.contains("secret"),
            "{text}"
        );
    }

    #[test]
    fn details_never_name_internal_subjects() {
        let err = Error::Unavailable(
            "asking for consumer info: request to $JS.API.CONSUMER.INFO.ORDERS.billing timed out (reply _INBOX.abc.1)".into(),
        );
        let detail = err.problem().detail;
        assert!(
            !detail.contains("$JS") && !detail.contains("_INBOX"),
            "{detail}"
        );
        assert!(detail.starts_with("asking for consumer info:"), "{detail}");
        let plain = Error::LeaseGone;
        assert_eq!(plain.problem().detail, plain.to_string());
    }
}
