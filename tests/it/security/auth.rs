//! HTTP bearer tokens: 401 without a valid token, 403 without the scope, open health and
//! docs, the per-token cap on waiting fetches, and start-up refusals that never echo a token.

use std::io::Write as _;
use std::time::Duration;

use serde_json::json;

use crate::support::client::{Reply, http_client, http_client_with_token};
use crate::support::{Client, GatewayProcess, NatsServer, Setup, wait_for};

const TOKENS: &str = "\
# workers
worker-fetch-token fetch
worker-settle-token settle
both-token fetch,settle
ops-token admin   # dashboards
publisher-token publish
";

fn tokens_file(text: &str) -> tempfile::NamedTempFile {
    let mut file = tempfile::NamedTempFile::new().expect("temp file");
    file.write_all(text.as_bytes()).expect("write tokens");
    file
}

async fn send(client: &reqwest::Client, method: &str, url: &str) -> Reply {
    let request = match method {
        "GET" => client.get(url),
        _ => client.post(url),
    };
    Reply::read(request.send().await.expect("request")).await
}

#[track_caller]
fn assert_challenge(reply: &Reply, status: u16, expect: &str) {
    reply.assert_problem(status);
    let challenge = reply
        .headers
        .get("www-authenticate")
        .unwrap_or_else(|| panic!("{status} without WWW-Authenticate: {:?}", reply.headers))
        .to_str()
        .expect("ascii");
    assert!(challenge.starts_with("Bearer"), "{challenge}");
    assert!(
        challenge.contains(expect),
        "{challenge} should contain {expect}"
    );
}

#[tokio::test]
async fn tokens_and_scopes_guard_every_endpoint_but_health_and_docs() {
    let (server, js) = crate::support::server_with_stream().await;
    let file = tokens_file(TOKENS);
    let path = file.path().to_str().expect("utf8 path");
    let gateway = Setup::consumer("auth")
        .flag("--auth-tokens-file", path)
        .flag("--auth-tokens", "inline-token *")
        .ready(&server.url())
        .await;
    js.publish("orders.auth", "one").await;
    let url = |path: &str| gateway.url(path);
    let anonymous = http_client();

    // Open: probes and the API description carry no token.
    for path in ["/healthz", "/readyz", "/openapi.json", "/docs", "/docs/"] {
        assert_eq!(
            send(&anonymous, "GET", &url(path)).await.status,
            200,
            "{path}"
        );
    }

    // No token, a wrong token, a token's prefix, another scheme: 401 with a Bearer challenge.
    let missing = send(&anonymous, "POST", &url("/fetch")).await;
    assert_challenge(&missing, 401, "realm=");
    let wrong = send(
        &http_client_with_token("worker-fetch-tokeX"),
        "POST",
        &url("/fetch"),
    )
    .await;
    assert_challenge(&wrong, 401, "invalid_token");
    let prefix = send(
        &http_client_with_token("worker-fetch"),
        "POST",
        &url("/fetch"),
    )
    .await;
    assert_challenge(&prefix, 401, "invalid_token");
    let basic = anonymous
        .post(url("/fetch"))
        .header("authorization", "Basic d29ya2VyLWZldGNoLXRva2Vu")
        .send()
        .await
        .expect("request");
    assert_challenge(&Reply::read(basic).await, 401, "Bearer");
    for (method, path) in [
        ("POST", "/messages/abc/ack"),
        ("POST", "/messages/ack"),
        ("GET", "/consumer"),
        ("GET", "/metrics"),
        ("POST", "/publish"),
    ] {
        assert_challenge(&send(&anonymous, method, &url(path)).await, 401, "Bearer");
    }
    // A path no route matches is a plain 404 without a token: it reveals nothing.
    let unknown = send(&anonymous, "GET", &url("/no-such-endpoint")).await;
    unknown.assert_problem(404);
    assert!(!unknown.headers.contains_key("www-authenticate"));

    // A valid token outside its scope: 403 naming the scope, before the body is looked at.
    let fetcher = http_client_with_token("worker-fetch-token");
    let settler = http_client_with_token("worker-settle-token");
    let ops = http_client_with_token("ops-token");
    for (client, method, path, scope) in [
        (&fetcher, "POST", "/messages/abc/ack", "settle"),
        (&fetcher, "POST", "/messages/nak", "settle"),
        (&fetcher, "GET", "/consumer", "admin"),
        (&fetcher, "GET", "/metrics", "admin"),
        (&fetcher, "POST", "/publish", "publish"),
        (&settler, "POST", "/fetch", "fetch"),
        (&ops, "POST", "/fetch", "fetch"),
        (&ops, "POST", "/messages/abc/term", "settle"),
    ] {
        let reply = send(client, method, &url(path)).await;
        assert_challenge(&reply, 403, "insufficient_scope");
        assert!(reply.text.contains(scope), "{path}: {}", reply.text);
    }

    // Within scope: the endpoint answers as without authentication.
    let fetched = fetcher
        .post(url("/fetch"))
        .json(&json!({ "batch": 1, "wait_ms": 5000, "encoding": "utf8" }))
        .send()
        .await
        .expect("fetch");
    let fetched = Reply::read(fetched).await;
    assert_eq!(fetched.status, 200, "{}", fetched.text);
    let id = fetched.body["messages"][0]["id"]
        .as_str()
        .expect("a message")
        .to_owned();
    let acked = send(&settler, "POST", &url(&format!("/messages/{id}/ack"))).await;
    assert_eq!(acked.status, 204, "{}", acked.text);
    assert_eq!(send(&ops, "GET", &url("/consumer")).await.status, 200);
    let published = http_client_with_token("publisher-token")
        .post(url("/publish"))
        .json(&json!({ "subject": "orders.auth", "data": "two" }))
        .send()
        .await
        .expect("publish");
    assert_eq!(Reply::read(published).await.status, 201);
    // `admin` may publish too (an operator injecting or replaying a message).
    let published = ops
        .post(url("/publish"))
        .json(&json!({ "subject": "orders.auth", "data": "three" }))
        .send()
        .await
        .expect("publish as admin");
    assert_eq!(Reply::read(published).await.status, 201);

    // Refusals are counted under their route template like any answer.
    let metrics = send(&ops, "GET", &url("/metrics")).await;
    for series in [
        r#"ruststream_http_requests_total{method="POST",route="/fetch",status="401"}"#,
        r#"ruststream_http_requests_total{method="POST",route="/fetch",status="403"}"#,
        r#"ruststream_http_requests_total{method="POST",route="/messages/{id}/ack",status="403"}"#,
    ] {
        assert!(
            metrics.text.lines().any(|line| line.starts_with(series)),
            "{series} missing from:\n{}",
            metrics.text
        );
    }
    // `*` grants every scope; an authenticated stranger path is a plain 404.
    let root = http_client_with_token("inline-token");
    assert_eq!(send(&root, "GET", &url("/consumer")).await.status, 200);
    send(&root, "GET", &url("/no-such-endpoint"))
        .await
        .assert_problem(404);
}

