//! `POST /fetch`: lease a batch of messages.
//!
//! May import: as the rest of `http`.

use std::sync::Arc;
use std::time::Duration;

use axum::Extension;
use axum::body::Body;
use axum::extract::FromRequestParts;
use axum::extract::State;
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;

use super::body::JsonBody;
use super::client::Connection;
use super::consumers::ConsumerPath;
use super::dto::{Encoding, FetchBody, FetchResponse, MessageDto};
use super::responses::{BodyRefusals, FetchRefusals, Guarded, NamedFetchRefusals};
use crate::config::Config;
use crate::domain::delivery::{Demand, Leased};
use crate::domain::idempotency::{self, Fingerprint, Scope};
use crate::error::Error;
use crate::gateway::{Consumer, Gateway, Idempotency, Target};
use crate::http::auth::Principal;
use crate::metrics::FetchRefusal;
use crate::telemetry;

/// The request header that makes a fetch retry-safe.
pub(crate) const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// Set on an answer that repeats an earlier one for the same `Idempotency-Key`.
pub(crate) const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

pub(crate) const DEFAULT_BATCH: u32 = 10;
pub(crate) const DEFAULT_WAIT_MS: u64 = 5_000;

/// Lease up to `batch` messages.
///
/// Returns as soon as at least one message is leased, with every message available at that
/// moment (up to `batch`); waits up to `wait_ms` only while none is.
#[utoipa::path(
    post,
    path = "/fetch",
    operation_id = "fetchMessages",
    tag = "leases",
    params(
        ("Idempotency-Key" = Option<String>, Header,
            description = "Makes the fetch retry-safe: repeated (1 to 255 printable ASCII characters, same body) while any lease of its first answer is live, it returns that answer again instead of leasing more. Scoped by the caller: a JWT's subject, else the Authorization header.",
            // The key: 1 to 255 printable ASCII characters. HTTP drops spaces and tabs around a
            // header value, so the raw header may carry them (and be longer).
            pattern = "^[ \\t]*[!-~]([ -~]{0,253}[!-~])?[ \\t]*$"),
    ),
    request_body(content = Option<FetchBody>, content_type = "application/json"),
    responses(
        (status = 200, description = "Leased messages (possibly none)", body = FetchResponse,
            headers(("Idempotent-Replayed" = String, description = "`true` when this repeats the first answer for the Idempotency-Key"))),
        Guarded, BodyRefusals, FetchRefusals,
    )
)]
pub(crate) async fn fetch(
    State(gateway): State<Arc<Gateway>>,
    connection: Option<Extension<Connection>>,
    principal: Option<Extension<Principal>>,
    headers: FetchHeaders,
    JsonBody(body): JsonBody<FetchBody>,
) -> Result<Response, Error> {
    let consumer = gateway.consumer(Target::Default).await?;
    fetch_from(&consumer, connection, principal, headers, body).await
}

/// Lease up to `batch` messages of the consumer the path names.
///
/// As `POST /fetch`, for this consumer: the same body, long poll, `max_bytes`, `encoding`,
/// `Idempotency-Key` (scoped by caller and consumer), and 429 at its `max_ack_pending`.
#[utoipa::path(
    post,
    path = "/streams/{stream}/consumers/{consumer}/fetch",
    operation_id = "fetchNamedMessages",
    tag = "leases",
    params(
        ConsumerPath,
        ("Idempotency-Key" = Option<String>, Header,
            description = "As for POST /fetch, scoped by the caller and this consumer.",
            pattern = "^[ \\t]*[!-~]([ -~]{0,253}[!-~])?[ \\t]*$"),
    ),
    request_body(content = Option<FetchBody>, content_type = "application/json"),
    responses(
        (status = 200, description = "Leased messages (possibly none)", body = FetchResponse,
            headers(("Idempotent-Replayed" = String, description = "`true` when this repeats the first answer for the Idempotency-Key"))),
        Guarded, BodyRefusals, NamedFetchRefusals,
    )
)]
pub(crate) async fn fetch_named(
    State(gateway): State<Arc<Gateway>>,
    path: ConsumerPath,
    connection: Option<Extension<Connection>>,
    principal: Option<Extension<Principal>>,
    headers: FetchHeaders,
    JsonBody(body): JsonBody<FetchBody>,
) -> Result<Response, Error> {
    let consumer = gateway.consumer(Target::Named(&path.name())).await?;
    fetch_from(&consumer, connection, principal, headers, body).await
}

