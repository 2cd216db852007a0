//! The producer side beyond one message: `POST /publish/batch` (each message on its own, or
//! one atomic batch), and the per-message options `msg_id`, `ttl`, `expected_last_sequence`
//! and `expected_last_subject_sequence`, against a real nats-server.

use std::time::Duration;

use serde_json::{Value, json};

use crate::support::{Js, STREAM, Setup, wait_until};

/// Let the test stream take TTLs and atomic batches (settings a stream is made with or
/// edited to have).
async fn allow_ttl_and_atomic(js: &Js) {
    let mut stream = js.js.get_stream(STREAM).await.expect("the stream");
    let mut config = stream.info().await.expect("stream info").config.clone();
    config.allow_message_ttl = true;
    config.allow_atomic_publish = true;
    js.js.update_stream(config).await.expect("stream updated");
}

async fn stream_last_sequence(js: &Js) -> u64 {
    let mut stream = js.js.get_stream(STREAM).await.expect("the stream");
    stream
        .info()
        .await
        .expect("stream info")
        .state
        .last_sequence
}

fn message(i: usize) -> Value {
    json!({ "subject": format!("orders.{}", i % 7), "data": format!("m{i}"), "msg_id": format!("id-{i}") })
}

/// 1 000 messages with three the stream or the gateway refuses: the 997 others stored in
/// request order with consecutive sequences, each bad one a 422 naming its index and field;
/// nothing stored for them. The same batch again stores nothing twice (every good one a
/// duplicate). A message that is not one at all refuses the whole request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_stores_every_good_message_in_order_and_refuses_the_bad_alone() {
    let (_server, js, gateway) = Setup::consumer("batcher").start().await;
    let bad = [3usize, 500, 999];
    let messages: Vec<Value> = (0..1000)
        .map(|i| match i {
            3 => json!({ "subject": "invoices.1", "data": "x" }),
            500 => json!({ "subject": "orders.1", "data": "!!", "encoding": "base64" }),
            999 => json!({ "subject": "orders.1", "data": "x", "ttl": "500ms" }),
            _ => message(i),
        })
        .collect();
    let body = json!({ "messages": messages });
    let reply = gateway.post("/publish/batch", Some(&body)).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    let results = reply.body["results"].as_array().expect("results");
    assert_eq!(results.len(), 1000);
    let mut expected_sequence = 1;
    for (i, result) in results.iter().enumerate() {
        if bad.contains(&i) {
            assert_eq!(result["status"], 422, "message {i}: {result}");
            let field = result["field"].as_str().unwrap_or_default();
            assert!(
                field.starts_with(&format!("messages[{i}].")),
                "message {i} named by index: {result}"
            );
            continue;
        }
        assert_eq!(result["status"], 201, "message {i}: {result}");
        assert_eq!(result["stream"], STREAM);
        assert_eq!(
            result["sequence"], expected_sequence,
            "message {i} in order"
        );
        assert_eq!(result["duplicate"], false);
        expected_sequence += 1;
    }
    assert_eq!(results[500]["field"], "messages[500].data");
    assert_eq!(results[999]["field"], "messages[999].ttl");
    assert_eq!(
        stream_last_sequence(&js).await,
        997,
        "only the good ones stored"
    );

    let again = gateway.post("/publish/batch", Some(&body)).await;
    assert_eq!(again.status, 200, "{}", again.text);
    let again = again.body["results"].as_array().expect("results");
    for (i, result) in again.iter().enumerate() {
        if !bad.contains(&i) {
            assert_eq!(
                result["duplicate"], true,
                "message {i} stored once: {result}"
            );
        }
    }
    assert_eq!(stream_last_sequence(&js).await, 997, "nothing stored twice");

    for (body, field) in [
        (json!({ "messages": [] }), "messages"),
        (
            json!({ "messages": (0..1001).map(message).collect::<Vec<_>>() }),
            "messages",
        ),
        (
            json!({ "messages": [message(1)], "colour": "red" }),
            "colour",
        ),
        // Not a message at all: the request is refused whole, naming it.
        (
            json!({ "messages": [message(1), { "subject": "orders.1", "colour": "red" }] }),
            "messages[1].colour",
        ),
        (
            json!({ "messages": [message(1), { "data": "x" }] }),
            "messages[1]",
        ),
    ] {
        gateway
            .post("/publish/batch", Some(&body))
            .await
            .assert_invalid(field);
    }
}