#[tokio::test]
async fn bad_token_sources_refuse_to_start_without_echoing_tokens() {
    let server = NatsServer::start().await;
    for (text, expect) in [
        (
            "fine-token fetch\nsecret-token-xyz fetch,sttle\n",
            ":2: unknown scope",
        ),
        ("secret-token-xyz\n", ":1: no scopes"),
        ("# nothing but a comment\n", "names no token"),
    ] {
        let file = tokens_file(text);
        let path = file.path().to_str().expect("utf8 path");
        let mut gateway = Setup::consumer("refused")
            .flag("--auth-tokens-file", path)
            .starting(&server.url())
            .await;
        let err = gateway
            .exit_result()
            .await
            .expect_err("must refuse to start");
        let err = format!("{err:#}");
        assert!(err.contains(expect), "{err}");
        assert!(
            !err.contains("secret-token"),
            "the error shows a token: {err}"
        );
    }
    let mut missing = Setup::consumer("refused")
        .flag("--auth-tokens-file", "/nonexistent/tokens")
        .starting(&server.url())
        .await;
    let err = format!("{:#}", missing.exit_result().await.expect_err("refused"));
    assert!(err.contains("/nonexistent/tokens"), "{err}");
}

#[tokio::test]
async fn each_token_has_its_own_cap_on_waiting_fetches() {
    let (server, _js) = crate::support::server_with_stream().await;
    let file = tokens_file("token-a fetch\ntoken-b fetch\nadmin-token admin\n");
    let path = file.path().to_str().expect("utf8 path");
    let gateway = Setup::consumer("capped")
        .flag("--auth-tokens-file", path)
        .flag("--max-waiting-fetches-per-token", "2")
        .ready(&server.url())
        .await;
    let a = http_client_with_token("token-a");
    let b = http_client_with_token("token-b");
    let fetch = |client: &reqwest::Client, wait_ms: u64| {
        client
            .post(gateway.url("/fetch"))
            .json(&json!({ "batch": 1, "wait_ms": wait_ms }))
            .send()
    };
    // Two long polls of token A wait (no messages) ...
    let long_polls = [fetch(&a, 4000), fetch(&a, 4000)];
    let long_polls = tokio::spawn(futures::future::join_all(long_polls));
    // ... so a third of A is refused at once, with Retry-After, while B is served.
    let refused = wait_for(
        "a third fetch of token A is refused",
        Duration::from_secs(3),
        || async {
            let reply = Reply::read(fetch(&a, 0).await.expect("fetch")).await;
            (reply.status == 429).then_some(reply)
        },
    )
    .await;
    refused.assert_problem(429);
    assert!(refused.retry_after_secs() >= 1);
    assert_eq!(
        Reply::read(fetch(&b, 0).await.expect("fetch")).await.status,
        200
    );
    for reply in long_polls.await.expect("join") {
        assert_eq!(reply.expect("long poll").status(), 200);
    }
    // The long polls returned: A's share is free again.
    assert_eq!(
        Reply::read(fetch(&a, 0).await.expect("fetch")).await.status,
        200
    );
    // Operators see the refusal.
    let metrics = Reply::read(
        http_client_with_token("admin-token")
            .get(gateway.url("/metrics"))
            .send()
            .await
            .expect("metrics"),
    )
    .await;
    let refused = metrics
        .text
        .lines()
        .find(|line| {
            line.starts_with("ruststream_fetches_refused_total{")
                && line.contains(r#"reason="token_limit""#)
        })
        .unwrap_or_else(|| panic!("no token_limit series:\n{}", metrics.text));
    assert!(!refused.ends_with(" 0"), "{refused}");
}

/// A token source that is set but names no token — an empty `RUSTSTREAM_AUTH_TOKENS` —
/// refuses to start rather than run with authentication off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_inline_token_source_refuses_to_start() {
    let server = NatsServer::start().await;
    let setup = Setup::consumer("empty-tokens")
        .create_stream()
        .env("RUSTSTREAM_AUTH_TOKENS", "");
    let mut gateway = GatewayProcess::spawn(&setup, &server.url());
    let status = gateway.wait_exit(Duration::from_secs(20)).await;
    assert!(
        !status.success(),
        "it must not run open; log:\n{}",
        gateway.log()
    );
    let log = gateway.log();
    assert!(log.contains("names no token"), "says why:\n{log}");
    assert!(
        !log.contains("HTTP authentication is off"),
        "it must not fall back to running open:\n{log}"
    );
}

