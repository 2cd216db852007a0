//! Capacity: the gateway never holds more than max_ack_pending leases, and a fetch beyond
//! that is refused at once with 429 and a Retry-After, never a silent hang; a nak with a
//! delay keeps its slot until the delay is over.

use std::time::Duration;

use serde_json::json;

use crate::support::{Action, STREAM, Setup, fetch_count, server_ack_pending};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetch_at_max_ack_pending_is_429_with_retry_after() {
    let (_server, js, gateway) = Setup::consumer("capped")
        .max_ack_pending(5)
        .ack_wait("10s")
        .start()
        .await;
    js.publish_many("orders.1", 8, "m").await;

    assert_eq!(gateway.fetch_n(3, 1000).await.len(), 3);
    let capped = gateway.fetch_n(3, 1000).await;
    assert_eq!(capped.len(), 2, "only 5 leases in total");
    assert_eq!(gateway.leases_in_flight().await, 5);
    assert_eq!(server_ack_pending(&js, &gateway).await, 5);

    let retry_after = gateway.fetch_refused_at_capacity().await;
    assert!(
        (5..=10).contains(&retry_after),
        "Retry-After is when the earliest lease (ack_wait 10 s) expires: {retry_after}"
    );

    // Settling one frees exactly one slot.
    assert_eq!(gateway.ack(&capped[0].id).await, 204);
    let next = gateway.fetch_n(10, 1000).await;
    assert_eq!(next.len(), 1, "one slot was free");
    gateway
        .fetch_reply(Some(&json!({ "wait_ms": 0 })))
        .await
        .assert_problem(429);
    assert_eq!(server_ack_pending(&js, &gateway).await, 5);
}

/// A pull that delivered its batch stops holding capacity: fetching and acking the whole
/// max_ack_pending, round after round, always gets full batches (a gateway that lost track
/// of which pull a delivery answered would keep the capacity reserved and answer [] here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settled_rounds_at_max_ack_pending_keep_getting_full_batches() {
    let (_server, js, gateway) = Setup::consumer("rounds")
        .max_ack_pending(10)
        .ack_wait("30s")
        .start()
        .await;
    js.publish_many("orders.1", 50, "m").await;
    for round in 0..5 {
        let messages = gateway.fetch_n(10, 1000).await;
        assert_eq!(messages.len(), 10, "round {round}: a full batch");
        let ids: Vec<&str> = messages.iter().map(|m| m.id.as_str()).collect();
        gateway
            .settle_many_all_204(Action::Ack, &json!(ids), &format!("round {round}"))
            .await;
    }
    assert_eq!(server_ack_pending(&js, &gateway).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_naks_count_against_max_ack_pending() {
    let (_server, js, gateway) = Setup::consumer("rv-parked")
        .max_ack_pending(2)
        .ack_wait("30s")
        .start()
        .await;
    js.publish_many("orders.1", 3, "m").await;
    let held = fetch_count(&gateway, 2, Duration::from_secs(5)).await;
    for message in &held {
        assert_eq!(gateway.nak(&message.id, Some(60_000)).await, 204);
    }
    assert_eq!(gateway.leases_in_flight().await, 0, "both settled (nak'd)");
    let info = js.consumer_info(STREAM, "rv-parked").await;
    assert_eq!(
        info.num_ack_pending, 2,
        "the server still holds both delayed naks as pending"
    );

    // The server still holds both as pending: a fetch is refused, not left to wait.
    let retry_after = gateway.fetch_refused_at_capacity().await;
    assert!(
        (1..=60).contains(&retry_after),
        "Retry-After within the nak delay (60 s): {retry_after}"
    );
    let info = js.consumer_info(STREAM, "rv-parked").await;
    assert_eq!(info.num_pending, 1, "the third message was not delivered");
}
