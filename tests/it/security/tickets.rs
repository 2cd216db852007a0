//! Browsers' streams: `POST /stream-tickets` hands out a single-use ticket for one consumer
//! (with the token's `fetch` scope there), accepted as `?ticket=` on the stream routes once,
//! at any replica; and `--cors-allow-origin` answers preflights and marks answers for the
//! origins it names only.

use std::time::Duration;

use serde_json::{Value, json};

use crate::support::client::http_client_with_token;
use crate::support::nats::files_dir;
use crate::support::streams::{EventStream, frame_of, open_socket_at, send};
use crate::support::{
    Client, GatewayProcess, STREAM, Setup, server_with_stream, shared_key, wait_until,
};

/// A ticket for `body`'s consumer (the default one when `None`), as `token` asks for it.
async fn ticket(gateway: &Client, token: &str, body: Option<Value>) -> Value {
    let client = Client::with_http(gateway.base(), http_client_with_token(token));
    let reply = client.post("/stream-tickets", body.as_ref()).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    reply.body
}

/// The status of opening the stream at `path` (no token).
async fn open_status(gateway: &Client, path: &str) -> u16 {
    reqwest::Client::new()
        .get(gateway.url(path))
        .send()
        .await
        .expect("GET")
        .status()
        .as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ticket_opens_one_stream_once_for_its_consumer_and_carries_only_its_rights() {
    let (server, js) = server_with_stream().await;
    let dir = files_dir();
    let tokens = dir.path().join("tokens");
    std::fs::write(
        &tokens,
        "worker fetch,settle\nreader fetch\nother fetch:ORDERS/elsewhere\n",
    )
    .expect("tokens");
    let gateway = Setup::consumer("ticketed")
        .auth_tokens_file(&tokens)
        .ready(&server.url())
        .await;
    js.publish("orders.1", "to the event stream").await;

    // Asking: a token is needed, and the fetch scope on the consumer.
    gateway
        .post("/stream-tickets", None)
        .await
        .assert_problem(401);
    let other = Client::with_http(gateway.base(), http_client_with_token("other"));
    other
        .post("/stream-tickets", None)
        .await
        .assert_problem(403);
    let both = json!({ "stream": "ORDERS" });
    let worker = Client::with_http(gateway.base(), http_client_with_token("worker"));
    worker
        .post("/stream-tickets", Some(&both))
        .await
        .assert_invalid("consumer");

    // Redeemed once, on its consumer's streams only.
    let issued = ticket(&gateway, "worker", None).await;
    assert_eq!(issued["consumer"], "ticketed", "{issued}");
    let ticket_text = issued["ticket"].as_str().expect("ticket");
    assert!(issued["expires_at"].is_string());
    assert_eq!(
        open_status(
            &gateway,
            "/streams/ORDERS/consumers/elsewhere/events?ticket=x"
        )
        .await,
        401
    );
    assert_eq!(
        open_status(&gateway, &format!("/events?ticket={ticket_text}garbled")).await,
        401
    );
    let events_path = format!(
        "{}&max_in_flight=1",
        issued["events"].as_str().expect("events")
    );
    let mut events = EventStream::open_at(&gateway, &events_path).await;
    let leased = events
        .message(Duration::from_secs(5))
        .await
        .expect("a lease over the ticket's stream");
    assert_eq!(
        open_status(&gateway, &format!("/events?ticket={ticket_text}")).await,
        401,
        "a ticket is used once"
    );
    assert_eq!(
        worker.ack(leased["id"].as_str().expect("id")).await,
        204,
        "settled with the token over HTTP"
    );

    // Over a WebSocket, in band: the ticket settles only if its token could.
    drop(events);
    // Published only once the gateway noticed the hang-up (no pull left for the gone
    // stream): a message that came before would be leased to it, and kept by it until its
    // lease ends, as a client that left keeps what was written to it.
    wait_until(
        "the gateway stops pulling for the gone stream",
        Duration::from_secs(5),
        || async { js.consumer_info(STREAM, "ticketed").await.num_waiting == 0 },
    )
    .await;
    js.publish("orders.1", "to the socket").await;
    let issued = ticket(&gateway, "reader", None).await;
    let mut socket = open_socket_at(&gateway, issued["ws"].as_str().expect("ws"), None).await;
    let held = frame_of(&mut socket, "message", Duration::from_secs(5))
        .await
        .expect("a lease");
    send(&mut socket, json!({ "op": "ack", "ids": [held["id"]] })).await;
    let refused = frame_of(&mut socket, "settled", Duration::from_secs(5))
        .await
        .expect("settled");
    assert_eq!(refused["results"][0]["status"], 403, "{refused}");
    let issued = ticket(&gateway, "worker", None).await;
    let mut socket = open_socket_at(&gateway, issued["ws"].as_str().expect("ws"), None).await;
    send(&mut socket, json!({ "op": "ack", "ids": [held["id"]] })).await;
    let settled = frame_of(&mut socket, "settled", Duration::from_secs(5))
        .await
        .expect("settled");
    assert_eq!(settled["results"][0]["status"], 204, "{settled}");
}

/// Every way a token, or a plain SHA-256 of it, could be written down.
fn spellings_of(token: &str) -> Vec<Vec<u8>> {
    use base64::Engine as _;
    use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(token.as_bytes());
    let hex: String = digest.iter().map(|byte| format!("{byte:02x}")).collect();
    let mut spellings = vec![
        token.as_bytes().to_vec(),
        digest.to_vec(),
        hex.clone().into_bytes(),
        hex.to_uppercase().into_bytes(),
    ];
    for engine in [STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD] {
        spellings.push(engine.encode(digest).into_bytes());
    }
    spellings
}

/// `text` and whatever its parts decode to, as base64 of either alphabet (JSON included).
fn decodings_of(text: &str) -> Vec<Vec<u8>> {
    use base64::Engine as _;
    use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
    let mut decoded = vec![text.as_bytes().to_vec()];
    for part in std::iter::once(text).chain(text.split(['.', '~', '-'])) {
        for engine in [STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD] {
            decoded.extend(engine.decode(part).ok());
        }
    }
    decoded
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ticket_reveals_nothing_about_its_token_and_dies_with_it() {
    let (server, _js) = server_with_stream().await;
    let dir = files_dir();
    let tokens = dir.path().join("tokens");
    // A short token: a plain digest of it in a URL would fall to a dictionary at once.
    std::fs::write(&tokens, "pw1 fetch,settle\nkept fetch\n").expect("tokens");
    let mut gateway = Setup::consumer("sealed")
        .auth_tokens_file(&tokens)
        .process(&server.url())
        .await;

    let issued = ticket(&gateway, "pw1", None).await;
    let spellings = spellings_of("pw1");
    for field in ["ticket", "events", "ws"] {
        let text = issued[field].as_str().expect("text");
        for decoded in decodings_of(text) {
            // Claims would be an object or a list. Not any JSON: a random fragment of the
            // sealed bytes can decode to a number ("18" once did, failing a fresh-clone run).
            let claims = match serde_json::from_slice::<Value>(&decoded) {
                Ok(Value::Object(fields)) => !fields.is_empty(),
                Ok(Value::Array(items)) => !items.is_empty(),
                _ => false,
            };
            assert!(
                !claims,
                "{field} decodes to JSON claims: {}",
                String::from_utf8_lossy(&decoded)
            );
            for spelling in &spellings {
                assert!(
                    !decoded
                        .windows(spelling.len())
                        .any(|window| window == spelling.as_slice()),
                    "{field} {text} shows the token as {}",
                    String::from_utf8_lossy(spelling)
                );
            }
        }
    }

    // Still bound to its token: a stream opened with it ends when a reload revokes the
    // token, and a ticket not yet used is refused from then on.
    let mut opened =
        EventStream::open_at(&gateway, issued["events"].as_str().expect("events")).await;
    let unused = ticket(&gateway, "pw1", None).await;
    std::fs::write(&tokens, "kept fetch\n").expect("tokens");
    gateway.sighup();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let last = loop {
        let event = opened
            .next(deadline.saturating_duration_since(tokio::time::Instant::now()))
            .await
            .expect("the revoked token's stream ends");
        if event.event.as_deref() == Some("shutdown") {
            break serde_json::from_str::<Value>(&event.data).expect("JSON");
        }
    };
    assert_eq!(last["reason"], "the token was revoked", "{last}");
    assert_eq!(
        open_status(&gateway, unused["events"].as_str().expect("events")).await,
        401,
        "a ticket of a revoked token"
    );
    let kept = ticket(&gateway, "kept", None).await;
    let _kept = EventStream::open_at(&gateway, kept["events"].as_str().expect("events")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ticket_made_at_one_replica_opens_a_stream_at_another_once_in_the_fleet() {
    let (server, _js) = server_with_stream().await;
    let key = shared_key();
    let setup = Setup::consumer("fleet-tickets")
        .lease_key_file(key.path())
        .flag("--auth-tokens", "worker fetch,settle");
    let first = setup.ready(&server.url()).await;
    let second = setup.ready(&server.url()).await;
    let issued = ticket(&first, "worker", None).await;
    let events = issued["events"].as_str().expect("events");
    let _opened = EventStream::open_at(&second, events).await;
    assert_eq!(open_status(&first, events).await, 401, "used at the other");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cors_answers_the_origins_it_names_and_no_other() {
    let (server, _js) = server_with_stream().await;
    let gateway = Setup::consumer("cors")
        .flag("--cors-allow-origin", "http://localhost:9")
        .flag("--cors-allow-origin", "https://app.example.com")
        .ready(&server.url())
        .await;
    let http = reqwest::Client::new();
    let preflight = |origin: &'static str| {
        http.request(reqwest::Method::OPTIONS, gateway.url("/stream-tickets"))
            .header("origin", origin)
            .header("access-control-request-method", "POST")
            .header(
                "access-control-request-headers",
                "authorization,content-type",
            )
            .send()
    };
    let allowed = preflight("https://app.example.com")
        .await
        .expect("preflight");
    assert!(allowed.status().is_success(), "{allowed:?}");
    let header = |response: &reqwest::Response, name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned)
    };
    assert_eq!(
        header(&allowed, "access-control-allow-origin").as_deref(),
        Some("https://app.example.com")
    );
    let methods = header(&allowed, "access-control-allow-methods").unwrap_or_default();
    assert!(methods.contains("POST"), "{methods}");
    let headers = header(&allowed, "access-control-allow-headers").unwrap_or_default();
    assert!(headers.contains("authorization"), "{headers}");
    let stranger = preflight("https://evil.example.com")
        .await
        .expect("preflight");
    assert_eq!(header(&stranger, "access-control-allow-origin"), None);
    // On answers too, streams included.
    let stream = http
        .get(gateway.url("/events"))
        .header("origin", "http://localhost:9")
        .send()
        .await
        .expect("GET /events");
    assert_eq!(stream.status(), 200);
    assert_eq!(
        header(&stream, "access-control-allow-origin").as_deref(),
        Some("http://localhost:9")
    );
    let plain = http
        .get(gateway.url("/healthz"))
        .header("origin", "https://evil.example.com")
        .send()
        .await
        .expect("GET /healthz");
    assert_eq!(header(&plain, "access-control-allow-origin"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cors_origin_that_is_not_exact_refuses_to_start() {
    let (server, _js) = server_with_stream().await;
    for bad in ["*", "https://app.example.com/", "app.example.com"] {
        let setup = Setup::consumer("cors-bad").flag("--cors-allow-origin", bad);
        let mut gateway = GatewayProcess::spawn(&setup, &server.url());
        let status = gateway.wait_exit(Duration::from_secs(10)).await;
        assert_eq!(status.code(), Some(2), "{bad}: {}", gateway.log());
        assert!(gateway.log().contains("origin"), "{bad}: {}", gateway.log());
    }
}
