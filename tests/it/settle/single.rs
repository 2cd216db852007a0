//! One lease settled at a time: confirmed 204s, nak delays, term reasons, in-progress
//! extensions, and the 404/409/410 fences the gateway keeps itself.

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{Value, json};
use time::OffsetDateTime;

use crate::support::{
    Action, Gateway, Msg, STREAM, Setup, rfc3339, server_ack_pending, sleep_past, wait_for,
};

/// Fetch until the message with `stream_sequence` comes back with a higher delivery count.
async fn wait_for_redelivery(gateway: &Gateway, stream_sequence: u64, timeout: Duration) -> Msg {
    wait_for(
        &format!("stream sequence {stream_sequence} is redelivered"),
        timeout,
        || async move {
            gateway
                .fetch_n(10, 250)
                .await
                .into_iter()
                .find(|m| m.stream_sequence == stream_sequence && m.delivered > 1)
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ack_answers_204_after_the_server_has_it() {
    let (_server, js, gateway) = Setup::consumer("acker").start().await;
    js.publish_many("orders.1", 2, "m").await;
    let messages = gateway.fetch_n(2, 1000).await;
    assert_eq!(messages.len(), 2);
    assert_eq!(server_ack_pending(&js, &gateway).await, 2);

    let reply = gateway.settle(&messages[0].id, Action::Ack, None).await;
    assert_eq!(reply.status, 204, "{}", reply.text);
    assert!(reply.text.is_empty(), "204 has no body: {:?}", reply.text);
    // 204 only after the server confirmed: the very next info already shows it.
    assert_eq!(server_ack_pending(&js, &gateway).await, 1);
    assert_eq!(gateway.ack(&messages[1].id).await, 204);
    let info = js.consumer_info(STREAM, "acker").await;
    assert_eq!(info.num_ack_pending, 0);
    assert_eq!(info.ack_floor.stream_sequence, 2);
    assert_eq!(gateway.leases_in_flight().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nak_redelivers_with_a_new_id_and_delivered_plus_one() {
    let (_server, js, gateway) = Setup::consumer("naker").ack_wait("30s").start().await;
    let sequence = js.publish("orders.1", "again").await;
    let first = gateway.fetch_n(1, 1000).await.remove(0);
    assert_eq!(first.delivered, 1);

    let started = Instant::now();
    assert_eq!(gateway.nak(&first.id, None).await, 204);
    let again = wait_for_redelivery(&gateway, sequence, Duration::from_secs(5)).await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "a plain nak redelivers at once, not after ack_wait"
    );
    assert_eq!(again.delivered, 2);
    assert_ne!(again.id, first.id, "a redelivery gets a new id");
    assert_eq!(again.payload(), b"again");
    assert_eq!(gateway.ack(&again.id).await, 204);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nak_with_delay_is_not_redelivered_before_the_delay() {
    let (_server, js, gateway) = Setup::consumer("delayed").ack_wait("30s").start().await;
    let sequence = js.publish("orders.1", "later").await;
    let first = gateway.fetch_n(1, 1000).await.remove(0);

    let naked = Instant::now();
    let reply = gateway
        .settle(&first.id, Action::Nak, Some(&json!({ "delay_ms": 2000 })))
        .await;
    assert_eq!(reply.status, 204, "{}", reply.text);
    let again = wait_for_redelivery(&gateway, sequence, Duration::from_secs(10)).await;
    let after = naked.elapsed();
    assert!(
        after >= Duration::from_millis(2000),
        "redelivered {after:?} after a nak with delay_ms 2000"
    );
    assert_eq!(again.delivered, 2);
    assert_ne!(again.id, first.id);
    assert_eq!(gateway.ack(&again.id).await, 204);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn term_with_reason_is_never_redelivered() {
    let (_server, js, gateway) = Setup::consumer("termer").ack_wait("1s").start().await;
    let mut advisories = js
        .client
        .subscribe("$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.ORDERS.termer")
        .await
        .expect("subscribe to advisories");
    js.client.flush().await.expect("flush");
    js.publish("orders.1", "poison").await;
    let message = gateway.fetch_n(1, 1000).await.remove(0);

    let reply = gateway
        .settle(
            &message.id,
            Action::Term,
            Some(&json!({ "reason": "unparseable order" })),
        )
        .await;
    assert_eq!(reply.status, 204, "{}", reply.text);
    let advisory = tokio::time::timeout(Duration::from_secs(5), advisories.next())
        .await
        .expect("a MSG_TERMINATED advisory")
        .expect("advisory stream open");
    let advisory: Value = serde_json::from_slice(&advisory.payload).expect("advisory JSON");
    assert_eq!(advisory["reason"], json!("unparseable order"), "{advisory}");

    // Well past ack_wait (1 s): still nothing.
    let messages = gateway.fetch_n(10, 2500).await;
    assert!(
        messages.is_empty(),
        "a termed message came back: {messages:?}"
    );
    let info = js.consumer_info(STREAM, "termer").await;
    assert_eq!(info.num_ack_pending, 0);
    assert_eq!(info.num_redelivered, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn term_without_body_is_accepted() {
    let (_server, js, gateway) = Setup::consumer("termplain").start().await;
    js.publish("orders.1", "x").await;
    let message = gateway.fetch_n(1, 1000).await.remove(0);
    assert_eq!(gateway.term(&message.id, None).await, 204);
    assert_eq!(server_ack_pending(&js, &gateway).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_progress_extends_the_lease_past_the_original_ack_wait() {
    let (_server, js, gateway) = Setup::consumer("worker").ack_wait("2s").start().await;
    js.publish("orders.1", "slow job").await;
    let message = gateway.fetch_n(1, 1000).await.remove(0);
    let original = message.lease_expires();

    let mut latest = original;
    // A client working for ~3.2 s (beyond ack_wait), reporting progress every 800 ms.
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(800)).await;
        let now = OffsetDateTime::now_utc();
        let reply = gateway.in_progress(&message.id).await;
        assert_eq!(reply.status, 200, "{}", reply.text);
        let expires = rfc3339(
            reply.body["lease_expires_at"]
                .as_str()
                .unwrap_or_else(|| panic!("no lease_expires_at: {}", reply.text)),
        );
        assert!(expires > latest, "each extension moves the lease later");
        assert!(
            expires <= now + time::Duration::seconds(2) + time::Duration::milliseconds(500),
            "the lease restarts from now with ack_wait, not more: {expires}"
        );
        latest = expires;
    }
    assert!(
        OffsetDateTime::now_utc() > original,
        "we are past the first lease"
    );
    // Not redelivered although the original ack_wait has passed.
    let stolen = gateway.fetch_n(10, 0).await;
    assert!(
        stolen.is_empty(),
        "redelivered while in progress: {stolen:?}"
    );
    let info = js.consumer_info(STREAM, "worker").await;
    assert_eq!(info.num_redelivered, 0);
    assert_eq!(gateway.ack(&message.id).await, 204);
    assert_eq!(server_ack_pending(&js, &gateway).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_malformed_or_forged_ids_are_404() {
    let (_server, js, gateway) = Setup::consumer("forgery").start().await;
    js.publish("orders.1", "real").await;
    let message = gateway.fetch_n(1, 1000).await.remove(0);

    // Flip one character in the middle and the last one of a real id.
    let flip = |id: &str, at: usize| -> String {
        let mut bytes = id.as_bytes().to_vec();
        bytes[at] = if bytes[at] == b'A' { b'B' } else { b'A' };
        String::from_utf8(bytes).expect("ascii")
    };
    let forged_middle = flip(&message.id, message.id.len() / 2);
    let forged_last = flip(&message.id, message.id.len() - 1);
    let truncated = message.id[..message.id.len() - 4].to_string();
    let extended = format!("{}AAAA", message.id);
    let random = "A".repeat(message.id.len());
    let long = "x".repeat(2000);
    for id in [
        "not-a-lease",
        "0",
        random.as_str(),
        forged_middle.as_str(),
        forged_last.as_str(),
        truncated.as_str(),
        extended.as_str(),
        long.as_str(),
        "a.b.c",
    ] {
        for action in Action::ALL {
            gateway.settle(id, action, None).await.assert_problem(404);
        }
    }
    // The real lease was not touched by any of that.
    assert_eq!(server_ack_pending(&js, &gateway).await, 1);
    assert_eq!(gateway.ack(&message.id).await, 204);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_lease_is_410_and_its_settle_never_reaches_the_server() {
    let (_server, js, gateway) = Setup::consumer("expiry").ack_wait("1s").start().await;
    let sequence = js.publish("orders.1", "late").await;
    let message = gateway.fetch_n(1, 1000).await.remove(0);
    sleep_past(message.lease_expires(), Duration::from_millis(100)).await;

    for action in Action::ALL {
        gateway
            .settle(&message.id, action, None)
            .await
            .assert_problem(410);
    }
    // The stale ack was fenced: the server still redelivers the message.
    let again = wait_for_redelivery(&gateway, sequence, Duration::from_secs(10)).await;
    assert_eq!(again.delivered, 2);
    assert_eq!(gateway.ack(&again.id).await, 204);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn superseded_lease_is_410_and_the_new_id_settles() {
    let (_server, js, gateway) = Setup::consumer("superseded").ack_wait("1s").start().await;
    let sequence = js.publish("orders.1", "twice").await;
    let old = gateway.fetch_n(1, 1000).await.remove(0);
    let new = wait_for_redelivery(&gateway, sequence, Duration::from_secs(10)).await;
    assert_eq!(new.delivered, old.delivered + 1);
    assert_ne!(new.id, old.id);

    // nats-server would accept this stale ack and settle the new delivery: the gateway fences it.
    gateway
        .settle(&old.id, Action::Ack, None)
        .await
        .assert_problem(410);
    assert_eq!(
        server_ack_pending(&js, &gateway).await,
        1,
        "the new delivery is still pending on the server"
    );
    assert_eq!(gateway.ack(&new.id).await, 204);
    assert_eq!(server_ack_pending(&js, &gateway).await, 0);
    // Still superseded after the new one settled.
    gateway
        .settle(&old.id, Action::Ack, None)
        .await
        .assert_problem(410);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_settles_are_retry_safe_and_conflicting_ones_409() {
    let (_server, js, gateway) = Setup::consumer("idempotent").ack_wait("1s").start().await;
    js.publish_many("orders.1", 2, "m").await;
    let messages = gateway.fetch_n(2, 1000).await;
    assert_eq!(messages.len(), 2);
    let (acked, naked) = (&messages[0], &messages[1]);

    assert_eq!(gateway.ack(&acked.id).await, 204);
    assert_eq!(gateway.ack(&acked.id).await, 204, "the same ack again");
    gateway
        .settle(&acked.id, Action::Nak, None)
        .await
        .assert_problem(409);
    gateway
        .settle(&acked.id, Action::Term, None)
        .await
        .assert_problem(409);

    assert_eq!(gateway.nak(&naked.id, Some(60_000)).await, 204);
    assert_eq!(
        gateway.nak(&naked.id, Some(60_000)).await,
        204,
        "the same nak again"
    );
    gateway
        .settle(&naked.id, Action::Ack, None)
        .await
        .assert_problem(409);

    // A settled lease past its expiry still answers the repeat as the first time did.
    sleep_past(acked.lease_expires(), Duration::from_millis(100)).await;
    assert_eq!(gateway.ack(&acked.id).await, 204);
    assert_eq!(
        server_ack_pending(&js, &gateway).await,
        1,
        "only the delayed nak"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settle_bodies_are_validated() {
    let (_server, js, gateway) = Setup::consumer("bodies").start().await;
    js.publish("orders.1", "x").await;
    let message = gateway.fetch_n(1, 1000).await.remove(0);

    for (action, body, field) in [
        (Action::Nak, json!({ "delay_ms": -5 }), "delay_ms"),
        (Action::Nak, json!({ "delay_ms": "soon" }), "delay_ms"),
        (Action::Nak, json!({ "delay": 5 }), "delay"),
        (Action::Term, json!({ "reason": 5 }), "reason"),
        (Action::Term, json!({ "why": "x" }), "why"),
    ] {
        gateway
            .settle(&message.id, action, Some(&body))
            .await
            .assert_invalid(field);
    }
    gateway
        .post_bytes(&format!("/messages/{}/nak", message.id), b"{delay".to_vec())
        .await
        .assert_problem(400);
    // None of it settled the lease.
    assert_eq!(server_ack_pending(&js, &gateway).await, 1);
    assert_eq!(gateway.ack(&message.id).await, 204);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_in_progress_calls_on_one_lease_both_answer_200() {
    let (_server, js, gateway) = Setup::consumer("rv-wpi").ack_wait("30s").start().await;
    js.publish("orders.1", "busy").await;
    let lease = gateway.fetch_n(1, 2000).await.remove(0);
    // Several rounds, so that the two calls really overlap at least once.
    for round in 0..5 {
        let (first, second) = tokio::join!(
            gateway.in_progress(&lease.id),
            gateway.in_progress(&lease.id)
        );
        for reply in [&first, &second] {
            assert_eq!(
                reply.status, 200,
                "round {round}: concurrent in-progress answered {} {}",
                reply.status, reply.text
            );
            let expires = reply.body["lease_expires_at"]
                .as_str()
                .unwrap_or_else(|| panic!("no lease_expires_at: {}", reply.text));
            assert!(
                crate::support::rfc3339(expires) >= lease.lease_expires(),
                "an extension never shortens the lease: {expires} < {}",
                lease.lease_expires_at
            );
        }
    }
    assert_eq!(gateway.ack(&lease.id).await, 204);
    assert_eq!(server_ack_pending(&js, &gateway).await, 0);
}
