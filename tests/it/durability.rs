//! The durability report: what `GET /consumer` says of how durable a consumer's settles are
//! (the stream's and consumer's replicas and storage, the server's sync policy read from its
//! monitoring endpoint, the settled records), the promise it makes and its warnings; the
//! `ruststream_durability_promise` gauge; and `--require-durability` refusing at start a
//! consumer that falls short.

use std::time::Duration;

use serde_json::Value;

use crate::support::{Js, NatsServer, STREAM, Scrape, Setup};

/// A server with the `ORDERS` stream and its monitoring endpoint; the endpoint's URL.
async fn monitored(sync_always: bool) -> (NatsServer, Js, String) {
    let (server, monitor) = NatsServer::with_monitoring(sync_always).await;
    let js = Js::connect(&server.url()).await;
    js.create_stream(STREAM, &["orders.>"]).await;
    (server, js, monitor)
}

fn warnings(durability: &Value) -> Vec<String> {
    durability["warnings"]
        .as_array()
        .expect("warnings")
        .iter()
        .map(|warning| warning.as_str().expect("a string").to_owned())
        .collect()
}

/// One nats-server at its default sync (2 minutes), R1: the settles are recorded (promise
/// `fleet`), and the report names both weak links — the stream's writes and the consumer's
/// acks not on disk when confirmed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_node_at_the_default_sync_is_reported_with_its_weak_links() {
    let (server, _js, monitor) = monitored(false).await;
    let gateway = Setup::consumer("durable-default")
        .flag("--nats-monitor-url", &monitor)
        .ready(&server.url())
        .await;
    let view = gateway.consumer_view().await;
    let durability = &view["durability"];
    assert_eq!(durability["stream_replicas"], 1, "{durability}");
    assert_eq!(durability["consumer_replicas"], 1);
    assert_eq!(durability["storage"], "file");
    assert_eq!(durability["persist_mode"], "default");
    assert_eq!(durability["server_sync"], "2m");
    assert_eq!(durability["settled_record_replicas"], 1);
    assert_eq!(durability["promise"], "fleet");
    let warnings = warnings(durability);
    assert!(
        warnings[0].starts_with("R1 stream at a sync interval of 2m")
            && warnings[0].contains("Jepsen"),
        "{warnings:?}"
    );
    assert!(warnings[1].starts_with("consumer R1"), "{warnings:?}");
    assert_eq!(
        Scrape::of(&gateway)
            .await
            .get("ruststream_durability_promise"),
        2.0
    );
}

/// With `sync_interval: always` the server is known to sync every write: no warning of the
/// stream's writes (the consumer's acks still are confirmed before they are stored); without
/// `--nats-monitor-url` the sync is `unknown`, and said so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_servers_sync_is_read_from_its_monitoring_endpoint_or_unknown() {
    let (server, _js, monitor) = monitored(true).await;
    let synced = Setup::consumer("durable-synced")
        .flag("--nats-monitor-url", &monitor)
        .ready(&server.url())
        .await;
    let durability = synced.consumer_view().await["durability"].clone();
    assert_eq!(durability["server_sync"], "always", "{durability}");
    let warnings_synced = warnings(&durability);
    assert!(
        warnings_synced
            .iter()
            .all(|warning| !warning.starts_with("R1 stream")),
        "{warnings_synced:?}"
    );
    assert!(
        warnings_synced
            .iter()
            .any(|warning| warning.starts_with("consumer R1"))
    );

    let blind = Setup::consumer("durable-blind").ready(&server.url()).await;
    let durability = blind.consumer_view().await["durability"].clone();
    assert_eq!(durability["server_sync"], "unknown", "{durability}");
    assert!(
        warnings(&durability)[0].contains("--nats-monitor-url"),
        "{durability}"
    );
}

/// `--require-durability`: `fleet` serves a single node (its settles are recorded);
/// `replicated` refuses it at start, naming the field that falls short; `synced` without the
/// monitoring endpoint too (after the replicas, the first shortfall).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_short_of_the_required_durability_is_refused_at_start() {
    let (server, _js, monitor) = monitored(true).await;
    let served = Setup::consumer("durable-fleet")
        .flag("--require-durability", "fleet")
        .process(&server.url())
        .await;
    assert_eq!(served.readyz().await, 200);

    for level in ["replicated", "synced"] {
        let mut refused = crate::support::GatewayProcess::spawn(
            &Setup::consumer("durable-refused")
                .flag("--require-durability", level)
                .flag("--nats-monitor-url", &monitor),
            &server.url(),
        );
        let status = refused.wait_exit(Duration::from_secs(20)).await;
        assert!(!status.success(), "{level}: refused at start");
        let log = refused.log();
        assert!(
            log.contains(&format!("--require-durability {level} is not met"))
                && log.contains("stream_replicas is 1"),
            "{level}: the bind error names the field:\n{log}"
        );
    }
}

/// A consumer bound after start (`--serve-existing`) that falls short of
/// `--require-durability` is not served: its requests are answered 503
/// `durability-insufficient`, `field` naming what falls short.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_bound_later_short_of_the_required_durability_is_answered_503() {
    let (server, js) = crate::support::server_with_stream().await;
    js.create_consumer(
        STREAM,
        async_nats::jetstream::consumer::pull::Config {
            durable_name: Some("ops".into()),
            ack_policy: async_nats::jetstream::consumer::AckPolicy::Explicit,
            ..Default::default()
        },
    )
    .await;
    let gateway = Setup::defaults()
        .switch("--no-default-consumer")
        .flag("--serve-existing", "ORDERS/*")
        .flag("--require-durability", "replicated")
        .ready(&server.url())
        .await;
    let reply = crate::support::wait_for(
        "the consumer is refused for its durability",
        Duration::from_secs(10),
        || async {
            let reply = gateway
                .post(
                    "/streams/ORDERS/consumers/ops/fetch",
                    Some(&serde_json::json!({"batch": 1, "wait_ms": 100})),
                )
                .await;
            (reply.status == 503 && reply.text.contains("durability-insufficient")).then_some(reply)
        },
    )
    .await;
    let problem = reply.assert_problem(503);
    assert_eq!(
        problem["type"],
        "urn:ruststream-nats:problem:durability-insufficient"
    );
    assert_eq!(problem["field"], "stream_replicas", "{}", reply.text);
    assert!(reply.retry_after_secs() >= 1);
}
