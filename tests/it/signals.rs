//! Signals as an operator or a supervisor sends them: SIGTERM ends the process within
//! `--shutdown-grace` + 5 s whatever NATS does, and SIGHUP re-reads the files the gateway
//! reads and never stops it.

use std::io::Write as _;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::support::client::http_client_with_token;
use crate::support::{GatewayProcess, Setup, wait_until};

/// A NATS address that accepts connections and never says a word (a hung server, a
/// half-open proxy), held open while the returned task lives.
async fn silent_nats() -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("nats://{}", listener.local_addr().expect("addr"));
    let task = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            open.push(stream);
        }
    });
    (url, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_ends_the_process_in_time_with_nats_unreachable() {
    for unreachable in ["silent", "refused"] {
        let (url, _silent) = silent_nats().await;
        let url = if unreachable == "silent" {
            url
        } else {
            "nats://127.0.0.1:1".to_owned()
        };
        let mut gateway =
            GatewayProcess::spawn(&Setup::consumer("signals").shutdown_grace("1s"), &url);
        // Until the process listens, a connection is refused: not yet, rather than a failure.
        wait_until("the gateway answers HTTP", Duration::from_secs(10), || {
            let request = gateway.http.get(gateway.url("/healthz")).send();
            async move { request.await.is_ok_and(|answer| answer.status() == 200) }
        })
        .await;
        assert_eq!(gateway.readyz().await, 503, "NATS is {unreachable}");
        let started = Instant::now();
        gateway.sigterm();
        let status = gateway.wait_exit(Duration::from_secs(6)).await;
        assert!(
            started.elapsed() < Duration::from_secs(6),
            "{unreachable}: {:?}",
            started.elapsed()
        );
        assert!(
            status.code().is_some(),
            "{unreachable}: exited, not killed: {status}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_rereads_the_token_file_and_keeps_serving() {
    let (server, _js) = crate::support::server_with_stream().await;
    let mut tokens = tempfile::NamedTempFile::new().expect("token file");
    writeln!(tokens, "first-token fetch").expect("write");
    let mut gateway = Setup::consumer("hangup")
        .auth_tokens_file(tokens.path())
        .process(&server.url())
        .await;
    let fetch_url = gateway.url("/fetch");
    let fetch = |token: &'static str| {
        let url = fetch_url.clone();
        async move {
            http_client_with_token(token)
                .post(url)
                .json(&json!({ "batch": 1, "wait_ms": 0 }))
                .send()
                .await
                .expect("fetch")
                .status()
                .as_u16()
        }
    };
    assert_eq!(fetch("first-token").await, 200);
    assert_eq!(fetch("second-token").await, 401);

    std::fs::write(tokens.path(), "second-token fetch\n").expect("rewrite");
    gateway.sighup();
    wait_until(
        "the new token is in force",
        Duration::from_secs(5),
        || async { fetch("second-token").await == 200 },
    )
    .await;
    assert_eq!(fetch("first-token").await, 401, "the removed token is gone");
    assert!(gateway.exited().is_none(), "SIGHUP stopped the gateway");
    assert_eq!(gateway.readyz().await, 200);
    assert!(
        gateway.log().contains("re-read the bearer tokens"),
        "{}",
        gateway.log()
    );

    // A file that no longer parses is refused with an error; the tokens in force stay.
    std::fs::write(tokens.path(), "third-token nonsense-scope\n").expect("rewrite");
    gateway.sighup();
    wait_until("the refusal is logged", Duration::from_secs(5), || {
        let log = gateway.log();
        async move { log.contains("cannot re-read the bearer tokens") }
    })
    .await;
    assert_eq!(fetch("second-token").await, 200);
    assert_eq!(fetch("third-token").await, 401);
    assert!(gateway.exited().is_none());
}
