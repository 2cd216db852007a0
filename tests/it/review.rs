//! Review of the latest fixes: a consumer recreated under a running gateway, an ephemeral
//! consumer across a NATS restart, concurrent in-progress calls, non-UTF-8 path ids, delayed
//! naks against max_ack_pending, a prompt shutdown, a client hanging up mid-poll, and a
//! lease held across a NATS restart.

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use crate::support::gateway::parse_messages;
use crate::support::{
    Deadline, Gateway, Js, Msg, NatsServer, STREAM, server_ack_pending, setup, wait_until,
};

/// Fetch (polling, bounded) until `count` messages in total have been leased.
async fn fetch_count(gateway: &Gateway, count: usize, timeout: Duration) -> Vec<Msg> {
    let deadline = Deadline::after(format!("{count} messages are fetched"), timeout);
    let mut got = Vec::new();
    while got.len() < count {
        got.extend(gateway.fetch_n((count - got.len()) as u64, 500).await);
        if got.len() < count {
            deadline
                .tick_seeing(format_args!("{} so far", got.len()))
                .await;
        }
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recreated_consumer_is_rebound_and_old_leases_cannot_settle_new_deliveries() {
    let consumer = "rv-recreated";
    let (_server, js, gateway) = setup(&["--consumer", consumer, "--ack-wait", "30s"]).await;
    let sequence = js.publish("orders.1", "survives the consumer").await;
    let lease_a = gateway.fetch_n(1, 2000).await.remove(0);
    assert_eq!(lease_a.stream_sequence, sequence);
    assert_eq!(lease_a.delivered, 1);
    let created_before = js.consumer_info(STREAM, consumer).await.created;

    let stream = js.js.get_stream(STREAM).await.expect("stream");
    stream
        .delete_consumer(consumer)
        .await
        .unwrap_or_else(|err| panic!("delete consumer {consumer}: {err}"));

    // The gateway notices on its next pull (409 Consumer Deleted / 503 no responders) and
    // recreates the durable consumer, which starts again at the first message.
    let deadline = Deadline::after(
        "the gateway rebinds (/readyz 200) and a fetch returns the message from the new consumer",
        Duration::from_secs(15),
    );
    let lease_b = loop {
        let ready = gateway.readyz().await;
        let reply = gateway
            .fetch_reply(Some(&json!({ "batch": 1, "wait_ms": 500 })))
            .await;
        if ready == 200
            && reply.status == 200
            && let Some(message) = parse_messages(&reply).into_iter().next()
        {
            break message;
        }
        let server_side = match stream.consumer_info(consumer).await {
            Ok(info) => format!(
                "consumer exists (created {}, num_ack_pending {}, num_pending {})",
                info.created, info.num_ack_pending, info.num_pending
            ),
            Err(err) => format!("consumer info: {err}"),
        };
        deadline
            .tick_seeing(format_args!(
                "/readyz {ready}; fetch {} {}; {server_side}",
                reply.status, reply.text
            ))
            .await;
    };
    let info = js.consumer_info(STREAM, consumer).await;
    assert_ne!(info.created, created_before, "the consumer was recreated");
    assert_eq!(lease_b.stream_sequence, sequence);
    assert_eq!(lease_b.delivered, 1, "a fresh consumer's first delivery");
    assert_eq!(lease_b.consumer, consumer);
    assert_ne!(lease_b.id, lease_a.id, "a new delivery gets a new id");
    assert_eq!(info.num_ack_pending, 1, "B is pending at the server");
    assert_eq!(gateway.leases_in_flight().await, 1, "only B is in flight");

    // A belongs to the deleted consumer: its ack must be fenced, not sent as a "stale ack"
    // that the server would apply to B (same consumer name, same sequence).
    gateway
        .settle(&lease_a.id, "ack", None)
        .await
        .assert_problem(&[410], "");
    assert_eq!(
        server_ack_pending(&js, &gateway).await,
        1,
        "acking A must not settle B"
    );
    assert_eq!(gateway.ack(&lease_b.id).await, 204, "B settles");
    assert_eq!(server_ack_pending(&js, &gateway).await, 0);
    assert_eq!(gateway.leases_in_flight().await, 0);
    // Retry-safe: A stays 410.
    assert_eq!(gateway.ack(&lease_a.id).await, 410);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ephemeral_consumer_survives_a_nats_restart_without_replaying() {
    let (mut server, js, mut gateway) = setup(&["--ephemeral", "--consumer", "rv-eph"]).await;
    let name_before = gateway.consumer_view().await["name"]
        .as_str()
        .expect("GET /consumer has a name")
        .to_string();
    js.publish_many("orders.1", 3, "m").await;
    let messages = fetch_count(&gateway, 3, Duration::from_secs(5)).await;
    for message in &messages {
        assert_eq!(message.consumer, name_before);
        assert_eq!(gateway.ack(&message.id).await, 204);
    }
    let before = js.consumer_info(STREAM, &name_before).await;
    assert_eq!(before.ack_floor.stream_sequence, 3, "all three acked");
    assert_eq!(before.num_pending, 0);
    drop(js);
    // nats-server confirms an ack before it writes the consumer state (batched, ~100 ms
    // later): a SIGKILL inside that window loses the acks whatever the gateway does, and the
    // server then redelivers. Kill only once the acks are on disk.
    wait_until(
        "the server has written the three acks to its store",
        Duration::from_secs(5),
        || {
            let state = persisted_consumer_state(&server, &name_before);
            async move { state.is_some_and(|(ack_floor, _)| ack_floor == 3) }
        },
    )
    .await;

    // Well within the server's 5 s inactive threshold for ephemeral consumers.
    let outage = Instant::now();
    server.kill();
    gateway.wait_unready().await;
    server.restart().await;
    let restarted_after = outage.elapsed();
    assert!(
        restarted_after < Duration::from_secs(4),
        "the restart must beat the 5 s inactive threshold: {restarted_after:?}"
    );
    gateway.wait_ready().await;

    let js = Js::connect(&server.url()).await;
    let reply = gateway
        .fetch_reply(Some(&json!({ "batch": 10, "wait_ms": 1000 })))
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    let replayed = parse_messages(&reply);
    if !replayed.is_empty() {
        let after = js.js.get_stream(STREAM).await.expect("stream");
        let info = after.consumer_info(&name_before).await;
        panic!(
            "after a NATS restart ({restarted_after:?} down) the ephemeral gateway replayed \
             {:?} (delivered {:?}); consumer before: created {}, ack floor {}; after: {}",
            replayed
                .iter()
                .map(|m| m.stream_sequence)
                .collect::<Vec<_>>(),
            replayed.iter().map(|m| m.delivered).collect::<Vec<_>>(),
            before.created,
            before.ack_floor.stream_sequence,
            match info {
                Ok(info) => format!(
                    "created {}, ack floor {}",
                    info.created, info.ack_floor.stream_sequence
                ),
                Err(err) => format!("consumer info: {err}"),
            }
        );
    }
    let view = gateway.consumer_view().await;
    assert_eq!(
        view["name"].as_str(),
        Some(name_before.as_str()),
        "the same consumer: {view}"
    );
    let after = js.consumer_info(STREAM, &name_before).await;
    assert_eq!(
        after.created, before.created,
        "the server kept the consumer rather than the gateway making a new one"
    );
    assert_eq!(after.ack_floor.stream_sequence, 3);
    assert_eq!(gateway.leases_in_flight().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_in_progress_calls_on_one_lease_both_answer_200() {
    let (_server, js, gateway) = setup(&["--consumer", "rv-wpi", "--ack-wait", "30s"]).await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_id_that_is_not_utf8_is_a_404_problem() {
    let (_server, _js, gateway) = setup(&["--consumer", "rv-utf8"]).await;
    for action in ["ack", "nak", "term", "in-progress"] {
        let reply = gateway.post(&format!("/messages/%FF/{action}"), None).await;
        reply.assert_problem(&[404], "");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_naks_count_against_max_ack_pending() {
    let (_server, js, gateway) = setup(&[
        "--consumer",
        "rv-parked",
        "--max-ack-pending",
        "2",
        "--ack-wait",
        "30s",
    ])
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_with_no_leases_out_completes_promptly() {
    let (_server, _js, mut gateway) =
        setup(&["--consumer", "rv-idle-stop", "--shutdown-grace", "30s"]).await;
    assert_eq!(gateway.leases_in_flight().await, 0);
    let started = Instant::now();
    gateway.trigger_shutdown();
    // `join` panics if run() has not returned within the bound.
    stops_within(&mut gateway, started, Duration::from_secs(5)).await;
}

/// The same promise once the last lease out is settled during the grace period: the wait
/// ends with that settle, not at the 30 s grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_completes_promptly_once_the_last_lease_is_settled() {
    let (_server, js, mut gateway) = setup(&[
        "--consumer",
        "rv-last-settle",
        "--shutdown-grace",
        "30s",
        "--ack-wait",
        "60s",
    ])
    .await;
    js.publish("orders.1", "settled during the grace").await;
    let lease = gateway.fetch_n(1, 2000).await.remove(0);
    gateway.begin_shutdown().await;
    let started = Instant::now();
    assert_eq!(gateway.ack(&lease.id).await, 204, "ack during the grace");
    stops_within(&mut gateway, started, Duration::from_secs(5)).await;
}

/// Open a raw long poll (`POST /fetch`, wait_ms 10 000), let it wait at the server for
/// `patience`, hang up, and publish at once. The next ordinary fetch must get the message
/// as its first delivery, with the gateway's and the server's counts in step.
async fn hang_up_then_publish(gateway: &Gateway, js: &Js, consumer: &str, patience: Duration) {
    let body = json!({ "batch": 10, "wait_ms": 10_000 }).to_string();
    let addr = gateway.base().trim_start_matches("http://").to_string();
    let mut socket = TcpStream::connect(&addr).await.expect("connect to gateway");
    let request = format!(
        "POST /fetch HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    socket
        .write_all(request.as_bytes())
        .await
        .expect("send the long poll");
    // The long poll is under way once the gateway has a pull waiting at the server.
    wait_until(
        "the long poll has a pull waiting at the server",
        Duration::from_secs(5),
        || async { js.consumer_info(STREAM, consumer).await.num_waiting >= 1 },
    )
    .await;
    // The client's patience: pacing, not a condition.
    tokio::time::sleep(patience).await;
    drop(socket);

    let sequence = js.publish("orders.1", "after the hang-up").await;
    let started = Instant::now();
    let messages = gateway.fetch_n(10, 5000).await;
    let took = started.elapsed();
    if messages.is_empty() {
        let info = js.consumer_info(STREAM, consumer).await;
        panic!(
            "(patience {patience:?}) the next fetch got nothing in {took:?}: server \
             num_ack_pending {}, num_pending {}, delivered up to {}; gateway leases in flight {}",
            info.num_ack_pending,
            info.num_pending,
            info.delivered.stream_sequence,
            gateway.leases_in_flight().await
        );
    }
    assert_eq!(messages.len(), 1, "{messages:?}");
    assert_eq!(messages[0].stream_sequence, sequence);
    assert_eq!(
        messages[0].delivered, 1,
        "(patience {patience:?}) handed on, not redelivered after a nak or ack_wait"
    );
    assert!(took < Duration::from_secs(5), "took {took:?}");

    let view: Value = gateway.consumer_view().await;
    assert_eq!(view["leases_in_flight"], 1, "{view}");
    assert_eq!(server_ack_pending(js, gateway).await, 1, "{view}");

    assert_eq!(gateway.ack(&messages[0].id).await, 204);
    assert_eq!(gateway.leases_in_flight().await, 0);
    assert_eq!(server_ack_pending(js, gateway).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_hanging_up_mid_poll_does_not_strand_the_next_message() {
    let consumer = "rv-hangup";
    let (_server, js, gateway) = setup(&["--consumer", consumer, "--ack-wait", "30s"]).await;
    hang_up_then_publish(&gateway, &js, consumer, Duration::from_millis(200)).await;
    // Sharper: the publish right on the heels of the hang-up, while the gateway may not
    // have noticed it yet. A few rounds, since it is a race.
    for _ in 0..10 {
        hang_up_then_publish(&gateway, &js, consumer, Duration::ZERO).await;
    }
}

/// The consumer state nats-server has written to its store (`o.dat`): `(ack floor, delivered)`
/// stream sequences, or `None` before the first write. The server writes consumer state
/// asynchronously (batched, ~100 ms after a change), so a SIGKILL right after a confirmed
/// ack can lose it; a test that kills the server waits for this first.
fn persisted_consumer_state(server: &NatsServer, consumer: &str) -> Option<(u64, u64)> {
    let log = server.log();
    let (_, rest) = log.split_once("Store Directory: \"")?;
    let (store, _) = rest.split_once('"')?;
    let path = std::path::Path::new(store)
        .join("$G/streams")
        .join(STREAM)
        .join("obs")
        .join(consumer)
        .join("o.dat");
    let bytes = std::fs::read(path).ok()?;
    // Magic 0x16, version 2, then uvarints: ack floor (consumer, stream), delivered
    // (consumer, stream).
    if bytes.len() < 2 || bytes[0] != 0x16 || bytes[1] != 2 {
        return None;
    }
    let mut at = 2;
    let mut next = || {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = *bytes.get(at)?;
            at += 1;
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Some(value);
            }
        }
        None
    };
    let _ack_floor_consumer = next()?;
    let ack_floor_stream = next()?;
    let _delivered_consumer = next()?;
    let delivered_stream = next()?;
    Some((ack_floor_stream, delivered_stream))
}

/// After a NATS restart the server keeps the consumer and its pending state (same `created`
/// in consumer info): a lease held across it still settles.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_held_across_a_nats_restart_still_settles() {
    let consumer = "rv-blip";
    let (mut server, js, mut gateway) = setup(&["--consumer", consumer, "--ack-wait", "30s"]).await;
    js.publish("orders.1", "held across the restart").await;
    let lease = gateway.fetch_n(1, 2000).await.remove(0);
    wait_until(
        "the server has written the delivery to its store",
        Duration::from_secs(5),
        || {
            let state = persisted_consumer_state(&server, consumer);
            async move { state.is_some_and(|(_, delivered)| delivered == 1) }
        },
    )
    .await;
    let created = js.consumer_info(STREAM, consumer).await.created;
    drop(js);

    server.kill();
    gateway.wait_unready().await;
    server.restart().await;
    gateway.wait_ready().await;
    let js = Js::connect(&server.url()).await;
    // A round trip through the gateway after the rebind.
    let after = js.publish("orders.1", "after the restart").await;
    let fresh = gateway.fetch_n(10, 2000).await;
    assert!(
        fresh.iter().any(|m| m.stream_sequence == after),
        "the gateway serves again: {fresh:?}"
    );
    let info = js.consumer_info(STREAM, consumer).await;
    assert_eq!(info.created, created, "the server kept the consumer");
    assert_eq!(
        info.num_ack_pending, 2,
        "the held delivery is still pending"
    );

    let reply = gateway.settle(&lease.id, "ack", None).await;
    assert_eq!(
        reply.status, 204,
        "a lease held across a NATS restart (same consumer, not redelivered, inside its \
         lease) must still settle: {}",
        reply.text
    );
    assert_eq!(server_ack_pending(&js, &gateway).await, 1);
}

/// `run()` returns Ok no later than `limit` after `started` (`join` panics past its bound).
async fn stops_within(gateway: &mut Gateway, started: Instant, limit: Duration) {
    let left = limit.saturating_sub(started.elapsed());
    gateway.join(left).await.expect("run() returns Ok");
}
