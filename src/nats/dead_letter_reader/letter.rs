//! A dead letter as the dead-letter stream holds it: the message read back from the copy
//! [`crate::nats::dead_letter`] wrote, its metadata out of the `Ruststream-Dead-Letter-*`
//! headers and the original's own headers under their own names again.
//!
//! May import: `domain`. Nothing of the gateway above the NATS boundary.

use async_nats::HeaderMap;
use bytes::Bytes;
use time::OffsetDateTime;

use crate::nats::dead_letter::headers;

/// A dead letter as the dead-letter stream holds it.
#[derive(Debug, Clone)]
pub(crate) struct DeadLetter {
    /// The stream holding it.
    pub(crate) store: String,
    /// Its sequence in that stream.
    pub(crate) sequence: u64,
    /// When it was stored there.
    pub(crate) dead_lettered_at: OffsetDateTime,
    /// `max_deliveries` or `terminated`.
    pub(crate) reason: String,
    pub(crate) term_reason: Option<String>,
    /// Where it came from.
    pub(crate) stream: String,
    pub(crate) consumer: String,
    pub(crate) stream_sequence: u64,
    pub(crate) subject: String,
    pub(crate) deliveries: u64,
    /// As the copy wrote it (RFC 3339).
    pub(crate) published_at: Option<String>,
    pub(crate) payload: Bytes,
    /// The original message's own headers, its `Nats-*` ones under their own names again.
    pub(crate) headers: HeaderMap,
}

impl DeadLetter {
    /// The dead letter a stored message is; `None` when it is not one (no reason header: a
    /// message published to the dead-letter subject by something else).
    pub(super) fn read(
        store: &str,
        sequence: u64,
        stored_at: OffsetDateTime,
        stored_headers: Option<&HeaderMap>,
        payload: Bytes,
    ) -> Option<Self> {
        let stored = stored_headers?;
        let value = |name: &str| stored.get(name).map(|value| value.as_str().to_owned());
        let reason = value(headers::REASON)?;
        let mut original = HeaderMap::new();
        for (name, values) in stored.iter() {
            let name: &str = name.as_ref();
            let Some(restored) = original_name(name) else {
                continue;
            };
            let Ok(restored) = restored.parse::<async_nats::HeaderName>() else {
                continue;
            };
            for value in values {
                original.append(restored.clone(), value.clone());
            }
        }
        Some(Self {
            store: store.to_owned(),
            sequence,
            dead_lettered_at: stored_at,
            reason,
            term_reason: value(headers::TERM_REASON),
            stream: value(headers::STREAM).unwrap_or_default(),
            consumer: value(headers::CONSUMER).unwrap_or_default(),
            stream_sequence: value(headers::STREAM_SEQUENCE)
                .and_then(|sequence| sequence.parse().ok())
                .unwrap_or_default(),
            subject: value(headers::SUBJECT).unwrap_or_default(),
            deliveries: value(headers::DELIVERIES)
                .and_then(|deliveries| deliveries.parse().ok())
                .unwrap_or_default(),
            published_at: value(headers::PUBLISHED_AT),
            payload,
            headers: original,
        })
    }
}

/// The name a dead letter's header had on the original message; `None` for the headers the
/// copy added (its metadata, its dedup id).
fn original_name(name: &str) -> Option<String> {
    const METADATA: &str = "ruststream-dead-letter-";
    let lower = name.to_ascii_lowercase();
    let original_prefix = headers::ORIGINAL_PREFIX.to_ascii_lowercase();
    if lower.starts_with(&original_prefix) {
        return Some(format!("Nats-{}", &name[original_prefix.len()..]));
    }
    if lower.starts_with(METADATA) || lower.starts_with("nats-") {
        return None;
    }
    Some(name.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dead_letter_shows_the_original_headers_under_their_own_names() {
        assert_eq!(
            original_name("Ruststream-Dead-Letter-Original-Msg-Id").as_deref(),
            Some("Nats-Msg-Id")
        );
        assert_eq!(original_name("Ruststream-Dead-Letter-Reason"), None);
        assert_eq!(original_name("Nats-Msg-Id"), None);
        assert_eq!(original_name("X-Order").as_deref(), Some("X-Order"));
        assert_eq!(
            original_name("Ruststream-Redriven-From").as_deref(),
            Some("Ruststream-Redriven-From")
        );
    }
}
