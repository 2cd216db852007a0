//! The gate's unit tests: heads, held messages, the fence and keep-alives, driven by hand.

use std::sync::Arc;

use bytes::Bytes;
use time::OffsetDateTime;

use super::*;
use crate::domain::lease_id::{DeliveryKey, LeaseCoordinates};

fn delivery(stream_sequence: u64, delivered: u64, received_at: Instant) -> Delivery {
    Delivery {
        coordinates: LeaseCoordinates {
            epoch: 1,
            key: DeliveryKey {
                stream_sequence,
                delivered,
            },
            consumer_sequence: stream_sequence,
            published_unix_nanos: 0,
        },
        reply: Arc::from(format!("$JS.ACK.S.C.{delivered}.{stream_sequence}.0.0.0")),
        subject: "orders.c1.created".into(),
        payload: Bytes::new(),
        headers: None,
        unparsed: Default::default(),
        stream: "S".into(),
        consumer: "C".into(),
        pending: 0,
        published_at: OffsetDateTime::UNIX_EPOCH,
        received_at,
    }
}

fn key(name: &str) -> Arc<str> {
    Arc::from(name)
}

fn sequences(deliveries: &[Delivery]) -> Vec<u64> {
    deliveries
        .iter()
        .map(|delivery| delivery.coordinates.key.stream_sequence)
        .collect()
}

fn leases(admitted: Option<Delivery>) -> bool {
    admitted.is_some()
}

#[test]
fn specs_parse_and_print_back() {
    assert_eq!(
        "subject:2".parse::<OrderingKeySpec>(),
        Ok(OrderingKeySpec::SubjectToken(2))
    );
    assert_eq!(
        "header".parse::<OrderingKeySpec>(),
        Ok(OrderingKeySpec::Header(ORDERING_KEY_HEADER.into()))
    );
    assert_eq!(
        "header:Customer-Id".parse::<OrderingKeySpec>(),
        Ok(OrderingKeySpec::Header("Customer-Id".into()))
    );
    for bad in [
        "",
        "subject:0",
        "subject:x",
        "subject:",
        "header:",
        "header:a b",
        "key",
    ] {
        assert!(bad.parse::<OrderingKeySpec>().is_err(), "{bad:?} parsed");
    }
    assert_eq!(OrderingKeySpec::SubjectToken(3).to_string(), "subject:3");
    for spec in ["header", "header:Customer-Id"] {
        assert_eq!(
            spec.parse::<OrderingKeySpec>().map(|spec| spec.to_string()),
            Ok(spec.to_owned())
        );
    }
}

#[test]
fn keys_come_from_a_subject_token_or_a_header() {
    let token = OrderingKeySpec::SubjectToken(2);
    assert_eq!(
        token.key_of("orders.c1.created", None),
        KeyOf::Key(key("c1"))
    );
    assert_eq!(token.key_of("orders", None), KeyOf::Unordered);
    let header = OrderingKeySpec::Header(ORDERING_KEY_HEADER.into());
    let mut headers = HeaderMap::new();
    headers.insert(ORDERING_KEY_HEADER, "c9");
    assert_eq!(
        header.key_of("orders.x", Some(&headers)),
        KeyOf::Key(key("c9"))
    );
    assert_eq!(header.key_of("orders.x", None), KeyOf::Unordered);
    let mut long = HeaderMap::new();
    long.insert(ORDERING_KEY_HEADER, "k".repeat(MAX_KEY_BYTES + 1).as_str());
    assert_eq!(header.key_of("orders.x", Some(&long)), KeyOf::TooLong);
}

#[test]
fn one_message_of_a_key_is_out_at_a_time_and_the_next_follows_a_final_settle() {
    let now = Instant::now();
    let mut gate = OrderingGate::default();
    assert!(leases(gate.admit(key("a"), delivery(1, 1, now))));
    assert!(!leases(gate.admit(key("a"), delivery(2, 1, now))));
    assert!(!leases(gate.admit(key("a"), delivery(3, 1, now))));
    // Another key is not held back.
    assert!(leases(gate.admit(key("b"), delivery(4, 1, now))));
    assert_eq!((gate.held(), gate.busy_keys()), (2, 2));
    gate.leased(1);
    // A nak or an expiry keeps the head: its redelivery, and only it, goes out.
    gate.returned(1);
    assert!(gate.take_ready().is_empty());
    assert!(leases(gate.admit(key("a"), delivery(1, 2, now))));
    gate.finished(1);
    assert_eq!(sequences(&gate.take_ready()), [2]);
    assert_eq!(gate.held(), 1);
    gate.finished(2);
    assert_eq!(sequences(&gate.take_ready()), [3]);
    gate.finished(3);
    gate.finished(4);
    assert!(gate.take_ready().is_empty());
    assert_eq!((gate.held(), gate.busy_keys()), (0, 0));
}

