//! What the JWT tests sign with and serve: RSA, P-256 and Ed25519 keys made in the test, their
//! claims, a JWKS server that counts its reads, and the gateway set up to trust it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use jsonwebtoken::jwk::{Jwk, JwkSet};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use rsa::Generate as _;
use rsa::pkcs1::{EncodeRsaPrivateKey as _, EncodeRsaPublicKey as _};
use serde_json::{Value, json};

use crate::support::client::{Reply, http_client_with_token};
use crate::support::{Client, Setup};

pub(super) const ISSUER: &str = "https://idp.example.test/realms/ops";
pub(super) const AUDIENCE: &str = "ruststream-gateway";
pub(super) const PREFIX: &str = "ruststream:";

/// A signing key made in the test, with its public JWK.
pub(super) struct Signer {
    pub(super) kid: String,
    pub(super) algorithm: Algorithm,
    pub(super) key: EncodingKey,
    pub(super) jwk: Jwk,
    /// The public key's bytes (PKCS#1 DER for RSA), for the HMAC forgery.
    pub(super) public: Vec<u8>,
}

impl Signer {
    pub(super) fn rsa(kid: &str) -> Self {
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

    pub(super) fn p256(kid: &str) -> Self {
        let pair = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("P-256");
        let public = pair.public_key_raw().to_vec();
        Self::new(
            kid,
            Algorithm::ES256,
            EncodingKey::from_ec_der(&pair.serialize_der()),
            public,
        )
    }

    pub(super) fn ed25519(kid: &str) -> Self {
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

    pub(super) fn new(kid: &str, algorithm: Algorithm, key: EncodingKey, public: Vec<u8>) -> Self {
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

    pub(super) fn sign(&self, claims: &Value) -> String {
        let mut header = Header::new(self.algorithm);
        header.kid = Some(self.kid.clone());
        jsonwebtoken::encode(&header, claims, &self.key).expect("sign")
    }

    /// The same claims under another key id, still signed by this key.
    pub(super) fn sign_as(&self, kid: &str, claims: &Value) -> String {
        let mut header = Header::new(self.algorithm);
        header.kid = Some(kid.to_owned());
        jsonwebtoken::encode(&header, claims, &self.key).expect("sign")
    }
}

pub(super) fn now() -> i64 {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_secs();
    i64::try_from(secs).expect("fits")
}

/// Claims of a valid token for `sub` with `scope` (our scopes carry the prefix).
pub(super) fn claims(sub: &str, scope: &str) -> Value {
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
pub(super) struct JwksServer {
    pub(super) url: String,
    pub(super) keys: Arc<Mutex<Vec<Jwk>>>,
    pub(super) reads: Arc<AtomicUsize>,
    pub(super) _task: tokio::task::JoinHandle<()>,
}

impl JwksServer {
    pub(super) async fn start(keys: Vec<Jwk>) -> Self {
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

    pub(super) fn publish(&self, signer: &Signer) {
        self.keys.lock().expect("keys").push(signer.jwk.clone());
    }

    pub(super) fn reads(&self) -> usize {
        self.reads.load(Ordering::SeqCst)
    }
}

pub(super) fn jwt_setup(name: &str, jwks_url: &str) -> Setup {
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

pub(super) async fn fetch(token: &str, gateway: &Client, wait_ms: u64) -> Reply {
    let reply = http_client_with_token(token)
        .post(gateway.url("/fetch"))
        .json(&json!({ "batch": 1, "wait_ms": wait_ms, "encoding": "utf8" }))
        .send()
        .await
        .expect("fetch");
    Reply::read(reply).await
}

pub(super) async fn ack(token: &str, gateway: &Client, id: &str) -> Reply {
    let reply = http_client_with_token(token)
        .post(gateway.url(&format!("/messages/{id}/ack")))
        .send()
        .await
        .expect("ack");
    Reply::read(reply).await
}

#[track_caller]
pub(super) fn assert_invalid_token(reply: &Reply, what: &str) {
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

impl Signer {
    pub(super) fn jwk_json(&self) -> String {
        serde_json::to_string(&self.jwk).expect("JWK")
    }

    pub(super) fn jwks_json(&self) -> String {
        serde_json::to_string(&JwkSet {
            keys: vec![self.jwk.clone()],
        })
        .expect("JWKS")
    }
}
