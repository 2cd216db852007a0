//! How open streams end, and that nothing else ends them: at SIGTERM at once whatever their
//! credit (SSE `event: shutdown`, WebSocket `shutdown` frame then 1001, the process exiting
//! 0); never unbound idle under them (nor a waiting fetch); ended with a reason when their
//! consumer is removed or changed in the consumers file, or when a reload revokes or narrows
//! their token.

use std::time::Duration;

use async_nats::jetstream::consumer;
use serde_json::{Value, json};
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;

use crate::support::nats::files_dir;
use crate::support::streams::{EventStream, Socket, frame_of, open_socket_at, send};
use crate::support::{STREAM, Scrape, Setup, server_with_stream, wait_until};

/// The next `shutdown` event of `stream` within `within` (comments and messages skipped),
/// as its data.
async fn shutdown_event(stream: &mut EventStream, within: Duration) -> Option<Value> {
    let deadline = Instant::now() + within;
    loop {
        let event = stream
            .next(deadline.saturating_duration_since(Instant::now()))
            .await?;
        if event.event.as_deref() == Some("shutdown") {
            return Some(serde_json::from_str(&event.data).expect("data is JSON"));
        }
    }
}

/// The close the gateway ends `socket` with, code and reason, within `within`.
async fn close_of(socket: &mut Socket, within: Duration) -> Option<(CloseCode, String)> {
    use futures::StreamExt as _;
    use tokio_tungstenite::tungstenite::Message;
    let deadline = Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, socket.next())
            .await
            .ok()??
        {
            Ok(Message::Close(close)) => {
                return close.map(|close| (close.code, close.reason.to_string()));
            }
            Ok(_) => {}
            Err(_) => return None,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_sigterm_streams_end_at_once_whatever_their_credit_and_the_process_exits_0() {
    let (server, js) = server_with_stream().await;
    let mut gateway = Setup::consumer("stop-streams")
        .shutdown_grace("4s")
        .process(&server.url())
        .await;
    js.publish_many("orders.1", 2, "m").await;
    // Every credit in use on both: each waits for a settle, not for messages.
    let mut events = EventStream::open(&gateway, "?max_in_flight=1").await;
    events
        .message(Duration::from_secs(5))
        .await
        .expect("the SSE stream's lease");
    let mut socket = open_socket_at(&gateway, "/ws?max_in_flight=1", None).await;
    let held = frame_of(&mut socket, "message", Duration::from_secs(5))
        .await
        .expect("the WebSocket's lease");

    let stopped = Instant::now();
    gateway.sigterm();
    let last = shutdown_event(&mut events, Duration::from_secs(2))
        .await
        .expect("event: shutdown at once");
    assert_eq!(last["reason"], "the gateway is stopping", "{last}");
    let frame = frame_of(&mut socket, "shutdown", Duration::from_secs(2))
        .await
        .expect("the shutdown frame at once");
    assert_eq!(frame["reason"], "the gateway is stopping", "{frame}");
    // Within the grace the client settles what it holds, in band.
    send(&mut socket, json!({ "op": "ack", "ids": [held["id"]] })).await;
    let settled = frame_of(&mut socket, "settled", Duration::from_secs(3))
        .await
        .expect("settled in the grace");
    assert_eq!(settled["results"][0]["status"], 204, "{settled}");
    let (code, _) = close_of(&mut socket, Duration::from_secs(6))
        .await
        .expect("closed");
    assert_eq!(code, CloseCode::Away);
    let status = gateway.wait_exit(Duration::from_secs(9)).await;
    assert!(status.success(), "{status:?}: {}", gateway.log());
    assert!(stopped.elapsed() < Duration::from_secs(9));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_stream_or_a_waiting_fetch_keeps_an_existing_consumer_bound() {
    let (server, js) = server_with_stream().await;
    for name in ["ops", "polled"] {
        js.create_consumer(
            STREAM,
            consumer::pull::Config {
                durable_name: Some(name.into()),
                filter_subject: format!("orders.{name}"),
                ..Default::default()
            },
        )
        .await;
    }
    let gateway = Setup::defaults()
        .switch("--no-default-consumer")
        .flag("--serve-existing", "ORDERS/*")
        .flag("--idle-unbind", "1s")
        .ready(&server.url())
        .await;
    let mut events = EventStream::open_at(
        &gateway,
        "/streams/ORDERS/consumers/ops/events?encoding=utf8",
    )
    .await;
    let poll = {
        let client = gateway.client().clone();
        tokio::spawn(async move {
            client
                .post(
                    "/streams/ORDERS/consumers/polled/fetch",
                    Some(&json!({ "batch": 1, "wait_ms": 6000, "encoding": "utf8" })),
                )
                .await
        })
    };
    let both_bound = || async {
        let listed: Value =
            serde_json::from_str(&gateway.get("/consumers").await.text).expect("json");
        listed["consumers"].as_array().map(Vec::len) == Some(2)
    };
    wait_until("both are bound", Duration::from_secs(5), both_bound).await;
    // Well past --idle-unbind with both requests open: then messages for each.
    crate::support::assert_stays(
        "both consumers stay bound",
        Duration::from_secs(3),
        both_bound,
    )
    .await;
    js.publish("orders.ops", "to the stream").await;
    js.publish("orders.polled", "to the poll").await;
    let streamed = events
        .message(Duration::from_secs(5))
        .await
        .expect("the open stream still delivers");
    assert_eq!(streamed["data"], "to the stream");
    let polled = poll.await.expect("poll task");
    assert_eq!(polled.status, 200, "{}", polled.text);
    assert_eq!(
        polled.body["messages"][0]["data"], "to the poll",
        "{}",
        polled.text
    );
}

const SHIPPING: &str = r#"
[[consumer]]
stream = "ORDERS"
name = "shipping"
ack_wait = "20s"
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_or_removed_consumer_ends_its_streams_with_a_reason() {
    let (server, js) = server_with_stream().await;
    let dir = files_dir();
    let file = dir.path().join("consumers.toml");
    std::fs::write(&file, SHIPPING).expect("consumers file");
    let gateway = Setup::defaults()
        .flag("--consumers-file", file.display().to_string())
        .ready(&server.url())
        .await;
    js.publish("orders.1", "m").await;
    let named = "/streams/ORDERS/consumers/shipping";

    // A new ack_wait is applied to the live consumer: the stream goes on.
    let mut events = EventStream::open_at(&gateway, &format!("{named}/events?encoding=utf8")).await;
    let held = events
        .message(Duration::from_secs(5))
        .await
        .expect("a lease");
    std::fs::write(&file, SHIPPING.replace("20s", "25s")).expect("change the file");
    wait_until(
        "the new ack_wait is in force",
        Duration::from_secs(10),
        || async {
            let view: Value =
                serde_json::from_str(&gateway.get(named).await.text).unwrap_or_default();
            view["config"]["ack_wait_ms"] == 25_000
        },
    )
    .await;
    js.publish("orders.1", "after the change").await;
    let next = events
        .message(Duration::from_secs(5))
        .await
        .expect("a lease after the change, on the same stream");
    assert_eq!(next["data"], "after the change", "{next}");

    // Changed in what only a new binding applies (max_deliver) while the stream holds
    // leases: the stream ends, and once they are settled the new setting is in force.
    std::fs::write(
        &file,
        format!("{}max_deliver = 5\n", SHIPPING.replace("20s", "25s")),
    )
    .expect("change the file");
    let last = shutdown_event(&mut events, Duration::from_secs(5))
        .await
        .expect("the stream ends");
    assert!(
        last["reason"]
            .as_str()
            .is_some_and(|reason| reason.contains("changed")),
        "{last}"
    );
    for lease in [&held, &next] {
        assert_eq!(gateway.ack(lease["id"].as_str().expect("id")).await, 204);
    }
    wait_until(
        "the new max_deliver is in force",
        Duration::from_secs(10),
        || async {
            let view: Value =
                serde_json::from_str(&gateway.get(named).await.text).unwrap_or_default();
            view["config"]["max_deliver"] == 5
        },
    )
    .await;

    // Removed: both kinds of stream end, saying so; the consumer is let go.
    let mut events = EventStream::open_at(&gateway, &format!("{named}/events")).await;
    let mut socket = open_socket_at(&gateway, &format!("{named}/ws"), None).await;
    std::fs::write(&file, "").expect("empty the file");
    let last = shutdown_event(&mut events, Duration::from_secs(5))
        .await
        .expect("the SSE stream ends");
    assert!(
        last["reason"]
            .as_str()
            .is_some_and(|reason| reason.contains("removed")),
        "{last}"
    );
    let frame = frame_of(&mut socket, "shutdown", Duration::from_secs(5))
        .await
        .expect("the shutdown frame");
    assert!(
        frame["reason"]
            .as_str()
            .is_some_and(|reason| reason.contains("removed")),
        "{frame}"
    );
    let (code, reason) = close_of(&mut socket, Duration::from_secs(5))
        .await
        .expect("closed");
    assert_eq!(code, CloseCode::Away);
    assert!(reason.contains("removed"), "{reason}");
    wait_until("shipping is let go", Duration::from_secs(5), || async {
        Scrape::of(&gateway)
            .await
            .get("ruststream_consumers{source=\"file\"}")
            == 0.0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_revokes_or_narrows_a_token_ends_its_streams_within_a_second() {
    let (server, _js) = server_with_stream().await;
    let dir = files_dir();
    let tokens = dir.path().join("tokens");
    std::fs::write(
        &tokens,
        "gone-token fetch,settle\nnarrowed-token fetch,settle\nkept-token fetch,settle\n",
    )
    .expect("tokens");
    let mut gateway = Setup::consumer("revoked")
        .auth_tokens_file(&tokens)
        .process(&server.url())
        .await;
    let mut gone = EventStream::open_with(&gateway, "/events", Some("gone-token")).await;
    let mut narrowed = open_socket_at(&gateway, "/ws", Some("narrowed-token")).await;
    let mut kept = EventStream::open_with(&gateway, "/events", Some("kept-token")).await;

    std::fs::write(&tokens, "narrowed-token settle\nkept-token fetch,settle\n").expect("tokens");
    gateway.sighup();
    let last = shutdown_event(&mut gone, Duration::from_secs(2))
        .await
        .expect("the revoked token's stream ends");
    assert_eq!(last["reason"], "the token was revoked", "{last}");
    let (code, reason) = close_of(&mut narrowed, Duration::from_secs(2))
        .await
        .expect("the narrowed token's socket closes");
    assert_eq!(code, CloseCode::Away);
    assert!(reason.contains("no longer has the fetch scope"), "{reason}");
    // A token the reload kept as it was keeps its stream.
    assert!(
        shutdown_event(&mut kept, Duration::from_secs(2))
            .await
            .is_none(),
        "the kept token's stream went on"
    );
}
