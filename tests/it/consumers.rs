//! Many consumers on one gateway: consumers named per request, the consumers file (at start
//! and reloaded), existing consumers served on demand and unbound when idle, tokens scoped
//! to consumers, and per-consumer metrics.

use std::time::Duration;

use async_nats::jetstream::consumer;
use serde_json::{Value, json};

use crate::support::nats::files_dir;
use crate::support::{
    Action, Client, STREAM, Scrape, Setup, assert_stays, server_with_stream, wait_until,
    with_consumers_file,
};

pub(crate) fn fetch_path(stream: &str, consumer: &str) -> String {
    format!("/streams/{stream}/consumers/{consumer}/fetch")
}

/// Fetch up to `batch` leases of a named consumer, waiting up to a second.
pub(crate) async fn fetch_named(
    client: &Client,
    consumer: &str,
    batch: u64,
) -> Vec<crate::support::Msg> {
    let reply = client
        .post(
            &fetch_path(STREAM, consumer),
            Some(&json!({ "batch": batch, "wait_ms": 1000, "encoding": "utf8" })),
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    reply.messages()
}

/// The status of a fetch of `consumer` that waits for nothing.
pub(crate) async fn fetch_status(client: &Client, consumer: &str) -> u16 {
    client
        .post(
            &fetch_path(STREAM, consumer),
            Some(&json!({ "wait_ms": 0 })),
        )
        .await
        .status
}

pub(crate) const TWO: &str = r#"
[[consumer]]
stream = "ORDERS"
name = "shipping"

[[consumer]]
stream = "ORDERS"
name = "analytics"
ack_wait = "20s"
max_ack_pending = 50
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declared_consumers_are_served_by_name_and_their_leases_never_cross() {
    let (server, js) = server_with_stream().await;
    let (gateway, _dir) = with_consumers_file(&server, TWO).await;
    js.publish_many("orders.1", 2, "m").await;

    // The same messages, leased through three consumers: the same stream sequences.
    let billing = gateway.fetch_n(2, 1000).await;
    let shipping = fetch_named(&gateway, "shipping", 2).await;
    let analytics = fetch_named(&gateway, "analytics", 2).await;
    assert_eq!(shipping.len(), 2);
    assert_eq!(analytics.len(), 2);
    assert_eq!(shipping[0].consumer, "shipping");
    assert_eq!(shipping[0].stream_sequence, billing[0].stream_sequence);

    // The file's settings were sent: analytics has its own ack_wait and max_ack_pending.
    let view = gateway
        .get(&format!("/streams/{STREAM}/consumers/analytics"))
        .await;
    assert_eq!(view.status, 200, "{}", view.text);
    let view: Value = serde_json::from_str(&view.text).expect("json");
    assert_eq!(view["name"], "analytics");
    assert_eq!(view["config"]["ack_wait_ms"], 20_000);
    assert_eq!(view["config"]["max_ack_pending"], 50);
    assert_eq!(view["leases_in_flight"], 2);

    // One batch mixing three consumers, results in request order; each lease settles its
    // own consumer's delivery only.
    let ids = [
        &billing[0].id,
        &shipping[0].id,
        &analytics[0].id,
        &shipping[1].id,
    ];
    let results = gateway
        .settle_many_ok(Action::Ack, &json!({ "ids": ids }))
        .await;
    let statuses: Vec<u16> = results.iter().map(|(_, status)| *status).collect();
    assert_eq!(statuses, [204, 204, 204, 204]);
    for (position, (id, _)) in results.iter().enumerate() {
        assert_eq!(id, ids[position]);
    }
    assert_eq!(
        js.consumer_info(STREAM, "shipping").await.num_ack_pending,
        0
    );
    assert_eq!(
        js.consumer_info(STREAM, "analytics").await.num_ack_pending,
        1
    );
    assert_eq!(js.consumer_info(STREAM, "billing").await.num_ack_pending, 1);
    // Acked on shipping, still leased on billing: the same sequence, another consumer.
    assert_eq!(gateway.ack(&billing[1].id).await, 204);

    let listed: Value = serde_json::from_str(&gateway.get("/consumers").await.text).expect("json");
    let listed: Vec<(String, String, bool)> = listed["consumers"]
        .as_array()
        .expect("consumers")
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap_or_default().to_owned(),
                c["source"].as_str().unwrap_or_default().to_owned(),
                c["bound"].as_bool().unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(
        listed,
        [
            ("analytics".to_owned(), "file".to_owned(), true),
            ("billing".to_owned(), "default".to_owned(), true),
            ("shipping".to_owned(), "file".to_owned(), true),
        ]
    );

    // Series per consumer, and the consumers counted by source.
    let scrape = Scrape::of(&gateway).await;
    assert_eq!(
        scrape.of_consumer("ruststream_leases_granted_total", "", STREAM, "shipping"),
        2.0
    );
    assert_eq!(
        scrape.of_consumer("ruststream_max_ack_pending", "", STREAM, "analytics"),
        50.0
    );
    assert_eq!(scrape.exact(r#"ruststream_consumers{source="file"}"#), 2.0);
    assert_eq!(
        scrape.exact(r#"ruststream_consumers{source="default"}"#),
        1.0
    );

    // A consumer this gateway does not serve.
    let unknown = gateway.post(&fetch_path(STREAM, "nobody"), None).await;
    let problem = unknown.assert_problem(404);
    assert!(
        problem["type"]
            .as_str()
            .is_some_and(|kind| kind.ends_with(":problem:consumer-not-found")),
        "{problem:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_of_one_consumer_never_settles_another_with_the_same_key() {
    // Two gateways of different consumers sharing one lease key: an id of A presented to
    // B's gateway is not B's delivery of the same stream sequence.
    let (server, js) = server_with_stream().await;
    let dir = files_dir();
    let key = dir.path().join("lease.key");
    std::fs::write(&key, [7u8; 32]).expect("key");
    let a = Setup::consumer("alpha")
        .lease_key_file(&key)
        .ready(&server.url())
        .await;
    let b = Setup::consumer("beta")
        .lease_key_file(&key)
        .ready(&server.url())
        .await;
    js.publish("orders.1", "one").await;
    let of_a = a.fetch_n(1, 1000).await;
    let of_b = b.fetch_n(1, 1000).await;
    assert_eq!(of_a[0].stream_sequence, of_b[0].stream_sequence);
    assert_eq!(b.ack(&of_a[0].id).await, 404, "A's id is nothing at B");
    assert_eq!(js.consumer_info(STREAM, "beta").await.num_ack_pending, 1);
    assert_eq!(b.ack(&of_b[0].id).await, 204);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_consumers_file_is_followed_as_it_changes() {
    let (server, js) = server_with_stream().await;
    let one = "[[consumer]]\nstream = \"ORDERS\"\nname = \"shipping\"\n";
    let (gateway, dir) = with_consumers_file(&server, one).await;
    let path = dir.path().join("consumers.toml");
    js.publish_many("orders.1", 3, "m").await;
    let held = fetch_named(&gateway, "shipping", 1).await;
    assert_eq!(held.len(), 1);

    // Added: served within 5 s.
    std::fs::write(
        &path,
        format!("{one}\n[[consumer]]\nstream = \"ORDERS\"\nname = \"audit\"\n"),
    )
    .expect("rewrite");
    wait_until("audit is served", Duration::from_secs(5), || async {
        fetch_status(&gateway, "audit").await == 200
    })
    .await;

    // Broken: refused, the previous file stays in force.
    std::fs::write(&path, "[[consumer]]\nstream = \"ORDERS\"\nnmae = \"x\"\n").expect("rewrite");
    assert_stays(
        "a file that does not parse changes nothing",
        Duration::from_millis(2500),
        || async { fetch_status(&gateway, "audit").await == 200 },
    )
    .await;

    // Removed with a live lease: no new fetch, the lease still settles.
    std::fs::write(&path, "").expect("empty");
    wait_until(
        "shipping takes no more fetches",
        Duration::from_secs(5),
        || async { fetch_status(&gateway, "shipping").await == 404 },
    )
    .await;
    assert_eq!(gateway.ack(&held[0].id).await, 204);
    wait_until("shipping is let go", Duration::from_secs(5), || async {
        let listed: Value =
            serde_json::from_str(&gateway.get("/consumers").await.text).expect("json");
        listed["consumers"]
            .as_array()
            .is_some_and(|all| all.iter().all(|c| c["name"] != "shipping"))
    })
    .await;
}

/// A changed ack_wait or max_ack_pending is applied to the live consumer at once — fetches
/// go on, under steady traffic too, and the lease out keeps its deadline; a change only a new
/// binding applies (the filter) answers 503 with Retry-After until the live lease ended,
/// never 404 for a consumer that exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_ack_wait_applies_at_once_and_a_rebind_is_a_503_not_a_404() {
    let (server, js) = server_with_stream().await;
    let entry = |settings: &str| {
        format!("[[consumer]]\nstream = \"ORDERS\"\nname = \"shipping\"\n{settings}")
    };
    let (gateway, dir) = with_consumers_file(&server, &entry("ack_wait = \"30s\"\n")).await;
    let path = dir.path().join("consumers.toml");
    js.publish_many("orders.1", 4, "m").await;
    let held = fetch_named(&gateway, "shipping", 1).await;
    assert_eq!(held.len(), 1);

    std::fs::write(&path, entry("ack_wait = \"45s\"\nmax_ack_pending = 500\n")).expect("rewrite");
    wait_until(
        "the server has the new ack_wait and max_ack_pending",
        Duration::from_secs(5),
        || async {
            let config = js.consumer_info(STREAM, "shipping").await.config;
            config.ack_wait == Duration::from_secs(45) && config.max_ack_pending == 500
        },
    )
    .await;
    // Served all along: the live lease did not hold the change back.
    let next = fetch_named(&gateway, "shipping", 1).await;
    assert_eq!(next.len(), 1, "a fetch right after the change is served");
    let lasts = next[0].lease_expires() - time::OffsetDateTime::now_utc();
    assert!(
        lasts > time::Duration::seconds(35),
        "a lease issued after the change lasts the new ack_wait: {lasts}"
    );
    assert_eq!(
        gateway.ack(&held[0].id).await,
        204,
        "the lease out still settles"
    );

    // Only a new binding applies a filter: 503 while the live lease keeps it.
    std::fs::write(
        &path,
        entry("ack_wait = \"45s\"\nmax_ack_pending = 500\nfilter_subject = \"orders.1\"\n"),
    )
    .expect("rewrite");
    // Until the file is read again, a fetch is still served: what it leases is acked.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let refused = loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the rebind was not announced within 5s"
        );
        let answer = gateway
            .post(
                &fetch_path(STREAM, "shipping"),
                Some(&json!({"batch": 1, "wait_ms": 0})),
            )
            .await;
        if answer.status != 200 {
            break answer;
        }
        for message in answer.body["messages"].as_array().into_iter().flatten() {
            let id = message["id"].as_str().expect("a lease id");
            assert_eq!(gateway.ack(id).await, 204);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let problem = refused.assert_problem(503);
    assert_eq!(
        problem["type"],
        "urn:ruststream-nats:problem:consumer-rebinding"
    );
    assert_eq!(
        refused
            .headers
            .get("retry-after")
            .map(|v| v.to_str().unwrap_or_default()),
        Some("1")
    );
    assert_eq!(gateway.ack(&next[0].id).await, 204);
    wait_until(
        "served again once rebound",
        Duration::from_secs(10),
        || async { fetch_status(&gateway, "shipping").await == 200 },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_consumers_file_exits_2_naming_the_file_line_and_key() {
    let dir = files_dir();
    let path = dir.path().join("consumers.toml");
    for (text, says) in [
        (
            "[[consumer]]\nstream = \"ORDERS\"\nname = \"a\"\nack_wiat = \"1s\"\n",
            "line 4",
        ),
        (
            "[[consumer]]\nstream = \"ORDERS\"\nname = \"a\"\n[[consumer]]\nstream = \"ORDERS\"\nname = \"a\"\n",
            "line 6: key `name`",
        ),
    ] {
        std::fs::write(&path, text).expect("write");
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_ruststream-nats"))
            .args(["--consumers-file", &path.display().to_string()])
            .env("NATS_URL", "nats://127.0.0.1:1")
            .output()
            .expect("run the gateway binary");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains(&path.display().to_string()) && stderr.contains(says),
            "{stderr}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_default_consumer_the_default_routes_name_the_named_ones() {
    let (server, _js) = server_with_stream().await;
    let gateway = Setup::defaults()
        .switch("--no-default-consumer")
        .flag("--serve-existing", "ORDERS/*")
        .ready(&server.url())
        .await;
    for reply in [
        gateway.post("/fetch", None).await,
        gateway.get("/consumer").await,
    ] {
        reply.assert_problem(404);
        assert!(
            reply
                .detail()
                .contains("/streams/{stream}/consumers/{consumer}/fetch"),
            "{}",
            reply.text
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn existing_consumers_are_bound_on_first_use_and_unbound_when_idle() {
    let (server, js) = server_with_stream().await;
    js.create_consumer(
        STREAM,
        consumer::pull::Config {
            durable_name: Some("ops".into()),
            ack_wait: Duration::from_secs(40),
            ..Default::default()
        },
    )
    .await;
    js.js
        .get_stream(STREAM)
        .await
        .expect("stream")
        .create_consumer(consumer::push::Config {
            durable_name: Some("pushed".into()),
            deliver_subject: "deliver.here".into(),
            ..Default::default()
        })
        .await
        .expect("push consumer");
    js.create_consumer(
        STREAM,
        consumer::pull::Config {
            durable_name: Some("acks-none".into()),
            ack_policy: consumer::AckPolicy::None,
            ..Default::default()
        },
    )
    .await;
    let gateway = Setup::defaults()
        .switch("--no-default-consumer")
        .flag("--serve-existing", "ORDERS/*")
        .flag("--idle-unbind", "1s")
        .ready(&server.url())
        .await;
    js.publish("orders.1", "one").await;

    let leased = fetch_named(&gateway, "ops", 1).await;
    assert_eq!(leased.len(), 1);
    let view: Value = serde_json::from_str(
        &gateway
            .get(&format!("/streams/{STREAM}/consumers/ops"))
            .await
            .text,
    )
    .expect("json");
    assert_eq!(
        view["config"]["ack_wait_ms"], 40_000,
        "its own settings, unchanged"
    );
    assert_eq!(gateway.ack(&leased[0].id).await, 204);

    for (consumer, status, says) in [
        ("missing", 404, "does not exist"),
        ("pushed", 409, "push consumer"),
        ("acks-none", 409, "ack_policy"),
    ] {
        let reply = gateway.post(&fetch_path(STREAM, consumer), None).await;
        reply.assert_problem(status);
        assert!(reply.detail().contains(says), "{consumer}: {}", reply.text);
    }
    let other = gateway.post(&fetch_path("EVENTS", "ops"), None).await;
    other.assert_problem(404);
    assert!(other.detail().contains("not served"), "{}", other.text);
    let bad = gateway
        .post("/streams/ORDERS/consumers/a%2Eb/fetch", None)
        .await;
    bad.assert_problem(404);
    assert!(bad.detail().contains("must not contain"), "{}", bad.text);

    // Idle: unbound (listed with `bound: false`, the unsuitable ones not at all), then bound
    // again by the next request.
    wait_until("ops is unbound", Duration::from_secs(15), || async {
        let listed: Value =
            serde_json::from_str(&gateway.get("/consumers").await.text).expect("json");
        listed["consumers"]
            == json!([{ "stream": STREAM, "name": "ops", "source": "existing", "bound": false, "leases_in_flight": 0 }])
    })
    .await;
    js.publish("orders.1", "two").await;
    let again = fetch_named(&gateway, "ops", 1).await;
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].data, "two");
}
