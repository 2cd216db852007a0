//! `GET /ws`: leases over a WebSocket, settled in band — message frames within the credit,
//! `settled` frames with each id's HTTP status (also for a lease fetched over HTTP, and a
//! fenced one), error frames for bad operations, 1003 for a binary frame, 1009 for one over
//! `--max-body-bytes`, and the end at shutdown.

use std::time::Duration;

use futures::SinkExt as _;
use serde_json::json;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;

use crate::support::Setup;
use crate::support::streams::{closed_with, frame_of, open_socket, send};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_flow_and_settle_in_band() {
    let (_server, js, gateway) = Setup::consumer("ws-flow").ack_wait("30s").start().await;
    js.publish_many("orders.1", 4, "ws").await;
    let mut socket = open_socket(&gateway, "?max_in_flight=2&encoding=utf8").await;
    let first = frame_of(&mut socket, "message", Duration::from_secs(5))
        .await
        .expect("a lease");
    let second = frame_of(&mut socket, "message", Duration::from_secs(5))
        .await
        .expect("a second lease");
    assert_eq!(first["data"], "ws-0", "{first}");
    assert_eq!(first["subject"], "orders.1");
    assert!(
        frame_of(&mut socket, "message", Duration::from_millis(800))
            .await
            .is_none(),
        "nothing beyond max_in_flight"
    );
    // One ack op for the first, with a ref: answered once confirmed; credit comes back.
    send(
        &mut socket,
        json!({ "op": "ack", "ids": [first["id"]], "ref": {"batch": 7} }),
    )
    .await;
    let settled = frame_of(&mut socket, "settled", Duration::from_secs(5))
        .await
        .expect("settled");
    assert_eq!(settled["op"], "ack");
    assert_eq!(settled["ref"], json!({"batch": 7}));
    assert_eq!(
        settled["results"],
        json!([{ "id": first["id"], "status": 204 }])
    );
    let third = frame_of(&mut socket, "message", Duration::from_secs(5))
        .await
        .expect("a lease once credit is free");
    assert_eq!(third["data"], "ws-2");
    // in_progress answers 200 with the new expiry; the same ack again 204; a nak after the
    // ack 409; a made-up id 404 — each as its HTTP settle would.
    send(
        &mut socket,
        json!({ "op": "in_progress", "ids": [second["id"]] }),
    )
    .await;
    let extended = frame_of(&mut socket, "settled", Duration::from_secs(5))
        .await
        .expect("settled");
    assert_eq!(extended["results"][0]["status"], 200, "{extended}");
    assert!(extended["results"][0]["lease_expires_at"].is_string());
    send(
        &mut socket,
        json!({ "op": "nak", "ids": [first["id"], "not-a-lease"], "delay_ms": 1000 }),
    )
    .await;
    let refused = frame_of(&mut socket, "settled", Duration::from_secs(5))
        .await
        .expect("settled");
    assert_eq!(refused["results"][0]["status"], 409, "{refused}");
    assert_eq!(refused["results"][1]["status"], 404, "{refused}");
    // A lease fetched over HTTP settles over the socket, and one from the socket over HTTP.
    let fetched = gateway.fetch_n(1, 2000).await;
    assert_eq!(fetched.len(), 1);
    send(
        &mut socket,
        json!({ "op": "term", "ids": [fetched[0].id], "reason": "bad" }),
    )
    .await;
    let termed = frame_of(&mut socket, "settled", Duration::from_secs(5))
        .await
        .expect("settled");
    assert_eq!(termed["results"][0]["status"], 204, "{termed}");
    assert_eq!(gateway.ack(third["id"].as_str().expect("id")).await, 204);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_frames_get_error_frames_binary_1003_and_oversized_1009() {
    let (_server, _js, gateway) = Setup::consumer("ws-bad")
        .flag("--max-body-bytes", "1024")
        .start()
        .await;
    let mut socket = open_socket(&gateway, "").await;
    for (bad, status, field) in [
        ("not json", 400, None),
        (r#"{"op":"ack","ids":[]}"#, 422, Some("ids")),
        (r#"{"op":"shred","ids":["x"]}"#, 422, Some("op")),
        (
            r#"{"op":"nak","ids":["x"],"delay_ms":999999999999}"#,
            422,
            Some("delay_ms"),
        ),
        (r#"{"op":"ack","ids":["x"],"extra":1}"#, 422, None),
    ] {
        socket.send(Message::Text(bad.into())).await.expect("send");
        let error = frame_of(&mut socket, "error", Duration::from_secs(5))
            .await
            .expect("an error frame");
        assert_eq!(error["status"], status, "{bad}: {error}");
        if let Some(field) = field {
            assert_eq!(error["field"], field, "{bad}: {error}");
        }
        assert!(error["title"].is_string() && error["detail"].is_string());
    }
    // The connection stays open after those; a binary frame closes it with 1003.
    socket
        .send(Message::Binary(vec![1, 2, 3].into()))
        .await
        .expect("send");
    assert_eq!(
        closed_with(&mut socket, Duration::from_secs(5)).await,
        Some(CloseCode::Unsupported)
    );
    let mut socket = open_socket(&gateway, "").await;
    let big = format!(r#"{{"op":"ack","ids":["{}"]}}"#, "a".repeat(1100));
    socket.send(Message::Text(big.into())).await.expect("send");
    assert_eq!(
        closed_with(&mut socket, Duration::from_secs(5)).await,
        Some(CloseCode::Size)
    );
    // Not an upgrade at all: a problem, not a stream.
    gateway.get("/ws").await.assert_problem(400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_sends_a_shutdown_frame_then_closes_with_1001() {
    let (_server, js, mut gateway) = Setup::consumer("ws-stop")
        .shutdown_grace("1s")
        .start()
        .await;
    js.publish_many("orders.1", 1, "ws").await;
    let mut socket = open_socket(&gateway, "").await;
    let leased = frame_of(&mut socket, "message", Duration::from_secs(5))
        .await
        .expect("a lease");
    gateway.trigger_shutdown();
    frame_of(&mut socket, "shutdown", Duration::from_secs(10))
        .await
        .expect("the shutdown frame");
    // During the grace a settle in band is still confirmed.
    send(&mut socket, json!({ "op": "ack", "ids": [leased["id"]] })).await;
    let settled = frame_of(&mut socket, "settled", Duration::from_secs(5))
        .await
        .expect("settled during the grace");
    assert_eq!(settled["results"][0]["status"], 204, "{settled}");
    assert_eq!(
        closed_with(&mut socket, Duration::from_secs(5)).await,
        Some(CloseCode::Away)
    );
}

/// A stopping process exits as soon as its last lease is settled during the grace — and not
/// before its WebSocket sessions sent their close frame (1001): a client never sees the
/// connection dropped without one (1006).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_exiting_once_its_last_lease_is_settled_closes_its_websockets_with_1001() {
    let (server, js) = crate::support::server_with_stream().await;
    let mut gateway = Setup::consumer("ws-exit")
        .shutdown_grace("30s")
        .process(&server.url())
        .await;
    js.publish_many("orders.1", 1, "ws").await;
    let mut socket = open_socket(&gateway, "").await;
    let leased = frame_of(&mut socket, "message", Duration::from_secs(5))
        .await
        .expect("a lease");
    gateway.sigterm();
    frame_of(&mut socket, "shutdown", Duration::from_secs(10))
        .await
        .expect("the shutdown frame");
    send(&mut socket, json!({ "op": "ack", "ids": [leased["id"]] })).await;
    let settled = frame_of(&mut socket, "settled", Duration::from_secs(5))
        .await
        .expect("settled during the grace");
    assert_eq!(settled["results"][0]["status"], 204, "{settled}");
    assert_eq!(
        closed_with(&mut socket, Duration::from_secs(5)).await,
        Some(CloseCode::Away),
        "closed with 1001 before the exit; log:\n{}",
        gateway.log()
    );
    let exit = gateway.wait_exit(Duration::from_secs(10)).await;
    assert!(exit.success(), "{exit:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_protocol_violation_ends_the_connection_with_the_code_that_names_it() {
    use tokio::io::AsyncWriteExt as _;
    let (_server, _js, gateway) = Setup::consumer("ws-violations").start().await;
    // Raw frames after the handshake: client frames must be masked (RFC 6455 5.1), text
    // must be UTF-8 (8.1), opcodes 0x3-0x7 are reserved (5.2).
    for (frame, code) in [
        (vec![0x81, 0x02, b'h', b'i'], CloseCode::Protocol),
        (vec![0x81, 0x82, 0, 0, 0, 0, 0xff, 0xfe], CloseCode::Invalid),
        (vec![0x83, 0x80, 0, 0, 0, 0], CloseCode::Protocol),
    ] {
        let mut socket = open_socket(&gateway, "").await;
        let raw = match socket.get_mut() {
            tokio_tungstenite::MaybeTlsStream::Plain(raw) => raw,
            _ => unreachable!("plain TCP"),
        };
        raw.write_all(&frame).await.expect("write a raw frame");
        assert_eq!(
            closed_with(&mut socket, Duration::from_secs(5)).await,
            Some(code),
            "{frame:02x?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_strands_a_slice_not_its_whole_credit() {
    let (_server, js, gateway) = Setup::consumer("ws-stuck").ack_wait("30s").start().await;
    // Frames far larger than the socket buffers (loopback's grow to 4 MB) can hold many of.
    let payload = vec![b'x'; 64 * 1024];
    for _ in 0..600 {
        js.publish("orders.1", payload.clone()).await;
    }
    // A client with a tiny receive window that never reads: the gateway's writes block soon.
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
    let address = gateway
        .base()
        .trim_start_matches("http://")
        .parse()
        .expect("the gateway's address");
    let stream = socket.connect(address).await.expect("connect");
    let url = format!("ws://{address}/ws?max_in_flight=1000");
    let (_socket, _) = tokio_tungstenite::client_async(url, stream)
        .await
        .expect("WebSocket handshake");
    crate::support::wait_until("the stream leased", Duration::from_secs(10), || async {
        gateway.leases_in_flight().await > 0
    })
    .await;
    // Once the writes block, the stream stops taking leases: at most one slice (100) leased
    // and not flushed — counting what the stream leased and has not handed over yet —
    // besides what was flushed into the socket's buffers (loopback's send buffer grows to
    // 4 MB: 64 frames of 64 KB). Leasing a whole slice more than the writer has room for
    // strands up to 200 and more; leasing into the writer's queue alone (256 frames) about 300.
    // Nor does its pull ask the server for more than it leases: a client that settled
    // nothing has shown no pace to take a surplus at (held unleased, it would be nak'd and
    // each message's delivery spent), so the server hands out no more than a slice besides.
    let (mut most, mut most_at_server) = (0, 0);
    let watched_until = tokio::time::Instant::now() + Duration::from_secs(3);
    while tokio::time::Instant::now() < watched_until {
        most = most.max(gateway.leases_in_flight().await);
        most_at_server =
            most_at_server.max(crate::support::server_ack_pending(&js, &gateway).await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        most < 200,
        "{most} leased at most to a client that reads nothing, expected fewer than 200"
    );
    assert!(
        most_at_server as u64 <= most + 100,
        "the server had {most_at_server} delivered and unacked at most, {most} leased"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operations_sent_together_are_each_answered_as_alone() {
    let (_server, js, gateway) = Setup::consumer("ws-together").ack_wait("30s").start().await;
    js.publish_many("orders.1", 60, "ws").await;
    let mut socket = open_socket(&gateway, "?max_in_flight=60").await;
    let mut ids = Vec::new();
    while ids.len() < 60 {
        let frame = crate::support::streams::frame(&mut socket, Duration::from_secs(5))
            .await
            .unwrap_or_else(|| panic!("a lease after {}", ids.len()));
        assert_eq!(frame["type"], "message", "{frame}");
        ids.push(frame["id"].as_str().expect("an id").to_owned());
    }
    // Written in one burst, so that the gateway reads them together: an ack per message,
    // one ack of three, one naming no lease and a nak among them.
    let mut operations = Vec::new();
    for (at, id) in ids[..50].iter().enumerate() {
        operations.push(json!({ "op": "ack", "ids": [id], "ref": at }));
        if at == 20 {
            operations.push(json!({ "op": "ack", "ids": ["not-a-lease"], "ref": "unknown" }));
        }
        if at == 30 {
            operations.push(json!({ "op": "ack", "ids": &ids[50..53], "ref": "three" }));
            operations.push(json!({ "op": "nak", "ids": [&ids[53]], "ref": "nak" }));
        }
    }
    for operation in &operations {
        socket
            .feed(Message::Text(operation.to_string().into()))
            .await
            .expect("feed");
    }
    socket.flush().await.expect("flush");
    let mut answers = std::collections::HashMap::new();
    while answers.len() < operations.len() {
        let frame = crate::support::streams::frame(&mut socket, Duration::from_secs(5))
            .await
            .unwrap_or_else(|| panic!("an answer after {}", answers.len()));
        if frame["type"] == "message" {
            continue; // the nak'd message again
        }
        assert_eq!(frame["type"], "settled", "{frame}");
        let reference = frame["ref"].to_string();
        assert!(
            answers.insert(reference, frame.clone()).is_none(),
            "answered twice: {frame}"
        );
    }
    for at in 0..50 {
        assert_eq!(all_acked(&answers[&at.to_string()]), 1);
    }
    assert_eq!(all_acked(&answers["\"three\""]), 3);
    let unknown = &answers["\"unknown\""]["results"][0];
    assert_eq!(unknown["id"], "not-a-lease");
    assert_eq!(unknown["status"], 404, "{unknown}");
    let nak = &answers["\"nak\""];
    assert_eq!(nak["op"], "nak");
    assert_eq!(nak["results"][0]["status"], 204, "{nak}");
    // 53 acked; the nak'd one and the six never settled are what the server still holds.
    crate::support::wait_until(
        "the server holds the unacked",
        Duration::from_secs(5),
        || async { crate::support::server_ack_pending(&js, &gateway).await <= 7 },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_an_in_band_ack_makes_room_for_comes_after_that_acks_answer() {
    let (_server, js, gateway) = Setup::consumer("ws-answer-first")
        .ack_wait("30s")
        .start()
        .await;
    let (count, credit) = (3000, 50);
    js.publish_many("orders.1", count, "ws").await;
    // Leases acked four at a time in one operation, as a worker coalesces them: a client
    // counting what it holds until each answer must never count more than its credit.
    let mut socket = open_socket(&gateway, &format!("?max_in_flight={credit}&encoding=utf8")).await;
    let (mut received, mut answered, mut most_held) = (0, 0, 0);
    let mut to_ack = Vec::new();
    while answered < count {
        let frame = crate::support::streams::frame(&mut socket, Duration::from_secs(5))
            .await
            .unwrap_or_else(|| panic!("a frame after {received} leases, {answered} answers"));
        match frame["type"].as_str() {
            Some("message") => {
                received += 1;
                most_held = most_held.max(received - answered);
                to_ack.push(frame["id"].clone());
                if to_ack.len() == 10 || received == count {
                    send(&mut socket, json!({ "op": "ack", "ids": to_ack })).await;
                    to_ack = Vec::new();
                }
            }
            Some("settled") => answered += all_acked(&frame),
            _ => panic!("an unexpected frame: {frame}"),
        }
    }
    assert_eq!(received, count);
    assert!(
        most_held <= credit,
        "held {most_held} leases not yet answered about, over the credit {credit}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_batch_puts_the_leases_ready_together_in_one_frame() {
    let (_server, js, gateway) = Setup::consumer("ws-batch-frames")
        .ack_wait("30s")
        .start()
        .await;
    // Framing is a WebSocket's alone: an event stream refuses it, naming it.
    let refused = gateway.get("/events?frames=batch").await;
    assert_eq!(refused.status, 422, "{}", refused.text);
    assert!(refused.text.contains("frames"), "{}", refused.text);
    let (count, credit) = (3000, 300);
    js.publish_many("orders.1", count, "ws").await;
    let mut socket = open_socket(
        &gateway,
        &format!("?max_in_flight={credit}&encoding=utf8&frames=batch"),
    )
    .await;
    let (mut received, mut answered, mut frames, mut most_held) = (0, 0, 0, 0);
    let mut last_sequence = 0;
    while answered < count {
        let frame = crate::support::streams::frame(&mut socket, Duration::from_secs(5))
            .await
            .unwrap_or_else(|| panic!("a frame after {received} leases, {answered} answers"));
        match frame["type"].as_str() {
            Some("messages") => {
                frames += 1;
                let messages = frame["messages"].as_array().expect("messages");
                assert!(
                    (1..=100).contains(&messages.len()),
                    "a frame holds 1 to 100 leases: {}",
                    messages.len()
                );
                let mut ids = Vec::new();
                for message in messages {
                    assert_eq!(message["data"], format!("ws-{received}"), "{message}");
                    assert!(message.get("type").is_none(), "{message}");
                    let sequence = message["stream_sequence"].as_u64().expect("sequence");
                    assert!(sequence > last_sequence, "in stream order: {message}");
                    last_sequence = sequence;
                    ids.push(message["id"].clone());
                    received += 1;
                }
                most_held = most_held.max(received - answered);
                send(&mut socket, json!({ "op": "ack", "ids": ids })).await;
            }
            Some("settled") => answered += all_acked(&frame),
            _ => panic!("an unexpected frame: {frame}"),
        }
    }
    assert_eq!(received, count);
    assert!(
        most_held <= credit,
        "held {most_held}, over the credit {credit}"
    );
    // Pulls of up to 100 arrive together: one frame per lease would be no batching at all.
    assert!(
        frames < count,
        "{frames} frames for {count} leases: the leases ready together were not framed together"
    );
}

/// A client that closes while leases flow: every lease it was sent it can read and give back,
/// and the gateway gives back the rest — none is left in flight until its expiry. (The lease
/// task could still be mid-step on the other worker thread when the session emptied its
/// queue: the lease it sent then was stranded for `ack_wait`, about once in 30 benchmark runs.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_closes_while_leases_flow_leaves_none_stranded() {
    use crate::support::client::Action;
    use futures::StreamExt as _;
    let (_server, js, gateway) = Setup::consumer("ws-close-mid")
        .ack_wait("30s")
        .start()
        .await;
    js.publish_many("orders.1", 2000, "ws").await;
    for round in 0..100 {
        let mut socket = open_socket(&gateway, "?max_in_flight=1000").await;
        let mut sent = Vec::new();
        // Closed after a few leases, a different number each round: the stream is still
        // leasing its first slices (its credit is far from spent) when the client goes.
        while sent.len() < 1 + round % 25 {
            let lease = frame_of(&mut socket, "message", Duration::from_secs(5))
                .await
                .unwrap_or_else(|| panic!("round {round}: a lease"));
            sent.push(lease["id"].clone());
        }
        socket.send(Message::Close(None)).await.expect("close");
        // Whatever the gateway wrote before it saw the close is still read.
        while let Ok(Some(Ok(frame))) =
            tokio::time::timeout(Duration::from_secs(3), socket.next()).await
        {
            if let Message::Text(text) = frame {
                let frame: serde_json::Value = serde_json::from_str(&text).expect("JSON");
                if frame["type"] == "message" {
                    sent.push(frame["id"].clone());
                }
            }
        }
        for ids in sent.chunks(1000) {
            gateway
                .settle_many_all_204(Action::Nak, &json!(ids), &format!("round {round}"))
                .await;
        }
        crate::support::wait_until(
            &format!("round {round}: no lease in flight once the client gave back all it was sent"),
            Duration::from_secs(5),
            || async { gateway.leases_in_flight().await == 0 },
        )
        .await;
    }
}

/// How many ids a `settled` frame answers, each of them acked (204).
fn all_acked(frame: &serde_json::Value) -> usize {
    let results = frame["results"].as_array().expect("results");
    assert!(
        results.iter().all(|result| result["status"] == 204),
        "{frame}"
    );
    results.len()
}