#[test]
fn a_fenced_gate_holds_everything_until_lifted_then_each_key_starts_at_its_oldest() {
    let now = Instant::now();
    let mut gate = OrderingGate::default();
    assert!(leases(gate.admit(key("a"), delivery(1, 1, now))));
    assert!(leases(gate.admit(key("c"), delivery(2, 1, now))));
    gate.fence();
    // Its own head, nak'd and back while fenced: held like the rest.
    assert!(!leases(gate.admit(key("c"), delivery(2, 2, now))));
    // A rebind under a new epoch forgets what was out.
    gate.release(true);
    gate.fence();
    assert_eq!(gate.busy_keys(), 0, "what was out is forgotten");
    assert!(!leases(gate.admit(key("a"), delivery(7, 1, now))));
    // A redelivery of what another process leased: older, so it goes first once lifted.
    assert!(!leases(gate.admit(key("a"), delivery(3, 2, now))));
    assert!(!leases(gate.admit(key("b"), delivery(4, 1, now))));
    assert!(gate.take_ready().is_empty());
    gate.lift_fence();
    let mut ready = sequences(&gate.take_ready());
    ready.sort_unstable();
    assert_eq!(ready, [3, 4]);
    gate.finished(3);
    assert_eq!(sequences(&gate.take_ready()), [7]);
}

#[test]
fn held_messages_are_kept_alive_and_count_as_received_then() {
    let start = Instant::now();
    let every = Duration::from_secs(10);
    let mut gate = OrderingGate::default();
    assert!(leases(gate.admit(key("a"), delivery(1, 1, start))));
    assert!(!leases(gate.admit(key("a"), delivery(2, 1, start))));
    assert!(
        gate.keep_alive_due(start + Duration::from_secs(9), every)
            .is_empty()
    );
    let later = start + Duration::from_secs(10);
    assert_eq!(gate.keep_alive_due(later, every).len(), 1);
    assert_eq!(gate.next_keep_alive(every), Some(later + every));
    gate.finished(1);
    let ready = gate.take_ready();
    assert_eq!(ready[0].received_at, later);
}

#[test]
fn a_head_past_max_deliver_whose_lease_ended_frees_its_key() {
    let now = Instant::now();
    let mut gate = OrderingGate::default();
    assert!(leases(gate.admit(key("a"), delivery(1, 3, now))));
    assert!(!leases(gate.admit(key("a"), delivery(2, 1, now))));
    // Waiting for a fetch: it will be leased.
    assert!(gate.sidelined(3, |_, _| false).is_empty());
    gate.leased(1);
    assert!(gate.sidelined(3, |_, _| true).is_empty());
    assert!(gate.sidelined(4, |_, _| false).is_empty());
    // Its lease expired, or it was nak'd back: the server gave up on it.
    assert_eq!(gate.sidelined(3, |_, _| false), [1]);
    gate.returned(1);
    assert_eq!(gate.sidelined(3, |_, _| true), [1]);
    gate.given_back(1);
    assert!(gate.sidelined(3, |_, _| false).is_empty());
}

#[test]
fn released_messages_leave_the_heads_in_place_unless_forgotten() {
    let now = Instant::now();
    let mut gate = OrderingGate::default();
    assert!(leases(gate.admit(key("a"), delivery(1, 1, now))));
    assert!(!leases(gate.admit(key("a"), delivery(2, 1, now))));
    assert_eq!(sequences(&gate.release(false)), [2]);
    assert_eq!((gate.held(), gate.busy_keys()), (0, 1));
    // Delivered again while 1 is out: held again.
    assert!(!leases(gate.admit(key("a"), delivery(2, 2, now))));
    assert_eq!(sequences(&gate.release(true)), [2]);
    assert_eq!(gate.busy_keys(), 0);
    assert!(leases(gate.admit(key("a"), delivery(2, 3, now))));
    assert_eq!(
        gate.hottest(3),
        Vec::<(Arc<str>, usize)>::new(),
        "nothing held"
    );
}

#[test]
fn messages_in_the_verification_window_wait_until_asked_about() {
    let now = Instant::now();
    let mut gate = OrderingGate::default();
    gate.verify_below(10);
    assert!(!leases(gate.admit(key("a"), delivery(5, 1, now))));
    assert!(!leases(gate.admit(key("a"), delivery(12, 1, now))));
    assert!(!leases(gate.admit(key("b"), delivery(6, 1, now))));
    let asked: Vec<u64> = gate
        .take_to_verify()
        .iter()
        .map(|message| message.stream_sequence)
        .collect();
    assert_eq!(asked, [5, 6], "past the window nothing is asked about");
    assert!(gate.take_ready().is_empty());
    // 6 ended elsewhere: taken out; 5 did not: it goes out, 12 after it.
    assert!(gate.take_ended(6).is_some());
    gate.verified(5);
    assert_eq!(sequences(&gate.take_ready()), [5]);
    gate.stop_verifying();
    assert_eq!(gate.verifying(), None);
    gate.finished(5);
    assert_eq!(sequences(&gate.take_ready()), [12]);
}
