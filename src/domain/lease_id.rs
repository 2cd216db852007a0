//! Lease ids: self-describing, HMAC-signed tokens naming one delivery of one message.
//!
//! An id carries the gateway instance that issued it and the delivery's coordinates (binding
//! epoch, stream and consumer sequence, delivery count, publish time) in the clear, and a
//! truncated HMAC-SHA256 over them and the stream/consumer names. It holds no secret and
//! cannot be forged without the key; any replica sharing the key can tell whose it is and
//! forward its settle there, without a shared table.
//!
//! Version 3 also carries the stream and consumer names in the clear, so a gateway serving
//! many consumers knows from the id alone which one to settle it on ([`named_in`]); the
//! default consumer (`--stream`/`--consumer`) issues version 2, without them. Version 4 adds
//! the lease's expiry as issued (before any extension), named or not: a replica that cannot
//! reach the issuer knows from the id alone that an expired lease's settle reaches nothing.
//! It is issued only while every replica that may be asked to settle it reads it (the
//! heartbeats say so); ids of every version are read, so in a fleet being rolled each
//! release settles the other's leases.
//!
//! May import: the rest of `domain` only.

use std::sync::atomic::{AtomicBool, Ordering};

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
    /// When the lease expired as issued (Unix milliseconds); an `in-progress` may have
    /// extended it since. `None` in an id of an earlier release (version 2 or 3).
    pub(crate) issued_expiry_unix_ms: Option<i64>,
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
/// Version 4 added the expiry as issued, after the coordinates; the names follow when the
/// signer names its consumer.
const VERSION_EXPIRING: u8 = 4;
const BODY_LEN: usize = 1 + 8 + 4 + 8 * 4;
const EXPIRY_LEN: usize = 8;
/// The longest stream or consumer name a version 3 id carries (one length byte each);
/// NATS allows 255 bytes for a stream.
pub(crate) const MAX_NAME_LEN: usize = 255;
/// 128 bits of tag: unguessable, and keeps ids short enough to paste into a curl line.
const TAG_LEN: usize = 16;
const ID_LEN: usize = BODY_LEN + TAG_LEN;
/// A version 2 id's length in unpadded base64.
const V2_ID_CHARS: usize = (4 * ID_LEN).div_ceil(3);
/// The longest id: version 4 with the longest names, in unpadded base64.
const MAX_ID_CHARS: usize = (4 * (ID_LEN + EXPIRY_LEN + 2 + 2 * MAX_NAME_LEN)).div_ceil(3);

/// Signs and verifies lease ids for one stream/consumer pair, issuing them as one instance.
pub(crate) struct LeaseSigner {
    mac: HmacSha256,
    owner: InstanceId,
    /// The length-prefixed names, as a version 3 id carries them after its coordinates
    /// (`None` for names too long to carry).
    names: Option<Vec<u8>>,
    /// Whether the ids issued name their consumer (version 3, or 4 with the names).
    issue_named: bool,
    /// Whether the ids issued are version 4 (they carry their expiry): only once every
    /// replica that may be asked to settle them reads that version.
    issue_expiring: AtomicBool,
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
            issue_expiring: AtomicBool::new(false),
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

    /// Issue version 4 ids from now on (`true`: every replica that may be asked to settle
    /// them reads that version), or again the version an earlier release reads.
    pub(crate) fn issue_expiring(&self, expiring: bool) {
        self.issue_expiring.store(expiring, Ordering::Relaxed);
    }

    /// [`LeaseSigner::issue_expiring`] at once, for a signer made to issue version 4.
    #[cfg(test)]
    pub(crate) fn expiring(self) -> Self {
        self.issue_expiring(true);
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

    /// The id of `lease`, expiring (as issued) at `expires_unix_ms`; without the expiry
    /// while a replica of an earlier release may be asked to settle it.
    pub(crate) fn encode(&self, lease: &LeaseCoordinates, expires_unix_ms: i64) -> String {
        if !self.issue_expiring.load(Ordering::Relaxed) {
            return self.encode_as_earlier_release(lease);
        }
        let mut raw = self.body(VERSION_EXPIRING, lease);
        raw.extend_from_slice(&expires_unix_ms.to_be_bytes());
        self.name_and_sign(raw)
    }

    /// The id a replica of an earlier release issues for `lease`: version 3 when this
    /// signer names its consumer, else version 2.
    fn encode_as_earlier_release(&self, lease: &LeaseCoordinates) -> String {
        let named = self.issue_named && self.names.is_some();
        self.name_and_sign(self.body(if named { VERSION_NAMED } else { VERSION }, lease))
    }

    fn body(&self, version: u8, lease: &LeaseCoordinates) -> Vec<u8> {
        let mut raw = Vec::with_capacity(ID_LEN + EXPIRY_LEN + 2 + 2 * MAX_NAME_LEN);
        raw.push(version);
        raw.extend_from_slice(&self.owner.0.to_be_bytes());
        raw.extend_from_slice(&lease.epoch.to_be_bytes());
        raw.extend_from_slice(&lease.key.stream_sequence.to_be_bytes());
        raw.extend_from_slice(&lease.consumer_sequence.to_be_bytes());
        raw.extend_from_slice(&lease.key.delivered.to_be_bytes());
        raw.extend_from_slice(&lease.published_unix_nanos.to_be_bytes());
        raw
    }

    /// Append the names (when this signer names its consumer) and the tag over everything.
    fn name_and_sign(&self, mut raw: Vec<u8>) -> String {
        if let Some(names) = self.names.as_ref().filter(|_| self.issue_named) {
            raw.extend_from_slice(names);
        }
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
        let version = *raw.first()?;
        let body_len = match version {
            VERSION | VERSION_NAMED => BODY_LEN,
            VERSION_EXPIRING => BODY_LEN + EXPIRY_LEN,
            _ => return None,
        };
        let signed_len = raw.len().checked_sub(TAG_LEN)?;
        let names = raw.get(body_len..signed_len)?;
        let named_as_this = || self.names.as_deref() == Some(names);
        let well_formed = match version {
            VERSION => names.is_empty(),
            VERSION_NAMED => named_as_this(),
            _ => names.is_empty() || named_as_this(),
        };
        if !well_formed {
            return None;
        }
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
            issued_expiry_unix_ms: (version == VERSION_EXPIRING)
                .then(|| i64::from_be_bytes(word(BODY_LEN))),
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
    // A version 2 id has exactly this length, a named one is longer: most settles of the
    // default consumer's version 2 ids are told apart without decoding.
    if id.len() <= V2_ID_CHARS || id.len() > MAX_ID_CHARS {
        return None;
    }
    let raw = URL_SAFE_NO_PAD.decode(id).ok()?;
    let body_len = match *raw.first()? {
        VERSION_NAMED => BODY_LEN,
        VERSION_EXPIRING => BODY_LEN + EXPIRY_LEN,
        _ => return None,
    };
    let rest = raw.get(body_len..raw.len().checked_sub(TAG_LEN)?)?;
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
mod tests;
