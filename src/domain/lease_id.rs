//! Lease ids: self-describing, HMAC-signed tokens naming one delivery of one message.
//!
//! An id carries the gateway instance that issued it and the delivery's coordinates (binding
//! epoch, stream and consumer sequence, delivery count, publish time) in the clear, and a
//! truncated HMAC-SHA256 over them and the stream/consumer names. It holds no secret and
//! cannot be forged without the key; any replica sharing the key can tell whose it is and
//! forward its settle there, without a shared table.
//!
//! Version 3 also carries the stream and consumer names in the clear, so a gateway serving
//! many consumers knows from the id alone which one to settle it on ([`named_in`]). The
//! default consumer (`--stream`/`--consumer`) still issues version 2, which releases before
//! named consumers read: in a fleet being rolled, an old replica can settle its leases.
//!
//! May import: the rest of `domain` only.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{KeyInit, Mac};
use sha2::Sha256;

type HmacSha256 = hmac::Hmac<Sha256>;

/// The shortest signing key accepted from `--lease-key-file`: HMAC-SHA256's own block of
/// strength (256 bits).
pub(crate) const MIN_KEY_LEN: usize = 32;

/// A lease-signing key from `--lease-key-file`. `Debug` never shows it.
#[derive(Clone)]
pub(crate) struct LeaseKey(Vec<u8>);

impl std::fmt::Debug for LeaseKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LeaseKey(<redacted>)")
    }
}

impl LeaseKey {
    /// Read a key file: hex or base64 text (surrounding whitespace ignored), else the raw
    /// bytes; at least [`MIN_KEY_LEN`] bytes once decoded. Errors name the path and the
    /// length, never the key.
    pub(crate) fn load(path: &std::path::Path) -> anyhow::Result<Self> {
        let bytes = std::fs::read(path)
            .map_err(|err| anyhow::anyhow!("reading --lease-key-file {}: {err}", path.display()))?;
        #[cfg(unix)]
        if let Ok(meta) = std::fs::metadata(path) {
            use std::os::unix::fs::PermissionsExt as _;
            // Group access is how a Kubernetes secret reaches a non-root pod (fsGroup), so
            // only access for everyone else is worth a warning.
            if meta.permissions().mode() & 0o007 != 0 {
                tracing::warn!(path = %path.display(), "--lease-key-file is readable by other users; chmod o-rwx it");
            }
        }
        Self::parse(&bytes)
            .map_err(|why| anyhow::anyhow!("--lease-key-file {}: {why}", path.display()))
    }

    pub(crate) fn parse(bytes: &[u8]) -> Result<Self, String> {
        let text = std::str::from_utf8(bytes)
            .map(str::trim)
            .unwrap_or_default();
        let key = decode_hex(text)
            .or_else(|| decode_base64(text))
            .unwrap_or_else(|| bytes.to_vec());
        if key.len() < MIN_KEY_LEN {
            return Err(format!(
                "the key must be at least {MIN_KEY_LEN} bytes (raw, or as hex or base64 text); it has {}",
                key.len()
            ));
        }
        Ok(Self(key))
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &self.0
    }
}

fn decode_hex(text: &str) -> Option<Vec<u8>> {
    if text.is_empty()
        || !text.len().is_multiple_of(2)
        || !text.bytes().all(|b| b.is_ascii_hexdigit())
    {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|at| u8::from_str_radix(&text[at..at + 2], 16).ok())
        .collect()
}

fn decode_base64(text: &str) -> Option<Vec<u8>> {
    use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE};
    if text.is_empty() {
        return None;
    }
    [STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD]
        .iter()
        .find_map(|engine| engine.decode(text).ok())
}

/// Which delivery of which message a lease is for; the key of the lease table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct DeliveryKey {
    pub(crate) stream_sequence: u64,
    pub(crate) delivered: u64,
}

/// One gateway process: random at start, named in every lease id it issues, so that another
/// replica knows where to forward a settle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct InstanceId(pub(crate) u64);

impl InstanceId {
    pub(crate) fn random() -> Self {
        Self(rand::random())
    }
}

impl InstanceId {
    /// An instance id as [`Display`](std::fmt::Display) prints it (16 hex digits).
    pub(crate) fn parse(text: &str) -> Option<Self> {
        if text.len() != 16 {
            return None;
        }
        u64::from_str_radix(text, 16).ok().map(Self)
    }
}

