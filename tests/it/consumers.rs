//! Many consumers on one gateway: consumers named per request, the consumers file (at start
//! and reloaded), existing consumers served on demand and unbound when idle, tokens scoped
//! to consumers, and per-consumer metrics.

use std::time::Duration;

use async_nats::jetstream::consumer;
use serde_json::{Value, json};

use crate::support::client::{batch_results, http_client_with_token};
use crate::support::nats::files_dir;
use crate::support::{
    Action, Client, STREAM, Scrape, Setup, assert_stays, server_with_stream, wait_until,
    with_consumers_file,
};

fn fetch_path(stream: &str, consumer: &str) -> String {
    format!("/streams/{stream}/consumers/{consumer}/fetch")
}

/// Fetch up to `batch` leases of a named consumer, waiting up to a second.
async fn fetch_named(client: &Client, consumer: &str, batch: u64) -> Vec<crate::support::Msg> {
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
async fn fetch_status(client: &Client, consumer: &str) -> u16 {
    client
        .post(
            &fetch_path(STREAM, consumer),
            Some(&json!({ "wait_ms": 0 })),
        )
        .await
        .status
}

const TWO: &str = r#"
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_scoped_to_a_consumer_reach_only_that_consumer() {
    let (server, js) = server_with_stream().await;
    let dir = files_dir();
    let tokens = dir.path().join("tokens");
    std::fs::write(
        &tokens,
        "ship-token fetch:ORDERS/shipping,settle:ORDERS/shipping\nall-token fetch,settle,admin\n",
    )
    .expect("tokens");
    let file = dir.path().join("consumers.toml");
    std::fs::write(&file, TWO).expect("consumers file");
    let gateway = Setup::defaults()
        .auth_tokens_file(&tokens)
        .flag("--consumers-file", file.display().to_string())
        .ready(&server.url())
        .await;
    js.publish_many("orders.1", 2, "m").await;
    let ship = Client::with_http(gateway.base(), http_client_with_token("ship-token"));
    let all = Client::with_http(gateway.base(), http_client_with_token("all-token"));

    let mine = fetch_named(&ship, "shipping", 2).await;
    assert_eq!(mine.len(), 2);
    for path in [
        fetch_path(STREAM, "analytics"),
        fetch_path(STREAM, "no-such-consumer"),
        "/fetch".to_owned(),
    ] {
        ship.post(&path, None).await.assert_problem(403);
    }
    let theirs = fetch_named(&all, "analytics", 1).await;
    assert_eq!(ship.ack(&theirs[0].id).await, 403);
    // The same id with its tag altered names analytics still, but is forged: a 404 for any
    // caller, so a token learns nothing of consumers it may not reach.
    let mut forged = theirs[0].id.clone().into_bytes();
    let at = forged.len() - 5;
    forged[at] = if forged[at] == b'A' { b'B' } else { b'A' };
    let forged = String::from_utf8(forged).expect("ascii");
    assert_eq!(ship.ack(&forged).await, 404);
    assert_eq!(all.ack(&forged).await, 404);
    let reply = ship
        .settle_many(
            Action::Ack,
            &json!({ "ids": [mine[0].id, theirs[0].id, mine[1].id] }),
        )
        .await;
    let statuses: Vec<u16> = batch_results(&reply).iter().map(|r| r.status).collect();
    assert_eq!(statuses, [204, 403, 204]);
    assert_eq!(all.ack(&theirs[0].id).await, 204);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_reaches_every_served_stream() {
    let (server, _js) = server_with_stream().await;
    crate::support::nats::create_stream(&server.url(), "EVENTS", &["events.>"]).await;
    let file = "[[consumer]]\nstream = \"EVENTS\"\nname = \"audit\"\n";
    let (gateway, _dir) = with_consumers_file(&server, file).await;
    let reply = gateway
        .post(
            "/publish",
            Some(&json!({ "subject": "events.login", "data": "hi" })),
        )
        .await;
    assert_eq!(reply.status, 201, "{}", reply.text);
    assert!(
        reply.text.contains(r#""stream":"EVENTS""#),
        "{}",
        reply.text
    );
    let leased = fetch_named_on(&gateway, "EVENTS", "audit").await;
    assert_eq!(leased[0].data, "hi");
}

async fn fetch_named_on(client: &Client, stream: &str, consumer: &str) -> Vec<crate::support::Msg> {
    let reply = client
        .post(
            &fetch_path(stream, consumer),
            Some(&json!({ "batch": 1, "wait_ms": 1000, "encoding": "utf8" })),
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    reply.messages()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotency_key_is_scoped_by_consumer() {
    let (server, js) = server_with_stream().await;
    let (gateway, _dir) = with_consumers_file(&server, TWO).await;
    js.publish_many("orders.1", 2, "m").await;
    let keyed = |consumer: &str| {
        let url = gateway.url(&fetch_path(STREAM, consumer));
        async move {
            let reply = crate::support::client::http_client()
                .post(url)
                .header("Idempotency-Key", "retry-me")
                .json(&json!({ "batch": 1, "wait_ms": 1000 }))
                .send()
                .await
                .expect("keyed fetch");
            crate::support::Reply::read(reply).await
        }
    };
    let first = keyed("shipping").await;
    assert_eq!(first.status, 200, "{}", first.text);
    // The same key on another consumer is another fetch, not the first one's answer.
    let other = keyed("analytics").await;
    assert_eq!(other.status, 200, "{}", other.text);
    assert!(!other.headers.contains_key("idempotent-replayed"));
    assert_eq!(other.messages()[0].consumer, "analytics");
    // Repeated on its own consumer: the first answer again.
    let again = keyed("shipping").await;
    assert_eq!(
        again
            .headers
            .get("idempotent-replayed")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..])
    );
    assert_eq!(again.body, first.body);
}

/// Two replicas serving three consumers: each process beats once in the one fleet stream
/// (no stream per consumer), each sees the other on every consumer both are busy on, and a
/// lease of a file consumer issued at one settles at the other through the process's one
/// subscription for forwarded settles.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_exchange_one_heartbeat_each_whatever_the_number_of_consumers() {
    let (server, js) = server_with_stream().await;
    let dir = files_dir();
    let path = dir.path().join("consumers.toml");
    std::fs::write(&path, TWO).expect("write the consumers file");
    let key = dir.path().join("lease.key");
    std::fs::write(&key, "two replicas share this lease key, 32+ bytes").expect("write key");
    let setup = Setup::defaults()
        .flag("--consumers-file", path.display().to_string())
        .lease_key_file(&key);
    let a = setup.clone().ready(&server.url()).await;
    let b = setup.ready(&server.url()).await;
    let replicas = |view: Value| view["replicas"].as_array().map_or(0, Vec::len);
    for gateway in [&a, &b] {
        wait_until(
            "each sees the other on every consumer",
            Duration::from_secs(10),
            || async {
                let mut seen = vec![replicas(gateway.consumer_view().await)];
                for consumer in ["shipping", "analytics"] {
                    let view = gateway
                        .get(&format!("/streams/{STREAM}/consumers/{consumer}"))
                        .await;
                    seen.push(replicas(
                        serde_json::from_str(&view.text).unwrap_or_default(),
                    ));
                }
                seen.iter().all(|count| *count == 2)
            },
        )
        .await;
    }
    let fleet = js
        .js
        .get_stream("RUSTSTREAM_FLEET")
        .await
        .expect("the fleet stream");
    let beats: Vec<(String, usize)> = futures::TryStreamExt::try_collect(
        fleet
            .info_with_subjects("_RUSTSTREAM.fleet.replica.*")
            .await
            .expect("subjects"),
    )
    .await
    .expect("subjects");
    assert_eq!(beats.len(), 2, "one heartbeat per process: {beats:?}");
    let names: Vec<String> = futures::TryStreamExt::try_collect(js.js.stream_names())
        .await
        .expect("names");
    let made: Vec<&String> = names
        .iter()
        .filter(|name| name.starts_with("RUSTSTREAM_"))
        .collect();
    assert_eq!(made, vec!["RUSTSTREAM_FLEET"], "no stream per consumer");

    js.publish_many("orders.1", 1, "m").await;
    let leased = fetch_named(&a, "shipping", 1).await;
    assert_eq!(leased.len(), 1);
    assert_eq!(b.ack(&leased[0].id).await, 204);
    assert_eq!(
        js.consumer_info(STREAM, "shipping").await.num_ack_pending,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_existing_consumers_stream_takes_publishes_bound_or_not_and_a_foreign_settle_binds_nothing()
 {
    let (server, js) = server_with_stream().await;
    crate::support::nats::create_stream(&server.url(), "EVENTS", &["events.>"]).await;
    for (stream, name) in [(STREAM, "ops"), ("EVENTS", "audit")] {
        js.create_consumer(
            stream,
            consumer::pull::Config {
                durable_name: Some(name.into()),
                ..Default::default()
            },
        )
        .await;
    }
    let dir = files_dir();
    let tokens = dir.path().join("tokens");
    std::fs::write(
        &tokens,
        "all fetch,settle,publish,admin\nops-only settle:ORDERS/ops\n",
    )
    .expect("tokens");
    let gateway = Setup::defaults()
        .switch("--no-default-consumer")
        .flag("--serve-existing", "ORDERS/*,EVENTS/*")
        .flag("--idle-unbind", "1s")
        .auth_tokens_file(&tokens)
        .ready(&server.url())
        .await;
    let all = Client::with_http(gateway.base(), http_client_with_token("all"));
    let publish = |data: &'static str| {
        let all = &all;
        async move {
            all.post(
                "/publish",
                Some(&json!({ "subject": "events.login", "data": data })),
            )
            .await
        }
    };
    // No consumer of EVENTS bound yet: the stream takes the publish all the same.
    let reply = publish("before").await;
    assert_eq!(reply.status, 201, "{}", reply.text);
    assert_eq!(reply.body["stream"], "EVENTS");
    let leased = fetch_named_on(&all, "EVENTS", "audit").await;
    assert_eq!(leased.len(), 1);
    let reply = publish("while bound").await;
    assert_eq!(reply.status, 201, "{}", reply.text);
    assert_eq!(all.ack(&leased[0].id).await, 204);

    // audit falls idle and is unbound; a token for another consumer presents its lease id:
    // 403, and audit is not bound for it.
    let bound_existing = || async {
        crate::support::Scrape::of(&all)
            .await
            .get("ruststream_consumers{source=\"existing\"}")
    };
    wait_until("audit is unbound", Duration::from_secs(10), || async {
        bound_existing().await == 0.0
    })
    .await;
    let ops_only = Client::with_http(gateway.base(), http_client_with_token("ops-only"));
    assert_eq!(ops_only.ack(&leased[0].id).await, 403);
    assert_eq!(
        bound_existing().await,
        0.0,
        "bound for a caller who may not settle there"
    );
    let reply = publish("after").await;
    assert_eq!(reply.status, 201, "{}", reply.text);
}
