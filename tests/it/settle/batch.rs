//! Batch settles: one answer per id in request order, delays and reasons applied to each,
//! ids validated, settles sent to NATS concurrently, a repeated id settled once.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::support::{
    Action, Deadline, Gateway, Msg, Scrape, Setup, server_ack_pending, sleep_past,
};

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