impl std::fmt::Display for InstanceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// A genuine id, decoded: who issued it and what it names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SignedLease {
    pub(crate) owner: InstanceId,
    pub(crate) lease: LeaseCoordinates,
}

/// Everything an id names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LeaseCoordinates {
    /// Which binding of the consumer issued it: a recreated consumer starts a new epoch,
    /// and ids of an older one are void even where sequences repeat.
    pub(crate) epoch: u32,
    pub(crate) key: DeliveryKey,
    pub(crate) consumer_sequence: u64,
    pub(crate) published_unix_nanos: i64,
}

/// Version 2 added the issuing instance.
const VERSION: u8 = 2;
/// Version 3 added the stream and consumer names, after the coordinates.
const VERSION_NAMED: u8 = 3;
const BODY_LEN: usize = 1 + 8 + 4 + 8 * 4;
/// The longest stream or consumer name a version 3 id carries (one length byte each);
/// NATS allows 255 bytes for a stream.
pub(crate) const MAX_NAME_LEN: usize = 255;
/// 128 bits of tag: unguessable, and keeps ids short enough to paste into a curl line.
const TAG_LEN: usize = 16;
const ID_LEN: usize = BODY_LEN + TAG_LEN;
/// A version 2 id's length in unpadded base64.
const V2_ID_CHARS: usize = (4 * ID_LEN).div_ceil(3);
/// The longest id: version 3 with the longest names, in unpadded base64.
const MAX_ID_CHARS: usize = (4 * (ID_LEN + 2 + 2 * MAX_NAME_LEN)).div_ceil(3);

/// Signs and verifies lease ids for one stream/consumer pair, issuing them as one instance.
pub(crate) struct LeaseSigner {
    mac: HmacSha256,
    owner: InstanceId,
    /// The length-prefixed names, as a version 3 id carries them after its coordinates
    /// (`None` for names too long to carry).
    names: Option<Vec<u8>>,
    /// Whether the ids issued are version 3 (they name their consumer).
    issue_named: bool,
    /// See [`LeaseSigner::key_fingerprint`].
    fingerprint: String,
}

impl LeaseSigner {
    /// A signer with a fresh random key: ids die with the process.
    #[cfg(test)]
    pub(crate) fn random(stream: &str, consumer: &str, owner: InstanceId) -> Self {
        let key: [u8; 32] = rand::random();
        Self::with_key(&key, stream, consumer, owner)
    }

    pub(crate) fn with_key(key: &[u8], stream: &str, consumer: &str, owner: InstanceId) -> Self {
        // HMAC accepts keys of any length, so this cannot fail.
        let mut mac = <HmacSha256 as KeyInit>::new_from_slice(key)
            .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        // Bind every id to its stream and consumer: an id from another consumer sharing the
        // key must not verify here.
        mac.update(stream.as_bytes());
        mac.update(&[0]);
        mac.update(consumer.as_bytes());
        mac.update(&[0]);
        let names = match (u8::try_from(stream.len()), u8::try_from(consumer.len())) {
            (Ok(stream_len), Ok(consumer_len)) => {
                let mut names = Vec::with_capacity(2 + stream.len() + consumer.len());
                names.push(stream_len);
                names.extend_from_slice(stream.as_bytes());
                names.push(consumer_len);
                names.extend_from_slice(consumer.as_bytes());
                Some(names)
            }
            _ => None,
        };
        let mut signer = Self {
            mac,
            owner,
            names,
            issue_named: false,
            fingerprint: String::new(),
        };
        // Distinct from any id body: those start with the version byte and are BODY_LEN long.
        let tag = signer.tag(b"ruststream-nats lease key fingerprint");
        signer.fingerprint = tag[..8].iter().map(|byte| format!("{byte:02x}")).collect();
        signer
    }

    /// Issue version 3 ids, which name the stream and consumer in the clear; names longer
    /// than [`MAX_NAME_LEN`] keep version 2. Both versions verify either way.
    pub(crate) fn naming(mut self) -> Self {
        self.issue_named = self.names.is_some();
        self
    }

    /// The instance whose ids this signer issues.
    pub(crate) fn owner(&self) -> InstanceId {
        self.owner
    }

