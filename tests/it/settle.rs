//! Settling leases one at a time and in batches: confirmed 204s, nak delays, term reasons,
//! in-progress extensions, the 404/409/410/504 fences the gateway must keep itself, and
//! settles retried after a 503 outage or a client that hung up.

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{Value, json};
use time::OffsetDateTime;

use crate::support::{
    Action, Deadline, Gateway, Msg, STREAM, Scrape, Setup, assert_stays, rfc3339,
    server_ack_pending, sleep_past, wait_for, wait_until,
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
async fn batch_ack_reports_each_id_in_request_order() {
    let (_server, js, gateway) = Setup::consumer("batchack").ack_wait("2s").start().await;
    let sequence = js.publish("orders.1", "expires").await;
    let stale = gateway.fetch_n(1, 1000).await.remove(0);
    js.publish_many("orders.2", 2, "fresh").await;
    // After the first lease expired, one fetch brings its redelivery and the two fresh ones.
    sleep_past(stale.lease_expires(), Duration::from_millis(100)).await;
    let mut fresh = Vec::new();
    let deadline = Deadline::after(
        "the redelivery and both fresh messages",
        Duration::from_secs(10),
    );
    while fresh.len() < 3 {
        fresh.extend(gateway.fetch_n(10, 250).await);
        if fresh.len() < 3 {
            deadline.tick().await;
        }
    }
    assert_eq!(fresh.len(), 3, "{fresh:?}");
    let redelivered = fresh
        .iter()
        .find(|m| m.stream_sequence == sequence)
        .expect("the expired message came back")
        .clone();
    let others: Vec<&Msg> = fresh
        .iter()
        .filter(|m| m.stream_sequence != sequence)
        .collect();

    let ids = vec![
        others[0].id.clone(),
        "bogus-id".to_string(),
        stale.id.clone(),
        redelivered.id.clone(),
        others[1].id.clone(),
    ];
    let results = gateway
        .settle_many_ok(Action::Ack, &json!({ "ids": ids }))
        .await;
    let answered: Vec<&str> = results.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(answered, ids.iter().map(String::as_str).collect::<Vec<_>>());
    let statuses: Vec<u16> = results.iter().map(|(_, status)| *status).collect();
    assert_eq!(statuses, vec![204, 404, 410, 204, 204]);
    assert_eq!(server_ack_pending(&js, &gateway).await, 0);
    assert_eq!(gateway.leases_in_flight().await, 0);

    // A different outcome for a settled lease is a 409 in the results.
    let conflict = gateway
        .settle_many_ok(Action::Nak, &json!({ "ids": [others[0].id] }))
        .await;
    assert_eq!(conflict, vec![(others[0].id.clone(), 409)]);

    // Repeating the batch is retry-safe.
    let again = gateway
        .settle_many_ok(Action::Ack, &json!({ "ids": ids }))
        .await;
    let statuses: Vec<u16> = again.iter().map(|(_, status)| *status).collect();
    assert_eq!(statuses, vec![204, 404, 410, 204, 204]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_nak_and_term_apply_delay_and_reason() {
    let (_server, js, gateway) = Setup::consumer("batchnak").ack_wait("30s").start().await;
    js.publish_many("orders.1", 4, "m").await;
    let messages = gateway.fetch_n(4, 1000).await;
    assert_eq!(messages.len(), 4);

    let term_ids = [messages[2].id.clone(), messages[3].id.clone()];
    let results = gateway
        .settle_many_ok(
            Action::Term,
            &json!({ "ids": term_ids, "reason": "bad batch" }),
        )
        .await;
    assert!(
        results.iter().all(|(_, status)| *status == 204),
        "{results:?}"
    );

    let nak_ids = [messages[0].id.clone(), messages[1].id.clone()];
    let naked = Instant::now();
    let results = gateway
        .settle_many_ok(Action::Nak, &json!({ "ids": nak_ids, "delay_ms": 1500 }))
        .await;
    assert!(
        results.iter().all(|(_, status)| *status == 204),
        "{results:?}"
    );

    let mut back = Vec::new();
    wait_until_len(&gateway, &mut back, 2, Duration::from_secs(10)).await;
    assert!(
        naked.elapsed() >= Duration::from_millis(1500),
        "not before the delay"
    );
    let mut sequences: Vec<u64> = back.iter().map(|m| m.stream_sequence).collect();
    sequences.sort_unstable();
    assert_eq!(
        sequences,
        vec![messages[0].stream_sequence, messages[1].stream_sequence]
    );
    assert!(back.iter().all(|m| m.delivered == 2));
    // The termed ones never come back.
    assert!(gateway.fetch_n(10, 500).await.is_empty());
}

async fn wait_until_len(gateway: &Gateway, into: &mut Vec<Msg>, len: usize, timeout: Duration) {
    let deadline = Deadline::after(format!("{len} messages were fetched"), timeout);
    loop {
        into.extend(gateway.fetch_n(10, 250).await);
        if into.len() >= len {
            return;
        }
        deadline.tick().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_settle_validates_ids() {
    let (_server, _js, gateway) = Setup::consumer("batchcheck").start().await;
    let too_many: Vec<String> = (0..1001).map(|i| format!("id-{i}")).collect();
    for action in Action::SETTLING {
        gateway
            .settle_many(action, &json!({ "ids": [] }))
            .await
            .assert_invalid("ids");
        gateway
            .settle_many(action, &json!({ "ids": too_many }))
            .await
            .assert_invalid("ids");
        gateway
            .settle_many(action, &json!({}))
            .await
            .assert_missing("ids");
        gateway
            .settle_many(action, &json!({ "ids": "abc" }))
            .await
            .assert_invalid("ids");
        gateway
            .settle_many(action, &json!({ "ids": ["a"], "extra": true }))
            .await
            .assert_invalid("extra");
    }
    // 1000 unknown ids are fine: one 404 each.
    let thousand: Vec<String> = (0..1000).map(|i| format!("id-{i}")).collect();
    let results = gateway
        .settle_many_ok(Action::Ack, &json!({ "ids": thousand }))
        .await;
    assert_eq!(results.len(), 1000);
    assert!(results.iter().all(|(_, status)| *status == 404));

    let mut huge = br#"{"ids": [""#.to_vec();
    huge.extend(std::iter::repeat_n(b'a', 3 * 1024 * 1024));
    huge.extend(br#""]}"#);
    gateway
        .post_bytes("/messages/ack", huge)
        .await
        .assert_problem(413);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unconfirmed_settle_is_504_and_the_retry_succeeds() {
    let (mut server, js, gateway) = Setup::consumer("hung")
        .settle_timeout("1s")
        .ack_wait("30s")
        .start()
        .await;
    js.publish("orders.1", "x").await;
    let message = gateway.fetch_n(1, 1000).await.remove(0);

    server.pause();
    let started = Instant::now();
    let reply = gateway.settle(&message.id, Action::Ack, None).await;
    let took = started.elapsed();
    server.resume();
    reply.assert_problem(504);
    assert!(
        took < Duration::from_secs(4),
        "bounded by --settle-timeout: {took:?}"
    );

    // The lease stayed valid: retrying is safe and confirmed.
    assert_eq!(gateway.ack(&message.id).await, 204);
    assert_stays(
        "the server has no pending ack",
        Duration::from_millis(300),
        || async { server_ack_pending(&js, &gateway).await == 0 },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_settles_go_to_nats_concurrently() {
    let (mut server, js, gateway) = Setup::consumer("concurrent")
        .settle_timeout("1s")
        .ack_wait("30s")
        .start()
        .await;
    js.publish_many("orders.1", 10, "m").await;
    let messages = gateway.fetch_n(10, 1000).await;
    assert_eq!(messages.len(), 10);
    let ids: Vec<&str> = messages.iter().map(|m| m.id.as_str()).collect();

    // A hung server: every settle waits out --settle-timeout (1 s). One after another, ten
    // would take ten seconds; sent concurrently, about one.
    server.pause();
    let started = Instant::now();
    let reply = gateway
        .settle_many(Action::Ack, &json!({ "ids": ids }))
        .await;
    let took = started.elapsed();
    server.resume();
    assert_eq!(reply.status, 200, "{}", reply.text);
    let statuses: Vec<u64> = reply.body["results"]
        .as_array()
        .expect("results")
        .iter()
        .map(|r| r["status"].as_u64().expect("status"))
        .collect();
    assert_eq!(statuses, vec![504; 10], "{}", reply.text);
    assert!(
        took < Duration::from_secs(4),
        "settled one after another: {took:?}"
    );

    // The leases stayed valid: the retry is confirmed for all.
    gateway
        .settle_many_all_204(Action::Ack, &json!(ids), "the batch settle")
        .await;
    assert_eq!(server_ack_pending(&js, &gateway).await, 0);
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

/// NATS down: a settle answers 503 (it cannot reach the server, so it settles nothing) and
/// the lease stays valid; once the gateway is connected again the same settle answers 204.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settle_refused_during_an_outage_succeeds_after_the_reconnect() {
    let (mut server, js, mut gateway) = Setup::consumer("outage-settle")
        .ack_wait("60s")
        .start()
        .await;
    let sequence = js.publish("orders.1", "held through the outage").await;
    let lease = gateway.fetch_n(1, 1000).await.remove(0);
    // A delivery the killed server had not yet written down is made again after the
    // restart, which rightly voids the lease (410): the outage under test starts after it.
    wait_until(
        "the server has written the delivery to its store",
        Duration::from_secs(5),
        || {
            let state = server.persisted_consumer_state(STREAM, "outage-settle");
            async move { state.is_some_and(|(_, delivered)| delivered >= sequence) }
        },
    )
    .await;

    server.kill();
    gateway.wait_unready().await;
    gateway
        .settle(&lease.id, Action::Ack, None)
        .await
        .assert_problem(503);

    server.restart().await;
    gateway.wait_ready().await;
    assert_eq!(gateway.ack(&lease.id).await, 204, "the same ack, retried");
    let info = js.consumer_info(STREAM, "outage-settle").await;
    assert_eq!(info.num_ack_pending, 0, "the server has the ack");
    assert!(info.ack_floor.stream_sequence >= sequence);
    assert!(
        gateway.fetch_n(1, 500).await.is_empty(),
        "never handed out again"
    );
}

/// A client gone mid-settle is as a 504: the ack may or may not have landed, and retrying it
/// while the lease is live is safe — 204, and the message never comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settle_whose_client_hung_up_can_be_retried() {
    let (_server, js, gateway) = Setup::consumer("hung-up-ack").ack_wait("30s").start().await;
    js.publish_many("orders.1", 5, "m").await;
    let leased = gateway.fetch_n(5, 1000).await;
    assert_eq!(leased.len(), 5);
    for lease in &leased {
        // Gone before the answer: a 1 ms bound on the whole request.
        let gone = gateway
            .try_settle(&lease.id, Action::Ack, None, Some(Duration::from_millis(1)))
            .await;
        if let Ok(reply) = &gone {
            assert_eq!(reply.status, 204, "answered after all: {}", reply.text);
        }
        assert_eq!(gateway.ack(&lease.id).await, 204, "the retry of the ack");
    }
    assert_eq!(server_ack_pending(&js, &gateway).await, 0);
    assert_eq!(gateway.leases_in_flight().await, 0);
    assert!(
        gateway.fetch_n(5, 500).await.is_empty(),
        "no acked message comes back"
    );
}

/// A batch that lists one id many times settles it once — one confirmed settle sent, one
/// counted — and answers every position as the single call would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_repeating_an_id_settles_it_once_and_answers_each_position() {
    let (_server, js, gateway) = Setup::consumer("repeated-ids").start().await;
    js.publish_many("orders.1", 2, "m").await;
    let leased = gateway.fetch_n(2, 1000).await;
    assert_eq!(leased.len(), 2);
    let acks = r#"ruststream_leases_settled_total{kind="ack","#;
    let before = Scrape::of(&gateway).await.sum(acks);
    let mut ids = vec![leased[0].id.as_str(); 999];
    ids.insert(500, leased[1].id.as_str());
    let results = gateway
        .settle_many_ok(Action::Ack, &json!({ "ids": ids }))
        .await;
    assert_eq!(results.len(), 1000);
    for (position, (id, status)) in results.iter().enumerate() {
        assert_eq!(id, ids[position], "position {position}");
        assert_eq!(*status, 204, "position {position}");
    }
    let after = Scrape::of(&gateway).await.sum(acks);
    assert_eq!(
        after - before,
        2.0,
        "two distinct leases, two settles counted, whatever their result"
    );
    assert_eq!(server_ack_pending(&js, &gateway).await, 0);
}
