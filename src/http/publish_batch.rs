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

use super::body::JsonBody;
use super::dto::PublishBody;
use super::problem::Problem;
use super::publish::{expectation_named, prepare, record_outcome};
use super::responses::{BodyRefusals, Guarded, PublishBatchRefusals};
use super::schedules::ScheduledResponse;
use crate::error::Error;
use crate::gateway::{Gateway, ScheduleChecks};
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
    /// 1 to 1 000 messages, each as the body of `POST /publish`. A message that is not
    /// one (a field unknown or of the wrong type) refuses the whole request, naming it
    /// (`messages[3].colour`); one the stream or the gateway refuses for what it says (a
    /// subject no stream captures, bad base64, a bad TTL, an expectation) is refused alone,
    /// in its result (unless `atomic`).
    #[schema(min_items = 1, max_items = 1000)]
    pub(crate) messages: Vec<PublishBody>,
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
    /// A message with `delay` or `deliver_at`: stored as a schedule.
    Scheduled(ScheduledItem),
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

/// A message of a batch stored as a schedule (it had `delay` or `deliver_at`).
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct ScheduledItem {
    /// 202.
    pub(crate) status: u16,
    #[serde(flatten)]
    pub(crate) scheduled: ScheduledResponse,
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
    let prepared = body
        .messages
        .into_iter()
        .enumerate()
        .map(|(index, message)| prepare(message).map_err(|err| indexed(index, err)));
    if body.atomic {
        let prepared = prepared.collect::<Result<Vec<_>, _>>()?;
        if let Some((index, (_, field))) = prepared
            .iter()
            .enumerate()
            .find_map(|(index, item)| item.deliver_at.map(|at| (index, at)))
        {
            return Err(Error::invalid(
                &format!("messages[{index}].{field}"),
                format!("messages[{index}]: an atomic batch is stored now, all of it: no {field}"),
            ));
        }
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
    let mut results: Vec<Option<BatchItemResult>> = (0..count).map(|_| None).collect();
    // Messages published now, and delayed ones as their schedules: each group sent in one
    // go, then its acknowledgements awaited together.
    let (mut published_at, mut messages) = (Vec::new(), Vec::new());
    let (mut scheduled_at, mut schedules) = (Vec::new(), Vec::new());
    let mut checks = ScheduleChecks::default();
    for (index, item) in prepared.enumerate() {
        let mut item = match item {
            Ok(item) => item,
            Err(refused) => {
                results[index] = Some(BatchItemResult::Refused(refused.problem()));
                continue;
            }
        };
        if let Some((at, field)) = item.deliver_at {
            let target = item.subject.clone();
            match gateway
                .prepare_once(&mut checks, &item.subject, item.headers, at, field)
                .await
            {
                Ok(prepared) => {
                    scheduled_at.push((index, target, at));
                    schedules.push((prepared, item.payload));
                }
                Err(err) => {
                    results[index] = Some(BatchItemResult::Refused(indexed(index, err).problem()));
                }
            }
            continue;
        }
        let span = telemetry::spans::send_span(&item.subject, &mut item.headers);
        published_at.push((index, span, item.expects_by_field));
        messages.push(Ok((item.subject, item.headers, item.payload)));
    }
    let published = gateway.publish_many(messages).await;
    for ((index, mut span, expects_by_field), published) in published_at.into_iter().zip(published)
    {
        let published = published
            .map_err(|err| indexed(index, err))
            .map_err(|err| expectation_named(err, expects_by_field));
        record_outcome(&mut span, &published);
        results[index] = Some(match published {
            Ok(ack) => BatchItemResult::Stored(StoredItem {
                status: StatusCode::CREATED.as_u16(),
                stream: ack.stream,
                sequence: ack.sequence,
                duplicate: ack.duplicate,
            }),
            Err(err) => BatchItemResult::Refused(err.problem()),
        });
    }
    let stored = gateway.store_schedules(schedules, false).await;
    for ((index, target, at), stored) in scheduled_at.into_iter().zip(stored) {
        results[index] = Some(match stored {
            Ok(scheduled) => BatchItemResult::Scheduled(ScheduledItem {
                status: StatusCode::ACCEPTED.as_u16(),
                scheduled: ScheduledResponse::new(scheduled, target, at),
            }),
            Err(err) => BatchItemResult::Refused(indexed(index, err).problem()),
        });
    }
    let results = results.into_iter().flatten().collect();
    Ok((StatusCode::OK, Json(PublishBatchResponse { results })).into_response())
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