/// With authentication on, neither a bearer token nor the lease key shows in the log, even
/// at debug level and after requests that carry the token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_and_the_lease_key_never_reach_the_log() {
    const TOKEN: &str = "logged-never-token-5c1e";
    const KEY: &str = "logged-never-lease-key-0123456789abcdef0123456789";
    let (server, js) = crate::support::server_with_stream().await;
    js.publish("orders.1", "x").await;
    let tokens = tokens_file(&format!("{TOKEN} *\n"));
    let mut key = tempfile::NamedTempFile::new().expect("temp key file");
    std::io::Write::write_all(&mut key, KEY.as_bytes()).expect("write the key");
    let mut gateway = Setup::consumer("quiet")
        .auth_tokens_file(tokens.path())
        .lease_key_file(key.path())
        .rust_log("debug")
        .process(&server.url())
        .await;
    let client = Client::with_http(gateway.base(), http_client_with_token(TOKEN));
    let leased = client.fetch_n(1, 2000).await;
    assert_eq!(leased.len(), 1);
    assert_eq!(client.ack(&leased[0].id).await, 204);
    let refused = send(
        &http_client_with_token("not-the-token"),
        "POST",
        &gateway.url("/fetch"),
    )
    .await;
    assert_eq!(refused.status, 401);
    gateway.terminate(Duration::from_secs(15)).await;
    let log = gateway.log();
    assert!(
        log.contains("lease settle"),
        "the debug log was written:\n{log}"
    );
    for secret in [TOKEN, KEY, "not-the-token"] {
        assert!(!log.contains(secret), "{secret:?} in the log:\n{log}");
    }
}
