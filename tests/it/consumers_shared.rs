//! Many consumers on one gateway, continued: tokens scoped to consumers, publishes to every
//! served stream, Idempotency-Key scoped by consumer, one heartbeat per replica whatever the
//! number of consumers, and an existing consumer's stream taking publishes.

use std::time::Duration;

use async_nats::jetstream::consumer;
use serde_json::{Value, json};

use crate::consumers::{TWO, fetch_named, fetch_path};
use crate::support::client::{batch_results, http_client_with_token};
use crate::support::nats::files_dir;
use crate::support::{
    Action, Client, STREAM, Setup, server_with_stream, wait_until, with_consumers_file,
};

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
    let mut made: Vec<&String> = names
        .iter()
        .filter(|name| name.starts_with("RUSTSTREAM_"))
        .collect();
    made.sort();
    assert_eq!(made.len(), 2, "no stream per consumer: {made:?}");
    assert_eq!(made[0], "RUSTSTREAM_FLEET");
    assert!(
        made[1].starts_with("RUSTSTREAM_SETTLED_ORDERS_"),
        "one settled records stream per consumed stream: {made:?}"
    );

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
