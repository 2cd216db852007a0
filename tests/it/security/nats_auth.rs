//! The gateway against nats-servers that demand authentication or TLS: user/password, token,
//! nkey, creds (operator mode with JWTs built here), TLS with a CA and a client certificate
//! (made here with rcgen). Each works end to end (publish, fetch, ack); each wrong secret
//! keeps the gateway unready; no secret reaches the gateway's log.

use std::path::Path;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use nkeys::KeyPair;
use serde_json::{Value, json};

use crate::support::nats::{files_dir, quoted};
use crate::support::pki::make_pki;
use crate::support::{GatewayProcess, NatsServer, Setup, assert_stays, wait_until};

/// A gateway creating its stream, with these NATS connection flags.
fn secure(nats_flags: &[&str]) -> Setup {
    nats_flags
        .chunks(2)
        .fold(Setup::consumer("secure").create_stream(), |setup, flag| {
            setup.flag(flag[0], flag[1])
        })
}

/// Start a gateway (creating the stream) and drive publish → fetch → ack through it.
async fn assert_gateway_works(url: &str, flags: &[&str]) {
    let gateway = secure(flags).ready(url).await;
    let published = gateway
        .post(
            "/publish",
            Some(&json!({ "subject": "orders.secure", "data": "hi" })),
        )
        .await;
    assert_eq!(published.status, 201, "{}", published.text);
    let leased = gateway.fetch_n(1, 5000).await;
    assert_eq!(leased.len(), 1);
    assert_eq!(gateway.ack(&leased[0].id).await, 204);
}

/// A gateway with these flags never becomes ready (the server refuses it).
async fn assert_refused(url: &str, flags: &[&str]) {
    let gateway = secure(flags).starting(url).await;
    wait_until("/healthz answers", Duration::from_secs(5), || async {
        gateway.healthz().await == 200
    })
    .await;
    assert_stays("/readyz is 503", Duration::from_secs(2), || async {
        gateway.readyz().await == 503
    })
    .await;
}

/// Run the gateway binary for a while with `env`, then return its log (debug level).
async fn binary_log(url: &str, env: &[(&str, &str)]) -> String {
    let setup = env
        .iter()
        .fold(secure(&[]).rust_log("debug"), |setup, (key, value)| {
            setup.env(key, value)
        });
    let mut gateway = GatewayProcess::spawn(&setup, url);
    wait_until("the refusal is logged", Duration::from_secs(10), || {
        let refused = gateway.log().to_lowercase().contains("authorization");
        async move { refused }
    })
    .await;
    gateway.kill9();
    gateway.log()
}

#[tokio::test]
async fn user_and_password() {
    let server =
        NatsServer::with_config("authorization { user: alice, password: \"pw-3f9a-secret\" }")
            .await;
    assert_gateway_works(
        &server.url(),
        &["--nats-user", "alice", "--nats-password", "pw-3f9a-secret"],
    )
    .await;
    assert_refused(
        &server.url(),
        &["--nats-user", "alice", "--nats-password", "pw-wrong"],
    )
    .await;
    assert_refused(&server.url(), &[]).await;
    let log = binary_log(
        &server.url(),
        &[
            ("NATS_USER", "alice"),
            ("NATS_PASSWORD", "pw-wrong-7c1e-secret"),
        ],
    )
    .await;
    assert!(
        !log.contains("pw-wrong-7c1e-secret"),
        "the password is in the log:\n{log}"
    );
}

/// `nats://user:password@host`: the credentials work (given to the client as options), and
/// the client's debug log, which names the server it connects to, never shows the password.
#[tokio::test]
async fn credentials_in_the_url() {
    let server =
        NatsServer::with_config("authorization { user: alice, password: \"pw-u7e2-secret\" }")
            .await;
    let with_credentials = |password: &str| {
        server
            .url()
            .replacen("://", &format!("://alice:{password}@"), 1)
    };
    assert_gateway_works(&with_credentials("pw-u7e2-secret"), &[]).await;
    let log = binary_log(&with_credentials("pw-wrong-4d1c-secret"), &[]).await;
    assert!(
        !log.contains("pw-wrong-4d1c-secret"),
        "the password is in the log:\n{log}"
    );
    // Credentials both in the URL and as a flag: which would win is not obvious, so neither.
    let mut both = Setup::defaults()
        .flag("--nats-token", "some-token")
        .starting(&with_credentials("pw-both-9b3f-secret"))
        .await;
    let refused = format!(
        "{:#}",
        both.exit_result().await.expect_err("refused to start")
    );
    assert!(refused.contains("one way"), "{refused}");
    assert!(!refused.contains("pw-both-9b3f-secret"), "{refused}");
}

#[tokio::test]
async fn token() {
    let server = NatsServer::with_config("authorization { token: \"tok-51d0-secret\" }").await;
    assert_gateway_works(&server.url(), &["--nats-token", "tok-51d0-secret"]).await;
    assert_refused(&server.url(), &["--nats-token", "tok-wrong"]).await;
    let log = binary_log(&server.url(), &[("NATS_TOKEN", "tok-wrong-88ab-secret")]).await;
    assert!(
        !log.contains("tok-wrong-88ab-secret"),
        "the token is in the log:\n{log}"
    );
}

