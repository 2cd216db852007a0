//! Logs and request ids: `x-request-id` is accepted and returned (or made up); at debug the
//! binary's `--log-format json` output has one span per request (route template, status,
//! latency) and settle events with the lease id and sequences; at the default level a
//! successful request writes no line; and no level logs a secret.

use std::time::Duration;

use serde_json::Value;

use crate::support::nats::free_port;
use crate::support::{GatewayProcess, Setup, wait_until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_ids_are_returned_as_given_or_made_up() {
    let (_server, _js, gateway) = Setup::consumer("request-ids").start().await;
    let given = gateway
        .http
        .get(gateway.url("/healthz"))
        .header("x-request-id", "client-chosen-42")
        .send()
        .await
        .expect("GET /healthz");
    assert_eq!(
        given.headers().get("x-request-id").map(|v| v.as_bytes()),
        Some(&b"client-chosen-42"[..]),
        "the client's request id comes back"
    );
    let made_up = |reply: &reqwest::Response| {
        reply
            .headers()
            .get("x-request-id")
            .and_then(|id| id.to_str().ok())
            .map(str::to_owned)
            .unwrap_or_else(|| panic!("no x-request-id on {reply:?}"))
    };
    let first = gateway
        .http
        .get(gateway.url("/nope"))
        .send()
        .await
        .expect("GET");
    let second = gateway
        .http
        .get(gateway.url("/healthz"))
        .send()
        .await
        .expect("GET");
    let (first, second) = (made_up(&first), made_up(&second));
    assert!(
        !first.is_empty() && first != second,
        "{first:?} vs {second:?}"
    );
}

/// At the default level a successful fetch and settle write nothing: the metrics are the
/// per-request record (a line per request cost more CPU than the request under load).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn successful_requests_write_no_line_at_the_default_level() {
    let (server, js) = crate::support::server_with_stream().await;
    js.publish("orders.quiet", "hello").await;
    // RUST_LOG unset: the binary's own default.
    let mut gateway = Setup::consumer("quiet-default")
        .rust_log("")
        .process(&server.url())
        .await;
    let written = gateway.log().len();
    let leased = gateway.fetch_n(1, 2000).await;
    assert_eq!(leased.len(), 1);
    assert_eq!(gateway.ack(&leased[0].id).await, 204);
    let status = gateway
        .http
        .get(gateway.url("/healthz"))
        .send()
        .await
        .expect("GET /healthz")
        .status();
    assert_eq!(status, 200);
    let during = gateway.log()[written..].to_owned();
    assert!(
        during.is_empty(),
        "a fetch, a settle and a probe wrote to the default log:\n{during}"
    );
    gateway.terminate(Duration::from_secs(15)).await;
    let log = gateway.log();
    assert!(
        log.contains("listening"),
        "start-up is still logged:\n{log}"
    );
    assert!(log.contains("stopped"), "shutdown is still logged:\n{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_carry_request_spans_and_settle_events_without_secrets() {
    const TOKEN: &str = "s3cret-bearer-token";
    const URL_PASSWORD: &str = "s3cret-url-password";
    let (server, js) = crate::support::server_with_stream().await;
    let sequence = js.publish("orders.logged", "hello").await;
    // Credentials in the URL: the server has no auth and ignores them; they must not be logged.
    let url = format!("nats://logger:{URL_PASSWORD}@127.0.0.1:{}", server.port());
    // The access log and settle events are at debug, for this crate only.
    let mut gateway = Setup::consumer("logged")
        .flag("--log-format", "json")
        .rust_log("info,ruststream_nats=debug")
        .process(&url)
        .await;
    let http = gateway.http.clone();

    let fetched: Value = http
        .post(gateway.url("/fetch"))
        .header("x-request-id", "fetch-1")
        .header("authorization", format!("Bearer {TOKEN}"))
        .body(r#"{"batch":1,"wait_ms":2000}"#)
        .send()
        .await
        .expect("POST /fetch")
        .json()
        .await
        .expect("fetch JSON");
    let id = fetched["messages"][0]["id"]
        .as_str()
        .unwrap_or_else(|| panic!("one message: {fetched}"))
        .to_owned();
    let acked = http
        .post(gateway.url(&format!("/messages/{id}/ack")))
        .header("x-request-id", "ack-1")
        .header("authorization", format!("Bearer {TOKEN}"))
        .send()
        .await
        .expect("POST ack");
    assert_eq!(acked.status(), 204);
    gateway.terminate(Duration::from_secs(15)).await;

    let text = gateway.log();
    let lines: Vec<Value> = text
        .lines()
        .map(|line| {
            serde_json::from_str(line)
                .unwrap_or_else(|err| panic!("not a JSON log line ({err}): {line}"))
        })
        .collect();
    let field = |line: &Value, name: &str| line["fields"][name].clone();
    let span = |line: &Value, name: &str| line["span"][name].clone();

    let settle = lines
        .iter()
        .find(|line| field(line, "message") == "lease settle")
        .unwrap_or_else(|| panic!("no settle event in:\n{text}"));
    assert_eq!(field(settle, "lease_id"), id.as_str(), "{settle}");
    assert_eq!(field(settle, "stream_sequence"), sequence, "{settle}");
    assert_eq!(field(settle, "consumer_sequence"), 1, "{settle}");
    assert_eq!(field(settle, "delivered"), 1, "{settle}");
    assert_eq!(field(settle, "kind"), "ack", "{settle}");
    assert_eq!(field(settle, "result"), "ok", "{settle}");
    assert_eq!(
        span(settle, "request_id"),
        "ack-1",
        "in its request's span: {settle}"
    );

    let finished = |route: &str, request_id: &str| {
        lines
            .iter()
            .find(|line| {
                field(line, "message") == "request finished"
                    && span(line, "route") == route
                    && span(line, "request_id") == request_id
            })
            .unwrap_or_else(|| panic!("no finished {route} request {request_id} in:\n{text}"))
    };
    let ack = finished("/messages/{id}/ack", "ack-1");
    assert_eq!(span(ack, "status"), 204, "{ack}");
    assert_eq!(span(ack, "method"), "POST", "{ack}");
    assert!(
        span(ack, "latency_us").as_u64().is_some(),
        "latency in whole microseconds: {ack}"
    );
    let fetch = finished("/fetch", "fetch-1");
    assert_eq!(span(fetch, "status"), 200, "{fetch}");

    for secret in [TOKEN, URL_PASSWORD] {
        assert!(!text.contains(secret), "a secret was logged:\n{text}");
    }
}

/// Without a token source the gateway warns at start that HTTP authentication is off; with
/// tokens it does not. NATS need not be up: the warning comes before HTTP is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warning_says_when_http_authentication_is_off() {
    const WARNING: &str = "HTTP authentication is off";
    let unreachable = format!("nats://127.0.0.1:{}", free_port());
    let started = |setup: Setup| GatewayProcess::spawn(&setup, &unreachable);
    let listening = |binary: &GatewayProcess| {
        let text = binary.log();
        async move { text.contains("listening") }
    };

    let open = started(Setup::defaults());
    wait_until("the open gateway listens", Duration::from_secs(20), || {
        listening(&open)
    })
    .await;
    let text = open.log();
    let warning = text
        .lines()
        .find(|line| line.contains(WARNING))
        .unwrap_or_else(|| panic!("no warning in:\n{text}"));
    assert!(warning.contains("WARN"), "not at warn level: {warning}");

    let guarded = started(Setup::defaults().flag("--auth-tokens", "some-token fetch"));
    wait_until(
        "the guarded gateway listens",
        Duration::from_secs(20),
        || listening(&guarded),
    )
    .await;
    let text = guarded.log();
    assert!(!text.contains(WARNING), "warned with tokens given:\n{text}");
}

/// A client's `x-request-id` is echoed and logged only when it is 1 to 128 visible ASCII
/// characters; a longer one (or one with spaces or other bytes) is replaced by a made-up id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unusable_request_ids_are_replaced() {
    let (_server, _js, gateway) = Setup::consumer("request-id-hygiene").start().await;
    let answered_id = |sent: Vec<u8>| {
        let gateway = &gateway;
        async move {
            let reply = gateway
                .http
                .get(gateway.url("/healthz"))
                .header(
                    "x-request-id",
                    reqwest::header::HeaderValue::from_bytes(&sent).expect("a header value"),
                )
                .send()
                .await
                .expect("GET /healthz");
            assert_eq!(reply.status(), 200);
            reply
                .headers()
                .get("x-request-id")
                .map(|id| id.as_bytes().to_vec())
                .unwrap_or_else(|| panic!("no x-request-id on {reply:?}"))
        }
    };
    let longest = vec![b'a'; 128];
    assert_eq!(
        answered_id(longest.clone()).await,
        longest,
        "128 characters are kept"
    );
    for unusable in [
        vec![b'a'; 8000],
        vec![b'a'; 129],
        b"has space".to_vec(),
        b"tab\there".to_vec(),
        vec![b'x', 0xff, b'y'],
    ] {
        let answered = answered_id(unusable.clone()).await;
        assert_ne!(answered, unusable, "{unusable:?} was echoed");
        assert!(
            !answered.is_empty()
                && answered.len() <= 128
                && answered.iter().all(u8::is_ascii_graphic),
            "a made-up id instead: {answered:?}"
        );
    }
}

