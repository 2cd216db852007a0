//! What a JWT's subject and scopes decide: an `Idempotency-Key` belongs to the subject, the
//! subject (never the token) reaches the log, and scopes may name consumers.

use std::time::Duration;

use serde_json::json;

use crate::support::Setup;
use crate::support::client::{Reply, http_client_with_token};

use super::keys::{AUDIENCE, JwksServer, Signer, ack, claims, fetch, jwt_setup, now};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotency_key_belongs_to_the_subject_not_the_token_string() {
    let signer = Signer::ed25519("ed-1");
    let jwks = JwksServer::start(vec![signer.jwk.clone()]).await;
    let (server, js) = crate::support::server_with_stream().await;
    let gateway = jwt_setup("idem", &jwks.url).ready(&server.url()).await;
    js.publish("orders.idem", "one").await;
    js.publish("orders.idem", "two").await;
    let keyed = |token: String| {
        let url = gateway.url("/fetch");
        async move {
            let reply = http_client_with_token(&token)
                .post(url)
                .header("Idempotency-Key", "batch-7")
                .json(&json!({ "batch": 1, "wait_ms": 1000 }))
                .send()
                .await
                .expect("fetch");
            Reply::read(reply).await
        }
    };
    let scope = "ruststream:fetch";
    let first = keyed(signer.sign(&claims("svc-a", scope))).await;
    assert_eq!(first.status, 200, "{}", first.text);
    assert_eq!(first.messages().len(), 1);
    // A new token for the same subject (another `jti`, so another string): the same answer.
    let renewed = signer.sign(&claims("svc-a", scope));
    let again = keyed(renewed).await;
    assert_eq!(again.status, 200, "{}", again.text);
    assert_eq!(
        again
            .headers
            .get("idempotent-replayed")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..]),
        "same subject, same scope"
    );
    assert_eq!(again.body, first.body);
    // Another subject with the same key gets its own fetch: the other message.
    let other = keyed(signer.sign(&claims("svc-b", scope))).await;
    assert_eq!(other.status, 200, "{}", other.text);
    assert!(!other.headers.contains_key("idempotent-replayed"));
    let (mine, theirs) = (first.messages(), other.messages());
    assert_eq!(theirs.len(), 1);
    assert_ne!(mine[0].id, theirs[0].id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_subject_reaches_the_log_and_the_token_never_does() {
    let signer = Signer::ed25519("ed-1");
    let file = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(file.path(), signer.jwks_json()).expect("write the JWKS");
    let (server, _js) = crate::support::server_with_stream().await;
    let setup = Setup::consumer("jwt-log")
        .flag("--auth-jwks-file", file.path().to_str().expect("utf8"))
        .flag("--auth-jwt-audience", AUDIENCE)
        .rust_log("debug");
    let mut gateway = setup.process(&server.url()).await;
    let token = signer.sign(&claims("svc-logged-7", "fetch"));
    assert_eq!(fetch(&token, &gateway, 0).await.status, 200);
    let expired = signer.sign(&json!({"aud": AUDIENCE, "sub": "x", "exp": now() - 600}));
    assert_eq!(fetch(&expired, &gateway, 0).await.status, 401);
    gateway.terminate(Duration::from_secs(15)).await;
    let log = gateway.log();
    assert!(
        log.lines()
            .any(|line| line.contains("request finished") && line.contains("svc-logged-7")),
        "the request line names the subject:\n{log}"
    );
    assert!(log.contains("JWT refused"), "the refusal is logged:\n{log}");
    for secret in [&token, &expired] {
        let signature = secret.rsplit('.').next().expect("signature");
        assert!(!log.contains(signature), "a token in the log:\n{log}");
    }
}

/// A JWT's scope claim may name consumers as a token file does (after the prefix): a fetch
/// of another consumer 403 (also one that does not exist), a settle of another consumer's
/// lease 403, single or in a batch beside its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jwt_scopes_may_name_consumers() {
    let signer = Signer::ed25519("ed-scoped");
    let jwks = JwksServer::start(vec![signer.jwk.clone()]).await;
    let (server, js) = crate::support::server_with_stream().await;
    let dir = crate::support::nats::files_dir();
    let file = dir.path().join("consumers.toml");
    std::fs::write(
        &file,
        "[[consumer]]\nstream = \"ORDERS\"\nname = \"audit\"\n",
    )
    .expect("consumers file");
    let gateway = jwt_setup("jwt-default", &jwks.url)
        .flag("--consumers-file", file.display().to_string())
        .ready(&server.url())
        .await;
    js.publish_many("orders.scoped", 2, "m").await;
    let audit = signer.sign(&claims(
        "svc-audit",
        "openid ruststream:fetch:ORDERS/audit ruststream:settle:ORDERS/aud*t ruststream:settle:*/audit",
    ));
    let named_fetch = |token: String, consumer: &'static str| {
        let url = gateway.url(&format!("/streams/ORDERS/consumers/{consumer}/fetch"));
        async move {
            let reply = http_client_with_token(&token)
                .post(url)
                .json(&json!({ "batch": 2, "wait_ms": 1000 }))
                .send()
                .await
                .expect("fetch");
            Reply::read(reply).await
        }
    };
    let mine = named_fetch(audit.clone(), "audit").await;
    assert_eq!(mine.status, 200, "{}", mine.text);
    let mine = mine.messages();
    assert_eq!(mine.len(), 2);
    for other in ["jwt-default", "no-such-consumer"] {
        named_fetch(audit.clone(), other).await.assert_problem(403);
    }
    fetch(&audit, &gateway, 0).await.assert_problem(403);
    let theirs = fetch("static-worker", &gateway, 1000).await.messages();
    assert_eq!(theirs.len(), 1);
    ack(&audit, &gateway, &theirs[0].id)
        .await
        .assert_problem(403);
    let batch = http_client_with_token(&audit)
        .post(gateway.url("/messages/ack"))
        .json(&json!({ "ids": [mine[0].id, theirs[0].id, mine[1].id] }))
        .send()
        .await
        .expect("batch ack");
    let batch = Reply::read(batch).await;
    let statuses: Vec<u16> = crate::support::client::batch_results(&batch)
        .iter()
        .map(|result| result.status)
        .collect();
    assert_eq!(statuses, [204, 403, 204]);
}
