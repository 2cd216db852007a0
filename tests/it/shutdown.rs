//! Graceful shutdown: waiting fetches return, new fetches get 503, settles are accepted during
//! the grace period, what was received but not leased is nak'd, and `run` returns Ok —
//! promptly once nothing is left to settle.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::support::{Deadline, Gateway, STREAM, Setup, wait_until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_polls_return_and_new_fetches_are_refused() {
    let (_server, js, mut gateway) = Setup::consumer("closing")
        .shutdown_grace("5s")
        .start()
        .await;
    // A lease out keeps the gateway serving through its grace period, so that the fetch
    // below is answered (503) rather than meeting a listener already closed.
    js.publish("orders.1", "held").await;
    let held = gateway.fetch_n(1, 1000).await;
    assert_eq!(held.len(), 1);
    let poll = {
        let http = gateway.http.clone();
        let url = gateway.url("/fetch");
        tokio::spawn(async move {
            let response = http
                .post(url)
                .json(&json!({ "wait_ms": 20_000 }))
                .send()
                .await
                .expect("the waiting poll gets an answer");
            let status = response.status().as_u16();
            let body: Value = response.json().await.unwrap_or(Value::Null);
            (status, body)
        })
    };
    wait_until(
        "the long poll waits at the server",
        Duration::from_secs(5),
        || async { js.consumer_info(STREAM, "closing").await.num_waiting >= 1 },
    )
    .await;

    let started = Instant::now();
    gateway.trigger_shutdown();
    let (status, body) = tokio::time::timeout(Duration::from_secs(10), poll)
        .await
        .expect("the waiting poll returns well before its wait_ms")
        .expect("poll task");
    assert_eq!(status, 200, "{body}");
    assert_eq!(body, json!({ "messages": [] }));

    // A new fetch after shutdown began is refused with 503, saying so (not "NATS
    // unavailable"), and /readyz says the same, so a balancer stops routing here.
    for reply in [
        gateway.fetch_reply(Some(&json!({ "wait_ms": 0 }))).await,
        gateway.get("/readyz").await,
    ] {
        reply.assert_problem(503);
        assert_eq!(
            reply.body["type"], "urn:ruststream-nats:problem:shutting-down",
            "{}",
            reply.text
        );
        assert_eq!(reply.body["title"], "Shutting down", "{}", reply.text);
        assert_eq!(
            reply.headers.get("retry-after").map(|v| v.as_bytes()),
            Some(&b"1"[..])
        );
    }
    // The last lease settled, the drain ends without waiting out the grace.
    assert_eq!(gateway.ack(&held[0].id).await, 204);

    gateway
        .join(Duration::from_secs(15))
        .await
        .expect("run() returns Ok after a graceful shutdown");
    assert!(started.elapsed() < Duration::from_secs(12));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settles_are_accepted_during_the_grace_period() {
    let (_server, js, mut gateway) = Setup::consumer("grace")
        .shutdown_grace("3s")
        .ack_wait("30s")
        .start()
        .await;
    js.publish_many("orders.1", 2, "m").await;
    let held = gateway.fetch_n(2, 1000).await;
    assert_eq!(held.len(), 2);

    gateway.begin_shutdown().await;
    assert_eq!(
        gateway.ack(&held[0].id).await,
        204,
        "ack during the grace period"
    );
    assert_eq!(
        gateway.nak(&held[1].id, None).await,
        204,
        "nak during the grace period"
    );
    gateway
        .join(Duration::from_secs(15))
        .await
        .expect("run() returns Ok");

    let info = js.consumer_info(STREAM, "grace").await;
    assert_eq!(
        info.ack_floor.stream_sequence, 1,
        "the ack reached the server"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unleased_messages_and_unsettled_leases_are_released_at_shutdown() {
    let (server, js, mut first) = Setup::consumer("handover")
        .shutdown_grace("1s")
        .ack_wait("60s")
        .start()
        .await;
    let published = js.publish_many("orders.1", 4, "m").await;
    let mut leased = first.fetch_n(2, 1000).await;
    assert_eq!(leased.len(), 2);
    // max_bytes cuts this fetch short after one message: the gateway received the second
    // (its pull asked for both) but leased it to no one. (`fetch::messages_beyond_max_bytes_*`
    // covers more messages than that on the wire.)
    let cut = first
        .fetch(json!({ "batch": 2, "wait_ms": 1000, "max_bytes": 1 }))
        .await;
    assert_eq!(cut.len(), 1);
    leased.extend(cut);
    first.shutdown().await.expect("run() returns Ok");

    // What was received but not leased was nak'd, and so were the leases still out after
    // the grace (nobody can settle them through this process any more). A nak'd message
    // still counts in the server's num_ack_pending until redelivered, so look at the effect:
    // the next gateway gets all four at once, not after ack_wait (60 s).
    let second = Setup::consumer("handover")
        .ack_wait("60s")
        .ready(&server.url())
        .await;
    let mut sequences = Vec::new();
    let deadline = Deadline::after("every message comes back", Duration::from_secs(5));
    while sequences.len() < published.len() {
        sequences.extend(
            second
                .fetch_n(10, 500)
                .await
                .iter()
                .map(|m| m.stream_sequence),
        );
        if sequences.len() < published.len() {
            let info = js.consumer_info(STREAM, "handover").await;
            deadline
                .tick_seeing(format_args!(
                    "fetched {sequences:?} (leased before: {:?}); server num_ack_pending {}",
                    leased.iter().map(|m| m.stream_sequence).collect::<Vec<_>>(),
                    info.num_ack_pending
                ))
                .await;
        }
    }
    sequences.sort_unstable();
    assert_eq!(sequences, published);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_with_no_leases_out_completes_promptly() {
    let (_server, _js, mut gateway) = Setup::consumer("rv-idle-stop")
        .shutdown_grace("30s")
        .start()
        .await;
    assert_eq!(gateway.leases_in_flight().await, 0);
    let started = Instant::now();
    gateway.trigger_shutdown();
    // `join` panics if run() has not returned within the bound.
    stops_within(&mut gateway, started, Duration::from_secs(5)).await;
}

/// A connection that was opened but has sent nothing yet (the gateway is still telling
/// HTTP/1.1 from HTTP/2 by its first bytes) does not hold the stop up until the 10 s
/// header-read timeout: it is closed at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_does_not_wait_for_a_connection_that_sent_nothing() {
    let (_server, _js, mut gateway) = Setup::consumer("rv-silent-stop")
        .shutdown_grace("30s")
        .start()
        .await;
    let address = gateway.url("").trim_start_matches("http://").to_owned();
    let mut silent = tokio::net::TcpStream::connect(&address)
        .await
        .expect("connect");
    // A request answered on a connection opened after it: connections are accepted in
    // order, so the silent one was accepted (and is being peeked at) before the stop.
    assert_eq!(gateway.leases_in_flight().await, 0);
    let started = Instant::now();
    gateway.trigger_shutdown();
    stops_within(&mut gateway, started, Duration::from_secs(5)).await;
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(
        Duration::from_secs(5),
        tokio::io::AsyncReadExt::read(&mut silent, &mut byte),
    )
    .await
    .expect("closed in time");
    assert!(
        matches!(read, Ok(0) | Err(_)),
        "the silent connection was closed: {read:?}"
    );
}

/// The same promise once the last lease out is settled during the grace period: the wait
/// ends with that settle, not at the 30 s grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_completes_promptly_once_the_last_lease_is_settled() {
    let (_server, js, mut gateway) = Setup::consumer("rv-last-settle")
        .shutdown_grace("30s")
        .ack_wait("60s")
        .start()
        .await;
    js.publish("orders.1", "settled during the grace").await;
    let lease = gateway.fetch_n(1, 2000).await.remove(0);
    gateway.begin_shutdown().await;
    let started = Instant::now();
    assert_eq!(gateway.ack(&lease.id).await, 204, "ack during the grace");
    stops_within(&mut gateway, started, Duration::from_secs(5)).await;
}

/// `run()` returns Ok no later than `limit` after `started` (`join` panics past its bound).
async fn stops_within(gateway: &mut Gateway, started: Instant, limit: Duration) {
    let left = limit.saturating_sub(started.elapsed());
    gateway.join(left).await.expect("run() returns Ok");
}
