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
