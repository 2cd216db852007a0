//! A JWKS that cannot be read: a bad file refuses to start naming its path, and a URL that
//! never answers holds neither the start nor a request.

use std::time::Duration;

use crate::support::{NatsServer, Setup};

use super::keys::{AUDIENCE, Signer, assert_invalid_token, claims, fetch, jwt_setup};

#[tokio::test]
async fn a_bad_jwks_file_refuses_to_start_naming_its_path() {
    let server = NatsServer::start().await;
    let unparsable = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(unparsable.path(), "{\"keys\": [").expect("write");
    let unparsable = unparsable.path().to_str().expect("utf8").to_owned();
    for path in ["/nonexistent/jwks.json", unparsable.as_str()] {
        let mut gateway = Setup::consumer("refused")
            .flag("--auth-jwks-file", path)
            .flag("--auth-jwt-audience", AUDIENCE)
            .starting(&server.url())
            .await;
        let err = format!("{:#}", gateway.exit_result().await.expect_err("refused"));
        assert!(
            err.starts_with("--auth-jwks-file") && err.contains(path),
            "{err}"
        );
        assert!(!err.contains('\n'), "one line: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jwks_url_that_never_answers_holds_neither_the_start_nor_a_request() {
    // Accepts connections and never answers a byte.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!(
        "http://{}/realms/ops/certs",
        silent.local_addr().expect("addr")
    );
    let _held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((stream, _)) = silent.accept().await {
            open.push(stream);
        }
    });
    let (server, _js) = crate::support::server_with_stream().await;
    let started = std::time::Instant::now();
    let gateway = jwt_setup("silent-jwks", &url).ready(&server.url()).await;
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "ready after {:?}",
        started.elapsed()
    );
    let signer = Signer::ed25519("never-fetched");
    let started = std::time::Instant::now();
    let reply = fetch(
        &signer.sign(&claims("svc-billing", "ruststream:fetch")),
        &gateway,
        0,
    )
    .await;
    assert_invalid_token(&reply, "no key could be read");
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "held {:?}",
        started.elapsed()
    );
    assert_eq!(fetch("static-worker", &gateway, 0).await.status, 200);
}
