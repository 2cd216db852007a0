//! Settles whose answer went missing: an unconfirmed settle is 504 and its retry succeeds,
//! a settle refused during a NATS outage succeeds after the reconnect, and one whose client
//! hung up can be retried.

use std::time::{Duration, Instant};

use crate::support::{Action, STREAM, Setup, assert_stays, server_ack_pending, wait_until};

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
