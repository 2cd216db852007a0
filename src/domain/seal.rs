//! Seals on what replicas send each other under the internal prefix (heartbeats, keyed fetch
//! answers, forwarded settles and their answers): an HMAC-SHA256, under a key derived from
//! the shared lease key, over the message's kind, subject, sender, time and content. Anyone
//! allowed to publish under the prefix can write there; only a holder of the key can write
//! something a replica believes, and a genuine message copied to another subject, or replayed
//! outside a short window, does not verify.
//!
//! May import: the rest of `domain` only.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{KeyInit, Mac};
use sha2::Sha256;

use super::lease_id::InstanceId;

type HmacSha256 = hmac::Hmac<Sha256>;

/// The NATS header that carries a seal: `1 <sender> <unix ms> <tag>`.
pub(crate) const HEADER: &str = "Ruststream-Seal";
/// The form of seal this release writes (and the only one it reads).
const VERSION: &str = "1";
/// Sealed keys are derived from the lease key under this label, so that a seal can never
/// double as a lease id's tag or the other way round.
const KEY_LABEL: &[u8] = b"ruststream-nats internal message seal v1";
/// How far a sender's clock may run ahead of the reader's.
const CLOCK_SKEW_MS: i64 = 5_000;

/// What a sealed message is; part of what the seal covers, so that a heartbeat cannot pass
/// for a forwarded settle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Kind {
    Heartbeat,
    KeyedAnswer,
    ForwardedSettle,
    ForwardedAnswer,
    /// A record of confirmed acks and terms (see `nats::settled`).
    SettledRecord,
}

impl Kind {
    /// The label of `ruststream_internal_messages_rejected_total{kind}`.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Heartbeat => "heartbeat",
            Self::KeyedAnswer => "keyed_answer",
            Self::ForwardedSettle => "forwarded_settle",
            Self::ForwardedAnswer => "forwarded_answer",
            Self::SettledRecord => "settled_record",
        }
    }
}

/// Why a message was not believed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rejection {
    /// No seal, and unsealed messages are not accepted.
    Unsealed,
    /// A seal that does not parse.
    Malformed,
    /// A seal made with another key, or over other content: a forgery, or a replica with
    /// another lease key.
    Forged,
    /// Genuine but older than the window allows (or from too far in the future): a replay.
    Stale,
    /// Genuine, but from another sender than the message claims.
    WrongSender,
}

impl Rejection {
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Self::Unsealed => "carries no seal (an older release? see --accept-unsigned-replicas)",
            Self::Malformed => "carries a seal that does not parse",
            Self::Forged => {
                "is not sealed with this gateway's lease key (a forgery, or a replica with another --lease-key-file)"
            }
            Self::Stale => "is sealed outside the replay window (a replay, or clocks far apart)",
            Self::WrongSender => "is sealed by another instance than it claims to come from",
        }
    }
}

/// Seals and opens messages as one instance, under one key.
pub(crate) struct Sealer {
    mac: HmacSha256,
    sender: InstanceId,
}

impl Sealer {
    /// `lease_key`: the shared lease key (replicas that hold the same one trust each other).
    pub(crate) fn new(lease_key: &[u8], sender: InstanceId) -> Self {
        let mut derive = <HmacSha256 as KeyInit>::new_from_slice(lease_key)
            .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        derive.update(KEY_LABEL);
        let key = derive.finalize().into_bytes();
        let mac = <HmacSha256 as KeyInit>::new_from_slice(&key)
            .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        Self { mac, sender }
    }

    /// The seal of a message of `kind` sent now (`now_ms`, Unix milliseconds) on `subject`
    /// whose content is `parts` (the payload and any header that means something).
    pub(crate) fn seal(&self, kind: Kind, subject: &str, parts: &[&[u8]], now_ms: i64) -> String {
        let tag = self.tag(kind, subject, self.sender, now_ms, parts);
        format!(
            "{VERSION} {} {now_ms} {}",
            self.sender,
            URL_SAFE_NO_PAD.encode(tag)
        )
    }

    /// The sender of a message whose seal is `seal`, once the seal is checked: made with
    /// this key over exactly this kind, subject and content, at most `max_age_ms` before
    /// `now_ms`.
    pub(crate) fn open(
        &self,
        kind: Kind,
        subject: &str,
        parts: &[&[u8]],
        seal: &str,
        now_ms: i64,
        max_age_ms: i64,
    ) -> Result<InstanceId, Rejection> {
        let mut fields = seal.split(' ');
        let (Some(VERSION), Some(sender), Some(sent_ms), Some(tag), None) = (
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
        ) else {
            return Err(Rejection::Malformed);
        };
        let sender = InstanceId::parse(sender).ok_or(Rejection::Malformed)?;
        let sent_ms: i64 = sent_ms.parse().map_err(|_| Rejection::Malformed)?;
        let tag = URL_SAFE_NO_PAD
            .decode(tag)
            .map_err(|_| Rejection::Malformed)?;
        let mut mac = self.mac.clone();
        feed(&mut mac, kind, subject, sender, sent_ms, parts);
        mac.verify_slice(&tag).map_err(|_| Rejection::Forged)?;
        let age = now_ms.saturating_sub(sent_ms);
        if age > max_age_ms || age < -CLOCK_SKEW_MS {
            return Err(Rejection::Stale);
        }
        Ok(sender)
    }

