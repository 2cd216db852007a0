//! Push delivery against real endpoints the tests start: what is sent (each format, the
//! Standard Webhooks signature), what each class of answer does to the message, the pacing
//! (a `Retry-After` holding every request, the window shrinking and growing back), batches,
//! a push table changed live, and SIGTERM mid-push.

use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use hmac::{KeyInit as _, Mac as _};
use serde_json::Value;
use tokio::time::Instant;

use crate::support::endpoint::{Endpoint, Received, Reply};
use crate::support::nats::files_dir;
use crate::support::pki::make_pki;
use crate::support::{
    Client, STREAM, Scrape, Setup, assert_stays, server_with_stream, wait_until,
    with_consumers_file,
};

/// The push consumer every test declares.
const PUSHED: &str = "hooks";

/// A consumers-file entry for the push consumer `name`, delivering to `url`, with `extra`
/// lines of its push table.
fn entry(name: &str, url: &str, extra: &str) -> String {
    format!(
        "[[consumer]]\nstream = \"{STREAM}\"\nname = \"{name}\"\nack_wait = \"20s\"\n\n[consumer.push]\nurl = \"{url}\"\nretry_initial = \"100ms\"\nretry_max = \"200ms\"\n{extra}\n"
    )
}

/// The payload of a json-format push.
fn payload(received: &Received) -> String {
    let data = received.json()["data"].as_str().expect("data").to_owned();
    String::from_utf8(STANDARD.decode(data).expect("base64 data")).expect("UTF-8 payload")
}

fn delivered(received: &Received) -> u64 {
    received
        .header("ruststream-delivered")
        .expect("Ruststream-Delivered")
        .parse()
        .expect("a number")
}

async fn push_view(gateway: &Client) -> Value {
    let reply = gateway
        .get(&format!("/streams/{STREAM}/consumers/{PUSHED}"))
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    reply.body
}

