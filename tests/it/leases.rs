//! Lease rules: lease_expires_at never outlives the server's ack timer, and the gateway
//! hoards nothing: without HTTP demand the server's num_ack_pending equals the leases in flight.

use std::time::Duration;

use serde_json::json;
use time::OffsetDateTime;

use crate::support::{
    Deadline, STREAM, assert_stays, server_ack_pending, setup, wait_for, wait_until,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redelivery_never_comes_before_lease_expires_at() {
    let (_server, js, gateway) = setup(&["--consumer", "timing", "--ack-wait", "2s"]).await;
    let sequence = js.publish("orders.1", "x").await;
    let first = gateway.fetch_n(1, 1000).await.remove(0);
    let expires = first.lease_expires();

    let (again, seen_at) = wait_for(
        "the message is redelivered",
        Duration::from_secs(10),
        || {
            let gateway = &gateway;
            async move {
                let found = gateway
                    .fetch_n(10, 100)
                    .await
                    .into_iter()
                    .find(|m| m.stream_sequence == sequence)?;
                Some((found, OffsetDateTime::now_utc()))
            }
        },
    )
    .await;
    assert_eq!(again.delivered, 2);
    assert!(
        seen_at >= expires,
        "the server redelivered at {seen_at}, before the first lease expired at {expires}"
    );
    assert_ne!(again.id, first.id);
    assert_eq!(gateway.ack(&again.id).await, 204);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_http_demand_the_server_keeps_the_messages() {
    let (_server, js, gateway) = setup(&["--consumer", "nohoard"]).await;
    js.publish_many("orders.1", 20, "m").await;

    let idle = || async {
        let info = js.consumer_info(STREAM, "nohoard").await;
        info.num_ack_pending == 0 && info.num_pending == 20 && gateway.leases_in_flight().await == 0
    };
    assert_stays(
        "nothing is delivered without a fetch",
        Duration::from_millis(1500),
        idle,
    )
    .await;

    let held = gateway.fetch_n(3, 1000).await;
    assert_eq!(held.len(), 3);
    let matches = |count: u64| {
        let js = &js;
        let gateway = &gateway;
        move || async move {
            server_ack_pending(js, gateway).await as u64 == count
                && gateway.leases_in_flight().await == count
        }
    };
    wait_until(
        "num_ack_pending == leases == 3",
        Duration::from_secs(5),
        matches(3),
    )
    .await;
    assert_stays(
        "num_ack_pending == leases == 3",
        Duration::from_millis(1000),
        matches(3),
    )
    .await;
    let info = js.consumer_info(STREAM, "nohoard").await;
    assert_eq!(info.num_pending, 17, "the rest stays in the stream");

    for message in &held {
        assert_eq!(gateway.ack(&message.id).await, 204);
    }
    assert_stays(
        "num_ack_pending == leases == 0",
        Duration::from_millis(500),
        matches(0),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_for_a_client_that_left_goes_to_the_next_fetch() {
    let (_server, js, gateway) = setup(&["--consumer", "abandoned", "--ack-wait", "30s"]).await;

    // A client starts a long poll and gives up after 300 ms.
    let abandoned = gateway
        .http
        .post(gateway.url("/fetch"))
        .json(&json!({ "batch": 1, "wait_ms": 10_000 }))
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(abandoned.is_err(), "the client timed out");

    let sequence = js.publish("orders.1", "for whoever asks next").await;
    // Within a fraction of ack_wait (30 s) the next client gets it.
    let messages = gateway.fetch_n(1, 5000).await;
    if messages.is_empty() {
        let info = js.consumer_info(STREAM, "abandoned").await;
        panic!(
            "the message was lost to the client that left: the server has it delivered and \
             unacked (num_ack_pending {}, delivered up to stream sequence {}), the gateway \
             holds {} leases, and the next fetch got nothing for 5 s",
            info.num_ack_pending,
            info.delivered.stream_sequence,
            gateway.leases_in_flight().await
        );
    }
    assert_eq!(messages.len(), 1);
    assert_eq!(messages[0].stream_sequence, sequence);
    assert!(messages[0].delivered <= 2);
    let left = messages[0].lease_expires() - OffsetDateTime::now_utc();
    assert!(
        left > time::Duration::seconds(10),
        "handed out with enough of its lease left: {left}"
    );
    assert_eq!(gateway.ack(&messages[0].id).await, 204);
    wait_until(
        "nothing pending anywhere",
        Duration::from_secs(5),
        || async {
            server_ack_pending(&js, &gateway).await == 0 && gateway.leases_in_flight().await == 0
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_ids_are_distinct_and_url_safe_across_many_messages() {
    let (_server, js, gateway) = setup(&["--consumer", "ids"]).await;
    js.publish_many("orders.1", 50, "m").await;
    let mut ids = Vec::new();
    let deadline = Deadline::after("all 50 messages were leased", Duration::from_secs(10));
    while ids.len() < 50 {
        ids.extend(gateway.fetch_n(20, 250).await.into_iter().map(|m| m.id));
        if ids.len() < 50 {
            deadline.tick().await;
        }
    }
    assert_eq!(ids.len(), 50);
    for id in &ids {
        assert!(
            id.len() >= 22
                && id
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'),
            "URL-safe, unguessable id: {id:?}"
        );
    }
    let mut unique = ids.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), 50, "ids are unique");
    let results = gateway.settle_many_ok("ack", &json!({ "ids": ids })).await;
    assert!(
        results.iter().all(|(_, status)| *status == 204),
        "{results:?}"
    );
    assert_eq!(server_ack_pending(&js, &gateway).await, 0);
}