/// An atomic batch is stored whole with consecutive sequences, or not at all: one bad
/// message, a message to another stream, or a stream that does not allow it leaves the
/// stream as it was; a retry of a stored batch with the same msg ids stores nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_atomic_batch_is_stored_whole_or_not_at_all() {
    let (_server, js, gateway) = Setup::consumer("atomic").start().await;
    let batch = |from: usize, to: usize| json!({ "atomic": true, "messages": (from..to).map(message).collect::<Vec<_>>() });
    let refused = gateway.post("/publish/batch", Some(&batch(0, 3))).await;
    refused.assert_problem(409);
    assert_eq!(
        refused.body["type"], "urn:ruststream-nats:problem:atomic-not-allowed",
        "{}",
        refused.text
    );
    assert_eq!(refused.body["setting"], "allow_atomic");
    assert_eq!(stream_last_sequence(&js).await, 0);

    allow_ttl_and_atomic(&js).await;
    let stored = gateway.post("/publish/batch", Some(&batch(0, 100))).await;
    assert_eq!(stored.status, 201, "{}", stored.text);
    assert_eq!(
        stored.body,
        json!({ "stream": STREAM, "first_sequence": 1, "last_sequence": 100, "count": 100 })
    );
    let one = gateway.post("/publish/batch", Some(&batch(100, 101))).await;
    assert_eq!(one.status, 201, "{}", one.text);
    assert_eq!(one.body["first_sequence"], 101);
    assert_eq!(one.body["count"], 1);

    let retry = gateway.post("/publish/batch", Some(&batch(0, 100))).await;
    retry.assert_problem(409);
    assert_eq!(
        retry.body["type"], "urn:ruststream-nats:problem:batch-already-stored",
        "{}",
        retry.text
    );

    let mut with_a_bad_one = batch(200, 210);
    with_a_bad_one["messages"][4]["data"] = json!("!!");
    with_a_bad_one["messages"][4]["encoding"] = json!("base64");
    gateway
        .post("/publish/batch", Some(&with_a_bad_one))
        .await
        .assert_invalid("messages[4].data");
    let mut two_streams = batch(300, 305);
    two_streams["messages"][2]["subject"] = json!("invoices.1");
    gateway
        .post("/publish/batch", Some(&two_streams))
        .await
        .assert_invalid("messages[2].subject");
    let mut behind = batch(400, 405);
    behind["messages"][0]["expected_last_sequence"] = json!(3);
    let behind = gateway.post("/publish/batch", Some(&behind)).await;
    behind.assert_problem(412);
    assert_eq!(
        behind.body["type"], "urn:ruststream-nats:problem:precondition-failed",
        "{}",
        behind.text
    );
    assert_eq!(
        stream_last_sequence(&js).await,
        101,
        "nothing refused stored"
    );

    let messages = gateway
        .fetch(json!({ "batch": 200, "wait_ms": 1000, "encoding": "utf8" }))
        .await;
    let data: Vec<String> = messages.iter().map(|m| m.data.clone()).collect();
    let expected: Vec<String> = (0..101).map(|i| format!("m{i}")).collect();
    assert_eq!(data, expected, "the batches' messages, each once, in order");
}

