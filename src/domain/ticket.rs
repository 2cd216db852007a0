//! Stream tickets: what lets a browser open an event stream or a WebSocket, which cannot
//! carry an `Authorization` header, without a long-lived secret in the URL. A ticket names
//! one consumer, what its holder may do there, when it ends, a nonce, and the token it was
//! issued for; it is sealed (encrypted and authenticated) with a key derived from the lease
//! key, so that any replica sharing the key file takes it and nobody else can read or alter
//! it. A ticket lands in URLs and access logs: its text is random-looking bytes that say
//! nothing of the token (not even its scopes), and even opened it names the token only by a
//! keyed digest, never by the token's plain SHA-256, which a dictionary would undo. That it
//! is used once is the redeemer's business (the nonce).
//!
//! May import: the rest of `domain` only.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{KeyInit, Mac};
use ring::aead::{Aad, CHACHA20_POLY1305, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

type HmacSha256 = hmac::Hmac<Sha256>;

/// Bound into every seal: a ticket opens as nothing else, and nothing else as a ticket.
const CONTEXT: &[u8] = b"ruststream-nats stream ticket v2";

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
    /// The static token it was issued for, as [`TicketSigner::token_ref`] names it:
    /// redeemed only while that token is still configured, and a stream opened with it ends
    /// when the token goes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) token: Option<String>,
    /// The JWT it was issued for expires then (Unix seconds): so does a stream opened with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) jwt_expires_at: Option<i64>,
}

/// Issues (seals) and verifies (opens) tickets.
pub(crate) struct TicketSigner {
    seal: LessSafeKey,
    /// Keys the digest by which a ticket names its token.
    token_ref: HmacSha256,
}

impl TicketSigner {
    /// A signer under keys of its own, derived from `lease_key`: nothing a ticket holds is
    /// valid as anything else the lease key signs.
    pub(crate) fn new(lease_key: &[u8]) -> Self {
        let seal_key = derive(lease_key, b"ruststream-nats stream tickets v2: seal");
        let seal = UnboundKey::new(&CHACHA20_POLY1305, &seal_key)
            .unwrap_or_else(|_| unreachable!("a 32-byte key is ChaCha20-Poly1305's size"));
        Self {
            seal: LessSafeKey::new(seal),
            token_ref: hmac_under(&derive(
                lease_key,
                b"ruststream-nats stream tickets v2: token",
            )),
        }
    }

    /// How a ticket names the static token whose digest is `digest`: a keyed digest of it,
    /// the same at every replica sharing the key, and of no use to anyone without the key.
    pub(crate) fn token_ref(&self, digest: &[u8; 32]) -> String {
        let mut mac = self.token_ref.clone();
        mac.update(digest);
        super::hex(&mac.finalize().into_bytes())
    }

    /// `ticket` as URL-safe text: a random nonce and the sealed ticket, base64url.
    pub(crate) fn issue(&self, ticket: &Ticket) -> String {
        // Strings, numbers and booleans only: cannot fail.
        let mut sealed = serde_json::to_vec(ticket).unwrap_or_default();
        let nonce: [u8; NONCE_LEN] = rand::random();
        // Sealing fails only for inputs of some 256 GiB.
        if self
            .seal
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(CONTEXT),
                &mut sealed,
            )
            .is_err()
        {
            sealed.clear();
        }
        let mut text = Vec::with_capacity(NONCE_LEN + sealed.len());
        text.extend_from_slice(&nonce);
        text.extend_from_slice(&sealed);
        URL_SAFE_NO_PAD.encode(text)
    }

    /// The ticket `text` stands for, if this signer (or one with the same key) issued it;
    /// its expiry is the caller's to check.
    pub(crate) fn verify(&self, text: &str) -> Option<Ticket> {
        // Far longer than any ticket: not decoded at all.
        if text.len() > 2048 {
            return None;
        }
        let mut bytes = URL_SAFE_NO_PAD.decode(text).ok()?;
        if bytes.len() < NONCE_LEN {
            return None;
        }
        let sealed = bytes.split_off(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(&bytes).ok()?;
        let mut sealed = sealed;
        // The tag is checked in constant time before anything is returned.
        let opened = self
            .seal
            .open_in_place(nonce, Aad::from(CONTEXT), &mut sealed)
            .ok()?;
        serde_json::from_slice(opened).ok()
    }
}

/// A key of its own for `purpose`, from `key`.
fn derive(key: &[u8], purpose: &[u8]) -> [u8; 32] {
    let mut mac = hmac_under(key);
    mac.update(purpose);
    mac.finalize().into_bytes().into()
}

fn hmac_under(key: &[u8]) -> HmacSha256 {
    <HmacSha256 as KeyInit>::new_from_slice(key)
        .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::Digest as _;

    fn ticket(token: Option<String>) -> Ticket {
        Ticket {
            stream: "ORDERS".into(),
            consumer: "billing".into(),
            expires_unix_ms: 1_800_000_000_000,
            nonce: "00ff".into(),
            settle: true,
            token,
            jwt_expires_at: None,
        }
    }

    #[test]
    fn a_ticket_verifies_where_the_key_is_the_same_and_nowhere_else() {
        let signer = TicketSigner::new(&[7; 32]);
        let issued = ticket(Some(signer.token_ref(&[1; 32])));
        let text = signer.issue(&issued);
        assert!(
            text.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_".contains(&b)),
            "URL-safe: {text}"
        );
        assert_eq!(TicketSigner::new(&[7; 32]).verify(&text), Some(issued));
        assert_eq!(TicketSigner::new(&[8; 32]).verify(&text), None);
        assert_ne!(
            signer.issue(&ticket(None)),
            signer.issue(&ticket(None)),
            "a fresh nonce each time"
        );
    }

    #[test]
    fn a_ticket_shows_nothing_of_what_it_holds_and_names_its_token_by_a_keyed_digest() {
        let token = "pw1";
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let signer = TicketSigner::new(&[7; 32]);
        let reference = signer.token_ref(&digest);
        assert_ne!(reference, super::super::hex(&digest));
        assert_ne!(reference, TicketSigner::new(&[8; 32]).token_ref(&digest));
        let text = signer.issue(&ticket(Some(reference)));
        let bytes = URL_SAFE_NO_PAD.decode(&text).expect("base64url");
        let shown = String::from_utf8_lossy(&bytes);
        for hidden in ["ORDERS", "billing", "settle", "token", "00ff"] {
            assert!(!shown.contains(hidden), "{hidden} shows in {shown}");
        }
        assert!(
            !bytes.windows(digest.len()).any(|window| window == digest),
            "the digest shows"
        );
    }

    #[test]
    fn a_ticket_altered_or_garbled_is_refused() {
        let signer = TicketSigner::new(&[7; 32]);
        let text = signer.issue(&ticket(None));
        let mut bytes = URL_SAFE_NO_PAD.decode(&text).expect("base64url");
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        let flipped = URL_SAFE_NO_PAD.encode(&bytes);
        bytes[last] ^= 1;
        bytes[NONCE_LEN] ^= 1;
        let altered = URL_SAFE_NO_PAD.encode(&bytes);
        for bad in [
            flipped,
            altered,
            text[..text.len() - 4].to_owned(),
            format!("{text}.x"),
            String::new(),
            "not a ticket".into(),
            "x".repeat(5000),
        ] {
            assert_eq!(signer.verify(&bad), None, "{bad}");
        }
    }
}
