//! Lease ids: self-describing, HMAC-signed tokens naming one delivery of one message.
//!
//! An id carries the delivery's coordinates (binding epoch, stream and consumer sequence,
//! delivery count, publish time) in the clear and a truncated HMAC-SHA256 over them and the stream/consumer
//! names. It holds no secret, cannot be forged without the key, and gives a later version
//! what it needs to let any replica sharing the key settle it without a shared table.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{KeyInit, Mac};
use sha2::Sha256;

type HmacSha256 = hmac::Hmac<Sha256>;

/// Which delivery of which message a lease is for; the key of the lease table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeliveryKey {
    pub stream_sequence: u64,
    pub delivered: u64,
}

/// Everything an id names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseCoordinates {
    /// Which binding of the consumer issued it: a recreated consumer starts a new epoch,
    /// and ids of an older one are void even where sequences repeat.
    pub epoch: u32,
    pub key: DeliveryKey,
    pub consumer_sequence: u64,
    pub published_unix_nanos: i64,
}

const VERSION: u8 = 1;
const BODY_LEN: usize = 1 + 4 + 8 * 4;
/// 128 bits of tag: unguessable, and keeps ids short enough to paste into a curl line.
const TAG_LEN: usize = 16;
const ID_LEN: usize = BODY_LEN + TAG_LEN;

/// Signs and verifies lease ids for one stream/consumer pair.
pub struct LeaseSigner {
    mac: HmacSha256,
}

impl LeaseSigner {
    /// A signer with a fresh random key: ids die with the process.
    pub fn random(stream: &str, consumer: &str) -> Self {
        let key: [u8; 32] = rand::random();
        Self::with_key(&key, stream, consumer)
    }

    pub fn with_key(key: &[u8], stream: &str, consumer: &str) -> Self {
        // HMAC accepts keys of any length, so this cannot fail.
        let mut mac = <HmacSha256 as KeyInit>::new_from_slice(key)
            .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        // Bind every id to its stream and consumer: an id from another consumer sharing the
        // key must not verify here.
        mac.update(stream.as_bytes());
        mac.update(&[0]);
        mac.update(consumer.as_bytes());
        mac.update(&[0]);
        Self { mac }
    }

    pub fn encode(&self, lease: &LeaseCoordinates) -> String {
        let mut raw = [0u8; ID_LEN];
        raw[0] = VERSION;
        raw[1..5].copy_from_slice(&lease.epoch.to_be_bytes());
        raw[5..13].copy_from_slice(&lease.key.stream_sequence.to_be_bytes());
        raw[13..21].copy_from_slice(&lease.consumer_sequence.to_be_bytes());
        raw[21..29].copy_from_slice(&lease.key.delivered.to_be_bytes());
        raw[29..37].copy_from_slice(&lease.published_unix_nanos.to_be_bytes());
        let tag = self.tag(&raw[..BODY_LEN]);
        raw[BODY_LEN..].copy_from_slice(&tag[..TAG_LEN]);
        URL_SAFE_NO_PAD.encode(raw)
    }

    /// The coordinates of a genuine id; `None` for anything malformed, truncated or forged.
    pub fn decode(&self, id: &str) -> Option<LeaseCoordinates> {
        if id.len() != URL_SAFE_NO_PAD.encode([0u8; ID_LEN]).len() {
            return None;
        }
        let raw = URL_SAFE_NO_PAD.decode(id).ok()?;
        if raw.len() != ID_LEN || raw[0] != VERSION {
            return None;
        }
        let mut mac = self.mac.clone();
        mac.update(&raw[..BODY_LEN]);
        // Constant-time comparison of the truncated tag.
        mac.verify_truncated_left(&raw[BODY_LEN..]).ok()?;
        let word = |at: usize| {
            let mut bytes = [0u8; 8];
            bytes.copy_from_slice(&raw[at..at + 8]);
            bytes
        };
        let mut epoch = [0u8; 4];
        epoch.copy_from_slice(&raw[1..5]);
        Some(LeaseCoordinates {
            epoch: u32::from_be_bytes(epoch),
            key: DeliveryKey {
                stream_sequence: u64::from_be_bytes(word(5)),
                delivered: u64::from_be_bytes(word(21)),
            },
            consumer_sequence: u64::from_be_bytes(word(13)),
            published_unix_nanos: i64::from_be_bytes(word(29)),
        })
    }

    fn tag(&self, body: &[u8]) -> Vec<u8> {
        let mut mac = self.mac.clone();
        mac.update(body);
        mac.finalize().into_bytes().to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> LeaseCoordinates {
        LeaseCoordinates {
            epoch: 2,
            key: DeliveryKey {
                stream_sequence: 42,
                delivered: 3,
            },
            consumer_sequence: 7,
            published_unix_nanos: 1_790_230_470_084_404_000,
        }
    }

    #[test]
    fn round_trips_and_is_url_safe() {
        let signer = LeaseSigner::random("ORDERS", "billing");
        let id = signer.encode(&sample());
        assert!(
            id.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        );
        assert_eq!(signer.decode(&id), Some(sample()));
    }

    #[test]
    fn rejects_tampered_truncated_and_foreign_ids() {
        let signer = LeaseSigner::with_key(b"key", "ORDERS", "billing");
        let id = signer.encode(&sample());
        assert_eq!(signer.decode(&id[..id.len() - 1]), None);
        assert_eq!(signer.decode(""), None);
        assert_eq!(signer.decode("not-a-lease"), None);
        let mut tampered = id.clone().into_bytes();
        tampered[5] = if tampered[5] == b'A' { b'B' } else { b'A' };
        assert_eq!(
            signer.decode(std::str::from_utf8(&tampered).expect("ascii")),
            None
        );
        let other_consumer = LeaseSigner::with_key(b"key", "ORDERS", "shipping");
        assert_eq!(other_consumer.decode(&id), None);
        let other_key = LeaseSigner::with_key(b"other", "ORDERS", "billing");
        assert_eq!(other_key.decode(&id), None);
    }
}
