//! A push request as the endpoint receives it: the body in the consumer's format, the
//! Standard Webhooks headers and signature, the lease's own headers; and a batch answer's
//! per-message results.
//!
//! May import: as the rest of `push`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, KeyInit as _, Mac as _};
use reqwest::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue};
use serde::Deserialize;
use sha2::Sha256;

use crate::config::{PushFormat, PushSpec};
use crate::domain::delivery::Leased;
use crate::domain::push::Settle;
use crate::http::dto::{Encoding, MessageDto, rfc3339};

/// Headers of a message that never pass through to the endpoint: HTTP/1.1 framing, and the
/// names the gateway itself sets (a message must not forge its own lease or signature).
const NEVER_PASSED: &[&str] = &["content-length", "transfer-encoding", "connection", "host"];
const OWN_PREFIXES: &[&str] = &["webhook-", "ruststream-"];

/// One request, ready to send.
pub(super) struct Request {
    pub(super) headers: HeaderMap,
    pub(super) body: Vec<u8>,
}

/// `<stream>:<stream_sequence>`: the same for every attempt of a message.
pub(super) fn webhook_id(leased: &Leased) -> String {
    format!(
        "{}:{}",
        leased.delivery.stream, leased.delivery.coordinates.key.stream_sequence
    )
}

/// The request for `leases` (one, or a batch in the json format), attempted at `now`.
pub(super) fn build(spec: &PushSpec, leases: &[Leased], now: SystemTime) -> Request {
    // Room for the gateway's own headers (and the Host the client adds), not grown per request.
    let mut headers = HeaderMap::with_capacity(16);
    let first = &leases[0];
    let id = webhook_id(first);
    let timestamp = now
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_secs()
        .to_string();
    let body = match spec.format {
        PushFormat::Json => {
            headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            json_body(spec.batch, leases)
        }
        PushFormat::Binary => {
            message_headers(first, &mut headers, false);
            metadata_headers(first, &mut headers);
            first.delivery.payload.to_vec()
        }
        PushFormat::CloudEvents => {
            let own_event = message_headers(first, &mut headers, true);
            if !own_event {
                cloudevent_headers(first, &id, &mut headers);
            }
            first.delivery.payload.to_vec()
        }
    };
    for (name, value) in &spec.headers {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(value),
        ) {
            headers.insert(name, value);
        }
    }
    set(&mut headers, "ruststream-lease-id", &first.id);
    set(
        &mut headers,
        "ruststream-delivered",
        &first.delivery.coordinates.key.delivered.to_string(),
    );
    if !spec.secrets.is_empty() {
        let signatures: Vec<String> = spec
            .secrets
            .iter()
            .map(|secret| signature(&secret.0, &id, &timestamp, &body))
            .collect();
        set(&mut headers, "webhook-signature", &signatures.join(" "));
    }
    set(&mut headers, "webhook-id", &id);
    set(&mut headers, "webhook-timestamp", &timestamp);
    Request { headers, body }
}

/// `v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">` (Standard Webhooks).
pub(super) fn signature(secret: &[u8], id: &str, timestamp: &str, body: &[u8]) -> String {
    // HMAC takes a key of any length: this cannot fail.
    let mut mac = <Hmac<Sha256>>::new_from_slice(secret).unwrap_or_else(|_| unreachable!());
    mac.update(id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.as_bytes());
    mac.update(b".");
    mac.update(body);
    format!("v1,{}", STANDARD.encode(mac.finalize().into_bytes()))
}

fn set(headers: &mut HeaderMap, name: &'static str, value: &str) {
    if let Ok(value) = HeaderValue::from_str(value) {
        headers.insert(HeaderName::from_static(name), value);
    }
}

/// One message as `POST /fetch` returns it, or `{"messages": […]}` for a batch.
fn json_body(batch: usize, leases: &[Leased]) -> Vec<u8> {
    let messages: Vec<MessageDto> = leases
        .iter()
        .map(|leased| MessageDto::new(leased.clone(), Encoding::Base64))
        .collect();
    // Strings, numbers and maps only: cannot fail.
    if batch > 1 {
        serde_json::to_vec(&serde_json::json!({ "messages": messages })).unwrap_or_default()
    } else {
        serde_json::to_vec(&messages[0]).unwrap_or_default()
    }
}

