//! The gateway binding its consumer again under a running server's changes: a consumer
//! deleted and recreated, an ephemeral consumer across a NATS restart, and a lease held
//! across a NATS restart.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::support::{
    Action, Deadline, Js, STREAM, Setup, fetch_count, server_ack_pending, wait_until,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recreated_consumer_is_rebound_and_old_leases_cannot_settle_new_deliveries() {
    let consumer = "rv-recreated";
    let (_server, js, gateway) = Setup::consumer(consumer).ack_wait("30s").start().await;
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
        // While the consumer is gone a fetch is refused with 503 ("consumer gone"), nothing else.
        assert!(
            reply.status == 200 || reply.status == 503,
            "a fetch while the consumer is recreated: {} {}",
            reply.status,
            reply.text
        );
        if reply.status == 503 {
            reply.assert_problem(503);
        }
        if ready == 200
            && reply.status == 200
            && let Some(message) = reply.messages().into_iter().next()
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
        .settle(&lease_a.id, Action::Ack, None)
        .await
        .assert_problem(410);
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
    let (mut server, js, mut gateway) = Setup::consumer("rv-eph").ephemeral().start().await;
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
            let state = server.persisted_consumer_state(STREAM, &name_before);
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
    let replayed = reply.messages();
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

/// After a NATS restart the server keeps the consumer and its pending state (same `created`
/// in consumer info): a lease held across it still settles.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_held_across_a_nats_restart_still_settles() {
    let consumer = "rv-blip";
    let (mut server, js, mut gateway) = Setup::consumer(consumer).ack_wait("30s").start().await;
    js.publish("orders.1", "held across the restart").await;
    let lease = gateway.fetch_n(1, 2000).await.remove(0);
    wait_until(
        "the server has written the delivery to its store",
        Duration::from_secs(5),
        || {
            let state = server.persisted_consumer_state(STREAM, consumer);
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

    let reply = gateway.settle(&lease.id, Action::Ack, None).await;
    assert_eq!(
        reply.status, 204,
        "a lease held across a NATS restart (same consumer, not redelivered, inside its \
         lease) must still settle: {}",
        reply.text
    );
    assert_eq!(server_ack_pending(&js, &gateway).await, 1);
}

/// A server killed before it wrote its consumer state forgets deliveries it had made: after
/// the restart it delivers the same message again with the same sequences and delivery
/// count. The gateway sees the server's delivered position behind what it received, starts
/// a new lease epoch, and the earlier id answers 410 — it would otherwise name the new
/// delivery, held by someone else — and never reaches the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_from_before_the_server_lost_its_deliveries_answer_410() {
    let consumer = "rv-forgot";
    let (mut server, js, mut gateway) = Setup::consumer(consumer).ack_wait("30s").start().await;
    // One settled message first, on disk, so that the consumer itself survives the kill.
    js.publish("orders.1", "settled before").await;
    let settled = gateway.fetch_n(1, 2000).await.remove(0);
    assert_eq!(gateway.ack(&settled.id).await, 204);
    wait_until(
        "the server has written the ack to its store",
        Duration::from_secs(5),
        || {
            let state = server.persisted_consumer_state(STREAM, consumer);
            async move { state.is_some_and(|(ack_floor, _)| ack_floor == 1) }
        },
    )
    .await;
    drop(js);

    // Fetch and kill at once, inside the server's write-behind window; the store on disk
    // says whether the kill landed there (if the server was quicker, try again).
    let mut forgotten = None;
    for _ in 0..5 {
        let js = Js::connect(&server.url()).await;
        js.publish("orders.1", "delivered, then forgotten").await;
        let lease = gateway.fetch_n(1, 2000).await.remove(0);
        server.kill();
        let on_disk = server
            .persisted_consumer_state(STREAM, consumer)
            .map(|(_, delivered)| delivered);
        gateway.wait_unready().await;
        server.restart().await;
        gateway.wait_ready().await;
        if on_disk.is_some_and(|delivered| delivered < lease.stream_sequence) {
            forgotten = Some(lease);
            break;
        }
        // The server wrote the delivery in time: the lease is simply still good.
        assert_eq!(
            gateway.ack(&lease.id).await,
            204,
            "a remembered delivery settles"
        );
    }
    let old = forgotten.expect("a kill inside the server's write-behind window in 5 tries");

    let js = Js::connect(&server.url()).await;
    let reply = gateway.settle(&old.id, Action::Ack, None).await;
    reply.assert_problem(410);
    let again = gateway.fetch_n(1, 5000).await;
    assert_eq!(again.len(), 1, "the forgotten delivery is made again");
    assert_eq!(again[0].stream_sequence, old.stream_sequence);
    assert_eq!(
        again[0].consumer_sequence, old.consumer_sequence,
        "same sequences"
    );
    assert_eq!(again[0].delivered, old.delivered, "same delivery count");
    assert_ne!(again[0].id, old.id, "a new id: the epoch changed");
    assert_eq!(
        server_ack_pending(&js, &gateway).await,
        1,
        "the 410 sent nothing to the server"
    );
    assert_eq!(gateway.ack(&again[0].id).await, 204);
    assert_eq!(server_ack_pending(&js, &gateway).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_existing_consumer_made_again_as_something_else_is_409_naming_the_field_until_fixed() {
    use async_nats::jetstream::consumer;
    let (server, js) = crate::support::server_with_stream().await;
    let pull = || consumer::pull::Config {
        durable_name: Some("morph".into()),
        ..Default::default()
    };
    js.create_consumer(STREAM, pull()).await;
    let gateway = Setup::defaults()
        .switch("--no-default-consumer")
        .flag("--serve-existing", "ORDERS/*")
        .process(&server.url())
        .await;
    let path = "/streams/ORDERS/consumers/morph/fetch";
    js.publish("orders.1", "one").await;
    let first = gateway
        .post(path, Some(&json!({ "batch": 1, "wait_ms": 2000 })))
        .await;
    assert_eq!(first.status, 200, "{}", first.text);
    let stream = js.js.get_stream(STREAM).await.expect("stream");
    let answers = |says: &'static str| {
        let gateway = &gateway;
        move || async move {
            let reply = gateway.post(path, Some(&json!({ "wait_ms": 0 }))).await;
            reply.status == 409
                && reply.body["type"] == "urn:ruststream-nats:problem:consumer-unsuitable"
                && reply.detail().contains(says)
        }
    };

    // Made again with ack_policy none, then as a push consumer: 409 naming the field.
    stream.delete_consumer("morph").await.expect("delete");
    js.create_consumer(
        STREAM,
        consumer::pull::Config {
            ack_policy: consumer::AckPolicy::None,
            ..pull()
        },
    )
    .await;
    wait_until(
        "409 naming ack_policy",
        Duration::from_secs(15),
        answers("ack_policy"),
    )
    .await;
    stream.delete_consumer("morph").await.expect("delete");
    stream
        .create_consumer(consumer::push::Config {
            durable_name: Some("morph".into()),
            deliver_subject: "deliver.morph".into(),
            ..Default::default()
        })
        .await
        .expect("push consumer");
    wait_until(
        "409 naming the push consumer",
        Duration::from_secs(15),
        answers("push"),
    )
    .await;

    // Fixed: served again, the held consumer tried again with its backoff.
    stream.delete_consumer("morph").await.expect("delete");
    js.create_consumer(STREAM, pull()).await;
    js.publish("orders.1", "two").await;
    wait_until("served again", Duration::from_secs(40), || async {
        gateway
            .post(path, Some(&json!({ "batch": 1, "wait_ms": 500 })))
            .await
            .status
            == 200
    })
    .await;
    // Said once per state, not once per try.
    let held = gateway.log().matches("cannot serve this consumer").count();
    assert!(held <= 3, "{held} lines: {}", gateway.log());
}
