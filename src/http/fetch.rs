//! `POST /fetch`: lease a batch of messages.

use std::time::{Duration, Instant};

use axum::extract::{ConnectInfo, State};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};

use super::body::JsonBody;
use super::client::Client;
use super::dto::{FetchBody, FetchResponse, MessageDto};
use super::responses::{BodyRefusals, FetchRefusals, Guarded};
use crate::auth::Principal;
use crate::config::Config;
use crate::dispatch::Demand;
use crate::error::Error;
use crate::gateway::Gateway;

pub const DEFAULT_BATCH: u32 = 10;
pub const DEFAULT_WAIT_MS: u64 = 5_000;

/// Lease up to `batch` messages.
///
/// Returns as soon as at least one message is leased, with every message available at that
/// moment (up to `batch`); waits up to `wait_ms` only while none is.
#[utoipa::path(
    post,
    path = "/fetch",
    operation_id = "fetchMessages",
    tag = "leases",
    request_body(content = Option<FetchBody>, content_type = "application/json"),
    responses(
        (status = 200, description = "Leased messages (possibly none)", body = FetchResponse),
        Guarded, BodyRefusals, FetchRefusals,
    )
)]
pub async fn fetch(
    State(gateway): State<Gateway>,
    client: Option<Extension<ConnectInfo<Client>>>,
    principal: Option<Extension<Principal>>,
    JsonBody(body): JsonBody<FetchBody>,
) -> Result<Response, Error> {
    let started = Instant::now();
    let encoding = body.encoding.unwrap_or_default();
    let demand = demand(&body, gateway.config())?;
    // Held until the answer is built: counts this fetch against its token's share.
    let _waiting = match &principal {
        Some(Extension(Principal(token))) => {
            Some(token.begin_fetch(gateway.config().max_waiting_fetches_per_token as usize)?)
        }
        None => None,
    };
    let client = client.map(|Extension(ConnectInfo(client))| client);
    let leased = match &client {
        // Dropping the fetch when the client hangs up hands its place (and anything its
        // pull still brings) to the next fetch.
        Some(client) => tokio::select! {
            leased = gateway.fetch(demand) => leased?,
            () = client.hung_up() => return Err(Error::ClientGone),
        },
        None => gateway.fetch(demand).await?,
    };
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
    Ok(response)
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
        Some(0) => {
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