/// `msg_id`, `ttl` and the expectations as fields: a precondition that does not hold is
/// 412 `precondition-failed` with the sequence the server compared with; a TTL the stream
/// does not allow is 409 naming `allow_msg_ttl`; a message with a TTL is gone after it and
/// never leased then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_message_options_reach_the_stream() {
    let (_server, js, gateway) = Setup::consumer("options").start().await;
    let publish = |body: Value| {
        let gateway = &gateway;
        async move { gateway.post("/publish", Some(&body)).await }
    };
    let ttl_refused = publish(json!({ "subject": "orders.1", "data": "x", "ttl": "10s" })).await;
    ttl_refused.assert_problem(409);
    assert_eq!(
        ttl_refused.body["setting"], "allow_msg_ttl",
        "{}",
        ttl_refused.text
    );
    for ttl in ["0s", "500ms", "soon", "1.5s"] {
        publish(json!({ "subject": "orders.1", "data": "x", "ttl": ttl }))
            .await
            .assert_invalid("ttl");
    }
    allow_ttl_and_atomic(&js).await;

    let first = publish(json!({ "subject": "orders.a", "data": "1", "msg_id": "a-1" })).await;
    assert_eq!(first.body["sequence"], 1, "{}", first.text);
    let duplicate = publish(json!({ "subject": "orders.a", "data": "1", "msg_id": "a-1" })).await;
    assert_eq!(duplicate.body["duplicate"], true, "{}", duplicate.text);
    let b = publish(json!({ "subject": "orders.b", "data": "2" })).await;
    assert_eq!(b.body["sequence"], 2, "{}", b.text);

    let stale =
        publish(json!({ "subject": "orders.a", "data": "x", "expected_last_sequence": 1 })).await;
    stale.assert_problem(412);
    assert_eq!(
        stale.body["type"],
        "urn:ruststream-nats:problem:precondition-failed"
    );
    assert_eq!(
        stale.body["last_sequence"], 2,
        "the stream's last: {}",
        stale.text
    );
    let stale_subject = publish(json!({
        "subject": "orders.a", "data": "x", "expected_last_subject_sequence": 2
    }))
    .await;
    stale_subject.assert_problem(412);
    assert_eq!(
        stale_subject.body["last_sequence"], 1,
        "the subject's last: {}",
        stale_subject.text
    );
    let holds = publish(json!({
        "subject": "orders.a", "data": "3", "expected_last_sequence": 2,
        "expected_last_subject_sequence": 1
    }))
    .await;
    assert_eq!(holds.status, 201, "{}", holds.text);
    assert_eq!(holds.body["sequence"], 3);

    let expiring =
        publish(json!({ "subject": "orders.ttl", "data": "gone soon", "ttl": "1s" })).await;
    assert_eq!(expiring.status, 201, "{}", expiring.text);
    let kept = publish(json!({ "subject": "orders.kept", "data": "kept", "ttl": "never" })).await;
    assert_eq!(kept.status, 201, "{}", kept.text);
    wait_until(
        "the message with a 1s TTL gone",
        Duration::from_secs(10),
        || async {
            let Ok(stream) = js.js.get_stream(STREAM).await else {
                return false;
            };
            stream
                .get_last_raw_message_by_subject("orders.ttl")
                .await
                .is_err()
        },
    )
    .await;
    let leased = gateway
        .fetch(json!({ "batch": 10, "wait_ms": 500, "encoding": "utf8" }))
        .await;
    let data: Vec<&str> = leased.iter().map(|m| m.data.as_str()).collect();
    assert_eq!(
        data,
        ["1", "2", "3", "kept"],
        "the expired message is never leased"
    );
}

/// A racing pair of writers, each appending to one subject only if nobody wrote since the
/// sequence it read: exactly one of each round wins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_writers_with_a_subject_expectation_store_exactly_one() {
    let (_server, js, gateway) = Setup::consumer("racers").start().await;
    let mut last = 0u64;
    for round in 0..20 {
        let attempt = |writer: usize| {
            let gateway = &gateway;
            async move {
                gateway
                    .post(
                        "/publish",
                        Some(&json!({
                            "subject": "orders.42", "data": format!("{round}-{writer}"),
                            "expected_last_subject_sequence": last
                        })),
                    )
                    .await
            }
        };
        let (a, b) = tokio::join!(attempt(0), attempt(1));
        let statuses = [a.status, b.status];
        let mut sorted = statuses;
        sorted.sort_unstable();
        assert_eq!(
            sorted,
            [201, 412],
            "round {round}: one wins: {} / {}",
            a.text,
            b.text
        );
        let winner = if a.status == 201 { &a } else { &b };
        let loser = if a.status == 201 { &b } else { &a };
        last = winner.body["sequence"].as_u64().expect("sequence");
        assert_eq!(
            loser.body["last_sequence"], last,
            "the loser learns the winner's sequence"
        );
    }
    assert_eq!(stream_last_sequence(&js).await, 20);
}