    fn tag(
        &self,
        kind: Kind,
        subject: &str,
        sender: InstanceId,
        sent_ms: i64,
        parts: &[&[u8]],
    ) -> [u8; 32] {
        let mut mac = self.mac.clone();
        feed(&mut mac, kind, subject, sender, sent_ms, parts);
        mac.finalize().into_bytes().into()
    }
}

/// Everything a seal covers, each field length-prefixed so that no two messages feed the
/// same bytes.
fn feed(
    mac: &mut HmacSha256,
    kind: Kind,
    subject: &str,
    sender: InstanceId,
    sent_ms: i64,
    parts: &[&[u8]],
) {
    let mut field = |bytes: &[u8]| {
        mac.update(&(bytes.len() as u64).to_be_bytes());
        mac.update(bytes);
    };
    field(kind.as_str().as_bytes());
    field(subject.as_bytes());
    field(&sender.0.to_be_bytes());
    field(&sent_ms.to_be_bytes());
    for part in parts {
        field(part);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: i64 = 1_800_000_000_000;
    const WINDOW: i64 = 10_000;

    fn sealer(key: &[u8], sender: u64) -> Sealer {
        Sealer::new(key, InstanceId(sender))
    }

    #[test]
    fn a_sealed_message_opens_with_the_same_key_and_names_its_sender() {
        let alice = sealer(b"key", 7);
        let seal = alice.seal(Kind::Heartbeat, "p.s.c.replica.7", &[b"{}"], NOW);
        let bob = sealer(b"key", 8);
        assert_eq!(
            bob.open(
                Kind::Heartbeat,
                "p.s.c.replica.7",
                &[b"{}"],
                &seal,
                NOW + 1,
                WINDOW
            ),
            Ok(InstanceId(7))
        );
    }

    #[test]
    fn anything_changed_breaks_the_seal() {
        let alice = sealer(b"key", 7);
        let seal = alice.seal(Kind::Heartbeat, "subject", &[b"a", b"b"], NOW);
        let bob = sealer(b"key", 8);
        let open = |kind, subject, parts: &[&[u8]], seal: &str| {
            bob.open(kind, subject, parts, seal, NOW, WINDOW)
        };
        assert_eq!(
            open(Kind::KeyedAnswer, "subject", &[b"a", b"b"], &seal),
            Err(Rejection::Forged)
        );
        assert_eq!(
            open(Kind::Heartbeat, "other", &[b"a", b"b"], &seal),
            Err(Rejection::Forged)
        );
        assert_eq!(
            open(Kind::Heartbeat, "subject", &[b"ab"], &seal),
            Err(Rejection::Forged)
        );
        assert_eq!(
            open(Kind::Heartbeat, "subject", &[b"a", b"c"], &seal),
            Err(Rejection::Forged)
        );
        let other_sender = seal.replacen("0000000000000007", "0000000000000009", 1);
        assert_eq!(
            open(Kind::Heartbeat, "subject", &[b"a", b"b"], &other_sender),
            Err(Rejection::Forged)
        );
        let forger = sealer(b"another key", 7);
        let forged = forger.seal(Kind::Heartbeat, "subject", &[b"a", b"b"], NOW);
        assert_eq!(
            open(Kind::Heartbeat, "subject", &[b"a", b"b"], &forged),
            Err(Rejection::Forged)
        );
    }

    #[test]
    fn an_old_seal_is_a_replay() {
        let alice = sealer(b"key", 7);
        let seal = alice.seal(Kind::ForwardedSettle, "s", &[b"x"], NOW);
        let open = |now| alice.open(Kind::ForwardedSettle, "s", &[b"x"], &seal, now, WINDOW);
        assert!(open(NOW + WINDOW).is_ok());
        assert_eq!(open(NOW + WINDOW + 1), Err(Rejection::Stale));
        assert!(open(NOW - CLOCK_SKEW_MS).is_ok());
        assert_eq!(open(NOW - CLOCK_SKEW_MS - 1), Err(Rejection::Stale));
    }

    #[test]
    fn garbage_is_malformed_never_a_panic() {
        let alice = sealer(b"key", 7);
        for seal in [
            "",
            "1",
            "2 0000000000000007 1 AAAA",
            "1 7 1 AAAA",
            "1 000000000000000g 1 AAAA",
            "1 0000000000000007 x AAAA",
            "1 0000000000000007 1 !!!",
            "1 0000000000000007 1 AAAA extra",
        ] {
            assert_eq!(
                alice.open(Kind::Heartbeat, "s", &[], seal, NOW, WINDOW),
                Err(Rejection::Malformed),
                "{seal:?}"
            );
        }
    }
}
