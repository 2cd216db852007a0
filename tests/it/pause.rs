//! A push consumer's pause at its far edge: a pause until a time as far off as 9999-12-31 is
//! answered as given, and read so by a restarted gateway; a pause until resumed is read as
//! such after a restart too; the instant the gateway gives the server for the latter is
//! refused as an `until`, so the two cannot be mistaken for each other.

use std::time::Duration;

use serde_json::{Value, json};

use crate::support::endpoint::Endpoint;
use crate::support::nats::files_dir;
use crate::support::{Client, STREAM, Setup, server_with_stream, wait_for};

const PUSHED: &str = "far-paused";

/// What a fetch of the consumer is told once the gateway reads the pause: its 409 problem.
async fn paused_refusal(gateway: &Client) -> Value {
    let path = format!("/streams/{STREAM}/consumers/{PUSHED}/fetch");
    wait_for(
        "a fetch refused as paused",
        Duration::from_secs(5),
        || async {
            // Nothing is published: a fetch before the pause is read leases nothing.
            let reply = gateway.post(&path, Some(&json!({"wait_ms": 0}))).await;
            let paused = reply.status == 409
                && reply.body["type"] == "urn:ruststream-nats:problem:consumer-paused";
            paused.then(|| Value::Object(reply.assert_problem(409).clone()))
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_until_9999_answers_that_time_and_until_resumed_stays_so_across_restarts() {
    let (server, _js) = server_with_stream().await;
    let endpoint = Endpoint::start().await;
    let dir = files_dir();
    let path = dir.path().join("consumers.toml");
    std::fs::write(
        &path,
        format!(
            "[[consumer]]\nstream = \"{STREAM}\"\nname = \"{PUSHED}\"\n\n[consumer.push]\nurl = \"{}\"\n",
            endpoint.url
        ),
    )
    .expect("write");
    let setup = Setup::defaults().flag("--consumers-file", path.display().to_string());
    let mut gateway = setup.ready(&server.url()).await;
    let pause = format!("/streams/{STREAM}/consumers/{PUSHED}/push/pause");

    // The gateway's own mark for "until resumed" is no `until` a user may give.
    gateway
        .post(
            &pause,
            Some(&json!({"until": "9999-12-31T23:59:59.999999999Z"})),
        )
        .await
        .assert_invalid("until");

    let far = "9999-12-31T00:00:00Z";
    let paused = gateway.post(&pause, Some(&json!({"until": far}))).await;
    assert_eq!(paused.status, 200, "{}", paused.text);
    assert_eq!(
        (&paused.body["paused"], &paused.body["paused_until"]),
        (&json!(true), &json!(far))
    );
    assert_eq!(paused_refusal(&gateway).await["paused_until"], far);
    gateway.shutdown().await.expect("a clean stop");
    let mut gateway = setup.ready(&server.url()).await;
    assert_eq!(
        paused_refusal(&gateway).await["paused_until"],
        far,
        "read back as that time after a restart"
    );

    let paused = gateway.post(&pause, None).await;
    assert_eq!(paused.status, 200, "{}", paused.text);
    assert_eq!(
        (&paused.body["paused"], &paused.body["paused_until"]),
        (&json!(true), &Value::Null)
    );
    gateway.shutdown().await.expect("a clean stop");
    let gateway = setup.ready(&server.url()).await;
    let refusal = paused_refusal(&gateway).await;
    assert!(
        refusal.get("paused_until").is_none_or(Value::is_null),
        "until resumed after a restart: {refusal}"
    );
    let resumed = gateway
        .post(
            &format!("/streams/{STREAM}/consumers/{PUSHED}/push/resume"),
            None,
        )
        .await;
    assert_eq!(
        (resumed.status, &resumed.body["paused"]),
        (200, &json!(false)),
        "{}",
        resumed.text
    );
}
