//! JWTs verified and scoped beside static tokens, and a rotated key fetched while unknown key
//! ids cannot make the gateway read the JWKS more than once per 30 s.

use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{Value, json};

use crate::support::client::{Reply, http_client_with_token};
use crate::support::wait_until;

use super::keys::{
    AUDIENCE, ISSUER, JwksServer, Signer, ack, assert_invalid_token, claims, fetch, jwt_setup, now,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jwts_are_verified_and_scoped_beside_static_tokens() {
    let rsa = Signer::rsa("rsa-1");
    let p256 = Signer::p256("ec-1");
    let ed = Signer::ed25519("ed-1");
    let jwks = JwksServer::start(vec![rsa.jwk.clone(), p256.jwk.clone(), ed.jwk.clone()]).await;
    let (server, js) = crate::support::server_with_stream().await;
    let gateway = jwt_setup("jwt", &jwks.url).ready(&server.url()).await;
    assert_eq!(jwks.reads(), 1, "read once at start");
    js.publish("orders.jwt", "one").await;
    js.publish("orders.jwt", "two").await;

    // Valid tokens of each algorithm, within their scopes: fetch 200, settle 204. Scope
    // values of other APIs (`openid`, unprefixed `admin`) grant nothing and harm nothing.
    let worker = claims(
        "svc-billing",
        "openid ruststream:fetch ruststream:settle admin",
    );
    for signer in [&rsa, &p256, &ed] {
        let token = signer.sign(&worker);
        let fetched = fetch(&token, &gateway, 200).await;
        assert_eq!(
            fetched.status, 200,
            "{:?}: {}",
            signer.algorithm, fetched.text
        );
        for message in fetched.messages() {
            let acked = ack(&token, &gateway, &message.id).await;
            assert_eq!(acked.status, 204, "{:?}: {}", signer.algorithm, acked.text);
        }
    }
    // The scope claim as an array works too, and `*` grants everything.
    let array = rsa.sign(&json!({
        "iss": ISSUER, "aud": AUDIENCE, "sub": "svc-ops", "exp": now() + 60,
        "scope": ["ruststream:*"],
    }));
    let consumer = Reply::read(
        http_client_with_token(&array)
            .get(gateway.url("/consumer"))
            .send()
            .await
            .expect("consumer"),
    )
    .await;
    assert_eq!(consumer.status, 200, "{}", consumer.text);

    // A missing scope: 403 naming it, not 401.
    let fetch_only = p256.sign(&claims("svc-reader", "ruststream:fetch admin"));
    let refused = ack(&fetch_only, &gateway, "abc").await;
    refused.assert_problem(403);
    let challenge = refused.headers["www-authenticate"].to_str().expect("ascii");
    assert!(challenge.contains("insufficient_scope"), "{challenge}");
    assert!(refused.text.contains("settle"), "{}", refused.text);

    // Expired (beyond the 30 s leeway), not yet valid, a foreign issuer or audience, no
    // subject: 401 invalid_token. Within the leeway, an expired token still passes.
    let mut cases: Vec<(&str, Value)> = Vec::new();
    let with = |key: &str, value: Value| {
        let mut claims = claims("svc-billing", "ruststream:fetch");
        claims[key] = value;
        claims
    };
    cases.push(("expired", with("exp", json!(now() - 120))));
    cases.push(("not yet valid", with("nbf", json!(now() + 600))));
    cases.push(("foreign issuer", with("iss", json!("https://evil.example"))));
    cases.push(("foreign audience", with("aud", json!("another-api"))));
    let mut no_sub = claims("x", "ruststream:fetch");
    no_sub.as_object_mut().expect("object").remove("sub");
    cases.push(("no subject", no_sub));
    let mut no_exp = claims("x", "ruststream:fetch");
    no_exp.as_object_mut().expect("object").remove("exp");
    cases.push(("no expiry", no_exp));
    for (what, claims) in &cases {
        assert_invalid_token(&fetch(&ed.sign(claims), &gateway, 0).await, what);
    }
    let lately_expired = ed.sign(&with("exp", json!(now() - 10)));
    assert_eq!(fetch(&lately_expired, &gateway, 0).await.status, 200);

    // A bad signature (another key under a known key id), `alg: none`, and HS256 "signed"
    // with the RSA public key's bytes (the key-confusion attack): 401.
    let impostor = Signer::p256("ec-1");
    assert_invalid_token(
        &fetch(&impostor.sign(&worker), &gateway, 0).await,
        "signed by another key",
    );
    let segment = |value: &Value| URL_SAFE_NO_PAD.encode(value.to_string());
    let unsigned = format!(
        "{}.{}.",
        segment(&json!({ "alg": "none", "typ": "JWT", "kid": "rsa-1" })),
        segment(&worker)
    );
    assert_invalid_token(&fetch(&unsigned, &gateway, 0).await, "alg none");
    let mut hmac = Header::new(Algorithm::HS256);
    hmac.kid = Some("rsa-1".into());
    for secret in [rsa.public.clone(), rsa.jwk_json().into_bytes()] {
        let forged = jsonwebtoken::encode(
            &hmac,
            &worker,
            &EncodingKey::from_secret(&secret).expect("an HMAC key"),
        )
        .expect("sign HS256");
        assert_invalid_token(
            &fetch(&forged, &gateway, 0).await,
            "HS256 with the public key",
        );
    }
    let mut tampered = rsa.sign(&claims("svc-billing", "ruststream:fetch"));
    tampered.push('A');
    assert_invalid_token(&fetch(&tampered, &gateway, 0).await, "tampered signature");
    assert_invalid_token(&fetch("not.a.jwt", &gateway, 0).await, "garbage");

    // Static tokens keep working beside JWTs.
    assert_eq!(fetch("static-worker", &gateway, 0).await.status, 200);
    let static_ops = Reply::read(
        http_client_with_token("static-ops-token")
            .get(gateway.url("/consumer"))
            .send()
            .await
            .expect("consumer"),
    )
    .await;
    assert_eq!(static_ops.status, 200);
    assert_invalid_token(&fetch("static-wrong", &gateway, 0).await, "unknown static");

    // None of this made the gateway read the JWKS again: every key id was known.
    assert_eq!(jwks.reads(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_key_is_fetched_but_unknown_key_ids_are_bounded() {
    let first = Signer::ed25519("2024-key");
    let jwks = JwksServer::start(vec![first.jwk.clone()]).await;
    let (server, _js) = crate::support::server_with_stream().await;
    let gateway = jwt_setup("rotation", &jwks.url).ready(&server.url()).await;
    // Read in the background from the start, once.
    wait_until("the JWKS is read", Duration::from_secs(5), || async {
        jwks.reads() == 1
    })
    .await;
    let worker = claims("svc-billing", "ruststream:fetch");
    assert_eq!(fetch(&first.sign(&worker), &gateway, 0).await.status, 200);

    // The issuer rotates: a token under the new key id makes the gateway read the JWKS
    // again, once, and is accepted.
    let second = Signer::p256("2025-key");
    jwks.publish(&second);
    let rotated = fetch(&second.sign(&worker), &gateway, 0).await;
    assert_eq!(rotated.status, 200, "{}", rotated.text);
    assert_eq!(jwks.reads(), 2, "one read for the new key id");
    assert_eq!(fetch(&second.sign(&worker), &gateway, 0).await.status, 200);
    assert_eq!(jwks.reads(), 2, "a known key id needs no read");

    // Within 30 s of that read, neither made-up key ids nor another new key cause a read.
    let third = Signer::ed25519("2026-key");
    jwks.publish(&third);
    for attempt in 0..20 {
        let bogus = first.sign_as(&format!("made-up-{attempt}"), &worker);
        assert_invalid_token(&fetch(&bogus, &gateway, 0).await, "unknown key id");
    }
    assert_invalid_token(
        &fetch(&third.sign(&worker), &gateway, 0).await,
        "a new key inside the bound",
    );
    assert_eq!(jwks.reads(), 2, "unknown key ids are bounded");
}
