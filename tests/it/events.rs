//! `GET /events`: leases as Server-Sent Events — the event format, credit (`max_in_flight`)
//! freed by a settle over HTTP, keep-alive comments, a client leaving mid-wait, the end at
//! shutdown, and a bad query.

use std::time::Duration;

use crate::support::streams::EventStream;
use crate::support::{Setup, wait_until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_flow_up_to_max_in_flight_and_a_settle_frees_credit() {
    let (_server, js, gateway) = Setup::consumer("sse-credit").start().await;
    js.publish_many("orders.1", 5, "streamed").await;
    let mut stream = EventStream::open(&gateway, "?max_in_flight=2&encoding=utf8").await;
    let first = stream
        .message(Duration::from_secs(5))
        .await
        .expect("a first lease");
    let second = stream
        .message(Duration::from_secs(5))
        .await
        .expect("a second lease");
    assert_eq!(first["data"], "streamed-0", "{first}");
    assert_eq!(first["encoding"], "utf8");
    assert_eq!(first["subject"], "orders.1");
    assert!(first["lease_expires_at"].is_string());
    assert_ne!(first["id"], second["id"]);
    // Two live: nothing more is sent.
    assert!(
        stream.message(Duration::from_millis(800)).await.is_none(),
        "a third lease beyond max_in_flight"
    );
    assert_eq!(gateway.leases_in_flight().await, 2);
    // A settle over HTTP frees one slot: the next lease comes.
    assert_eq!(gateway.ack(first["id"].as_str().expect("id")).await, 204);
    let third = stream
        .message(Duration::from_secs(5))
        .await
        .expect("a lease once credit is free");
    assert_eq!(third["data"], "streamed-2");
    assert!(stream.message(Duration::from_millis(500)).await.is_none());
    // A nak frees one too (and the message comes back later).
    assert_eq!(
        gateway.nak(second["id"].as_str().expect("id"), None).await,
        204
    );
    assert!(stream.message(Duration::from_secs(5)).await.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_stream_says_it_is_alive_and_ends_with_shutdown() {
    let (_server, _js, mut gateway) = Setup::consumer("sse-idle").start().await;
    let mut stream = EventStream::open(&gateway, "").await;
    let quiet = stream
        .next(Duration::from_secs(15))
        .await
        .expect("something within 15 s");
    assert_eq!(quiet.comment.as_deref(), Some("keep-alive"), "{quiet:?}");
    gateway.trigger_shutdown();
    let last = loop {
        let event = stream
            .next(Duration::from_secs(10))
            .await
            .expect("the shutdown event");
        if event.comment.is_none() {
            break event;
        }
    };
    assert_eq!(last.event.as_deref(), Some("shutdown"), "{last:?}");
    assert!(
        stream.next(Duration::from_secs(5)).await.is_none(),
        "the stream ends"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_mid_wait_strands_nothing() {
    let (_server, js, gateway) = Setup::consumer("sse-leave").start().await;
    let stream = EventStream::open(&gateway, "").await;
    // The stream's pull waits at the server; the client goes.
    wait_until(
        "the stream's pull waits",
        Duration::from_secs(5),
        || async {
            js.consumer_info(crate::support::STREAM, "sse-leave")
                .await
                .num_waiting
                > 0
        },
    )
    .await;
    drop(stream);
    // The gateway notices the hang-up and asks for nothing more: its last pull expires (a
    // slice of a second) and none follows. A gateway that missed the hang-up keeps pulling
    // for the gone stream, and this wait fails.
    wait_until(
        "the gateway stops pulling for the gone stream",
        Duration::from_secs(5),
        || async {
            js.consumer_info(crate::support::STREAM, "sse-leave")
                .await
                .num_waiting
                == 0
        },
    )
    .await;
    js.publish("orders.1", "after the client left").await;
    let fetched = gateway.fetch_n(1, 5000).await;
    assert_eq!(
        fetched.len(),
        1,
        "the message is not held for the gone stream"
    );
    wait_until(
        "no lease is left to the gone stream",
        Duration::from_secs(5),
        || async { gateway.leases_in_flight().await == 1 },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_query_is_a_422_naming_the_parameter() {
    let (_server, _js, gateway) = Setup::consumer("sse-query").start().await;
    for (query, field) in [
        ("?max_in_flight=0", "max_in_flight"),
        ("?max_in_flight=1001", "max_in_flight"),
        ("?encoding=hex", "encoding"),
        ("?batch=3", "batch"),
    ] {
        let reply = gateway.get(&format!("/events{query}")).await;
        reply.assert_invalid(field);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_stream_resumes_after_a_nats_restart() {
    let (mut server, js, gateway) = Setup::consumer("sse-restart").start().await;
    let mut stream = EventStream::open(&gateway, "?encoding=utf8").await;
    js.publish("orders.1", "before").await;
    let before = stream
        .message(Duration::from_secs(5))
        .await
        .expect("a lease before the restart");
    assert_eq!(before["data"], "before");
    server.kill();
    server.restart().await;
    let js = crate::support::Js::connect(&server.url()).await;
    js.publish("orders.1", "after").await;
    // The unsettled "before" may come again first: the restarted server redelivers what it
    // had delivered and not seen acked (its lease id still names the first delivery).
    let deadline = crate::support::Deadline::after(
        "a lease of the message published after the restart, on the same stream",
        Duration::from_secs(20),
    );
    loop {
        let next = stream
            .message(Duration::from_secs(20))
            .await
            .expect("a lease on the same stream after the restart");
        if next["data"] == "after" {
            break;
        }
        assert_eq!(next["data"], "before", "only a redelivery may come first");
        assert_ne!(next["id"], before["id"], "a redelivery is a new lease");
        deadline.tick_seeing(format_args!("{next}")).await;
    }
}

/// A graceful nats-server restart (SIGTERM: its state written, nothing forgotten) voids no
/// lease: what the stream wrote before it settles after the reconnect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_lease_settles_after_a_graceful_nats_restart() {
    let (mut server, js, gateway) = Setup::consumer("sse-graceful").start().await;
    let mut stream = EventStream::open(&gateway, "?encoding=utf8&max_in_flight=2").await;
    js.publish("orders.1", "before").await;
    let before = stream
        .message(Duration::from_secs(5))
        .await
        .expect("a lease before the restart");
    server.stop_gracefully().await;
    server.restart().await;
    let js = crate::support::Js::connect(&server.url()).await;
    js.publish("orders.1", "after").await;
    let after = stream
        .message(Duration::from_secs(20))
        .await
        .expect("a lease on the same stream after the restart");
    assert_eq!(
        after["data"], "after",
        "the lease out was not redelivered: {after}"
    );
    let id = before["id"].as_str().expect("an id");
    assert_eq!(
        gateway.ack(id).await,
        204,
        "the lease written before the restart settles"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_lease_settles_at_another_replica_and_frees_credit_there() {
    use std::io::Write as _;
    let (server, js) = crate::support::server_with_stream().await;
    let mut key = tempfile::NamedTempFile::new().expect("key file");
    write!(key, "replicas share this lease key: 0123456789!").expect("write key");
    let setup = Setup::consumer("sse-replicas").lease_key_file(key.path());
    let streaming = setup.ready(&server.url()).await;
    let other = setup.ready(&server.url()).await;
    wait_until(
        "the replicas see each other",
        Duration::from_secs(10),
        || async {
            other.consumer_view().await["replicas"]
                .as_array()
                .map_or(0, Vec::len)
                == 2
        },
    )
    .await;
    js.publish_many("orders.1", 2, "spread").await;
    let mut stream = EventStream::open(&streaming, "?max_in_flight=1").await;
    let first = stream
        .message(Duration::from_secs(5))
        .await
        .expect("a lease");
    assert!(stream.message(Duration::from_millis(500)).await.is_none());
    assert_eq!(other.ack(first["id"].as_str().expect("id")).await, 204);
    assert!(
        stream.message(Duration::from_secs(5)).await.is_some(),
        "the settle at the other replica freed the stream's slot"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_consumer_streams_its_own_leases() {
    let (server, js) = crate::support::server_with_stream().await;
    let dir = crate::support::nats::files_dir();
    let file = dir.path().join("consumers.toml");
    std::fs::write(
        &file,
        "[[consumer]]\nstream = \"ORDERS\"\nname = \"audit\"\n",
    )
    .expect("file");
    let gateway = Setup::consumer("sse-default")
        .flag("--consumers-file", file.display().to_string())
        .ready(&server.url())
        .await;
    js.publish("orders.1", "one").await;
    let mut stream = EventStream::open_at(
        &gateway,
        "/streams/ORDERS/consumers/audit/events?encoding=utf8",
    )
    .await;
    let message = stream
        .message(Duration::from_secs(5))
        .await
        .expect("a lease of the named consumer");
    assert_eq!(message["consumer"], "audit");
    assert_eq!(message["data"], "one");
    let id = message["id"].as_str().expect("an id");
    assert_eq!(gateway.ack(id).await, 204);
    // The default consumer has the message still: the streams are apart.
    let fetched = gateway.fetch_n(1, 2000).await;
    assert_eq!(fetched.len(), 1);
    assert_eq!(fetched[0].consumer, "sse-default");
    let unknown = gateway.get("/streams/ORDERS/consumers/nobody/events").await;
    unknown.assert_problem(404);
}