    /// A short digest of the key (and the stream and consumer): replicas compare theirs to
    /// find one signing with another key, whose ids they could not verify. Reveals nothing
    /// of the key.
    pub(crate) fn key_fingerprint(&self) -> &str {
        &self.fingerprint
    }

    pub(crate) fn encode(&self, lease: &LeaseCoordinates) -> String {
        let names = match &self.names {
            Some(names) if self.issue_named => names.as_slice(),
            _ => &[],
        };
        let mut raw = Vec::with_capacity(ID_LEN + names.len());
        raw.push(if names.is_empty() {
            VERSION
        } else {
            VERSION_NAMED
        });
        raw.extend_from_slice(&self.owner.0.to_be_bytes());
        raw.extend_from_slice(&lease.epoch.to_be_bytes());
        raw.extend_from_slice(&lease.key.stream_sequence.to_be_bytes());
        raw.extend_from_slice(&lease.consumer_sequence.to_be_bytes());
        raw.extend_from_slice(&lease.key.delivered.to_be_bytes());
        raw.extend_from_slice(&lease.published_unix_nanos.to_be_bytes());
        raw.extend_from_slice(names);
        let tag = self.tag(&raw);
        raw.extend_from_slice(&tag[..TAG_LEN]);
        URL_SAFE_NO_PAD.encode(raw)
    }

    /// The issuer and coordinates of a genuine id (this instance's or another's with the
    /// same key) of this signer's consumer, in either version; `None` for anything
    /// malformed, truncated, forged, or of another consumer.
    pub(crate) fn decode(&self, id: &str) -> Option<SignedLease> {
        self.parse(id, true)
    }

    /// [`LeaseSigner::decode`] of an id this process holds as it was issued (a push
    /// worker's own leases, never read back from a client): parsed, its tag not checked
    /// again — that check is the cost of a settle's decoding.
    pub(crate) fn decode_issued(&self, id: &str) -> Option<SignedLease> {
        self.parse(id, false)
    }

    fn parse(&self, id: &str, verify: bool) -> Option<SignedLease> {
        // Bounded before decoding: nothing longer than the longest names is an id.
        if id.len() > MAX_ID_CHARS {
            return None;
        }
        let raw = URL_SAFE_NO_PAD.decode(id).ok()?;
        let signed_len = match *raw.first()? {
            VERSION if raw.len() == ID_LEN => BODY_LEN,
            VERSION_NAMED => {
                let names = self.names.as_deref()?;
                let signed_len = BODY_LEN + names.len();
                if raw.len() != signed_len + TAG_LEN || &raw[BODY_LEN..signed_len] != names {
                    return None;
                }
                signed_len
            }
            _ => return None,
        };
        if verify {
            let mut mac = self.mac.clone();
            mac.update(&raw[..signed_len]);
            // Constant-time comparison of the truncated tag.
            mac.verify_truncated_left(&raw[signed_len..]).ok()?;
        }
        let word = |at: usize| {
            let mut bytes = [0u8; 8];
            bytes.copy_from_slice(&raw[at..at + 8]);
            bytes
        };
        let mut epoch = [0u8; 4];
        epoch.copy_from_slice(&raw[9..13]);
        Some(SignedLease {
            owner: InstanceId(u64::from_be_bytes(word(1))),
            lease: LeaseCoordinates {
                epoch: u32::from_be_bytes(epoch),
                key: DeliveryKey {
                    stream_sequence: u64::from_be_bytes(word(13)),
                    delivered: u64::from_be_bytes(word(29)),
                },
                consumer_sequence: u64::from_be_bytes(word(21)),
                published_unix_nanos: i64::from_be_bytes(word(37)),
            },
        })
    }

    fn tag(&self, body: &[u8]) -> Vec<u8> {
        let mut mac = self.mac.clone();
        mac.update(body);
        mac.finalize().into_bytes().to_vec()
    }
}

/// The stream and consumer a version 3 id names, unverified: which consumer's signer to
/// ask. `None` for a version 2 id (the default consumer's) or anything else.
pub(crate) fn named_in(id: &str) -> Option<(String, String)> {
    // A version 2 id has exactly this length, a version 3 one is longer: most settles (the
    // default consumer's) are told apart without decoding.
    if id.len() <= V2_ID_CHARS || id.len() > MAX_ID_CHARS {
        return None;
    }
    let raw = URL_SAFE_NO_PAD.decode(id).ok()?;
    if raw.first() != Some(&VERSION_NAMED) {
        return None;
    }
    let rest = raw.get(BODY_LEN..raw.len().checked_sub(TAG_LEN)?)?;
    let (stream, rest) = length_prefixed(rest)?;
    let (consumer, rest) = length_prefixed(rest)?;
    rest.is_empty()
        .then(|| (stream.to_owned(), consumer.to_owned()))
}

