//! POST /publish (the README's curl path): stores in the stream, answers 201 with the
//! sequence, and refuses subjects the stream does not capture.

use serde_json::json;

use crate::support::{STREAM, Setup};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_stores_the_message_and_fetch_returns_it() {
    let (_server, _js, gateway) = Setup::consumer("publisher").start().await;
    let reply = gateway
        .post(
            "/publish",
            Some(&json!({
                "subject": "orders.created",
                "data": "hello",
                "headers": { "X-Source": "curl" }
            })),
        )
        .await;
    assert_eq!(reply.status, 201, "{}", reply.text);
    assert_eq!(reply.body["stream"], STREAM);
    assert_eq!(reply.body["sequence"], 1);
    assert_eq!(reply.body["duplicate"], false);

    let binary = gateway
        .post(
            "/publish",
            Some(&json!({ "subject": "orders.bin", "data": "/wA=", "encoding": "base64" })),
        )
        .await;
    assert_eq!(binary.status, 201, "{}", binary.text);

    let messages = gateway
        .fetch(json!({ "wait_ms": 1000, "encoding": "utf8" }))
        .await;
    assert_eq!(messages.len(), 2);
    assert_eq!(messages[0].data, "hello");
    assert_eq!(messages[0].headers["X-Source"], json!(["curl"]));
    assert_eq!(messages[1].payload(), vec![0xff, 0x00]);

    for (body, field) in [
        (json!({ "subject": "invoices.1", "data": "x" }), "subject"),
        (json!({ "subject": "orders.*", "data": "x" }), "subject"),
        (
            json!({ "subject": "orders.1", "data": "!!", "encoding": "base64" }),
            "data",
        ),
        (json!({ "subject": "orders.1", "colour": "red" }), "colour"),
    ] {
        gateway
            .post("/publish", Some(&body))
            .await
            .assert_invalid(field);
    }
    gateway
        .post("/publish", Some(&json!({ "data": "x" })))
        .await
        .assert_missing("subject");
}

/// A publish the stream refuses because of the publisher's own headers is a client error,
/// never "NATS unavailable": an expectation that did not hold is 412 (retrying as is cannot
/// succeed), a directive the stream does not allow is 422 naming `headers`; the detail says
/// the server's reason once. A header name NATS cannot carry is refused before publishing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_the_stream_refuses_are_client_errors() {
    let (_server, _js, gateway) = Setup::consumer("refusals").start().await;
    let publish = |headers: serde_json::Value| {
        let gateway = &gateway;
        async move {
            gateway
                .post(
                    "/publish",
                    Some(&json!({ "subject": "orders.1", "data": "x", "headers": headers })),
                )
                .await
        }
    };
    let stored = publish(json!({})).await;
    assert_eq!(stored.status, 201, "{}", stored.text);

    for (headers, reason) in [
        (
            json!({ "Nats-Expected-Last-Sequence": "99" }),
            "wrong last sequence",
        ),
        (
            json!({ "Nats-Expected-Stream": "ELSEWHERE" }),
            "expected stream does not match",
        ),
        (
            json!({ "Nats-Expected-Last-Subject-Sequence": "99" }),
            "wrong last sequence",
        ),
        (
            json!({ "Nats-Expected-Last-Msg-Id": "nope" }),
            "wrong last msg ID",
        ),
    ] {
        let reply = publish(headers.clone()).await;
        reply.assert_problem(412);
        assert_eq!(
            reply.body["type"], "urn:ruststream-nats:problem:publish-precondition-failed",
            "{headers}: {}",
            reply.text
        );
        let detail = reply.detail();
        assert!(
            detail.to_lowercase().contains(&reason.to_lowercase()),
            "{headers}: the server's reason in {detail:?}"
        );
        assert_eq!(
            detail.matches(" (code ").count(),
            1,
            "{headers}: said once: {detail:?}"
        );
    }

    let rollup = publish(json!({ "Nats-Rollup": "sub" })).await;
    rollup.assert_invalid("headers");
    assert!(
        rollup.detail().contains("rollup"),
        "the server's reason: {}",
        rollup.text
    );

    for name in ["", "Bad Name", "Bad:Name"] {
        publish(json!({ name: "v" }))
            .await
            .assert_invalid("headers");
    }
    let after = publish(json!({})).await;
    assert_eq!(
        after.body["sequence"], 2,
        "nothing refused was stored: {}",
        after.text
    );
}
