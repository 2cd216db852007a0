//! `POST /publish`: put a message on the stream, with its options (de-duplication id, TTL,
//! expectations, ordering key) turned into the NATS headers that carry them.
//!
//! May import: as the rest of `http`.

use std::str::FromStr;
use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use super::body::JsonBody;
use super::dto::{Encoding, HeaderValues, PublishBody, PublishResponse};
use super::responses::{BodyRefusals, Guarded, PublishRefusals};
use super::schedules::ScheduledResponse;
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
        (status = 202, description = "With `delay` or `deliver_at`: stored as a schedule, delivered to `subject` at `deliver_at`", body = ScheduledResponse),
        Guarded, BodyRefusals, PublishRefusals,
    )
)]
pub(crate) async fn publish(
    State(gateway): State<Arc<Gateway>>,
    JsonBody(body): JsonBody<PublishBody>,
) -> Result<Response, Error> {
    let Prepared {
        subject,
        mut headers,
        payload,
        expects_by_field,
        deliver_at,
    } = prepare(body)?;
    if let Some((at, field)) = deliver_at {
        let scheduled = gateway
            .schedule_once(subject.clone(), headers, payload, at, field)
            .await?;
        return Ok((
            StatusCode::ACCEPTED,
            Json(ScheduledResponse::new(scheduled, subject, at)),
        )
            .into_response());
    }
    let mut span = telemetry::spans::send_span(&subject, &mut headers);
    let published = gateway
        .publish(subject, headers, payload)
        .await
        .map_err(|err| expectation_named(err, expects_by_field));
    record_outcome(&mut span, &published);
    let ack = published?;
    Ok((
        StatusCode::CREATED,
        Json(PublishResponse {
            stream: ack.stream,
            sequence: ack.sequence,
            duplicate: ack.duplicate,
        }),
    )
        .into_response())
}

/// Put a publish's outcome on its span: where it was stored, or the status it failed with.
pub(crate) fn record_outcome(
    span: &mut telemetry::spans::MessageSpan,
    published: &Result<async_nats::jetstream::publish::PublishAck, Error>,
) {
    telemetry::spans::sent(
        span,
        published
            .as_ref()
            .map(|ack| (ack.stream.as_str(), ack.sequence))
            .map_err(|err| err.status().as_u16()),
    );
}

/// A publish body checked and turned into what goes to NATS.
pub(crate) struct Prepared {
    pub(crate) subject: String,
    pub(crate) headers: async_nats::HeaderMap,
    pub(crate) payload: bytes::Bytes,
    /// An `expected_last_*` field set the expectation (not a `Nats-Expected-*` header).
    pub(crate) expects_by_field: bool,
    /// When to deliver it, if not at once, and the field that said so.
    pub(crate) deliver_at: Option<(OffsetDateTime, &'static str)>,
}

/// A precondition set by a field is answered as `precondition-failed`; one set by a header
/// keeps the type it always had.
pub(crate) fn expectation_named(err: Error, by_field: bool) -> Error {
    match err {
        Error::PublishPrecondition {
            detail,
            last_sequence,
            ..
        } if by_field => Error::PublishPrecondition {
            detail,
            last_sequence,
            by_header: false,
        },
        other => other,
    }
}

/// Check a publish body and build its subject, headers and payload; every refusal names
/// its field.
pub(crate) fn prepare(body: PublishBody) -> Result<Prepared, Error> {
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
        headers.insert(ORDERING_KEY_HEADER, header_value("ordering_key", &key)?);
    }
    if let Some(id) = body.msg_id {
        if id.is_empty() || id.len() > MAX_MSG_ID_BYTES || id.chars().any(char::is_control) {
            return Err(Error::invalid(
                "msg_id",
                format!("msg_id: must be 1 to {MAX_MSG_ID_BYTES} bytes without control characters"),
            ));
        }
        headers.insert("Nats-Msg-Id", header_value("msg_id", &id)?);
    }
    if let Some(ttl) = body.ttl {
        headers.insert("Nats-TTL", ttl_header(&ttl)?);
    }
    let deliver_at = match (body.delay, body.deliver_at) {
        (Some(_), Some(_)) => {
            return Err(Error::invalid(
                "delay",
                "delay: give delay or deliver_at, not both",
            ));
        }
        (Some(delay), None) => {
            let delay = humantime::parse_duration(&delay).map_err(|_| {
                Error::invalid(
                    "delay",
                    format!("delay: {delay:?} is not a duration (e.g. 90s, 10m, 24h)"),
                )
            })?;
            let delay = time::Duration::try_from(delay)
                .map_err(|_| Error::invalid("delay", "delay: too long"))?;
            Some((OffsetDateTime::now_utc() + delay, "delay"))
        }
        (None, Some(at)) => {
            let at = OffsetDateTime::parse(&at, &Rfc3339).map_err(|_| {
                Error::invalid(
                    "deliver_at",
                    format!(
                        "deliver_at: {at:?} is not an RFC 3339 time (e.g. 2026-12-24T09:00:00Z)"
                    ),
                )
            })?;
            Some((at, "deliver_at"))
        }
        (None, None) => None,
    };
    let expects_by_field =
        body.expected_last_sequence.is_some() || body.expected_last_subject_sequence.is_some();
    if let Some(sequence) = body.expected_last_sequence {
        headers.insert("Nats-Expected-Last-Sequence", sequence.to_string().as_str());
    }
    if let Some(sequence) = body.expected_last_subject_sequence {
        headers.insert(
            "Nats-Expected-Last-Subject-Sequence",
            sequence.to_string().as_str(),
        );
    }
    Ok(Prepared {
        subject: body.subject,
        headers,
        payload: payload.into(),
        expects_by_field,
        deliver_at,
    })
}