fn length_prefixed(bytes: &[u8]) -> Option<(&str, &[u8])> {
    let (&len, rest) = bytes.split_first()?;
    let (name, rest) = rest.split_at_checked(usize::from(len))?;
    Some((std::str::from_utf8(name).ok()?, rest))
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
    fn key_files_hold_hex_base64_or_raw_bytes_of_at_least_32() {
        let raw: Vec<u8> = (0u8..32).collect();
        let hex: String = raw.iter().map(|b| format!("{b:02x}")).collect();
        let b64 = base64::engine::general_purpose::STANDARD.encode(&raw);
        for text in [
            format!("{hex}\n"),
            format!("  {b64}\n"),
            b64.trim_end_matches('=').into(),
        ] {
            assert_eq!(
                LeaseKey::parse(text.as_bytes()).expect("valid").bytes(),
                raw
            );
        }
        let binary: Vec<u8> = (200u8..=255).collect();
        assert_eq!(LeaseKey::parse(&binary).expect("raw").bytes(), binary);
        let err = LeaseKey::parse(b"short-secret-key\n").expect_err("too short");
        assert!(
            err.contains("at least 32 bytes") && !err.contains("short-secret"),
            "{err}"
        );
        assert!(
            LeaseKey::parse(&hex.as_bytes()[..62]).is_err(),
            "31 bytes as hex"
        );
        assert_eq!(
            format!("{:?}", LeaseKey::parse(&binary).expect("raw")),
            "LeaseKey(<redacted>)"
        );
    }

    #[test]
    fn round_trips_and_is_url_safe() {
        let signer = LeaseSigner::random("ORDERS", "billing", InstanceId(0xfeed));
        let id = signer.encode(&sample());
        assert!(
            id.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        );
        assert_eq!(
            signer.decode(&id),
            Some(SignedLease {
                owner: InstanceId(0xfeed),
                lease: sample()
            })
        );
    }

    #[test]
    fn an_issued_id_parses_as_decode_would_without_the_tag_checked() {
        let signer = LeaseSigner::with_key(b"key", "ORDERS", "billing", InstanceId(1));
        let id = signer.encode(&sample());
        assert_eq!(signer.decode_issued(&id), signer.decode(&id));
        // Only what the process holds as issued goes this way: a forged tag still parses,
        // where decode refuses it.
        let forger = LeaseSigner::with_key(b"other", "ORDERS", "billing", InstanceId(1));
        let forged = forger.encode(&sample());
        assert_eq!(signer.decode(&forged), None);
        assert_eq!(signer.decode_issued(&forged), signer.decode(&id));
        assert_eq!(signer.decode_issued("not-a-lease"), None);
    }

    #[test]
    fn rejects_tampered_truncated_and_foreign_ids() {
        let signer = LeaseSigner::with_key(b"key", "ORDERS", "billing", InstanceId(1));
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
        let other_consumer = LeaseSigner::with_key(b"key", "ORDERS", "shipping", InstanceId(1));
        assert_eq!(other_consumer.decode(&id), None);
        let other_key = LeaseSigner::with_key(b"other", "ORDERS", "billing", InstanceId(1));
        assert_eq!(other_key.decode(&id), None);
        // Another replica with the same key verifies it and sees whose it is.
        let replica = LeaseSigner::with_key(b"key", "ORDERS", "billing", InstanceId(2));
        assert_eq!(
            replica.decode(&id).map(|signed| signed.owner),
            Some(InstanceId(1))
        );
    }

    #[test]
    fn named_ids_carry_their_consumer_and_verify_only_for_it() {
        let billing = LeaseSigner::with_key(b"key", "ORDERS", "billing", InstanceId(1)).naming();
        let id = billing.encode(&sample());
        assert_eq!(
            named_in(&id),
            Some(("ORDERS".to_owned(), "billing".to_owned()))
        );
        assert_eq!(
            billing.decode(&id).map(|signed| signed.lease),
            Some(sample())
        );
        // The same key, another consumer: neither version crosses over.
        let shipping = LeaseSigner::with_key(b"key", "ORDERS", "shipping", InstanceId(1)).naming();
        assert_eq!(shipping.decode(&id), None);
        assert_eq!(billing.decode(&shipping.encode(&sample())), None);
        // A version 2 id (the default consumer's) names nothing and still verifies.
        let default = LeaseSigner::with_key(b"key", "ORDERS", "billing", InstanceId(1));
        let old = default.encode(&sample());
        assert_eq!(named_in(&old), None);
        assert!(billing.decode(&old).is_some());
        assert_eq!(
            default.decode(&id).map(|signed| signed.lease),
            Some(sample()),
            "a consumer served as the default reads the ids it issued as a named one"
        );
    }

    #[test]
    fn key_fingerprints_match_only_for_the_same_key() {
        let one = LeaseSigner::with_key(b"key", "ORDERS", "billing", InstanceId(1));
        let two = LeaseSigner::with_key(b"key", "ORDERS", "billing", InstanceId(2));
        let other = LeaseSigner::with_key(b"kez", "ORDERS", "billing", InstanceId(1));
        assert_eq!(one.key_fingerprint(), two.key_fingerprint());
        assert_ne!(one.key_fingerprint(), other.key_fingerprint());
        assert_eq!(one.key_fingerprint().len(), 16);
    }

    #[test]
    fn instance_ids_print_as_16_hex_digits() {
        assert_eq!(
            InstanceId(0x00ab_cdef_0123_4567).to_string(),
            "00abcdef01234567"
        );
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        fn coordinates() -> impl Strategy<Value = LeaseCoordinates> {
            (
                any::<u32>(),
                any::<u64>(),
                any::<u64>(),
                any::<u64>(),
                any::<i64>(),
            )
                .prop_map(
                    |(epoch, stream_sequence, delivered, consumer_sequence, published)| {
                        LeaseCoordinates {
                            epoch,
                            key: DeliveryKey {
                                stream_sequence,
                                delivered,
                            },
                            consumer_sequence,
                            published_unix_nanos: published,
                        }
                    },
                )
        }

        fn signer() -> LeaseSigner {
            LeaseSigner::with_key(&[7u8; 32], "ORDERS", "billing", InstanceId(7))
        }

        proptest! {
            #[test]
            fn every_id_round_trips(lease in coordinates()) {
                let signer = signer();
                let id = signer.encode(&lease);
                prop_assert_eq!(signer.decode(&id).map(|signed| signed.lease), Some(lease));
            }

            #[test]
            fn arbitrary_text_never_panics_and_never_verifies(text in any::<String>()) {
                prop_assert_eq!(signer().decode(&text), None);
            }

            #[test]
            fn arbitrary_bytes_never_verify(bytes in proptest::collection::vec(any::<u8>(), 0..100)) {
                let text = String::from_utf8_lossy(&bytes);
                prop_assert_eq!(signer().decode(&text), None);
                // Bytes of an id's length, base64-encoded: well-formed but unsigned.
                let well_formed = URL_SAFE_NO_PAD.encode(&bytes);
                prop_assert_eq!(signer().decode(&well_formed), None);
            }

            #[test]
            fn changing_any_character_is_rejected(
                lease in coordinates(),
                at in any::<proptest::sample::Index>(),
                replacement in proptest::sample::select(
                    b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_".to_vec()
                ),
            ) {
                let signer = signer();
                let id = signer.encode(&lease);
                let at = at.index(id.len());
                let mut bytes = id.clone().into_bytes();
                prop_assume!(bytes[at] != replacement);
                bytes[at] = replacement;
                let tampered = String::from_utf8(bytes).expect("ascii");
                // The last character carries only 4 bits of the tag plus 2 padding bits that
                // a lenient decoder could ignore: this one must not, and all must fail.
                prop_assert_eq!(signer.decode(&tampered), None, "{} → {}", id, tampered);
            }

            #[test]
            fn truncating_or_extending_is_rejected(lease in coordinates(), cut in 1usize..82) {
                let signer = signer();
                let id = signer.encode(&lease);
                prop_assert_eq!(signer.decode(&id[..id.len() - cut.min(id.len())]), None);
                prop_assert_eq!(signer.decode(&format!("{id}A")), None);
            }
        }
    }
}
