//! Stream tickets: what lets a browser open an event stream or a WebSocket, which cannot
//! carry an `Authorization` header, without a long-lived secret in the URL. A ticket names
//! one consumer, what its holder may do there, when it ends and a nonce; it is signed with a
//! key derived from the lease key, so that any replica sharing the key file takes it. That
//! it is used once is the redeemer's business (the nonce).
//!
//! May import: the rest of `domain` only.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{KeyInit, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

type HmacSha256 = hmac::Hmac<Sha256>;

/// What a ticket says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Ticket {
    /// The consumer whose streams it opens.
    pub(crate) stream: String,
    pub(crate) consumer: String,
    /// Unix milliseconds after which it is refused.
    pub(crate) expires_unix_ms: i64,
    /// Unique per ticket: redeemed once.
    pub(crate) nonce: String,
    /// Whether its holder may settle that consumer's leases in band (over a WebSocket).
    pub(crate) settle: bool,
    /// The static token it was issued for (its digest, hex): redeemed only while that token
    /// is still configured, and a stream opened with it ends when the token goes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) token: Option<String>,
    /// The JWT it was issued for expires then (Unix seconds): so does a stream opened with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) jwt_expires_at: Option<i64>,
}

/// Issues and verifies tickets.
pub(crate) struct TicketSigner {
    mac: HmacSha256,
}

impl TicketSigner {
    /// A signer under a key of its own, derived from `lease_key`: a ticket's tag is never
    /// valid as anything else the lease key signs.
    pub(crate) fn new(lease_key: &[u8]) -> Self {
        let mut derive = <HmacSha256 as KeyInit>::new_from_slice(lease_key)
            .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        derive.update(b"ruststream-nats stream tickets v1");
        let key = derive.finalize().into_bytes();
        Self {
            mac: <HmacSha256 as KeyInit>::new_from_slice(&key)
                .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length")),
        }
    }

    /// `ticket` as URL-safe text: its JSON and its tag, each base64url.
    pub(crate) fn issue(&self, ticket: &Ticket) -> String {
        // Strings, numbers and booleans only: cannot fail.
        let body = serde_json::to_vec(ticket).unwrap_or_default();
        let mut mac = self.mac.clone();
        mac.update(&body);
        let tag = mac.finalize().into_bytes();
        format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(&body),
            URL_SAFE_NO_PAD.encode(tag)
        )
    }

    /// The ticket `text` stands for, if this signer (or one with the same key) issued it;
    /// its expiry is the caller's to check.
    pub(crate) fn verify(&self, text: &str) -> Option<Ticket> {
        // Far longer than any ticket: not decoded at all.
        if text.len() > 2048 {
            return None;
        }
        let (body, tag) = text.split_once('.')?;
        let body = URL_SAFE_NO_PAD.decode(body).ok()?;
        let tag = URL_SAFE_NO_PAD.decode(tag).ok()?;
        let mut mac = self.mac.clone();
        mac.update(&body);
        // Constant time.
        mac.verify_slice(&tag).ok()?;
        serde_json::from_slice(&body).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ticket() -> Ticket {
        Ticket {
            stream: "ORDERS".into(),
            consumer: "billing".into(),
            expires_unix_ms: 1_800_000_000_000,
            nonce: "00ff".into(),
            settle: true,
            token: Some("ab".repeat(32)),
            jwt_expires_at: None,
        }
    }

    #[test]
    fn a_ticket_verifies_where_the_key_is_the_same_and_nowhere_else() {
        let signer = TicketSigner::new(&[7; 32]);
        let text = signer.issue(&ticket());
        assert!(
            text.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)),
            "URL-safe: {text}"
        );
        assert_eq!(TicketSigner::new(&[7; 32]).verify(&text), Some(ticket()));
        assert_eq!(TicketSigner::new(&[8; 32]).verify(&text), None);
    }

    #[test]
    fn a_ticket_altered_or_garbled_is_refused() {
        let signer = TicketSigner::new(&[7; 32]);
        let text = signer.issue(&ticket());
        let (body, tag) = text.split_once('.').expect("two parts");
        let mut changed = ticket();
        changed.consumer = "shipping".into();
        let forged_body = URL_SAFE_NO_PAD.encode(serde_json::to_vec(&changed).expect("json"));
        for bad in [
            format!("{forged_body}.{tag}"),
            format!("{body}.{}", URL_SAFE_NO_PAD.encode([0u8; 32])),
            body.to_owned(),
            String::new(),
            "not a ticket".into(),
            "x".repeat(5000),
        ] {
            assert_eq!(signer.verify(&bad), None, "{bad}");
        }
    }
}
