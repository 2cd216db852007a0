//! `POST /publish`: put a message on the stream (for trying the gateway with curl).
//!
//! May import: as the rest of `http`.

use std::str::FromStr;
use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use base64::Engine;
use base64::engine::general_purpose::STANDARD;

use super::body::JsonBody;
use super::dto::{Encoding, HeaderValues, PublishBody, PublishResponse};
use super::responses::{BodyRefusals, Guarded, PublishRefusals};
use crate::domain::ordering::{MAX_KEY_BYTES, ORDERING_KEY_HEADER};
use crate::domain::subject::validate_publish_subject;
use crate::error::Error;
use crate::gateway::Gateway;
use crate::telemetry;

/// Publish a message to a subject the stream captures; answers once the stream stored it.
#[utoipa::path(
    post,
    path = "/publish",
    operation_id = "publishMessage",
    tag = "messages",
    request_body(content = PublishBody, content_type = "application/json"),
    responses(
        (status = 201, description = "Stored by the stream", body = PublishResponse),
        Guarded, BodyRefusals, PublishRefusals,
    )
)]
pub(crate) async fn publish(
    State(gateway): State<Arc<Gateway>>,
    JsonBody(body): JsonBody<PublishBody>,
) -> Result<(StatusCode, Json<PublishResponse>), Error> {
    validate_publish_subject(&body.subject)
        .map_err(|why| Error::invalid("subject", format!("subject: {why}")))?;
    let payload = match body.encoding.unwrap_or(Encoding::Utf8) {
        Encoding::Utf8 => body.data.into_bytes(),
        Encoding::Base64 => STANDARD
            .decode(body.data.as_bytes())
            .map_err(|err| Error::invalid("data", format!("data: not valid base64: {err}")))?,
    };
    let mut headers = async_nats::HeaderMap::new();
    for (name, values) in body.headers {
        // NATS writes headers as `Name: value` lines: an empty name (stored as `: v`) makes
        // other clients read no headers at all, and a colon or a control character in a
        // name would split or end the line.
        if name.is_empty()
            || name
                .chars()
                .any(|c| c == ':' || c.is_whitespace() || c.is_control())
        {
            return Err(Error::invalid(
                "headers",
                format!(
                    "headers: invalid header name {name:?} (must be non-empty, without spaces, colons or control characters)"
                ),
            ));
        }
        let header_name = async_nats::header::HeaderName::from_str(&name).map_err(|_| {
            Error::invalid("headers", format!("headers: invalid header name {name:?}"))
        })?;
        let values = match values {
            HeaderValues::One(value) => vec![value],
            HeaderValues::Many(values) => values,
        };
        for value in values {
            let value = async_nats::HeaderValue::from_str(&value).map_err(|_| {
                Error::invalid("headers", format!("headers: invalid value for {name:?}"))
            })?;
            headers.append(header_name.clone(), value);
        }
    }
    if let Some(key) = body.ordering_key {
        if key.is_empty() || key.len() > MAX_KEY_BYTES || key.chars().any(char::is_control) {
            return Err(Error::invalid(
                "ordering_key",
                format!(
                    "ordering_key: must be 1 to {MAX_KEY_BYTES} bytes without control characters"
                ),
            ));
        }
        let value = async_nats::HeaderValue::from_str(&key).map_err(|_| {
            Error::invalid("ordering_key", "ordering_key: not a valid header value")
        })?;
        headers.insert(ORDERING_KEY_HEADER, value);
    }
    let mut span = telemetry::spans::send_span(&body.subject, &mut headers);
    let published = gateway.publish(body.subject, headers, payload.into()).await;
    telemetry::spans::sent(
        &mut span,
        published
            .as_ref()
            .map(|ack| (ack.stream.as_str(), ack.sequence))
            .map_err(|err| err.status().as_u16()),
    );
    let ack = published?;
    Ok((
        StatusCode::CREATED,
        Json(PublishResponse {
            stream: ack.stream,
            sequence: ack.sequence,
            duplicate: ack.duplicate,
        }),
    ))
}
