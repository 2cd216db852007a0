//! Every kind of error answer, collected in one run and swept: problem+json, and no internal
//! subject, stack trace, source location or secret in any body or header.

use std::io::Write as _;
use std::time::Duration;

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::client::{Reply, http_client, http_client_with_token};
use crate::support::{Action, Setup, sleep_past};

const FETCH_TOKEN: &str = "sweep-fetch-token-0d7e";
const ALL_TOKEN: &str = "sweep-all-token-91fa";
const NATS_PASSWORD: &str = "sweep-nats-pw-44c2";

/// What no client-facing answer may contain.
const FORBIDDEN: [&str; 12] = [
    "$JS.",
    "_INBOX.",
    "$SYS.",
    "panicked",
    "backtrace",
    ".rs:",
    "src/",
    "RUST_",
    FETCH_TOKEN,
    ALL_TOKEN,
    NATS_PASSWORD,
    "sweep-lease-key",
];

#[tokio::test]
async fn no_error_answer_reveals_internals_or_secrets() {
    let (mut server, js) = crate::support::server_with_stream().await;
    let mut tokens = tempfile::NamedTempFile::new().expect("temp");
    writeln!(tokens, "{FETCH_TOKEN} fetch\n{ALL_TOKEN} *").expect("write");
    let mut key = tempfile::NamedTempFile::new().expect("temp");
    write!(key, "sweep-lease-key-{}", "k".repeat(32)).expect("write");
    let mut gateway = Setup::consumer("sweep")
        .auth_tokens_file(tokens.path())
        .lease_key_file(key.path())
        .ack_wait("1s")
        .max_ack_pending(1)
        .settle_timeout("500ms")
        .flag("--body-read-timeout", "1s")
        .ready(&server.url())
        .await;
    let mut seen: Vec<(String, Reply)> = Vec::new();
    let anonymous = http_client();
    let base = gateway.url("");
    let url = |path: &str| format!("{base}{path}");

    // 401 and 403.
    let reply = Reply::read(anonymous.post(url("/fetch")).send().await.expect("send")).await;
    seen.push(("401".into(), reply));
    let reply = Reply::read(
        http_client_with_token(FETCH_TOKEN)
            .get(url("/consumer"))
            .send()
            .await
            .expect("send"),
    )
    .await;
    seen.push(("403".into(), reply));

    gateway.http = http_client_with_token(ALL_TOKEN);
    // 400, 413, 422, 404 (lease and endpoint), 405.
    seen.push((
        "400".into(),
        gateway.post_bytes("/fetch", b"{not json".to_vec()).await,
    ));
    seen.push((
        "413".into(),
        gateway.post_bytes("/fetch", vec![b' '; 300 * 1024]).await,
    ));
    seen.push((
        "422".into(),
        gateway.post("/fetch", Some(&json!({ "batch": 0 }))).await,
    ));
    seen.push((
        "422 subject".into(),
        gateway
            .post(
                "/publish",
                Some(&json!({ "subject": "$JS.API.STREAM.DELETE.ORDERS", "data": "x" })),
            )
            .await,
    ));
    seen.push((
        "404 lease".into(),
        gateway.settle("forged", Action::Ack, None).await,
    ));
    seen.push(("404 endpoint".into(), gateway.get("/nowhere").await));
    seen.push(("405".into(), gateway.get("/fetch").await));

    // 409, 429 (capacity), 410 (expired).
    js.publish_many("orders.sweep", 2, "s").await;
    let leased = gateway.fetch_n(1, 5000).await;
    assert_eq!(gateway.ack(&leased[0].id).await, 204);
    seen.push((
        "409".into(),
        gateway.settle(&leased[0].id, Action::Nak, None).await,
    ));
    let held = gateway.fetch_n(1, 5000).await;
    seen.push((
        "429".into(),
        gateway.fetch_reply(Some(&json!({ "wait_ms": 0 }))).await,
    ));
    sleep_past(held[0].lease_expires(), Duration::from_millis(200)).await;
    seen.push((
        "410".into(),
        gateway.settle(&held[0].id, Action::Ack, None).await,
    ));
    seen.push((
        "batch".into(),
        gateway
            .settle_many(
                Action::Ack,
                &json!({ "ids": [held[0].id, "forged", leased[0].id] }),
            )
            .await,
    ));

    // 408: a body that does not arrive.
    let mut stream = tokio::net::TcpStream::connect(url("").trim_start_matches("http://"))
        .await
        .expect("connect");
    stream
        .write_all(
            format!(
                "POST /fetch HTTP/1.1\r\nHost: g\r\nAuthorization: Bearer {ALL_TOKEN}\r\nContent-Length: 10\r\n\r\n{{"
            )
            .as_bytes(),
        )
        .await
        .expect("write");
    let mut raw = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut raw)).await;
    let raw = String::from_utf8_lossy(&raw).into_owned();
    assert!(raw.starts_with("HTTP/1.1 408"), "{raw}");

    // 504 (server paused) and 503 (server gone).
    let pending = gateway.fetch_n(1, 5000).await;
    server.pause();
    seen.push((
        "504".into(),
        gateway.settle(&pending[0].id, Action::Ack, None).await,
    ));
    server.resume();
    server.kill();
    gateway.wait_unready().await;
    seen.push(("503 fetch".into(), gateway.fetch_reply(None).await));
    seen.push(("503 consumer".into(), gateway.get("/consumer").await));
    seen.push((
        "503 publish".into(),
        gateway
            .post(
                "/publish",
                Some(&json!({ "subject": "orders.x", "data": "x" })),
            )
            .await,
    ));
    seen.push((
        "503 settle".into(),
        gateway.settle(&pending[0].id, Action::Ack, None).await,
    ));
    seen.push(("503 readyz".into(), gateway.get("/readyz").await));

    // Each call answered the status its label names (the batch settle: 200 with results).
    let mut everything = raw;
    for (what, reply) in &seen {
        let expected: u16 = match what.split(' ').next().and_then(|code| code.parse().ok()) {
            Some(code) => code,
            None => {
                assert_eq!(what, "batch", "a label without a status");
                200
            }
        };
        assert_eq!(
            reply.status, expected,
            "{what}: expected {expected}, got {} {}",
            reply.status, reply.text
        );
        if expected >= 400 && what != "503 readyz" {
            reply.assert_problem(expected);
        }
        everything.push_str(&format!("\n{what}: {:?} {}", reply.headers, reply.text));
    }
    for needle in FORBIDDEN {
        assert!(
            !everything.contains(needle),
            "an error answer contains {needle:?}:\n{everything}"
        );
    }
}
