//! `POST /stream-tickets`: a single-use ticket, valid 30 s, with which a browser opens a
//! stream (`?ticket=` on `/events`, `/ws` and the named consumers' variants) — `EventSource`
//! and `WebSocket` cannot set `Authorization`, and a long-lived token in a URL ends up in
//! logs. A ticket names one consumer and carries only what its token may do there, sealed:
//! its text reveals nothing about the token. It is redeemed once across the fleet (by the
//! authentication middleware, where it is presented), and a stream opened with it ends when
//! its token is revoked, as one opened with the token would.
//!
//! May import: as the rest of `http`.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::{Extension, Json};
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use utoipa::ToSchema;

use super::body::JsonBody;
use super::dto::rfc3339;
use super::principal::Principal;
use super::responses::{BodyRefusals, Guarded, NamedFetchRefusals};
use super::scopes::Scope;
use crate::domain::consumers::ConsumerName;
use crate::domain::ticket::Ticket;
use crate::error::Error;
use crate::gateway::{Gateway, Target};

/// How long a ticket may wait to be redeemed.
const VALID_FOR: Duration = Duration::from_secs(30);

/// Which consumer's streams the ticket opens; both fields or neither (the default consumer).
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct TicketRequest {
    /// The consumer's stream (with `consumer`).
    stream: Option<String>,
    /// The consumer (with `stream`).
    consumer: Option<String>,
}

/// A ticket: pass it as `?ticket=` when opening the stream, within 30 s, once.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({
    "ticket": "q7Xb0VdU3m9kXh1c2Jf8pZ4oTnRwLs6eYgAiKvHq0DxE5uCt_MaN-bWl7rJy",
    "expires_at": "2026-12-02T10:00:30Z",
    "stream": "ORDERS",
    "consumer": "billing",
    "events": "/streams/ORDERS/consumers/billing/events?ticket=q7Xb0VdU3m9kXh1c2Jf8pZ4oTnRwLs6eYgAiKvHq0DxE5uCt_MaN-bWl7rJy",
    "ws": "/streams/ORDERS/consumers/billing/ws?ticket=q7Xb0VdU3m9kXh1c2Jf8pZ4oTnRwLs6eYgAiKvHq0DxE5uCt_MaN-bWl7rJy"
}))]
pub(crate) struct TicketResponse {
    ticket: String,
    expires_at: String,
    stream: String,
    consumer: String,
    /// The consumer's event stream, with the ticket (relative to the gateway).
    events: String,
    /// The consumer's WebSocket, with the ticket (relative to the gateway).
    ws: String,
}

/// A single-use ticket to open a stream from a browser.
///
/// The caller's token must have the `fetch` scope on the consumer (its `settle` scope there,
/// if any, carries over to settles sent in band over a WebSocket). The ticket is valid for
/// 30 s and opens one stream, once, at any replica; the stream then lives as one opened with
/// the token would (it ends if a reload revokes the token).
#[utoipa::path(
    post,
    path = "/stream-tickets",
    operation_id = "createStreamTicket",
    tag = "leases",
    request_body(content = Option<TicketRequest>, content_type = "application/json"),
    responses(
        (status = 200, description = "A ticket for one stream of the consumer", body = TicketResponse),
        Guarded, BodyRefusals, NamedFetchRefusals,
    )
)]
pub(crate) async fn create(
    State(gateway): State<Arc<Gateway>>,
    principal: Option<Extension<Principal>>,
    JsonBody(body): JsonBody<TicketRequest>,
) -> Result<Json<TicketResponse>, Error> {
    let name = match (body.stream, body.consumer) {
        (Some(stream), Some(consumer)) => Some(ConsumerName::new(&stream, &consumer)),
        (None, None) => None,
        (Some(_), None) => return Err(Error::invalid("consumer", "consumer: give it with stream")),
        (None, Some(_)) => return Err(Error::invalid("stream", "stream: give it with consumer")),
    };
    let principal = principal.map(|Extension(principal)| principal);
    // The scope first: a token learns nothing of consumers it may not reach.
    let allowed = |scope: Scope, name: &ConsumerName| {
        principal
            .as_ref()
            .is_none_or(|principal| principal.allows_on(scope, name))
    };
    if let Some(name) = &name
        && !allowed(Scope::Fetch, name)
    {
        return Err(Error::Forbidden { scope: "fetch" });
    }
    let consumer = match &name {
        Some(name) => gateway.consumer(Target::Named(name)).await?,
        None => gateway.consumer(Target::Default).await?,
    };
    let name = consumer.name().clone();
    if !allowed(Scope::Fetch, &name) {
        return Err(Error::Forbidden { scope: "fetch" });
    }
    let expires_at = OffsetDateTime::now_utc() + VALID_FOR;
    let ticket = Ticket {
        stream: name.stream.clone(),
        consumer: name.consumer.clone(),
        expires_unix_ms: i64::try_from(expires_at.unix_timestamp_nanos() / 1_000_000)
            .unwrap_or(i64::MAX),
        nonce: crate::domain::hex(&rand::random::<[u8; 16]>()),
        settle: allowed(Scope::Settle, &name),
        token: principal
            .as_ref()
            .and_then(Principal::token_digest)
            .map(|digest| gateway.tickets().token_ref(digest)),
        jwt_expires_at: principal.as_ref().and_then(Principal::expires_at),
    };
    let text = gateway.tickets().issue(&ticket);
    let base = format!("/streams/{}/consumers/{}", name.stream, name.consumer);
    Ok(Json(TicketResponse {
        events: format!("{base}/events?ticket={text}"),
        ws: format!("{base}/ws?ticket={text}"),
        ticket: text,
        expires_at: rfc3339(expires_at),
        stream: name.stream,
        consumer: name.consumer,
    }))
}