/// What an operator on call reads, at the binary's default level and in a log file: the
/// lost NATS connection at warn, naming the server and why it cannot be reached — not a
/// line per reconnect attempt —, no colour codes, and one true line about the leases still
/// out at shutdown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_logs_say_what_happened_plainly_and_once() {
    let (mut server, js) = crate::support::server_with_stream().await;
    js.publish("orders.1", "held through the shutdown").await;
    let mut gateway = Setup::consumer("operator")
        .ack_wait("60s")
        .shutdown_grace("1s")
        .rust_log("")
        .process(&server.url())
        .await;
    let held = gateway.fetch_n(1, 2000).await;
    assert_eq!(held.len(), 1);

    server.kill();
    let address = format!("127.0.0.1:{}", server.port());
    wait_until(
        "the gateway says it cannot reach NATS",
        Duration::from_secs(10),
        || async { gateway.log().contains("cannot reach NATS") },
    )
    .await;
    gateway.terminate(Duration::from_secs(15)).await;
    let log = gateway.log();

    assert!(
        !log.contains('\u{1b}'),
        "no ANSI colour codes in a log file:\n{log}"
    );
    let unreachable: Vec<&str> = log
        .lines()
        .filter(|line| line.contains("cannot reach NATS"))
        .collect();
    assert_eq!(
        unreachable.len(),
        1,
        "reported once, not per attempt:\n{log}"
    );
    let line = unreachable[0];
    assert!(line.contains("WARN"), "{line}");
    assert!(line.contains(&address), "names the server: {line}");
    assert!(
        line.to_lowercase().contains("refused"),
        "says why (the server is gone: connection refused): {line}"
    );
    assert!(
        !log.lines()
            .any(|line| line.contains("INFO") && line.contains("IO error")),
        "no info line per failed reconnect:\n{log}"
    );
    let shutdown: Vec<&str> = log
        .lines()
        .filter(|line| line.contains("leases still out"))
        .collect();
    assert_eq!(
        shutdown.len(),
        1,
        "one line about the leases still out:\n{log}"
    );
    assert!(
        shutdown[0].contains("NATS unreachable, the server redelivers them after ack_wait"),
        "the true one (nothing could be nak'd): {}",
        shutdown[0]
    );
}
