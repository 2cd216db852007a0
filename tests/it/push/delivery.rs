//! What is sent: the json format signed the Standard Webhooks way, binary and CloudEvents
//! bodies with their headers, credentials and hop-by-hop headers no message chooses, and an
//! HTTPS endpoint verified against its CA file.

use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use hmac::{KeyInit as _, Mac as _};

use crate::support::endpoint::Endpoint;
use crate::support::nats::files_dir;
use crate::support::pki::make_pki;
use crate::support::{
    STREAM, Scrape, assert_stays, server_with_stream, wait_until, with_consumers_file,
};

use super::fixtures::{PUSHED, delivered, entry, payload, push_view, wait_all_settled};

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
