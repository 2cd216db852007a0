//! POST /fetch: defaults, batch and max_bytes limits, returning at once vs long-polling,
//! encodings, headers, the message fields, and input validation as problem+json.

use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use base64::Engine as _;
use serde_json::{Value, json};
use time::OffsetDateTime;

use crate::support::{Deadline, STREAM, Scrape, Setup, rfc3339, wait_for, wait_until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_body_and_empty_object_use_the_defaults() {
    let (_server, js, gateway) = Setup::consumer("defaults").start().await;
    js.publish_many("orders.1", 12, "m").await;

    // No body at all: batch 10, base64.
    let reply = gateway.fetch_reply(None).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    assert!(reply.content_type().starts_with("application/json"));
    let first = reply.messages();
    assert_eq!(first.len(), 10, "default batch is 10");
    assert!(
        first.iter().all(|m| m.encoding == "base64"),
        "default encoding is base64"
    );
    assert_eq!(first[0].payload(), b"m-0");
    assert_eq!(
        first[0].data,
        base64::engine::general_purpose::STANDARD.encode("m-0")
    );

    // `{}`: the same defaults; the two left come at once.
    let started = Instant::now();
    let second = gateway.fetch(json!({})).await;
    assert_eq!(second.len(), 2);
    assert!(started.elapsed() < Duration::from_secs(3));
    let sequences: Vec<u64> = first
        .iter()
        .chain(&second)
        .map(|m| m.stream_sequence)
        .collect();
    assert_eq!(sequences, (1..=12).collect::<Vec<u64>>());

    // Nothing left: the default wait_ms (5 s) passes, then an empty list.
    let started = Instant::now();
    let reply = gateway.fetch_reply(None).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.body, json!({ "messages": [] }));
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(4500) && waited < Duration::from_secs(10),
        "the default wait is 5 s, waited {waited:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_limits_the_number_of_messages() {
    let (_server, js, gateway) = Setup::consumer("batching").start().await;
    js.publish_many("orders.1", 5, "m").await;
    assert_eq!(gateway.fetch_n(3, 1000).await.len(), 3);
    assert_eq!(gateway.fetch_n(3, 1000).await.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn returns_available_messages_at_once_without_waiting_for_wait_ms() {
    let (_server, js, gateway) = Setup::consumer("prompt").start().await;
    js.publish_many("orders.1", 3, "m").await;
    let started = Instant::now();
    let messages = gateway.fetch_n(10, 10_000).await;
    let took = started.elapsed();
    assert_eq!(messages.len(), 3, "every available message, up to batch");
    assert!(
        took < Duration::from_secs(5),
        "must not wait for wait_ms when messages are there: took {took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waits_up_to_wait_ms_then_returns_an_empty_list() {
    let (_server, _js, gateway) = Setup::consumer("idle").start().await;

    let started = Instant::now();
    let reply = gateway.fetch_reply(Some(&json!({ "wait_ms": 1000 }))).await;
    let took = started.elapsed();
    assert_eq!(reply.status, 200, "{}", reply.text);
    assert_eq!(reply.body, json!({ "messages": [] }));
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(5),
        "waited {took:?} for wait_ms 1000"
    );

    let started = Instant::now();
    assert!(gateway.fetch_n(10, 0).await.is_empty());
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "wait_ms 0 answers at once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_published_during_a_long_poll_is_returned_promptly() {
    let (_server, js, gateway) = Setup::consumer("longpoll").start().await;
    let poll = {
        let http = gateway.http.clone();
        let url = gateway.url("/fetch");
        tokio::spawn(async move {
            let started = Instant::now();
            let response = http
                .post(url)
                .json(&json!({ "batch": 5, "wait_ms": 20_000 }))
                .send()
                .await
                .expect("long poll");
            let status = response.status().as_u16();
            let body: Value = response.json().await.expect("json body");
            (status, body, started.elapsed())
        })
    };
    wait_until(
        "the long poll waits at the server",
        Duration::from_secs(5),
        || async { js.consumer_info(STREAM, "longpoll").await.num_waiting >= 1 },
    )
    .await;
    let published = Instant::now();
    let sequence = js.publish("orders.1", "during").await;
    let (status, body, _) = poll.await.expect("poll task");
    let latency = published.elapsed();
    assert_eq!(status, 200, "{body}");
    let messages = body["messages"].as_array().expect("messages");
    assert_eq!(messages.len(), 1, "{body}");
    assert_eq!(messages[0]["stream_sequence"], json!(sequence));
    assert!(
        latency < Duration::from_secs(3),
        "the message must be handed out promptly, took {latency:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn utf8_encoding_is_used_only_for_valid_utf8_payloads() {
    let (_server, js, gateway) = Setup::consumer("encodings").start().await;
    js.publish("orders.text", "héllo wörld").await;
    let invalid: Vec<u8> = vec![0xff, 0xfe, 0x00, 0x41];
    js.publish("orders.binary", invalid.clone()).await;

    let messages = gateway
        .fetch(json!({ "batch": 10, "wait_ms": 1000, "encoding": "utf8" }))
        .await;
    assert_eq!(messages.len(), 2);
    assert_eq!(messages[0].encoding, "utf8");
    assert_eq!(messages[0].data, "héllo wörld");
    assert_eq!(messages[1].encoding, "base64", "invalid UTF-8 stays base64");
    assert_eq!(
        messages[1].data,
        base64::engine::general_purpose::STANDARD.encode(&invalid)
    );
    assert_eq!(messages[1].payload(), invalid);

    // Explicit base64 for a text payload.
    js.publish("orders.text", "plain").await;
    let messages = gateway
        .fetch(json!({ "wait_ms": 1000, "encoding": "base64" }))
        .await;
    assert_eq!(messages.len(), 1);
    assert_eq!(messages[0].encoding, "base64");
    assert_eq!(messages[0].payload(), b"plain");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_are_an_object_of_string_arrays() {
    let (_server, js, gateway) = Setup::consumer("headers").start().await;
    let mut headers = HeaderMap::new();
    headers.append("X-Tenant", "acme");
    headers.append("X-Tag", "one");
    headers.append("X-Tag", "two");
    js.publish_with_headers("orders.1", headers, "with headers")
        .await;
    js.publish("orders.2", "without headers").await;

    let messages = gateway.fetch_n(10, 1000).await;
    assert_eq!(messages.len(), 2);
    let find = |name: &str| -> Value {
        messages[0]
            .headers
            .iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.clone())
            .unwrap_or_else(|| panic!("header {name} missing: {:?}", messages[0].headers))
    };
    assert_eq!(find("X-Tenant"), json!(["acme"]));
    assert_eq!(find("X-Tag"), json!(["one", "two"]));
    assert!(
        messages[1].headers.is_empty(),
        "no headers is {{}}: {:?}",
        messages[1].headers
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_message_field_is_present_and_typed() {
    let (_server, js, gateway) = Setup::consumer("fields").ack_wait("20s").start().await;
    js.publish_many("orders.eu.7", 3, "m").await;
    // `pending` is the server's count, updated a moment after each publish is acknowledged.
    wait_until(
        "the consumer counts the 3 messages as pending",
        Duration::from_secs(5),
        || async { js.consumer_info(STREAM, "fields").await.num_pending == 3 },
    )
    .await;

    let before = OffsetDateTime::now_utc();
    let reply = gateway
        .fetch_reply(Some(&json!({ "batch": 1, "wait_ms": 1000 })))
        .await;
    let after = OffsetDateTime::now_utc();
    assert_eq!(reply.status, 200, "{}", reply.text);
    let raw = &reply.body["messages"][0];
    for (field, check) in [
        ("id", Value::is_string as fn(&Value) -> bool),
        ("subject", Value::is_string),
        ("data", Value::is_string),
        ("encoding", Value::is_string),
        ("headers", Value::is_object),
        ("stream", Value::is_string),
        ("consumer", Value::is_string),
        ("stream_sequence", Value::is_u64),
        ("consumer_sequence", Value::is_u64),
        ("delivered", Value::is_u64),
        ("pending", Value::is_u64),
        ("published_at", Value::is_string),
        ("lease_expires_at", Value::is_string),
    ] {
        let value = raw
            .get(field)
            .unwrap_or_else(|| panic!("field {field} missing: {raw}"));
        assert!(check(value), "field {field} has the wrong type: {raw}");
    }

    let message = &reply.messages()[0];
    assert!(
        message.id.len() >= 22
            && message
                .id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'),
        "the id is URL-safe and long enough to be unguessable: {:?}",
        message.id
    );
    assert_eq!(message.subject, "orders.eu.7");
    assert_eq!(message.payload(), b"m-0");
    assert_eq!(message.stream, STREAM);
    assert_eq!(message.consumer, "fields");
    assert_eq!(message.stream_sequence, 1);
    assert_eq!(message.consumer_sequence, 1);
    assert_eq!(message.delivered, 1);
    assert_eq!(message.pending, 2, "two more messages wait in the stream");

    let published = rfc3339(&message.published_at);
    assert!(
        published <= after && published > before - time::Duration::minutes(1),
        "published_at {published} is the publish time"
    );
    let expires = rfc3339(&message.lease_expires_at);
    assert!(
        expires > after && expires <= after + time::Duration::seconds(20),
        "lease_expires_at {expires} lies within ack_wait (20 s) of the fetch at {after}"
    );
    assert!(
        expires >= before + time::Duration::seconds(15),
        "the lease is not needlessly short: {expires} for a fetch at {before}"
    );

    // Ids are distinct per lease.
    let more = gateway.fetch_n(2, 1000).await;
    let mut ids: Vec<&str> = more.iter().map(|m| m.id.as_str()).collect();
    ids.push(&message.id);
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_bytes_stops_before_the_limit_but_returns_at_least_one() {
    let (_server, js, gateway) = Setup::consumer("bytes").start().await;
    for _ in 0..3 {
        js.publish("orders.1", vec![b'x'; 1000]).await;
    }
    let messages = gateway
        .fetch(json!({ "batch": 10, "wait_ms": 1000, "max_bytes": 2500 }))
        .await;
    assert_eq!(
        messages.len(),
        2,
        "1000 + 1000 fit in 2500, a third would not"
    );

    // A message larger than max_bytes still comes, alone.
    js.publish("orders.1", vec![b'y'; 5000]).await;
    let messages = gateway
        .fetch(json!({ "batch": 10, "wait_ms": 1000, "max_bytes": 10 }))
        .await;
    assert_eq!(messages.len(), 1);
    assert_eq!(
        messages[0].payload().len(),
        1000,
        "the third 1000-byte message"
    );
    let messages = gateway
        .fetch(json!({ "batch": 10, "wait_ms": 1000, "max_bytes": 10 }))
        .await;
    assert_eq!(messages.len(), 1);
    assert_eq!(messages[0].payload().len(), 5000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_fetch_requests_are_problems_naming_the_field() {
    let (_server, js, gateway) = Setup::consumer("validation").start().await;
    js.publish("orders.1", "keep me").await;

    // Well-formed JSON with a wrong field is a 422 naming it (docs/api.md: 400 only for non-JSON).
    for (body, field) in [
        (json!({ "batch": 0 }), "batch"),
        (json!({ "batch": 1001 }), "batch"),
        (json!({ "wait_ms": 30_001 }), "wait_ms"),
        (json!({ "encoding": "hex" }), "encoding"),
        (json!({ "max_bytes": 0 }), "max_bytes"),
        (json!({ "batch": "ten" }), "batch"),
        (json!({ "wait_ms": -1 }), "wait_ms"),
        (json!({ "batch": 2.5 }), "batch"),
        (json!({ "batchsize": 5 }), "batchsize"),
        (json!({ "batch": 1, "colour": "red" }), "colour"),
    ] {
        gateway.fetch_reply(Some(&body)).await.assert_invalid(field);
    }
    // JSON, but not an object: a wrong type, with no field to name.
    gateway
        .fetch_reply(Some(&json!([1, 2])))
        .await
        .assert_problem(422);

    // The edges of the ranges are accepted; nothing was leased by the refused requests.
    let started = Instant::now();
    let messages = gateway
        .fetch(json!({ "batch": 1, "wait_ms": 30_000 }))
        .await;
    assert_eq!(messages.len(), 1);
    assert_eq!(messages[0].payload(), b"keep me");
    assert_eq!(messages[0].delivered, 1, "not leased before");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(
        gateway
            .fetch(json!({ "batch": 1000, "wait_ms": 0 }))
            .await
            .is_empty()
    );
    assert_eq!(gateway.leases_in_flight().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_json_is_400_and_an_oversized_body_413() {
    let (_server, _js, gateway) = Setup::consumer("malformed").start().await;
    for body in [&b"{batch: 1"[..], b"{\"batch\": 1", b"\x00\x01", b"nope"] {
        gateway
            .post_bytes("/fetch", body.to_vec())
            .await
            .assert_problem(400);
    }
    // curl -d sends a form content type; the body is JSON all the same.
    let response = gateway
        .http
        .post(gateway.url("/fetch"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(r#"{"batch": 1, "wait_ms": 0}"#)
        .send()
        .await
        .expect("form-typed fetch");
    assert_eq!(response.status().as_u16(), 200);

    let mut huge = br#"{"batch": 1, "wait_ms": 0, "pad": ""#.to_vec();
    huge.extend(std::iter::repeat_n(b'a', 3 * 1024 * 1024));
    huge.extend(br#""}"#);
    gateway.post_bytes("/fetch", huge).await.assert_problem(413);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_beyond_max_bytes_go_to_the_next_fetch() {
    let (_server, js, gateway) = Setup::consumer("overflow").ack_wait("30s").start().await;
    let published = js.publish_many("orders.1", 6, "m").await;
    let first = gateway
        .fetch(json!({ "batch": 6, "wait_ms": 1000, "max_bytes": 1 }))
        .await;
    assert_eq!(first.len(), 1, "max_bytes 1: one message");

    // The other five are not stuck in the gateway or on the wire for ack_wait (30 s).
    let mut sequences = vec![first[0].stream_sequence];
    let deadline = Deadline::after("the other five are fetched", Duration::from_secs(5));
    while sequences.len() < 6 {
        sequences.extend(
            gateway
                .fetch_n(10, 500)
                .await
                .iter()
                .map(|m| m.stream_sequence),
        );
        if sequences.len() < 6 {
            let info = js.consumer_info(STREAM, "overflow").await;
            deadline
                .tick_seeing(format_args!(
                    "fetched {sequences:?}; server num_ack_pending {}, leases {}",
                    info.num_ack_pending,
                    gateway.leases_in_flight().await
                ))
                .await;
        }
    }
    sequences.sort_unstable();
    assert_eq!(sequences, published);
}

/// `--max-batch`, `--max-wait` and `--max-body-bytes` set below their defaults are enforced
/// at the configured values: one past each cap is refused (422 naming the field, 413), the
/// caps themselves are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configured_batch_wait_and_body_caps_are_enforced() {
    let (_server, _js, gateway) = Setup::consumer("caps")
        .flag("--max-batch", "5")
        .flag("--max-wait", "2s")
        .flag("--max-body-bytes", "1024")
        .start()
        .await;
    gateway
        .fetch_reply(Some(&json!({ "batch": 6, "wait_ms": 0 })))
        .await
        .assert_invalid("batch");
    gateway
        .fetch_reply(Some(&json!({ "batch": 1, "wait_ms": 2001 })))
        .await
        .assert_invalid("wait_ms");
    let at_caps = gateway
        .fetch_reply(Some(&json!({ "batch": 5, "wait_ms": 2000 })))
        .await;
    assert_eq!(at_caps.status, 200, "{}", at_caps.text);

    // JSON padded with whitespace to exactly the cap, then one byte more.
    let padded = |size: usize| {
        let mut body = br#"{"batch": 1, "wait_ms": 0}"#.to_vec();
        body.resize(size, b' ');
        body
    };
    let at_cap = gateway.post_bytes("/fetch", padded(1024)).await;
    assert_eq!(at_cap.status, 200, "{}", at_cap.text);
    let over = gateway.post_bytes("/fetch", padded(1025)).await;
    over.assert_problem(413);
    assert!(
        over.detail().contains("1024"),
        "the 413 names the configured cap: {}",
        over.text
    );
}

/// A delivery nobody takes (here: beyond a fetch's max_bytes) is held for the next fetch for
/// min(ack_wait/4, 2 s) — 500 ms at ack_wait 2 s — then released: nak'd back to the server,
/// counted in `ruststream_deliveries_released_total`, and redelivered to the next fetch
/// (`delivered` 2) long before ack_wait would have brought it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_nobody_takes_is_held_then_released() {
    let (_server, js, gateway) = Setup::consumer("held").ack_wait("2s").start().await;
    let published = js.publish_many("orders.1", 2, "m").await;
    let released = "ruststream_deliveries_released_total";
    let before = Scrape::of(&gateway).await.get(released);
    let first = gateway
        .fetch(json!({ "batch": 2, "wait_ms": 1000, "max_bytes": 1 }))
        .await;
    let answered = Instant::now();
    assert_eq!(first.len(), 1, "max_bytes 1: one message, the other held");
    assert_eq!(first[0].stream_sequence, published[0]);

    let held_for = wait_for(
        "the held delivery is released",
        Duration::from_secs(5),
        || async {
            let now = Scrape::of(&gateway).await.get(released);
            (now > before).then(|| (now - before, answered.elapsed()))
        },
    )
    .await;
    assert_eq!(
        held_for.0, 1.0,
        "exactly the one held delivery was released"
    );
    assert!(
        held_for.1 >= Duration::from_millis(400),
        "held for the next fetch first (500 ms), released after {:?}",
        held_for.1
    );
    assert!(
        held_for.1 < Duration::from_secs(2),
        "released before ack_wait would bring it back: {:?}",
        held_for.1
    );
    let again = gateway.fetch_n(1, 2000).await;
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].stream_sequence, published[1]);
    assert_eq!(again[0].delivered, 2, "nak'd back once, redelivered");
}