/// A fetch from `consumer`, however the request named it.
async fn fetch_from(
    gateway: &Consumer,
    connection: Option<Extension<Connection>>,
    principal: Option<Extension<Principal>>,
    headers: FetchHeaders,
    body: FetchBody,
) -> Result<Response, Error> {
    let encoding = body.encoding.unwrap_or_default();
    let demand = demand(&body, gateway.config())?;
    // Held until the answer is built: counts this fetch against its token's share.
    let _waiting = match &principal {
        Some(Extension(principal)) => {
            let limit = gateway.config().max_waiting_fetches_per_token as usize;
            Some(
                principal
                    .begin_fetch(limit)
                    .inspect_err(|_| gateway.metrics().fetch_refused(FetchRefusal::TokenLimit))?,
            )
        }
        None => None,
    };
    let credential = principal
        .as_ref()
        .and_then(|Extension(principal)| principal.idempotency_credential());
    let idempotency = idempotency(&headers, credential.as_deref(), &demand, encoding)?;
    let client = connection.map(|Extension(connection)| connection.client);
    let name = gateway.name();
    // Behind a lock: the answer is rendered by a shared closure.
    let span = std::sync::Mutex::new(telemetry::spans::receive_span(&name.stream, &name.consumer));
    let fetched = gateway
        .fetch(demand, idempotency, client.as_ref(), |leased| {
            if let Ok(mut span) = span.lock() {
                telemetry::spans::received(&mut span, &leased);
            }
            render(leased, encoding)
        })
        .await?;
    let mut response = json_response(fetched.body);
    if fetched.replayed {
        response
            .headers_mut()
            .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    }
    Ok(response)
}

/// The request headers a fetch reads, taken alone: a copy of the whole header map would be
/// held by a long poll for its whole wait.
pub(crate) struct FetchHeaders {
    idempotency_key: Option<HeaderValue>,
    authorization: Option<HeaderValue>,
}

impl<S: Send + Sync> FromRequestParts<S> for FetchHeaders {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        // Copies: a clone would share the bytes of the connection's read buffer, and keep
        // all of it for the poll's whole wait.
        let copied = |value: &HeaderValue| HeaderValue::from_bytes(value.as_bytes()).ok();
        let idempotency_key = parts.headers.get(IDEMPOTENCY_KEY).and_then(copied);
        // Read only to scope an Idempotency-Key.
        let authorization = idempotency_key
            .as_ref()
            .and_then(|_| parts.headers.get(header::AUTHORIZATION).and_then(copied));
        Ok(Self {
            idempotency_key,
            authorization,
        })
    }
}

/// The fetch's `Idempotency-Key`, scoped by the caller — a JWT's subject (`credential`) or
/// else the `Authorization` header — with what it asks.
fn idempotency(
    headers: &FetchHeaders,
    credential: Option<&[u8]>,
    demand: &Demand,
    encoding: Encoding,
) -> Result<Option<Idempotency>, Error> {
    let Some(key) = &headers.idempotency_key else {
        return Ok(None);
    };
    let key = idempotency::validate_key(key.as_bytes())
        .map_err(|detail| Error::invalid("Idempotency-Key", detail))?;
    let credential =
        credential.or_else(|| headers.authorization.as_ref().map(HeaderValue::as_bytes));
    let scope = Scope::new(key, credential);
    let fingerprint = Fingerprint::of(&format!(
        "batch={};wait={:?};max_bytes={:?};encoding={encoding:?}",
        demand.batch, demand.wait, demand.max_bytes
    ));
    Ok(Some(Idempotency { scope, fingerprint }))
}

/// The answer's JSON.
fn render(leased: Vec<Leased>, encoding: Encoding) -> Result<Bytes, Error> {
    let messages = leased
        .into_iter()
        .map(|leased| MessageDto::new(leased, encoding))
        .collect();
    serde_json::to_vec(&FetchResponse { messages })
        .map(Bytes::from)
        .map_err(|err| Error::Unavailable(format!("encoding the answer: {err}")))
}

fn json_response(body: Bytes) -> Response {
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        Body::from(body),
    )
        .into_response()
}

fn demand(body: &FetchBody, config: &Config) -> Result<Demand, Error> {
    let max_batch = config.max_batch;
    let max_wait_ms = u64::try_from(config.max_wait.as_millis()).unwrap_or(u64::MAX);
    let batch = body.batch.unwrap_or(DEFAULT_BATCH.min(max_batch));
    if !(1..=max_batch).contains(&batch) {
        return Err(Error::invalid(
            "batch",
            format!("batch: must be between 1 and {max_batch}, got {batch}"),
        ));
    }
    let wait_ms = body.wait_ms.unwrap_or(DEFAULT_WAIT_MS.min(max_wait_ms));
    if wait_ms > max_wait_ms {
        return Err(Error::invalid(
            "wait_ms",
            format!("wait_ms: must be between 0 and {max_wait_ms}, got {wait_ms}"),
        ));
    }
    let max_bytes = match body.max_bytes {
        Some(max) if max < 1 => {
            return Err(Error::invalid("max_bytes", "max_bytes: must be at least 1"));
        }
        Some(max) => Some(usize::try_from(max).unwrap_or(usize::MAX)),
        None => None,
    };
    Ok(Demand {
        batch: batch as usize,
        credit: batch as usize,
        wait: Duration::from_millis(wait_ms),
        max_bytes,
        stream: None,
        patient: false,
    })
}
