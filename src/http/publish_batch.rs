//! `POST /publish/batch`: up to 1 000 messages in one request — each stored or refused on
//! its own, sent all at once and then confirmed (not a round trip each) — or, `atomic`, one
//! nats-server atomic batch that the stream stores whole or not at all.
//!
//! May import: as the rest of `http`.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::body::{JsonBody, parse};
use super::dto::PublishBody;
use super::problem::Problem;
use super::publish::{Prepared, expectation_named, prepare, record_outcome};
use super::responses::{BodyRefusals, Guarded, PublishBatchRefusals};
use crate::error::Error;
use crate::gateway::Gateway;
use crate::telemetry;

/// Most messages one batch takes (nats-server's limit for an atomic batch, too).
pub(crate) const MAX_BATCH: usize = 1000;

/// `POST /publish/batch` body.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"messages": [
    {"subject": "orders.created", "data": "order 1", "msg_id": "order-1"},
    {"subject": "orders.created", "data": "order 2", "msg_id": "order-2"}
], "atomic": false}))]
pub(crate) struct PublishBatchBody {
    /// 1 to 1 000 messages, each as the body of `POST /publish` (schema `PublishBody`).
    /// Each is checked on its own, whatever it holds: a bad one — even one that is not a
    /// `PublishBody` at all — is refused alone, in its result (unless `atomic`); so the
    /// items are described as any JSON value here.
    #[schema(value_type = Vec<serde_json::Value>, min_items = 1, max_items = 1000)]
    pub(crate) messages: Vec<serde_json::Value>,
    /// Store all the messages or none, as one nats-server atomic batch (all to one stream
    /// that allows it: `allow_atomic`; nats-server 2.12 or later).
    #[serde(default)]
    pub(crate) atomic: bool,
}

/// `POST /publish/batch` answer when not atomic: one result per message, in request order.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct PublishBatchResponse {
    pub(crate) results: Vec<BatchItemResult>,
}

/// What `POST /publish` would have answered for one message of a batch.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
pub(crate) enum BatchItemResult {
    Stored(StoredItem),
    /// The problem `POST /publish` would have answered, with its `status`; a field at fault
    /// is named with its index (`messages[3].subject`).
    Refused(Problem),
}

/// A message of a batch the stream stored.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"status": 201, "stream": "ORDERS", "sequence": 42, "duplicate": false}))]
pub(crate) struct StoredItem {
    /// 201.
    pub(crate) status: u16,
    pub(crate) stream: String,
    /// The message's stream sequence.
    pub(crate) sequence: u64,
    /// The stream already had a message with this msg id (nothing stored again).
    pub(crate) duplicate: bool,
}

/// `POST /publish/batch` answer for an atomic batch the stream stored.
#[derive(Debug, Serialize, ToSchema)]
#[schema(example = json!({"stream": "ORDERS", "first_sequence": 41, "last_sequence": 43, "count": 3}))]
pub(crate) struct AtomicBatchResponse {
    pub(crate) stream: String,
    /// The first message's stream sequence; the others follow it, in request order.
    pub(crate) first_sequence: u64,
    pub(crate) last_sequence: u64,
    pub(crate) count: u64,
}

/// Publish up to 1 000 messages in one request.
#[utoipa::path(
    post,
    path = "/publish/batch",
    operation_id = "publishBatch",
    tag = "messages",
    request_body(content = PublishBatchBody, content_type = "application/json"),
    responses(
        (status = 200, description = "Not atomic: each message's own result, in request order (a refused message does not stop the others)", body = PublishBatchResponse),
        (status = 201, description = "Atomic: every message stored, with consecutive sequences", body = AtomicBatchResponse),
        Guarded, BodyRefusals, PublishBatchRefusals,
    )
)]
pub(crate) async fn publish_batch(
    State(gateway): State<Arc<Gateway>>,
    JsonBody(body): JsonBody<PublishBatchBody>,
) -> Result<Response, Error> {
    let count = body.messages.len();
    if count == 0 || count > MAX_BATCH {
        return Err(Error::invalid(
            "messages",
            format!("messages: 1 to {MAX_BATCH} messages, not {count}"),
        ));
    }
    let prepared = body.messages.iter().enumerate().map(prepare_item);
    if body.atomic {
        let prepared = prepared.collect::<Result<Vec<_>, _>>()?;
        let expects_by_field = prepared.iter().any(|item| item.expects_by_field);
        let messages = prepared
            .into_iter()
            .map(|item| (item.subject, item.headers, item.payload))
            .collect();
        let ack = gateway
            .publish_atomic(messages)
            .await
            .map_err(|err| expectation_named(err, expects_by_field))?;
        let stored = AtomicBatchResponse {
            first_sequence: ack
                .last_sequence
                .saturating_sub(ack.count.saturating_sub(1)),
            stream: ack.stream,
            last_sequence: ack.last_sequence,
            count: ack.count,
        };
        return Ok((StatusCode::CREATED, Json(stored)).into_response());
    }
    let mut spans = Vec::with_capacity(count);
    let messages = prepared
        .map(|item| {
            item.map(|mut item| {
                spans.push(Some((
                    telemetry::spans::send_span(&item.subject, &mut item.headers),
                    item.expects_by_field,
                )));
                (item.subject, item.headers, item.payload)
            })
            .inspect_err(|_| spans.push(None))
        })
        .collect();
    let published = gateway.publish_many(messages).await;
    let results = published
        .into_iter()
        .zip(spans)
        .enumerate()
        .map(|(index, (published, span))| {
            let published = published.map_err(|err| indexed(index, err));
            let published = match span {
                Some((mut span, expects_by_field)) => {
                    let published =
                        published.map_err(|err| expectation_named(err, expects_by_field));
                    record_outcome(&mut span, &published);
                    published
                }
                None => published,
            };
            match published {
                Ok(ack) => BatchItemResult::Stored(StoredItem {
                    status: StatusCode::CREATED.as_u16(),
                    stream: ack.stream,
                    sequence: ack.sequence,
                    duplicate: ack.duplicate,
                }),
                Err(err) => BatchItemResult::Refused(err.problem()),
            }
        })
        .collect();
    Ok((StatusCode::OK, Json(PublishBatchResponse { results })).into_response())
}

/// Check message `index` as `POST /publish` checks its body.
fn prepare_item((index, item): (usize, &serde_json::Value)) -> Result<Prepared, Error> {
    let bytes = serde_json::to_vec(item)
        .map_err(|err| Error::invalid(&format!("messages[{index}]"), err.to_string()))?;
    parse::<PublishBody>(&bytes)
        .and_then(prepare)
        .map_err(|err| indexed(index, err))
}

/// A refusal of message `index` naming it: its field as `messages[3].subject`.
fn indexed(index: usize, err: Error) -> Error {
    match err {
        Error::Invalid { field, detail }
            if !field
                .as_deref()
                .is_some_and(|field| field.starts_with("messages[")) =>
        {
            let field = match field {
                Some(field) => format!("messages[{index}].{field}"),
                None => format!("messages[{index}]"),
            };
            Error::Invalid {
                field: Some(field),
                detail: format!("messages[{index}]: {detail}"),
            }
        }
        other => other,
    }
}