/// Wait until the server has every message of the push consumer acked or terminated.
async fn wait_all_settled(gateway: &Client) {
    wait_until(
        "every pushed message settled",
        Duration::from_secs(15),
        || async {
            let view = push_view(gateway).await;
            view["num_ack_pending"] == 0 && view["num_pending"] == 0
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_are_posted_as_fetch_returns_them_signed_and_acked_on_2xx() {
    let (server, js) = server_with_stream().await;
    let endpoint = Endpoint::start().await;
    let dir = files_dir();
    let secret = b"0123456789abcdef0123456789abcdef";
    let other = b"fedcba9876543210fedcba9876543210";
    let secrets = dir.path().join("secrets");
    std::fs::write(
        &secrets,
        format!(
            "whsec_{}\nwhsec_{}\n",
            STANDARD.encode(secret),
            STANDARD.encode(other)
        ),
    )
    .expect("write the secrets");
    let file = entry(
        PUSHED,
        &endpoint.url,
        &format!(
            "signing_secret_file = \"{}\"\nheaders = {{ Authorization = \"Bearer endpoint-token\" }}",
            secrets.display()
        ),
    );
    let (gateway, _dir) = with_consumers_file(&server, &file).await;
    let mut sequences = Vec::new();
    for word in ["one", "two", "three"] {
        sequences.push(js.publish("orders.1", word).await);
    }
    let received = endpoint.wait_for(3, Duration::from_secs(10)).await;
    let mut words: Vec<String> = received.iter().map(payload).collect();
    words.sort();
    assert_eq!(words, ["one", "three", "two"]);
    for request in &received {
        let body = request.json();
        let id = request.header("webhook-id").expect("webhook-id");
        assert_eq!(id, format!("{STREAM}:{}", body["stream_sequence"]));
        assert!(sequences.contains(&body["stream_sequence"].as_u64().expect("sequence")));
        assert_eq!(
            request.header("ruststream-lease-id").as_deref(),
            body["id"].as_str()
        );
        assert_eq!(body["consumer"], PUSHED);
        assert_eq!(delivered(request), 1);
        assert_eq!(
            request.header("content-type").as_deref(),
            Some("application/json")
        );
        assert_eq!(
            request.header("authorization").as_deref(),
            Some("Bearer endpoint-token")
        );
        // One Standard Webhooks signature per secret, over "{id}.{timestamp}.{body}".
        let timestamp = request.header("webhook-timestamp").expect("timestamp");
        let signatures = request.header("webhook-signature").expect("signature");
        let expected: Vec<String> = [&secret[..], &other[..]]
            .iter()
            .map(|key| {
                let mut mac = <hmac::Hmac<sha2::Sha256>>::new_from_slice(key).expect("key");
                mac.update(format!("{id}.{timestamp}.").as_bytes());
                mac.update(&request.body);
                format!("v1,{}", STANDARD.encode(mac.finalize().into_bytes()))
            })
            .collect();
        assert_eq!(signatures, expected.join(" "));
    }
    wait_all_settled(&gateway).await;
    assert_stays(
        "no message pushed again",
        Duration::from_secs(1),
        || async { endpoint.received().len() == 3 },
    )
    .await;
    let scrape = Scrape::of(&gateway).await;
    assert_eq!(
        scrape.of_consumer(
            "ruststream_push_requests_total",
            "result=\"ack\"",
            STREAM,
            PUSHED
        ),
        3.0
    );
    let view = push_view(&gateway).await;
    assert_eq!(view["push"]["url"], endpoint.url);
    assert_eq!(view["push"]["state"], "running");
}

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
async fn a_retry_after_holds_back_every_request_to_the_endpoint() {
    let (server, js) = server_with_stream().await;
    let endpoint = Endpoint::start().await;
    endpoint.answer(|request, index| {
        if index == 0 {
            Reply::status(429).header("Retry-After", "2")
        } else {
            let _ = request;
            Reply::status(204)
        }
    });
    let (gateway, _dir) = with_consumers_file(&server, &entry(PUSHED, &endpoint.url, "")).await;
    js.publish("orders.1", "first").await;
    let refused = endpoint.wait_for(1, Duration::from_secs(10)).await[0].at;
    // Another message, published right after the refusal, waits out the Retry-After too.
    js.publish("orders.1", "second").await;
    wait_until(
        "the consumer says it backs off",
        Duration::from_secs(1),
        || async { push_view(&gateway).await["push"]["state"] == "backing_off" },
    )
    .await;
    assert_eq!(
        push_view(&gateway).await["push"]["last_failure"]["status"],
        429
    );
    let received = endpoint.wait_for(3, Duration::from_secs(10)).await;
    for request in &received[1..] {
        assert!(
            request.at.duration_since(refused) >= Duration::from_millis(1900),
            "a request {:?} after a Retry-After: 2",
            request.at.duration_since(refused)
        );
    }
    wait_all_settled(&gateway).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_window_halves_on_refusals_and_grows_back_on_successes() {
    let (server, js) = server_with_stream().await;
    let endpoint = Endpoint::start().await;
    endpoint.answer(|_, index| {
        if index < 8 {
            Reply::status(429).after(Duration::from_millis(20))
        } else {
            Reply::status(204).after(Duration::from_millis(20))
        }
    });
    let (gateway, _dir) = with_consumers_file(&server, &entry(PUSHED, &endpoint.url, "")).await;
    js.publish_many("orders.1", 40, "m").await;
    let mut smallest = u64::MAX;
    let started = Instant::now();
    loop {
        let view = push_view(&gateway).await;
        if let Some(window) = view["push"]["window"].as_u64() {
            smallest = smallest.min(window);
        }
        if view["num_ack_pending"] == 0 && view["num_pending"] == 0 {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(20), "{view}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(smallest, 1, "the window came down to one");
    let grown = push_view(&gateway).await["push"]["window"]
        .as_u64()
        .expect("window");
    assert!(grown >= 3, "the window grew back: {grown}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_and_cloudevents_bodies_are_the_exact_bytes_with_metadata_in_headers() {
    let (server, js) = server_with_stream().await;
    let binary = Endpoint::start().await;
    let events = Endpoint::start().await;
    let file = format!(
        "{}{}",
        entry("raw", &binary.url, "format = \"binary\""),
        entry("events", &events.url, "format = \"cloudevents\"")
    );
    let (_gateway, _dir) = with_consumers_file(&server, &file).await;
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Content-Type", "text/plain");
    headers.insert("X-Order", "42");
    let sequence = js
        .publish_with_headers("orders.new", headers, "exact bytes")
        .await;
    let mut own = async_nats::HeaderMap::new();
    own.insert("ce-specversion", "1.0");
    own.insert("ce-id", "mine");
    own.insert("ce-source", "/elsewhere");
    own.insert("ce-type", "com.example.own");
    js.publish_with_headers("orders.new", own, "its own event")
        .await;

    let raw = binary.wait_for(2, Duration::from_secs(10)).await;
    let first = raw
        .iter()
        .find(|request| request.body == b"exact bytes")
        .expect("the first message");
    assert_eq!(first.header("content-type").as_deref(), Some("text/plain"));
    assert_eq!(first.header("x-order").as_deref(), Some("42"));
    assert_eq!(
        first.header("ruststream-subject").as_deref(),
        Some("orders.new")
    );
    assert_eq!(first.header("ruststream-stream").as_deref(), Some(STREAM));
    assert_eq!(
        first.header("ruststream-stream-sequence"),
        Some(sequence.to_string())
    );
    assert!(first.header("ruststream-published-at").is_some());
    let other = raw
        .iter()
        .find(|request| request.body == b"its own event")
        .expect("the second message");
    assert_eq!(
        other.header("content-type").as_deref(),
        Some("application/octet-stream")
    );

    let received = events.wait_for(2, Duration::from_secs(10)).await;
    let event = received
        .iter()
        .find(|request| request.body == b"exact bytes")
        .expect("the first event");
    assert_eq!(event.header("ce-specversion").as_deref(), Some("1.0"));
    assert_eq!(event.header("ce-id"), Some(format!("{STREAM}:{sequence}")));
    assert_eq!(
        event.header("ce-source"),
        Some(format!("/streams/{STREAM}"))
    );
    assert_eq!(event.header("ce-type").as_deref(), Some("orders.new"));
    assert!(event.header("ce-time").is_some());
    assert_eq!(event.header("content-type").as_deref(), Some("text/plain"));
    let passed = received
        .iter()
        .find(|request| request.body == b"its own event")
        .expect("the second event");
    assert_eq!(passed.header("ce-id").as_deref(), Some("mine"));
    assert_eq!(passed.header("ce-source").as_deref(), Some("/elsewhere"));
    assert_eq!(passed.header("ce-type").as_deref(), Some("com.example.own"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_never_chooses_the_credentials_or_hop_by_hop_headers_of_its_push() {
    let (server, js) = server_with_stream().await;
    let binary = Endpoint::start().await;
    let events = Endpoint::start().await;
    let with_user = |url: &str| url.replacen("http://", "http://pusher:s%40cret@", 1);
    let file = format!(
        "{}{}",
        entry("raw", &with_user(&binary.url), "format = \"binary\""),
        entry(
            "events",
            &with_user(&events.url),
            "format = \"cloudevents\""
        )
    );
    let (_gateway, _dir) = with_consumers_file(&server, &file).await;
    let mut hostile = async_nats::HeaderMap::new();
    for (name, value) in [
        ("Authorization", "Bearer chosen-by-the-publisher"),
        ("Proxy-Authorization", "Basic cHJveHk6cHJveHk="),
        ("Cookie", "session=stolen"),
        ("Expect", "100-continue"),
        ("Upgrade", "websocket"),
        ("TE", "trailers"),
        ("Keep-Alive", "timeout=600"),
        ("Proxy-Connection", "keep-alive"),
        ("Trailer", "X-Checksum"),
        ("Connection", "X-Hop"),
        ("X-Hop", "named by Connection"),
        ("X-Order", "42"),
    ] {
        hostile.insert(name, value);
    }
    js.publish_with_headers("orders.new", hostile, "hostile")
        .await;
    // A message carrying only part of an event gets the rest from the gateway.
    let mut partial = async_nats::HeaderMap::new();
    partial.insert("ce-specversion", "1.0");
    partial.insert("ce-type", "com.example.partial");
    let partial_sequence = js
        .publish_with_headers("orders.new", partial, "partial event")
        .await;

    let basic = format!("Basic {}", STANDARD.encode("pusher:s@cret"));
    for endpoint in [&binary, &events] {
        let received = endpoint.wait_for(2, Duration::from_secs(10)).await;
        let request = received
            .iter()
            .find(|request| request.body == b"hostile")
            .expect("the hostile message");
        assert_eq!(
            request.header("authorization").as_deref(),
            Some(basic.as_str()),
            "the URL's credentials, not the message's"
        );
        for name in [
            "proxy-authorization",
            "cookie",
            "expect",
            "upgrade",
            "te",
            "keep-alive",
            "proxy-connection",
            "trailer",
            "x-hop",
        ] {
            assert_eq!(request.header(name), None, "{name} passed: {request:?}");
        }
        assert_eq!(request.header("x-order").as_deref(), Some("42"));
    }
    let received = events.received();
    let event = received
        .iter()
        .find(|request| request.body == b"partial event")
        .expect("the partial event");
    assert_eq!(event.header("ce-specversion").as_deref(), Some("1.0"));
    assert_eq!(
        event.header("ce-type").as_deref(),
        Some("com.example.partial")
    );
    assert_eq!(
        event.header("ce-id"),
        Some(format!("{STREAM}:{partial_sequence}"))
    );
    assert_eq!(
        event.header("ce-source"),
        Some(format!("/streams/{STREAM}"))
    );
    assert!(event.header("ce-time").is_some());
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
async fn a_message_caught_while_a_retry_after_holds_is_kept_leased_and_pushed_as_its_first_delivery()
 {
    let (server, js) = server_with_stream().await;
    let endpoint = Endpoint::start().await;
    // The first request is answered late enough for the worker to be waiting patiently for
    // the next message (after a second with nothing), and refused with a hold longer than
    // ack_wait: what that wait catches must be kept leased until the hold ends.
    endpoint.answer(|_, index| {
        if index == 0 {
            Reply::status(503)
                .header("Retry-After", "6")
                .after(Duration::from_millis(2500))
        } else {
            Reply::status(204)
        }
    });
    let file = format!(
        "[[consumer]]\nstream = \"{STREAM}\"\nname = \"{PUSHED}\"\nack_wait = \"4s\"\n\n[consumer.push]\nurl = \"{}\"\ntimeout = \"3s\"\nretry_initial = \"100ms\"\nretry_max = \"200ms\"\n",
        endpoint.url
    );
    let (gateway, _dir) = with_consumers_file(&server, &file).await;
    js.publish("orders.1", "refused").await;
    endpoint.wait_for(1, Duration::from_secs(10)).await;
    wait_until(
        "the endpoint's Retry-After holds the pushes",
        Duration::from_secs(10),
        || async { push_view(&gateway).await["push"]["state"] == "backing_off" },
    )
    .await;
    let held_from = Instant::now();
    js.publish("orders.1", "caught").await;
    let received = endpoint.wait_for(3, Duration::from_secs(20)).await;
    let caught: Vec<&Received> = received
        .iter()
        .filter(|request| payload(request) == "caught")
        .collect();
    assert_eq!(caught.len(), 1, "pushed once: {received:?}");
    assert_eq!(
        delivered(caught[0]),
        1,
        "its first delivery reached the endpoint"
    );
    assert!(
        caught[0].at.duration_since(held_from) >= Duration::from_secs(3),
        "sent after the hold"
    );
    wait_all_settled(&gateway).await;
    assert_stays("nothing pushed again", Duration::from_secs(1), || async {
        endpoint.received().len() == 3
    })
    .await;
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
async fn a_changed_push_table_is_applied_live_and_a_broken_one_refused() {
    let (server, js) = server_with_stream().await;
    let before = Endpoint::start().await;
    let after = Endpoint::start().await;
    let dir = files_dir();
    let path = dir.path().join("consumers.toml");
    std::fs::write(&path, entry(PUSHED, &before.url, "")).expect("write");
    let gateway = Setup::defaults()
        .flag("--consumers-file", path.display().to_string())
        .process(&server.url())
        .await;
    js.publish("orders.1", "to the first").await;
    before.wait_for(1, Duration::from_secs(10)).await;
    // Not below the lease: refused with an ERROR naming file, consumer and key; the table in
    // force stays.
    std::fs::write(&path, entry(PUSHED, &after.url, "timeout = \"30s\"")).expect("write");
    wait_until("the reload is refused", Duration::from_secs(5), || async {
        gateway.log().lines().any(|line| {
            line.contains("ERROR")
                && line.contains("consumers.toml")
                && line.contains(&format!("consumer {STREAM}/{PUSHED}"))
                && line.contains("push.timeout")
        })
    })
    .await;
    js.publish("orders.1", "still to the first").await;
    before.wait_for(2, Duration::from_secs(10)).await;
    std::fs::write(&path, entry(PUSHED, &after.url, "")).expect("write");
    wait_until(
        "the new endpoint is in force",
        Duration::from_secs(5),
        || async { push_view(&gateway).await["push"]["url"] == after.url },
    )
    .await;
    js.publish("orders.1", "to the second").await;
    let received = after.wait_for(1, Duration::from_secs(10)).await;
    assert_eq!(payload(&received[0]), "to the second");
    assert_eq!(before.received().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_sigterm_a_push_in_flight_gets_the_grace_then_its_message_goes_back() {
    let (server, js) = server_with_stream().await;
    let hanging = Endpoint::start().await;
    hanging.answer(|_, _| Reply::status(204).after(Duration::from_secs(8)));
    let dir = files_dir();
    let path = dir.path().join("consumers.toml");
    std::fs::write(&path, entry(PUSHED, &hanging.url, "timeout = \"9s\"")).expect("write");
    let setup = Setup::defaults()
        .flag("--consumers-file", path.display().to_string())
        .shutdown_grace("1s");
    let mut gateway = setup.ready(&server.url()).await;
    js.publish("orders.1", "stuck").await;
    hanging.wait_for(1, Duration::from_secs(10)).await;
    let stopping = Instant::now();
    gateway.shutdown().await.expect("a clean stop");
    assert!(
        stopping.elapsed() < Duration::from_secs(5),
        "stopped after {:?}",
        stopping.elapsed()
    );
    // Nak'd at the end of the grace: pushed again at once, not after ack_wait (20 s).
    let answering = Endpoint::start().await;
    std::fs::write(&path, entry(PUSHED, &answering.url, "")).expect("write");
    let _gateway = setup.ready(&server.url()).await;
    let received = answering.wait_for(1, Duration::from_secs(5)).await;
    assert_eq!(payload(&received[0]), "stuck");
    assert_eq!(delivered(&received[0]), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_push_consumer_stays_paused_across_a_restart_until_resumed() {
    let (server, js) = server_with_stream().await;
    let endpoint = Endpoint::start().await;
    let dir = files_dir();
    let path = dir.path().join("consumers.toml");
    std::fs::write(&path, entry(PUSHED, &endpoint.url, "")).expect("write");
    let setup = Setup::defaults().flag("--consumers-file", path.display().to_string());
    let mut gateway = setup.ready(&server.url()).await;
    let named = format!("/streams/{STREAM}/consumers/{PUSHED}");

    // Bad input changes nothing.
    let past = gateway
        .post(
            &format!("{named}/push/pause"),
            Some(&serde_json::json!({"until": "2001-01-01T00:00:00Z"})),
        )
        .await;
    past.assert_invalid("until");
    gateway
        .post(
            &format!("/streams/{STREAM}/consumers/billing/push/pause"),
            None,
        )
        .await
        .assert_problem(404);

    let paused = gateway.post(&format!("{named}/push/pause"), None).await;
    assert_eq!(paused.status, 200, "{}", paused.text);
    assert_eq!(paused.body["paused"], true);
    js.publish("orders.1", "held").await;
    let fetch = gateway
        .post(
            &format!("{named}/fetch"),
            Some(&serde_json::json!({"wait_ms": 0})),
        )
        .await;
    assert_eq!(
        fetch.assert_problem(409)["type"],
        "urn:ruststream-nats:problem:consumer-paused"
    );
    wait_until(
        "the push says it is paused",
        Duration::from_secs(3),
        || async { push_view(&gateway).await["push"]["state"] == "paused" },
    )
    .await;

    // The pause is the server's: a restarted gateway finds it.
    gateway.shutdown().await.expect("a clean stop");
    let gateway = setup.ready(&server.url()).await;
    assert_stays(
        "nothing pushed while paused",
        Duration::from_secs(2),
        || async { endpoint.received().is_empty() },
    )
    .await;
    let resumed = gateway.post(&format!("{named}/push/resume"), None).await;
    assert_eq!(resumed.status, 200, "{}", resumed.text);
    assert_eq!(resumed.body["paused"], false);
    let received = endpoint.wait_for(1, Duration::from_secs(10)).await;
    assert_eq!(payload(&received[0]), "held");
}

/// An idle push worker's pull waits at the server for up to a minute, and nats-server never
/// serves a pull that was open while the consumer was paused, not even after the resume:
/// paused behind the worker's back (at the server, as `nats consumer pause` does) and resumed
/// through the gateway, the consumer pushes what waited at once, not a minute later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_consumer_paused_under_its_open_pull_pushes_at_once_when_resumed() {
    let (server, js) = server_with_stream().await;
    let endpoint = Endpoint::start().await;
    let dir = files_dir();
    let path = dir.path().join("consumers.toml");
    std::fs::write(&path, entry(PUSHED, &endpoint.url, "")).expect("write");
    let gateway = Setup::defaults()
        .flag("--consumers-file", path.display().to_string())
        .ready(&server.url())
        .await;
    wait_until(
        "the idle push worker's pull waits at the server",
        Duration::from_secs(10),
        || async { js.consumer_info(STREAM, PUSHED).await.num_waiting >= 1 },
    )
    .await;
    let paused: serde_json::Value = js
        .js
        .request(
            format!("CONSUMER.PAUSE.{STREAM}.{PUSHED}"),
            &serde_json::json!({"pause_until": "9999-12-31T00:00:00Z"}),
        )
        .await
        .expect("pause at the server");
    assert_eq!(paused["paused"], true, "{paused}");
    js.publish("orders.1", "held").await;
    assert_stays(
        "nothing pushed while paused",
        Duration::from_secs(1),
        || async { endpoint.received().is_empty() },
    )
    .await;
    let resumed = gateway
        .post(
            &format!("/streams/{STREAM}/consumers/{PUSHED}/push/resume"),
            None,
        )
        .await;
    assert_eq!(resumed.status, 200, "{}", resumed.text);
    let received = endpoint.wait_for(1, Duration::from_secs(10)).await;
    assert_eq!(payload(&received[0]), "held");
}

/// One request as the faulty endpoint of the push ledger answered it.
#[derive(Debug, Clone)]
struct Attempt {
    word: String,
    /// Which gateway process sent it (the test runs one at a time).
    generation: usize,
    taken: bool,
}

/// How the faulty endpoint answers one attempt: the same for the same message and delivery.
fn roll(word: &str, delivered: u64) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in word.bytes().chain(delivered.to_le_bytes()) {
        hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
    }
    hash % 100
}

/// The push worker under faults, at nats-server's default sync: an endpoint that answers
/// 204, 500, 429 or too late at random and is stopped and started again, the gateway killed
/// -9 and restarted, nats-server killed -9 and restarted. Every message ends taken (2xx) or
/// dead-lettered, and no process pushes a message again once the endpoint took it from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ledger_push_under_faults_loses_nothing_and_never_pushes_a_taken_message_again() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    let (mut server, js) = server_with_stream().await;
    js.create_stream("DLQ", &["DLQ.>"]).await;
    let mut endpoint = Endpoint::start().await;
    let generation = Arc::new(AtomicUsize::new(0));
    let attempts: Arc<Mutex<Vec<Attempt>>> = Arc::default();
    {
        let (generation, attempts) = (generation.clone(), attempts.clone());
        endpoint.answer(move |request, _| {
            let word = payload(request);
            let roll = roll(&word, delivered(request));
            let taken = roll < 60;
            attempts.lock().expect("attempts").push(Attempt {
                word,
                generation: generation.load(Ordering::SeqCst),
                taken,
            });
            match roll {
                0..60 => Reply::status(204),
                60..75 => Reply::status(500),
                75..85 => Reply::status(429),
                // Past the push timeout: the gateway never sees this answer.
                _ => Reply::status(500).after(Duration::from_millis(400)),
            }
        });
    }
    let dir = files_dir();
    let path = dir.path().join("consumers.toml");
    std::fs::write(
        &path,
        format!(
            "[[consumer]]\nstream = \"{STREAM}\"\nname = \"{PUSHED}\"\nack_wait = \"5s\"\nmax_deliver = 20\ndead_letter_subject = \"DLQ.hooks\"\n\n[consumer.push]\nurl = \"{}\"\ntimeout = \"250ms\"\nretry_initial = \"50ms\"\nretry_max = \"500ms\"\n",
            endpoint.url
        ),
    )
    .expect("write");
    let setup = Setup::defaults().flag("--consumers-file", path.display().to_string());
    let mut gateway = setup.process(&server.url()).await;
    let mut published = Vec::new();
    let mut publish = |count: usize| {
        let start = published.len();
        published.extend((start..start + count).map(|n| format!("m{n}")));
        published[start..].to_vec()
    };
    let taken_count = |attempts: &Arc<Mutex<Vec<Attempt>>>| {
        let attempts = attempts.lock().expect("attempts");
        attempts
            .iter()
            .filter(|attempt| attempt.taken)
            .map(|attempt| attempt.word.clone())
            .collect::<std::collections::HashSet<_>>()
            .len()
    };
    let wait_taken = |count: usize| {
        let attempts = attempts.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(30);
            while taken_count(&attempts) < count {
                if Instant::now() > deadline {
                    return false;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            true
        }
    };

    for word in publish(60) {
        js.publish("orders.1", word).await;
    }
    assert!(wait_taken(20).await, "{}", gateway.log());
    endpoint.stop();
    tokio::time::sleep(Duration::from_millis(800)).await;
    endpoint.restart().await;
    assert!(wait_taken(40).await, "{}", gateway.log());
    gateway.kill9();
    generation.fetch_add(1, Ordering::SeqCst);
    gateway.restart().await;
    for word in publish(60) {
        js.publish("orders.1", word).await;
    }
    assert!(wait_taken(80).await, "{}", gateway.log());
    server.kill();
    server.restart().await;
    let js = crate::support::Js::connect(&server.url()).await;
    for word in publish(30) {
        js.publish("orders.1", word).await;
    }

    // Each message ends taken or dead-lettered.
    let dead = |js: crate::support::Js| async move {
        let Ok(mut dlq) = js.js.get_stream("DLQ").await else {
            return Vec::new();
        };
        let count = dlq.info().await.map_or(0, |info| info.state.messages);
        let mut words = Vec::new();
        for sequence in 1..=count {
            if let Ok(letter) = dlq.get_raw_message(sequence).await {
                words.push(String::from_utf8_lossy(&letter.payload).into_owned());
            }
        }
        words
    };
    let mut unsettled = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        let taken: std::collections::HashSet<String> = attempts
            .lock()
            .expect("attempts")
            .iter()
            .filter(|attempt| attempt.taken)
            .map(|attempt| attempt.word.clone())
            .collect();
        let dead_lettered: std::collections::HashSet<String> =
            dead(crate::support::Js::connect(&server.url()).await)
                .await
                .into_iter()
                .collect();
        unsettled = published
            .iter()
            .filter(|word| !taken.contains(*word) && !dead_lettered.contains(*word))
            .cloned()
            .collect();
        if unsettled.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        unsettled.is_empty(),
        "lost: {unsettled:?}\n{}",
        gateway.log()
    );

    // No process pushed a message again after the endpoint took it from that process.
    let attempts = attempts.lock().expect("attempts").clone();
    let mut taken_by: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    let mut again = Vec::new();
    for attempt in &attempts {
        if taken_by.get(attempt.word.as_str()) == Some(&attempt.generation) {
            again.push(attempt.word.clone());
        }
        if attempt.taken {
            taken_by.insert(&attempt.word, attempt.generation);
        }
    }
    assert!(
        again.is_empty(),
        "pushed again by the process that got its 2xx: {again:?}"
    );
    let _ = gateway;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_endpoint_holds_back_neither_another_push_consumer_nor_a_fetch() {
    let (server, js) = server_with_stream().await;
    let hanging = Endpoint::start().await;
    hanging.answer(|_, _| Reply::status(204).after(Duration::from_secs(15)));
    let answering = Endpoint::start().await;
    let file = format!(
        "{}{}",
        entry("stuck", &hanging.url, "timeout = \"10s\""),
        entry("quick", &answering.url, "")
    );
    let (gateway, _dir) = with_consumers_file(&server, &file).await;
    js.publish("orders.1", "for everyone").await;
    hanging.wait_for(1, Duration::from_secs(10)).await;
    // While the first endpoint holds its request, the other consumer's push and a fetch of
    // the default consumer go on.
    let received = answering.wait_for(1, Duration::from_secs(5)).await;
    assert_eq!(payload(&received[0]), "for everyone");
    let fetched = gateway.fetch_n(1, 0).await;
    assert_eq!(fetched.len(), 1, "the default consumer's fetch");
    assert_eq!(
        hanging.received().len(),
        1,
        "the hanging push is still in flight"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_endpoint_is_verified_against_its_ca_file_and_given_the_client_certificate() {
    let (server, js) = server_with_stream().await;
    let pki = make_pki();
    let endpoint = Endpoint::start_tls(&pki).await;
    let trusted = format!(
        "ca_file = \"{}\"\nclient_cert_file = \"{}\"\nclient_key_file = \"{}\"",
        pki.ca, pki.client_cert, pki.client_key
    );
    // The same endpoint without the CA: its certificate is not trusted.
    let file = format!(
        "{}{}",
        entry(PUSHED, &endpoint.url, &trusted),
        entry("untrusting", &endpoint.url, "")
    );
    let (gateway, _dir) = with_consumers_file(&server, &file).await;
    js.publish("orders.1", "over TLS").await;
    let received = endpoint.wait_for(1, Duration::from_secs(10)).await;
    assert_eq!(payload(&received[0]), "over TLS");
    wait_all_settled(&gateway).await;
    wait_until(
        "the untrusting consumer's push failed on the certificate",
        Duration::from_secs(10),
        || async {
            let view = gateway
                .get(&format!("/streams/{STREAM}/consumers/untrusting"))
                .await;
            view.body["push"]["last_failure"]["error"]
                .as_str()
                .is_some_and(|error| {
                    error.starts_with("cannot connect: TLS") && error.contains("certificate")
                })
        },
    )
    .await;
    assert_eq!(
        endpoint.received().len(),
        1,
        "only the trusting consumer's push arrived"
    );
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
async fn the_rate_limit_and_a_retry_after_date_pace_the_requests() {
    let (server, js) = server_with_stream().await;
    let endpoint = Endpoint::start().await;
    endpoint.answer(|request, index| {
        if index == 0 {
            // An HTTP date two seconds ahead (whole seconds: at least one second away).
            let at = std::time::SystemTime::now() + Duration::from_secs(2);
            Reply::status(503).header("Retry-After", &httpdate::fmt_http_date(at))
        } else {
            let _ = request;
            Reply::status(204)
        }
    });
    let (gateway, _dir) =
        with_consumers_file(&server, &entry(PUSHED, &endpoint.url, "rate_limit = 20")).await;
    js.publish("orders.1", "refused first").await;
    let refused = endpoint.wait_for(1, Duration::from_secs(10)).await[0].at;
    js.publish_many("orders.1", 30, "paced").await;
    let received = endpoint.wait_for(32, Duration::from_secs(15)).await;
    assert!(
        received[1].at.duration_since(refused) >= Duration::from_millis(900),
        "the next request came {:?} after a Retry-After date",
        received[1].at.duration_since(refused)
    );
    // At most 20 a second (and a burst of two): no second holds more than 22 requests.
    for (at, request) in received.iter().enumerate().skip(1) {
        let within = received[at..]
            .iter()
            .take_while(|later| later.at.duration_since(request.at) < Duration::from_secs(1))
            .count();
        assert!(
            within <= 22,
            "{within} requests within a second of request {at}"
        );
    }
    wait_all_settled(&gateway).await;
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

/// The consumer's leader, and how many pulls wait at it.
async fn leader_and_waiting(js: &async_nats::jetstream::Context) -> Option<(String, usize)> {
    let stream = js.get_stream(STREAM).await.ok()?;
    let info = stream.consumer_info(PUSHED).await.ok()?;
    let leader = info.cluster.as_ref()?.leader.clone()?;
    Some((leader, info.num_waiting))
}

/// An idle push consumer's pull waits at its consumer leader for up to a minute. When that
/// leader is killed outright (no status ends the pull), the leader elected next is asked
/// again at once: a message published then is pushed in seconds, not after that minute.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_push_consumer_pulls_again_from_a_new_consumer_leader() {
    use crate::support::cluster::Cluster;
    let mut cluster = Cluster::start(3, false).await;
    // Everyone talks to n1; the consumer's leader is made another node, then killed.
    let n1 = cluster.nodes[0].1.url();
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(n1.as_str())
        .await
        .expect("connect");
    let js = async_nats::jetstream::new(client);
    let deadline = Instant::now() + Duration::from_secs(30);
    while js
        .create_stream(async_nats::jetstream::stream::Config {
            name: STREAM.to_owned(),
            subjects: vec!["orders.>".to_owned()],
            num_replicas: 3,
            ..Default::default()
        })
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "the R3 stream was not made");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let endpoint = Endpoint::start().await;
    let dir = files_dir();
    let path = dir.path().join("consumers.toml");
    std::fs::write(&path, entry(PUSHED, &endpoint.url, "")).expect("write");
    let _gateway = Setup::defaults()
        .flag("--consumers-file", path.display().to_string())
        .ready(&n1)
        .await;
    // Moved off n1 if it is there; then one pull waits at it.
    let deadline = Instant::now() + Duration::from_secs(20);
    let leader = loop {
        match leader_and_waiting(&js).await {
            Some((at, _)) if at == "n1" => {
                // The JetStream context puts `$JS.API.` before the subject itself.
                let api = format!("CONSUMER.LEADER.STEPDOWN.{STREAM}.{PUSHED}");
                let _ = tokio::time::timeout(
                    Duration::from_secs(2),
                    js.request::<_, Value, Value>(api, &serde_json::json!({})),
                )
                .await;
            }
            Some((at, waiting)) if waiting > 0 => break at,
            _ => {}
        }
        assert!(
            Instant::now() < deadline,
            "no pull of the idle push consumer waits at a leader other than n1"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    cluster.node(&leader).kill();
    wait_until(
        "another consumer leader",
        Duration::from_secs(20),
        || async {
            leader_and_waiting(&js)
                .await
                .is_some_and(|(at, _)| at != leader)
        },
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let published = match js.publish("orders.1", "after the kill".into()).await {
            Ok(ack) => ack.await.is_ok(),
            Err(_) => false,
        };
        match published {
            true => break,
            false => {
                assert!(
                    Instant::now() < deadline,
                    "could not publish after the kill"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    let received = endpoint.wait_for(1, Duration::from_secs(15)).await;
    assert_eq!(payload(&received[0]), "after the kill");
    cluster.node(&leader).restart().await;
}
