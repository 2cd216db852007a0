//! `POST /fetch`: lease a batch of messages.

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{ConnectInfo, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use bytes::Bytes;

use super::body::JsonBody;
use super::client::Client;
use super::dto::{FetchBody, FetchResponse, MessageDto};
use super::responses::{BodyRefusals, FetchRefusals, Guarded};
use crate::config::Config;
use crate::domain::delivery::Demand;
use crate::domain::idempotency::{self, Begin, Fingerprint, Scope};
use crate::error::Error;
use crate::gateway::Gateway;
use crate::http::auth::Principal;
use crate::metrics::FetchRefusal;

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
            description = "Makes the fetch retry-safe: repeated (1 to 255 printable ASCII characters, same body) while any lease of its first answer is live, it returns that answer again instead of leasing more. Scoped by the Authorization header.",
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
    State(gateway): State<Gateway>,
    client: Option<Extension<ConnectInfo<Client>>>,
    principal: Option<Extension<Principal>>,
    headers: HeaderMap,
    JsonBody(body): JsonBody<FetchBody>,
) -> Result<Response, Error> {
    let started = Instant::now();
    let encoding = body.encoding.unwrap_or_default();
    let demand = demand(&body, gateway.config())?;
    // Held until the answer is built: counts this fetch against its token's share.
    let _waiting = match &principal {
        Some(Extension(Principal(token))) => {
            let limit = gateway.config().max_waiting_fetches_per_token as usize;
            Some(
                token
                    .begin_fetch(limit)
                    .inspect_err(|_| gateway.metrics().fetch_refused(FetchRefusal::TokenLimit))?,
            )
        }
        None => None,
    };
    let client = client.map(|Extension(ConnectInfo(client))| client);
    let Some(key) = headers.get(IDEMPOTENCY_KEY) else {
        let leased = lease(&gateway, demand, client.as_ref()).await?;
        if client.as_ref().is_some_and(Client::has_hung_up) {
            // It left while the answer was on its way: nobody would see these leases.
            gateway.give_back(leased).await;
            return Err(Error::ClientGone);
        }
        let count = leased.len();
        let messages = leased
            .into_iter()
            .map(|leased| MessageDto::new(leased, encoding))
            .collect();
        // Encoded here, so that the latency includes the JSON.
        let response = Json(FetchResponse { messages }).into_response();
        gateway.metrics().fetch_served(started.elapsed(), count);
        return Ok(response);
    };
    let key = idempotency::validate_key(key.as_bytes())
        .map_err(|detail| Error::invalid("Idempotency-Key", detail))?;
    let scope = Scope::new(
        key,
        headers
            .get(header::AUTHORIZATION)
            .map(HeaderValue::as_bytes),
    );
    let fingerprint = Fingerprint::of(&format!(
        "batch={};wait={:?};max_bytes={:?};encoding={encoding:?}",
        demand.batch, demand.wait, demand.max_bytes
    ));
    loop {
        let claim = match gateway.begin_idempotent(&scope, fingerprint) {
            Begin::Replay(body) => {
                let mut response = json_response(body);
                response
                    .headers_mut()
                    .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
                return Ok(response);
            }
            Begin::Mismatch => {
                return Err(Error::invalid(
                    "Idempotency-Key",
                    "Idempotency-Key: already used with a different request body; use a new key",
                ));
            }
            Begin::Wait(mut done) => {
                // The first request with this key is still waiting: take its answer.
                match &client {
                    Some(client) => tokio::select! {
                        _ = done.changed() => {}
                        () = client.hung_up() => return Err(Error::ClientGone),
                    },
                    None => {
                        let _ = done.changed().await;
                    }
                }
                continue;
            }
            Begin::First(claim) => claim,
        };
        let leased = lease(&gateway, demand, client.as_ref()).await?;
        let count = leased.len();
        let keys = leased
            .iter()
            .map(|leased| leased.delivery.coordinates.key)
            .collect();
        let messages = leased
            .into_iter()
            .map(|leased| MessageDto::new(leased, encoding))
            .collect();
        let body = serde_json::to_vec(&FetchResponse { messages })
            .map(Bytes::from)
            .map_err(|err| Error::Unavailable(format!("encoding the answer: {err}")))?;
        // Remembered even when the client hung up meanwhile: it said it would retry, and
        // its retry gets these leases instead of stranding them until they expire.
        claim.answer(body.clone(), keys);
        gateway.metrics().fetch_served(started.elapsed(), count);
        return Ok(json_response(body));
    }
}

/// Lease for this fetch, giving up when the client hangs up mid-wait.
async fn lease(
    gateway: &Gateway,
    demand: Demand,
    client: Option<&Client>,
) -> Result<Vec<crate::domain::delivery::Leased>, Error> {
    match client {
        // Dropping the fetch when the client hangs up hands its place (and anything its
        // pull still brings) to the next fetch.
        Some(client) => tokio::select! {
            leased = gateway.fetch(demand) => leased,
            () = client.hung_up() => Err(Error::ClientGone),
        },
        None => gateway.fetch(demand).await,
    }
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
        wait: Duration::from_millis(wait_ms),
        max_bytes,
    })
}