/// Longest `msg_id` taken: ids are kept by the stream for its whole duplicate window.
const MAX_MSG_ID_BYTES: usize = 1024;
/// Longest TTL taken: what nats-server's duration type holds (about 292 years).
const MAX_TTL_SECS: u64 = 9_223_372_036;

fn header_value(field: &str, value: &str) -> Result<async_nats::HeaderValue, Error> {
    async_nats::HeaderValue::from_str(value)
        .map_err(|_| Error::invalid(field, format!("{field}: not a valid header value")))
}

/// The `Nats-TTL` value for a `ttl` field: `never`, or whole seconds (at least 1).
fn ttl_header(ttl: &str) -> Result<async_nats::HeaderValue, Error> {
    let refused = |why: &str| {
        Error::invalid(
            "ttl",
            format!(
                "ttl: {why} (a duration of whole seconds such as 30s, 10m or 1h30m, at least 1s, or \"never\")"
            ),
        )
    };
    if ttl == "never" {
        return header_value("ttl", "never");
    }
    let duration = match ttl.parse::<u64>() {
        Ok(secs) => std::time::Duration::from_secs(secs),
        Err(_) => humantime::parse_duration(ttl).map_err(|_| refused("not a duration"))?,
    };
    if duration < std::time::Duration::from_secs(1) {
        return Err(refused("below 1s"));
    }
    if duration.subsec_nanos() != 0 {
        return Err(refused("not whole seconds"));
    }
    if duration.as_secs() > MAX_TTL_SECS {
        return Err(refused("too long"));
    }
    header_value("ttl", &format!("{}s", duration.as_secs()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ttl_is_whole_seconds_of_at_least_one_or_never() {
        let header = |ttl: &str| ttl_header(ttl).map(|value| value.as_str().to_owned());
        assert_eq!(header("never").ok().as_deref(), Some("never"));
        assert_eq!(header("2").ok().as_deref(), Some("2s"));
        assert_eq!(header("10m").ok().as_deref(), Some("600s"));
        assert_eq!(header("1h30m").ok().as_deref(), Some("5400s"));
        for bad in [
            "",
            "0",
            "0s",
            "500ms",
            "1500ms",
            "soon",
            "-1s",
            "1e3",
            "99999999999s",
        ] {
            assert!(header(bad).is_err(), "{bad:?} is refused");
        }
    }
}
