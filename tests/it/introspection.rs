//! GET /healthz, /readyz, /consumer and /openapi.json, and the committed spec
//! `openapi/openapi.json` kept equal to the served one.

use std::path::Path;
use std::time::Duration;

use serde_json::Value;

use crate::support::{STREAM, Setup, nats::free_port, server_ack_pending, wait_until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_endpoint_reports_config_server_counters_and_leases() {
    let (_server, js, gateway) = Setup::consumer("introspect")
        .ack_wait("12s")
        .max_ack_pending(77)
        .start()
        .await;
    assert_eq!(gateway.healthz().await, 200);
    assert_eq!(gateway.readyz().await, 200);
    js.publish_many("orders.1", 3, "m").await;

    let view = gateway.consumer_view().await;
    assert_eq!(view["name"], "introspect", "{view}");
    assert_eq!(view["stream"], STREAM, "{view}");
    // The effective config is the server's, as the flags set it (and the defaults).
    assert_eq!(
        view["config"],
        serde_json::json!({
            "durable": true,
            "deliver_policy": "all",
            "ack_policy": "explicit",
            "ack_wait": "12s",
            "ack_wait_ms": 12_000,
            "max_ack_pending": 77,
            "max_deliver": -1,
            "filter_subject": null,
            "filter_subjects": [],
            "max_waiting": 512
        }),
        "{view}"
    );
    for counter in [
        "num_pending",
        "num_ack_pending",
        "num_redelivered",
        "num_waiting",
        "leases_in_flight",
    ] {
        assert!(
            view.get(counter).is_some_and(Value::is_u64),
            "counter {counter}: {view}"
        );
    }
    // The server counts a stored message as pending for the consumer a moment after the
    // publish was acknowledged: wait for it rather than race it.
    wait_until(
        "the consumer counts the 3 messages as pending",
        Duration::from_secs(5),
        || async { gateway.consumer_view().await["num_pending"] == 3 },
    )
    .await;
    let view = gateway.consumer_view().await;
    assert_eq!(view["num_ack_pending"], 0, "{view}");
    assert_eq!(view["leases_in_flight"], 0, "{view}");

    let held = gateway.fetch_n(2, 1000).await;
    assert_eq!(held.len(), 2);
    let view = gateway.consumer_view().await;
    assert_eq!(view["num_pending"], 1, "{view}");
    assert_eq!(view["num_ack_pending"], 2, "{view}");
    assert_eq!(view["leases_in_flight"], 2, "{view}");
    assert_eq!(server_ack_pending(&js, &gateway).await, 2);
}

/// Everything about /openapi.json works without NATS: the gateway serves HTTP at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openapi_json_describes_every_endpoint_and_matches_the_committed_spec() {
    let unreachable = format!("nats://127.0.0.1:{}", free_port());
    let mut gateway = Setup::consumer("spec").starting(&unreachable).await;
    let reply = gateway.openapi().await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    assert!(reply.content_type().starts_with("application/json"));
    let spec = &reply.body;
    assert!(
        spec["openapi"]
            .as_str()
            .is_some_and(|v| v.starts_with("3.")),
        "an OpenAPI 3 document: {}",
        reply.text
    );
    let paths = spec["paths"].as_object().expect("paths");
    for (path, method) in [
        ("/fetch", "post"),
        ("/messages/{id}/ack", "post"),
        ("/messages/{id}/nak", "post"),
        ("/messages/{id}/term", "post"),
        ("/messages/{id}/in-progress", "post"),
        ("/messages/ack", "post"),
        ("/messages/nak", "post"),
        ("/messages/term", "post"),
        ("/healthz", "get"),
        ("/readyz", "get"),
        ("/consumer", "get"),
    ] {
        assert!(
            paths.get(path).and_then(|p| p.get(method)).is_some(),
            "{method} {path} missing from the spec; paths: {:?}",
            paths.keys().collect::<Vec<_>>()
        );
    }

    let committed = Path::new(env!("CARGO_MANIFEST_DIR")).join("openapi/openapi.json");
    let text = std::fs::read_to_string(&committed).unwrap_or_else(|err| {
        panic!(
            "{} is missing ({err}); run UPDATE_OPENAPI=1 cargo test --lib committed_spec",
            committed.display()
        )
    });
    let on_disk: Value = serde_json::from_str(&text).expect("openapi/openapi.json is JSON");
    assert!(
        on_disk == *spec,
        "openapi/openapi.json drifted from the served spec; \
         regenerate with UPDATE_OPENAPI=1 cargo test --lib committed_spec"
    );
    gateway.shutdown().await.expect("shutdown without NATS");
}