#[tokio::test]
async fn nkey_seed_file() {
    let user = KeyPair::new_user();
    let server = NatsServer::with_config(&format!(
        "authorization {{ users: [ {{ nkey: {} }} ] }}",
        user.public_key()
    ))
    .await;
    let files = files_dir();
    let seed_path = files.path().join("user.nk");
    let seed = user.seed().expect("seed");
    std::fs::write(&seed_path, format!("{seed}\n")).expect("write seed");
    assert_gateway_works(
        &server.url(),
        &["--nats-nkey", seed_path.to_str().expect("utf8")],
    )
    .await;

    // Another user's seed is refused by the server; a file without a seed by the gateway.
    let stranger = files.path().join("stranger.nk");
    std::fs::write(&stranger, KeyPair::new_user().seed().expect("seed")).expect("write");
    assert_refused(
        &server.url(),
        &["--nats-nkey", stranger.to_str().expect("utf8")],
    )
    .await;
    let garbage = files.path().join("garbage.nk");
    std::fs::write(&garbage, "SUnot-a-seed-but-secret-ish\n").expect("write");
    let mut gateway = Setup::consumer("secure")
        .flag("--nats-nkey", garbage.to_str().expect("utf8"))
        .starting(&server.url())
        .await;
    let err = format!("{:#}", gateway.exit_result().await.expect_err("refused"));
    assert!(err.contains("no valid user seed"), "{err}");
    assert!(
        !err.contains("secret-ish"),
        "the error shows the file's content: {err}"
    );
}

/// A NATS JWT (v2): header and claims signed with the issuer's nkey.
fn jwt(issuer: &KeyPair, subject: &str, name: &str, nats: Value) -> String {
    let header = json!({ "typ": "JWT", "alg": "ed25519-nkey" });
    let claims = json!({
        "jti": format!("{:032X}", rand::random::<u128>()),
        "iat": 1_700_000_000,
        "iss": issuer.public_key(),
        "name": name,
        "sub": subject,
        "nats": nats,
    });
    let signing_input = format!(
        "{}.{}",
        URL_SAFE_NO_PAD.encode(header.to_string()),
        URL_SAFE_NO_PAD.encode(claims.to_string())
    );
    let signature = issuer.sign(signing_input.as_bytes()).expect("sign");
    format!("{signing_input}.{}", URL_SAFE_NO_PAD.encode(signature))
}

#[tokio::test]
async fn creds_file_in_operator_mode() {
    let operator = KeyPair::new_operator();
    let account = KeyPair::new_account();
    let user = KeyPair::new_user();
    let operator_jwt = jwt(
        &operator,
        &operator.public_key(),
        "it-operator",
        json!({ "type": "operator", "version": 2 }),
    );
    let unlimited = json!({
        "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
        "wildcards": true, "conn": -1, "leaf": -1,
        "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1,
    });
    let account_jwt = jwt(
        &operator,
        &account.public_key(),
        "it-account",
        json!({ "limits": unlimited, "type": "account", "version": 2 }),
    );
    let user_jwt = jwt(
        &account,
        &user.public_key(),
        "it-user",
        json!({ "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1, "type": "user", "version": 2 }),
    );
    // JetStream needs a system account in operator mode.
    let system = KeyPair::new_account();
    let system_jwt = jwt(
        &operator,
        &system.public_key(),
        "SYS",
        json!({ "type": "account", "version": 2 }),
    );
    let server = NatsServer::with_config(&format!(
        "operator: {operator_jwt}\nsystem_account: {sys}\nresolver: MEMORY\n\
         resolver_preload: {{ {sys}: {system_jwt}, {acc}: {account_jwt} }}",
        sys = system.public_key(),
        acc = account.public_key(),
    ))
    .await;
    let files = files_dir();
    let creds = files.path().join("user.creds");
    std::fs::write(&creds, creds_file(&user_jwt, &user.seed().expect("seed"))).expect("write");
    assert_gateway_works(
        &server.url(),
        &["--nats-creds", creds.to_str().expect("utf8")],
    )
    .await;

    // A user signed by an account the server does not know is refused.
    let rogue_account = KeyPair::new_account();
    let rogue_jwt = jwt(
        &rogue_account,
        &user.public_key(),
        "rogue",
        json!({ "pub": {}, "sub": {}, "type": "user", "version": 2 }),
    );
    let rogue = files.path().join("rogue.creds");
    std::fs::write(&rogue, creds_file(&rogue_jwt, &user.seed().expect("seed"))).expect("write");
    assert_refused(
        &server.url(),
        &["--nats-creds", rogue.to_str().expect("utf8")],
    )
    .await;
}

fn creds_file(jwt: &str, seed: &str) -> String {
    format!(
        "-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n\
         -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
    )
}

#[tokio::test]
async fn tls_with_ca_and_client_certificate() {
    let pki = make_pki();
    let server = NatsServer::with_config(&format!(
        "tls {{ cert_file: {}, key_file: {}, ca_file: {}, verify: true, timeout: 2 }}",
        quoted(Path::new(&pki.server_cert)),
        quoted(Path::new(&pki.server_key)),
        quoted(Path::new(&pki.ca)),
    ))
    .await;
    let tls = [
        "--nats-tls-ca",
        pki.ca.as_str(),
        "--nats-tls-cert",
        pki.client_cert.as_str(),
        "--nats-tls-key",
        pki.client_key.as_str(),
    ];
    assert_gateway_works(&server.url(), &tls).await;
    // Without a client certificate the server (verify: true) refuses the handshake.
    assert_refused(&server.url(), &tls[..2]).await;
    // A CA that did not sign the server's certificate: the gateway refuses the server.
    let other = make_pki();
    assert_refused(
        &server.url(),
        &[
            "--nats-tls-ca",
            other.ca.as_str(),
            "--nats-tls-cert",
            pki.client_cert.as_str(),
            "--nats-tls-key",
            pki.client_key.as_str(),
        ],
    )
    .await;
}
