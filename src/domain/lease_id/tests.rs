//! Tests of lease ids: round trips, every version still read, tampering and foreign ids refused.

use super::*;

/// An expiry as issued: some Unix milliseconds.
const EXPIRY: i64 = 1_790_230_500_084;

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
    let signer = LeaseSigner::random("ORDERS", "billing", InstanceId(0xfeed)).expiring();
    let id = signer.encode(&sample(), EXPIRY);
    assert!(
        id.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    );
    assert_eq!(
        signer.decode(&id),
        Some(SignedLease {
            owner: InstanceId(0xfeed),
            lease: sample(),
            issued_expiry_unix_ms: Some(EXPIRY),
        })
    );
}

#[test]
fn ids_of_earlier_releases_still_verify_and_carry_no_expiry() {
    for naming in [false, true] {
        let mut signer = LeaseSigner::with_key(b"key", "ORDERS", "billing", InstanceId(3));
        if naming {
            signer = signer.naming();
        }
        // Issued while a replica of an earlier release may be asked to settle it.
        let earlier = signer.encode(&sample(), EXPIRY);
        signer.issue_expiring(true);
        let current = signer.encode(&sample(), EXPIRY);
        assert!(current.len() > earlier.len(), "the expiry makes ids longer");
        assert_eq!(
            signer.decode(&earlier),
            Some(SignedLease {
                owner: InstanceId(3),
                lease: sample(),
                issued_expiry_unix_ms: None,
            })
        );
        assert_eq!(
            named_in(&earlier).is_some(),
            naming,
            "version 3 names its consumer"
        );
        assert_eq!(named_in(&current).is_some(), naming);
        // The expiry is signed: an earlier body with an expiry appended is no id.
        let mut raw = URL_SAFE_NO_PAD.decode(&earlier).expect("base64");
        raw[0] = VERSION_EXPIRING;
        raw.splice(BODY_LEN..BODY_LEN, 0i64.to_be_bytes());
        assert_eq!(signer.decode(&URL_SAFE_NO_PAD.encode(raw)), None);
    }
}

#[test]
fn an_issued_id_parses_as_decode_would_without_the_tag_checked() {
    let signer = LeaseSigner::with_key(b"key", "ORDERS", "billing", InstanceId(1)).expiring();
    let id = signer.encode(&sample(), EXPIRY);
    assert_eq!(signer.decode_issued(&id), signer.decode(&id));
    // Only what the process holds as issued goes this way: a forged tag still parses,
    // where decode refuses it.
    let forger = LeaseSigner::with_key(b"other", "ORDERS", "billing", InstanceId(1)).expiring();
    let forged = forger.encode(&sample(), EXPIRY);
    assert_eq!(signer.decode(&forged), None);
    assert_eq!(signer.decode_issued(&forged), signer.decode(&id));
    assert_eq!(signer.decode_issued("not-a-lease"), None);
}

#[test]
fn rejects_tampered_truncated_and_foreign_ids() {
    let signer = LeaseSigner::with_key(b"key", "ORDERS", "billing", InstanceId(1)).expiring();
    let id = signer.encode(&sample(), EXPIRY);
    assert_eq!(signer.decode(&id[..id.len() - 1]), None);
    assert_eq!(signer.decode(""), None);
    assert_eq!(signer.decode("not-a-lease"), None);
    let mut tampered = id.clone().into_bytes();
    tampered[5] = if tampered[5] == b'A' { b'B' } else { b'A' };
    assert_eq!(
        signer.decode(std::str::from_utf8(&tampered).expect("ascii")),
        None
    );
    let other_consumer =
        LeaseSigner::with_key(b"key", "ORDERS", "shipping", InstanceId(1)).expiring();
    assert_eq!(other_consumer.decode(&id), None);
    let other_key = LeaseSigner::with_key(b"other", "ORDERS", "billing", InstanceId(1)).expiring();
    assert_eq!(other_key.decode(&id), None);
    // Another replica with the same key verifies it and sees whose it is.
    let replica = LeaseSigner::with_key(b"key", "ORDERS", "billing", InstanceId(2)).expiring();
    assert_eq!(
        replica.decode(&id).map(|signed| signed.owner),
        Some(InstanceId(1))
    );
}

#[test]
fn named_ids_carry_their_consumer_and_verify_only_for_it() {
    let billing = LeaseSigner::with_key(b"key", "ORDERS", "billing", InstanceId(1))
        .naming()
        .expiring();
    let id = billing.encode(&sample(), EXPIRY);
    assert_eq!(
        named_in(&id),
        Some(("ORDERS".to_owned(), "billing".to_owned()))
    );
    assert_eq!(
        billing.decode(&id).map(|signed| signed.lease),
        Some(sample())
    );
    // The same key, another consumer: neither version crosses over.
    let shipping = LeaseSigner::with_key(b"key", "ORDERS", "shipping", InstanceId(1))
        .naming()
        .expiring();
    assert_eq!(shipping.decode(&id), None);
    assert_eq!(billing.decode(&shipping.encode(&sample(), EXPIRY)), None);
    // The default consumer's ids name nothing and still verify.
    let default = LeaseSigner::with_key(b"key", "ORDERS", "billing", InstanceId(1)).expiring();
    let old = default.encode(&sample(), EXPIRY);
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
    let one = LeaseSigner::with_key(b"key", "ORDERS", "billing", InstanceId(1)).expiring();
    let two = LeaseSigner::with_key(b"key", "ORDERS", "billing", InstanceId(2)).expiring();
    let other = LeaseSigner::with_key(b"kez", "ORDERS", "billing", InstanceId(1)).expiring();
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
            let id = signer.encode(&lease, EXPIRY);
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
            let id = signer.encode(&lease, EXPIRY);
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
            let id = signer.encode(&lease, EXPIRY);
            prop_assert_eq!(signer.decode(&id[..id.len() - cut.min(id.len())]), None);
            prop_assert_eq!(signer.decode(&format!("{id}A")), None);
        }
    }
}
