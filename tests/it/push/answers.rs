//! What each class of answer does to the message: ack, nak, term, left for later (and
//! settled at another replica), a directive the gateway cannot read, a batch's results, and
//! a request that outlasts half the lease.

use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use serde_json::Value;

use crate::support::endpoint::{Endpoint, Reply};
use crate::support::nats::files_dir;
use crate::support::{
    STREAM, Scrape, Setup, assert_stays, server_with_stream, wait_until, with_consumers_file,
};

use super::fixtures::{PUSHED, delivered, entry, payload, push_view, wait_all_settled};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_answer_settles_as_it_says_poison_once_failures_again_later_by_hand() {
    let (server, js) = server_with_stream().await;
    let endpoint = Endpoint::start().await;
    endpoint.answer(|request, _| {
        let word = payload(request);
        match (word.as_str(), delivered(request)) {
            ("poison", _) => Reply::status(422),
            ("flaky", 1) => Reply::status(500),
            ("told", 1) => Reply::status(200).header("Ruststream-Settle", "nak; delay=50"),
            ("later", _) => Reply::status(200).header("Ruststream-Settle", "later"),
            _ => Reply::status(204),
        }
    });
    let (gateway, _dir) = with_consumers_file(&server, &entry(PUSHED, &endpoint.url, "")).await;
    for word in ["poison", "flaky", "told", "later"] {
        js.publish("orders.1", word).await;
    }
    // poison once, flaky twice, told twice, later once.
    let received = endpoint.wait_for(6, Duration::from_secs(10)).await;
    wait_until(
        "the later push is the only lease left",
        Duration::from_secs(10),
        || async {
            let view = push_view(&gateway).await;
            view["num_ack_pending"] == 1 && view["num_pending"] == 0
        },
    )
    .await;
    let attempts = |word: &str| -> Vec<u64> {
        endpoint
            .received()
            .iter()
            .filter(|request| payload(request) == word)
            .map(delivered)
            .collect()
    };
    assert_eq!(attempts("poison"), [1], "{received:?}");
    assert_eq!(attempts("flaky"), [1, 2]);
    assert_eq!(attempts("told"), [1, 2]);
    assert_eq!(attempts("later"), [1]);
    // The endpoint settles its `later` lease itself, through the usual route.
    let later = endpoint
        .received()
        .into_iter()
        .find(|request| payload(request) == "later")
        .expect("the later push");
    let lease = later.header("ruststream-lease-id").expect("lease id");
    assert_eq!(gateway.ack(&lease).await, 204);
    wait_all_settled(&gateway).await;
    let scrape = Scrape::of(&gateway).await;
    let result = |result: &str| {
        scrape.of_consumer(
            "ruststream_push_requests_total",
            &format!("result=\"{result}\""),
            STREAM,
            PUSHED,
        )
    };
    assert_eq!(result("term"), 1.0);
    assert_eq!(result("later"), 1.0);
    assert_eq!(result("nak"), 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settle_directive_the_gateway_cannot_read_is_a_nak_never_an_ack() {
    let (server, js) = server_with_stream().await;
    let endpoint = Endpoint::start().await;
    endpoint.answer(|request, _| match delivered(request) {
        1 => Reply::status(200).header("Ruststream-Settle", "retry"),
        _ => Reply::status(204),
    });
    let dir = files_dir();
    let path = dir.path().join("consumers.toml");
    std::fs::write(&path, entry(PUSHED, &endpoint.url, "")).expect("write");
    let gateway = Setup::defaults()
        .flag("--consumers-file", path.display().to_string())
        .process(&server.url())
        .await;
    js.publish("orders.1", "misread").await;
    let received = endpoint.wait_for(2, Duration::from_secs(10)).await;
    assert_eq!(
        received.iter().map(delivered).collect::<Vec<_>>(),
        [1, 2],
        "pushed again after the backoff, not acked"
    );
    assert!(received.iter().all(|request| payload(request) == "misread"));
    wait_all_settled(&gateway).await;
    let log = gateway.log();
    let warned: Vec<&str> = log
        .lines()
        .filter(|line| line.contains("WARN") && line.contains("Ruststream-Settle"))
        .collect();
    assert_eq!(warned.len(), 1, "{log}");
    assert!(
        warned[0].contains("retry"),
        "names the value: {}",
        warned[0]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_is_settled_per_message_by_its_results() {
    let (server, js) = server_with_stream().await;
    let endpoint = Endpoint::start().await;
    endpoint.answer(|request, _| {
        let messages = request.json()["messages"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let results: Vec<Value> = messages
            .iter()
            .map(|message| {
                let word = String::from_utf8(
                    STANDARD
                        .decode(message["data"].as_str().unwrap_or_default())
                        .unwrap_or_default(),
                )
                .unwrap_or_default();
                match (word.as_str(), message["delivered"].as_u64()) {
                    ("bad", _) => serde_json::json!({"settle": "term", "reason": "bad order"}),
                    ("again", Some(1)) => serde_json::json!({"settle": "nak"}),
                    _ => serde_json::json!({"settle": "ack"}),
                }
            })
            .collect();
        Reply::status(200).body(&serde_json::json!({ "results": results }).to_string())
    });
    let file = entry(PUSHED, &endpoint.url, "batch = 3\nbatch_wait = \"1s\"");
    let (gateway, _dir) = with_consumers_file(&server, &file).await;
    for word in ["good", "bad", "again"] {
        js.publish("orders.1", word).await;
    }
    let received = endpoint.wait_for(2, Duration::from_secs(10)).await;
    let first = received[0].json();
    assert_eq!(
        first["messages"].as_array().map(Vec::len),
        Some(3),
        "one request of three: {first}"
    );
    wait_all_settled(&gateway).await;
    let again: Vec<Value> = endpoint.received()[1..]
        .iter()
        .flat_map(|request| {
            request.json()["messages"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .collect();
    assert_eq!(
        again.len(),
        1,
        "only the nak'd message came back: {again:?}"
    );
    assert_eq!(again[0]["delivered"], 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_left_for_later_is_settled_at_another_replica() {
    let (server, js) = server_with_stream().await;
    let endpoint = Endpoint::start().await;
    endpoint.answer(|_, _| Reply::status(202).header("Ruststream-Settle", "later"));
    let key = crate::support::shared_key();
    let dir = files_dir();
    let path = dir.path().join("consumers.toml");
    std::fs::write(&path, entry(PUSHED, &endpoint.url, "")).expect("write");
    let pushing = Setup::defaults()
        .lease_key_file(key.path())
        .flag("--consumers-file", path.display().to_string())
        .ready(&server.url())
        .await;
    // Another replica that does not push this consumer, serving it on demand.
    let other = Setup::defaults()
        .lease_key_file(key.path())
        .flag("--serve-existing", "ORDERS/*")
        .ready(&server.url())
        .await;
    js.publish("orders.1", "long work").await;
    let received = endpoint.wait_for(1, Duration::from_secs(10)).await;
    let lease = received[0].header("ruststream-lease-id").expect("lease id");
    assert_eq!(other.ack(&lease).await, 204, "settled at the other replica");
    wait_all_settled(&pushing).await;
    assert_stays("not pushed again", Duration::from_secs(1), || async {
        endpoint.received().len() == 1
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_longer_than_half_the_lease_keeps_it_alive_past_its_first_end() {
    let (server, js) = server_with_stream().await;
    let endpoint = Endpoint::start().await;
    // ack_wait 3 s: a lease of 2.85 s. The answer comes after 1.8 s, past half of it, and
    // leaves the lease open: only the in-progress sent at half the lease keeps it alive.
    endpoint.answer(|_, _| {
        Reply::status(202)
            .header("Ruststream-Settle", "later")
            .after(Duration::from_millis(1800))
    });
    let entry = format!(
        "[[consumer]]\nstream = \"{STREAM}\"\nname = \"{PUSHED}\"\nack_wait = \"3s\"\n\n[consumer.push]\nurl = \"{}\"\ntimeout = \"2s\"\n",
        endpoint.url
    );
    let (gateway, _dir) = with_consumers_file(&server, &entry).await;
    js.publish("orders.1", "long request").await;
    let received = endpoint.wait_for(1, Duration::from_secs(10)).await;
    let lease = received[0].header("ruststream-lease-id").expect("lease id");
    // Past the lease's first end and the server's ack_wait, both counted from the delivery.
    tokio::time::sleep_until(received[0].at + Duration::from_millis(3300)).await;
    assert_eq!(gateway.ack(&lease).await, 204, "the lease was extended");
    wait_all_settled(&gateway).await;
    assert_eq!(endpoint.received().len(), 1, "never redelivered");
}
