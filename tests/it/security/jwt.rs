//! JWT bearer tokens (OIDC): tokens signed in the test with RSA, P-256 and Ed25519 keys made
//! in the test, their JWKS served by a local HTTP server that counts its reads. Valid tokens
//! work within their scopes; expired, foreign, unsigned and HMAC-forged ones are refused with
//! `invalid_token`; a rotated key is fetched, but unknown key ids cannot make the gateway
//! read the JWKS more than once per 30 s; static tokens keep working; an `Idempotency-Key`
//! belongs to the token's subject; the subject, never the token, reaches the log.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use jsonwebtoken::jwk::{Jwk, JwkSet};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use rsa::Generate as _;
use rsa::pkcs1::{EncodeRsaPrivateKey as _, EncodeRsaPublicKey as _};
use serde_json::{Value, json};

use crate::support::client::{Reply, http_client_with_token};
use crate::support::{Client, NatsServer, Setup, wait_until};

const ISSUER: &str = "https://idp.example.test/realms/ops";
const AUDIENCE: &str = "ruststream-gateway";
const PREFIX: &str = "ruststream:";

/// A signing key made in the test, with its public JWK.
struct Signer {
    kid: String,
    algorithm: Algorithm,
    key: EncodingKey,
    jwk: Jwk,
    /// The public key's bytes (PKCS#1 DER for RSA), for the HMAC forgery.
    public: Vec<u8>,
}

impl Signer {
    fn rsa(kid: &str) -> Self {
        let private = rsa::PrivateKey::generate();
        let der = private.to_pkcs1_der().expect("PKCS#1 DER");
        let public = private
            .to_public_key()
            .to_pkcs1_der()
            .expect("public DER")
            .into_vec();
        Self::new(
            kid,
            Algorithm::RS256,
            EncodingKey::from_rsa_der(der.as_bytes()),
            public,
        )
    }

    fn p256(kid: &str) -> Self {
        let pair = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("P-256");
        let public = pair.public_key_raw().to_vec();
        Self::new(
            kid,
            Algorithm::ES256,
            EncodingKey::from_ec_der(&pair.serialize_der()),
            public,
        )
    }

    fn ed25519(kid: &str) -> Self {
        // A PKCS#8 v1 document around a random seed: what jsonwebtoken derives the JWK from.
        let seed: [u8; 32] = rand::random();
        let mut der = vec![
            0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22,
            0x04, 0x20,
        ];
        der.extend_from_slice(&seed);
        Self::new(
            kid,
            Algorithm::EdDSA,
            EncodingKey::from_ed_der(&der),
            Vec::new(),
        )
    }

    fn new(kid: &str, algorithm: Algorithm, key: EncodingKey, public: Vec<u8>) -> Self {
        let mut jwk = Jwk::from_encoding_key(&key, algorithm).expect("public JWK");
        jwk.common.key_id = Some(kid.to_owned());
        Self {
            kid: kid.to_owned(),
            algorithm,
            key,
            jwk,
            public,
        }
    }

    fn sign(&self, claims: &Value) -> String {
        let mut header = Header::new(self.algorithm);
        header.kid = Some(self.kid.clone());
        jsonwebtoken::encode(&header, claims, &self.key).expect("sign")
    }

    /// The same claims under another key id, still signed by this key.
    fn sign_as(&self, kid: &str, claims: &Value) -> String {
        let mut header = Header::new(self.algorithm);
        header.kid = Some(kid.to_owned());
        jsonwebtoken::encode(&header, claims, &self.key).expect("sign")
    }
}

fn now() -> i64 {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_secs();
    i64::try_from(secs).expect("fits")
}

/// Claims of a valid token for `sub` with `scope` (our scopes carry the prefix).
fn claims(sub: &str, scope: &str) -> Value {
    json!({
        "iss": ISSUER,
        "aud": [AUDIENCE, "account"],
        "sub": sub,
        "iat": now(),
        "exp": now() + 300,
        "jti": rand::random::<u64>().to_string(),
        "scope": scope,
    })
}

/// A JWKS over HTTP on 127.0.0.1:0, its keys swappable, its reads counted.
struct JwksServer {
    url: String,
    keys: Arc<Mutex<Vec<Jwk>>>,
    reads: Arc<AtomicUsize>,
    _task: tokio::task::JoinHandle<()>,
}

impl JwksServer {
    async fn start(keys: Vec<Jwk>) -> Self {
        let keys = Arc::new(Mutex::new(keys));
        let reads = Arc::new(AtomicUsize::new(0));
        let app = axum::Router::new().route(
            "/realms/ops/certs",
            axum::routing::get({
                let keys = keys.clone();
                let reads = reads.clone();
                move || async move {
                    reads.fetch_add(1, Ordering::SeqCst);
                    let keys = keys.lock().expect("keys").clone();
                    axum::Json(JwkSet { keys })
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!(
            "http://{}/realms/ops/certs",
            listener.local_addr().expect("addr")
        );
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.expect("serve the JWKS");
        });
        Self {
            url,
            keys,
            reads,
            _task: task,
        }
    }

    fn publish(&self, signer: &Signer) {
        self.keys.lock().expect("keys").push(signer.jwk.clone());
    }

    fn reads(&self) -> usize {
        self.reads.load(Ordering::SeqCst)
    }
}

fn jwt_setup(name: &str, jwks_url: &str) -> Setup {
    Setup::consumer(name)
        .flag("--auth-jwks-url", jwks_url)
        .flag("--auth-jwt-issuer", ISSUER)
        .flag("--auth-jwt-audience", AUDIENCE)
        .flag("--auth-jwt-scope-prefix", PREFIX)
        .flag(
            "--auth-tokens",
            "static-ops-token admin; static-worker fetch,settle",
        )
}

async fn fetch(token: &str, gateway: &Client, wait_ms: u64) -> Reply {
    let reply = http_client_with_token(token)
        .post(gateway.url("/fetch"))
        .json(&json!({ "batch": 1, "wait_ms": wait_ms, "encoding": "utf8" }))
        .send()
        .await
        .expect("fetch");
    Reply::read(reply).await
}

async fn ack(token: &str, gateway: &Client, id: &str) -> Reply {
    let reply = http_client_with_token(token)
        .post(gateway.url(&format!("/messages/{id}/ack")))
        .send()
        .await
        .expect("ack");
    Reply::read(reply).await
}

#[track_caller]
fn assert_invalid_token(reply: &Reply, what: &str) {
    assert_eq!(reply.status, 401, "{what}: {}", reply.text);
    reply.assert_problem(401);
    let challenge = reply
        .headers
        .get("www-authenticate")
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default();
    assert!(
        challenge.starts_with("Bearer") && challenge.contains("error=\"invalid_token\""),
        "{what}: {challenge:?}"
    );
}

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

impl Signer {
    fn jwk_json(&self) -> String {
        serde_json::to_string(&self.jwk).expect("JWK")
    }

    fn jwks_json(&self) -> String {
        serde_json::to_string(&JwkSet {
            keys: vec![self.jwk.clone()],
        })
        .expect("JWKS")
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
