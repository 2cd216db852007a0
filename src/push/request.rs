//! A push request as the endpoint receives it: the body in the consumer's format, the
//! Standard Webhooks headers and signature, the lease's own headers; and a batch answer's
//! per-message results.
//!
//! May import: as the rest of `push`.

use crate::config::CONNECTION_HEADERS;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, KeyInit as _, Mac as _};
use reqwest::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue};
use serde::Deserialize;
use sha2::Sha256;

use crate::config::{PushFormat, PushSpec};
use crate::domain::delivery::Leased;
use crate::domain::push::{Settle, Unreadable, batch_result, endpoint_reason};
use crate::http::dto::{Encoding, MessageDto, rfc3339};

/// Headers of a message that never pass through to the endpoint besides the connection's
/// own ([`CONNECTION_HEADERS`], RFC 9110 §7.6.1): credentials — only the operator's `headers`
/// table, or the URL's userinfo, chooses what the gateway presents to the endpoint.
const NEVER_PASSED: &[&str] = &["authorization", "proxy-authorization", "cookie"];
/// The names the gateway itself sets: a message must not forge its own lease or signature.
const OWN_PREFIXES: &[&str] = &["webhook-", "ruststream-"];
/// The CloudEvents attributes the gateway gives an event, each where the message has none.
const EVENT_ATTRIBUTES: [&str; 5] = ["ce-specversion", "ce-id", "ce-source", "ce-type", "ce-time"];

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
            message_headers(first, &mut headers, true);
            cloudevent_headers(first, &id, &mut headers);
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

/// The message's own headers that are valid HTTP headers, but for those that never pass
/// ([`NEVER_PASSED`], the gateway's own, those its `Connection` header names as hop-by-hop,
/// and `ce-*` unless `keep_events`); and its `Content-Type` (or `application/octet-stream`).
fn message_headers(leased: &Leased, headers: &mut HeaderMap, keep_events: bool) {
    if let Some(map) = &leased.delivery.headers {
        // RFC 9110 §7.6.1: a field the Connection header names is hop-by-hop too.
        let hop_by_hop: Vec<String> = map
            .iter()
            .filter(|(name, _)| AsRef::<str>::as_ref(*name).eq_ignore_ascii_case("connection"))
            .flat_map(|(_, values)| values.iter().flat_map(|value| value.as_str().split(',')))
            .map(|name| name.trim().to_ascii_lowercase())
            .filter(|name| !name.is_empty())
            .collect();
        for (name, values) in map.iter() {
            let Ok(name) = HeaderName::from_bytes(AsRef::<str>::as_ref(name).as_bytes()) else {
                continue;
            };
            let lower = name.as_str();
            if CONNECTION_HEADERS.contains(&lower)
                || NEVER_PASSED.contains(&lower)
                || OWN_PREFIXES.iter().any(|prefix| lower.starts_with(prefix))
                || (!keep_events && lower.starts_with("ce-"))
                || hop_by_hop.iter().any(|named| named == lower)
            {
                continue;
            }
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

/// CloudEvents 1.0, HTTP binary content mode: each required attribute, and the time, that
/// the message does not carry itself (a message published as an event keeps its own; one
/// that carries only some gets the rest, so that the event is always whole).
fn cloudevent_headers(leased: &Leased, id: &str, headers: &mut HeaderMap) {
    let delivery = &leased.delivery;
    for attribute in EVENT_ATTRIBUTES {
        if headers.contains_key(attribute) {
            continue;
        }
        match attribute {
            "ce-specversion" => set(headers, attribute, "1.0"),
            "ce-id" => set(headers, attribute, id),
            "ce-source" => set(headers, attribute, &format!("/streams/{}", delivery.stream)),
            "ce-type" => set(headers, attribute, delivery.subject.as_str()),
            _ => set(headers, attribute, &rfc3339(delivery.published_at)),
        }
    }
}

/// One result of a batch's answer body.
#[derive(Deserialize)]
struct BatchResult {
    settle: String,
    delay_ms: Option<u64>,
    reason: Option<String>,
}

/// The settles a 2xx answer to a batch of `count` asks for, one per message it names, in
/// request order (`None` when the body holds no `results`: the status then settles them
/// all). A result the gateway cannot read is [`Unreadable`], never an ack; `results` that is
/// no list makes every message's unreadable.
pub(super) fn batch_results(body: &[u8], count: usize) -> Option<Vec<Result<Settle, Unreadable>>> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return None;
    }
    let mut answer: serde_json::Value = serde_json::from_slice(body).ok()?;
    let results = answer.get_mut("results")?.take();
    let serde_json::Value::Array(results) = results else {
        return Some(vec![Err(Unreadable); count]);
    };
    Some(
        results
            .into_iter()
            .map(|result| {
                let result: BatchResult = serde_json::from_value(result).map_err(|_| Unreadable)?;
                let reason = result.reason.as_deref().map(endpoint_reason);
                batch_result(&result.settle, result.delay_ms, reason.as_deref())
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
    fn batch_results_settle_each_in_order_and_never_ack_what_they_cannot_read() {
        let results = batch_results(
            br#"{"results": [{"settle": "ack"}, {"settle": "nak", "delay_ms": 250}, {"settle": "term", "reason": "bad"}, {"settle": "?"}, {"settle": "nak", "delay_ms": -5}, {"settle": "nak", "delay_ms": 1.5}, 7]}"#,
            7,
        )
        .expect("results");
        assert_eq!(
            results,
            vec![
                Ok(Settle::Ack),
                Ok(Settle::Nak(Duration::from_millis(250))),
                Ok(Settle::Term("bad".into())),
                Err(Unreadable),
                Err(Unreadable),
                Err(Unreadable),
                Err(Unreadable),
            ]
        );
        assert_eq!(
            batch_results(br#"{"results": "ack"}"#, 2),
            Some(vec![Err(Unreadable), Err(Unreadable)])
        );
        assert_eq!(batch_results(b"", 2), None);
        assert_eq!(batch_results(b"ok", 2), None);
        assert_eq!(batch_results(br#"{"ok": true}"#, 2), None);
    }
}