/// The message's own headers that are valid HTTP headers, and its `Content-Type` (or
/// `application/octet-stream`); whether it carries its own CloudEvent (`ce-specversion`).
fn message_headers(leased: &Leased, headers: &mut HeaderMap, keep_events: bool) -> bool {
    let mut own_event = false;
    if let Some(map) = &leased.delivery.headers {
        for (name, values) in map.iter() {
            let Ok(name) = HeaderName::from_bytes(AsRef::<str>::as_ref(name).as_bytes()) else {
                continue;
            };
            let lower = name.as_str();
            if NEVER_PASSED.contains(&lower)
                || OWN_PREFIXES.iter().any(|prefix| lower.starts_with(prefix))
                || (!keep_events && lower.starts_with("ce-"))
            {
                continue;
            }
            own_event |= lower == "ce-specversion";
            for value in values {
                if let Ok(value) = HeaderValue::from_str(value.as_str()) {
                    headers.append(name.clone(), value);
                }
            }
        }
    }
    if !headers.contains_key(CONTENT_TYPE) {
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/octet-stream"),
        );
    }
    own_event
}

/// Where the binary format says what the body is.
fn metadata_headers(leased: &Leased, headers: &mut HeaderMap) {
    let delivery = &leased.delivery;
    set(headers, "ruststream-subject", delivery.subject.as_str());
    set(headers, "ruststream-stream", &delivery.stream);
    set(
        headers,
        "ruststream-stream-sequence",
        &delivery.coordinates.key.stream_sequence.to_string(),
    );
    set(
        headers,
        "ruststream-published-at",
        &rfc3339(delivery.published_at),
    );
}

/// CloudEvents 1.0, HTTP binary content mode: the required attributes and the time.
fn cloudevent_headers(leased: &Leased, id: &str, headers: &mut HeaderMap) {
    let delivery = &leased.delivery;
    set(headers, "ce-specversion", "1.0");
    set(headers, "ce-id", id);
    set(
        headers,
        "ce-source",
        &format!("/streams/{}", delivery.stream),
    );
    set(headers, "ce-type", delivery.subject.as_str());
    set(headers, "ce-time", &rfc3339(delivery.published_at));
}

/// A batch's answer body: a settle per message, in request order.
#[derive(Deserialize)]
struct BatchAnswer {
    results: Vec<BatchResult>,
}

#[derive(Deserialize)]
struct BatchResult {
    settle: String,
    delay_ms: Option<u64>,
    reason: Option<String>,
}

/// The settles a 2xx batch answer asks for, one per message it names (`None` when the body
/// says nothing per message: the status then settles them all).
pub(super) fn batch_results(body: &[u8]) -> Option<Vec<Option<Settle>>> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return None;
    }
    let answer: BatchAnswer = serde_json::from_slice(body).ok()?;
    Some(
        answer
            .results
            .into_iter()
            .map(|result| match result.settle.as_str() {
                "ack" => Some(Settle::Ack),
                "nak" => Some(Settle::Nak(Duration::from_millis(
                    result.delay_ms.unwrap_or(0),
                ))),
                "term" => {
                    Some(Settle::Term(result.reason.unwrap_or_else(|| {
                        "push: terminated by the endpoint".into()
                    })))
                }
                _ => None,
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signature_is_the_standard_webhooks_one() {
        // The example of the Standard Webhooks specification.
        let secret = STANDARD
            .decode("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
            .expect("base64");
        let signature = signature(
            &secret,
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            "1614265330",
            br#"{"test": 2432232314}"#,
        );
        assert_eq!(signature, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
    }

    #[test]
    fn batch_results_settle_each_in_order() {
        let results = batch_results(
            br#"{"results": [{"settle": "ack"}, {"settle": "nak", "delay_ms": 250}, {"settle": "term", "reason": "bad"}, {"settle": "?"}]}"#,
        )
        .expect("results");
        assert_eq!(
            results,
            vec![
                Some(Settle::Ack),
                Some(Settle::Nak(Duration::from_millis(250))),
                Some(Settle::Term("bad".into())),
                None
            ]
        );
        assert_eq!(batch_results(b""), None);
        assert_eq!(batch_results(b"ok"), None);
    }
}
