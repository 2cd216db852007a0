//! The listener's TLS and HTTP/2: HTTPS with ALPN `h2` and `http/1.1`, HTTP/2 with prior
//! knowledge (h2c) beside HTTP/1.1 on a plain port, mTLS refusing a client without a
//! certificate, certificate files checked at start and reloaded in place, and an HTTP/2
//! stream reset withdrawing a waiting fetch as a closed socket does.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::rustls::pki_types::pem::PemObject as _;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore};

use crate::support::pki::{Pki, make_pki};
use crate::support::{STREAM, Setup, wait_until};

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A rustls client trusting the test CA, offering `alpn`, with a client certificate or not.
fn client_config(pki: &Pki, alpn: &[&[u8]], with_client_cert: bool) -> ClientConfig {
    client_config_trusting(&[pki], alpn, with_client_cert)
}

/// As [`client_config`], trusting the CAs of all `pkis` (the first one's client certificate).
fn client_config_trusting(pkis: &[&Pki], alpn: &[&[u8]], with_client_cert: bool) -> ClientConfig {
    let pki = pkis[0];
    let mut roots = RootCertStore::empty();
    for ca in pkis {
        for cert in CertificateDer::pem_file_iter(&ca.ca).expect("ca pem") {
            roots.add(cert.expect("ca cert")).expect("add ca");
        }
    }
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("protocol versions")
        .with_root_certificates(roots);
    let mut config = if with_client_cert {
        let certs = CertificateDer::pem_file_iter(&pki.client_cert)
            .expect("client pem")
            .collect::<Result<Vec<_>, _>>()
            .expect("client certs");
        let key = PrivateKeyDer::from_pem_file(&pki.client_key).expect("client key");
        builder
            .with_client_auth_cert(certs, key)
            .expect("client auth")
    } else {
        builder.with_no_client_auth()
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    config
}

fn https_client(config: ClientConfig) -> reqwest::Client {
    crate::support::client::http_builder()
        .tls_backend_preconfigured(config)
        .timeout(Duration::from_secs(10))
        .build()
        .expect("an HTTPS client")
}

fn tls_setup(consumer: &str, pki: &Pki) -> Setup {
    Setup::consumer(consumer)
        .flag("--tls-cert", pki.server_cert.clone())
        .flag("--tls-key", pki.server_key.clone())
}

/// The gateway's HTTPS base URL (the setup's client speaks plain HTTP to it).
fn https_base(plain: &str) -> String {
    plain.replacen("http://127.0.0.1", "https://localhost", 1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_speaks_h2_and_http11_by_alpn_and_serves_the_lease_flow() {
    let pki = make_pki();
    let (server, js) = crate::support::server_with_stream().await;
    let gateway = tls_setup("https", &pki).starting(&server.url()).await;
    let base = https_base(&gateway.url(""));
    let h2 = https_client(client_config(&pki, &[b"h2", b"http/1.1"], false));
    wait_until("ready over HTTPS", Duration::from_secs(20), || async {
        h2.get(format!("{base}/readyz"))
            .send()
            .await
            .is_ok_and(|reply| reply.status() == 200)
    })
    .await;
    let reply = h2.get(format!("{base}/healthz")).send().await.expect("GET");
    assert_eq!(reply.version(), reqwest::Version::HTTP_2, "ALPN h2 chosen");

    let http11 = https_client(client_config(&pki, &[b"http/1.1"], false));
    let reply = http11
        .get(format!("{base}/healthz"))
        .send()
        .await
        .expect("GET");
    assert_eq!(reply.status(), 200);
    assert_eq!(reply.version(), reqwest::Version::HTTP_11);

    // The lease flow over h2.
    js.publish("orders.1", "over h2").await;
    let fetched: Value = h2
        .post(format!("{base}/fetch"))
        .json(&json!({ "batch": 1, "wait_ms": 2000 }))
        .send()
        .await
        .expect("fetch")
        .json()
        .await
        .expect("json");
    let id = fetched["messages"][0]["id"].as_str().expect("a lease");
    let acked = h2
        .post(format!("{base}/messages/{id}/ack"))
        .send()
        .await
        .expect("ack");
    assert_eq!(acked.status(), 204);

    // Plain HTTP to the TLS port is not served.
    let plain = crate::support::client::http_client()
        .get(gateway.url("/healthz"))
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    assert!(
        !plain.is_ok_and(|reply| reply.status() == 200),
        "plain HTTP answered on the TLS listener"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_speaks_h2_with_prior_knowledge_beside_http11() {
    let (_server, _js, gateway) = Setup::consumer("h2c").start().await;
    let h2c = crate::support::client::http_builder()
        .http2_prior_knowledge()
        .build()
        .expect("an h2c client");
    let reply = h2c.get(gateway.url("/healthz")).send().await.expect("GET");
    assert_eq!(reply.status(), 200);
    assert_eq!(reply.version(), reqwest::Version::HTTP_2);
    let reply = gateway.client().get("/healthz").await;
    assert_eq!(reply.status, 200, "HTTP/1.1 on the same port");
}

/// The gateway tells HTTP/2 from HTTP/1.1 by peeking at a connection's first bytes: a
/// preface that arrives in pieces still speaks HTTP/2 (the server answers with its SETTINGS
/// frame, not an HTTP/1.1 400).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2_preface_sent_in_pieces_still_speaks_h2() {
    let (_server, _js, gateway) = Setup::consumer("h2c-split").start().await;
    let address = gateway.url("").trim_start_matches("http://").to_owned();
    let mut stream = tokio::net::TcpStream::connect(&address)
        .await
        .expect("connect");
    stream.set_nodelay(true).expect("nodelay");
    stream.write_all(b"PR").await.expect("first piece");
    // The pieces must reach the gateway apart: that is the case under test.
    tokio::time::sleep(Duration::from_millis(50)).await;
    stream
        .write_all(b"I * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .expect("rest of the preface");
    // An empty SETTINGS frame: length 0, type 4, no flags, stream 0.
    stream
        .write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0])
        .await
        .expect("SETTINGS");
    let mut frame_head = [0u8; 9];
    tokio::time::timeout(Duration::from_secs(5), stream.read_exact(&mut frame_head))
        .await
        .expect("an answer in time")
        .expect("a frame header");
    assert_eq!(
        frame_head[3], 4,
        "the first frame is the server's SETTINGS: {frame_head:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtls_refuses_a_client_without_a_certificate() {
    let pki = make_pki();
    let (server, _js) = crate::support::server_with_stream().await;
    let gateway = tls_setup("mtls", &pki)
        .flag("--tls-client-ca", pki.ca.clone())
        .starting(&server.url())
        .await;
    let base = https_base(&gateway.url(""));
    let with_cert = https_client(client_config(&pki, &[b"h2", b"http/1.1"], true));
    wait_until("ready over mTLS", Duration::from_secs(20), || async {
        with_cert
            .get(format!("{base}/readyz"))
            .send()
            .await
            .is_ok_and(|reply| reply.status() == 200)
    })
    .await;
    let without = https_client(client_config(&pki, &[b"h2", b"http/1.1"], false));
    let refused = without.get(format!("{base}/healthz")).send().await;
    assert!(
        refused.is_err(),
        "served without a client certificate: {refused:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_tls_files_refuse_to_start_naming_the_path() {
    let pki = make_pki();
    let server = crate::support::NatsServer::start().await;
    let missing = pki.dir.path().join("missing.pem");
    let missing = missing.to_str().expect("utf8");
    for (flag, value, other, other_value) in [
        ("--tls-cert", missing, "--tls-key", pki.server_key.as_str()),
        ("--tls-key", missing, "--tls-cert", pki.server_cert.as_str()),
        (
            "--tls-cert",
            pki.server_key.as_str(),
            "--tls-key",
            pki.server_key.as_str(),
        ),
    ] {
        let setup = Setup::consumer("bad-tls")
            .flag(flag, value)
            .flag(other, other_value);
        let mut gateway = setup.starting(&server.url()).await;
        let err = gateway
            .exit_result()
            .await
            .expect_err("must refuse to start");
        let err = format!("{err:#}");
        assert!(
            err.contains(flag) && err.contains(value),
            "{flag} {value}: {err}"
        );
    }
}

/// A certificate replaced in place is used for new connections; an open connection goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_certificate_is_used_without_dropping_connections() {
    let pki = make_pki();
    let (server, _js) = crate::support::server_with_stream().await;
    let gateway = tls_setup("rotate", &pki).starting(&server.url()).await;
    let address = gateway.url("").trim_start_matches("http://").to_owned();
    // The next certificate comes from another CA; the client trusts both.
    let next = make_pki();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(client_config_trusting(
        &[&pki, &next],
        &[b"http/1.1"],
        false,
    )));
    let connect = || {
        let connector = connector.clone();
        let address = address.clone();
        async move {
            let tcp = tokio::net::TcpStream::connect(&address).await?;
            connector
                .connect(ServerName::try_from("localhost").expect("name"), tcp)
                .await
        }
    };
    let peer = |stream: &tokio_rustls::client::TlsStream<tokio::net::TcpStream>| {
        stream
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|certs| certs.first())
            .map(|cert| cert.as_ref().to_vec())
    };
    let mut open = wait_for_tls(connect).await;
    let first = peer(&open).expect("a certificate");

    // The other certificate written over the files, as a Kubernetes secret rotates.
    let cert = std::fs::read_to_string(&next.server_cert).expect("cert");
    let key = std::fs::read_to_string(&next.server_key).expect("key");
    std::fs::write(&pki.server_cert, cert).expect("write cert");
    std::fs::write(&pki.server_key, key).expect("write key");
    wait_until(
        "new connections get the new certificate",
        Duration::from_secs(15),
        || async {
            match connect().await {
                Ok(stream) => peer(&stream).is_some_and(|cert| cert != first),
                Err(_) => false,
            }
        },
    )
    .await;
    open.write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await
        .expect("the open connection still writes");
    let mut answer = Vec::new();
    open.read_to_end(&mut answer).await.expect("read");
    assert!(
        answer.starts_with(b"HTTP/1.1 200"),
        "the connection opened before the rotation is still served: {}",
        String::from_utf8_lossy(&answer)
    );
}

async fn wait_for_tls<F, Fut>(connect: F) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<
            Output = std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>,
        >,
{
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match connect().await {
            Ok(stream) => return stream,
            Err(err) if Instant::now() >= deadline => panic!("no TLS connection: {err}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// HTTP/2 multiplexes requests on one connection: a waiting fetch whose stream is reset
/// (the client gave up on it, the connection stays) is withdrawn at once, like one whose
/// socket closed — what is published next goes to the next fetch as its first delivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_stream_reset_withdraws_a_waiting_fetch() {
    let consumer = "h2-reset";
    let (_server, js, gateway) = Setup::consumer(consumer).ack_wait("30s").start().await;
    let h2c = crate::support::client::http_builder()
        .http2_prior_knowledge()
        .build()
        .expect("an h2c client");
    // One connection for both requests: warm it up.
    assert_eq!(
        h2c.get(gateway.url("/healthz"))
            .send()
            .await
            .expect("GET")
            .status(),
        200
    );
    let poll = {
        let h2c = h2c.clone();
        let url = gateway.url("/fetch");
        tokio::spawn(async move {
            h2c.post(url)
                .json(&json!({ "batch": 10, "wait_ms": 20_000 }))
                .send()
                .await
        })
    };
    wait_until(
        "the long poll has a pull waiting at the server",
        Duration::from_secs(10),
        || async { js.consumer_info(STREAM, consumer).await.num_waiting >= 1 },
    )
    .await;
    poll.abort();
    let _ = poll.await;
    // The gateway withdraws the fetch once hyper drops its stream; the open pull ends at the
    // server within its slice (at most 1 s), after which a message stays for the next fetch.
    wait_until(
        "the reset fetch is withdrawn",
        Duration::from_secs(5),
        || async {
            crate::support::Scrape::of(&gateway)
                .await
                .get("ruststream_fetches_in_progress")
                == 0.0
        },
    )
    .await;
    let sequence = js.publish("orders.1", "after the reset").await;
    let messages = gateway.fetch_n(10, 5000).await;
    assert_eq!(messages.len(), 1, "{messages:?}");
    assert_eq!(messages[0].stream_sequence, sequence);
    assert_eq!(messages[0].delivered, 1, "handed on, not stranded");
    assert_eq!(gateway.ack(&messages[0].id).await, 204);
}

/// Over HTTPS with HTTP/1.1, a client that goes away while its fetch waits is noticed at
/// once, as on plain HTTP: its fetch is withdrawn, not left waiting out its `wait_ms`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_a_waiting_fetch_over_tls_withdraws_it() {
    let pki = make_pki();
    let (server, _js) = crate::support::server_with_stream().await;
    let gateway = tls_setup("tls-hangup", &pki).starting(&server.url()).await;
    let address = gateway.url("").trim_start_matches("http://").to_owned();
    let connector =
        tokio_rustls::TlsConnector::from(Arc::new(client_config(&pki, &[b"http/1.1"], false)));
    let connect = || {
        let connector = connector.clone();
        let address = address.clone();
        async move {
            let tcp = tokio::net::TcpStream::connect(&address).await?;
            connector
                .connect(ServerName::try_from("localhost").expect("name"), tcp)
                .await
        }
    };
    let mut stream = wait_for_tls(connect).await;
    // Ready first: a fetch before then is refused (503) rather than left waiting.
    let base = https_base(&gateway.url(""));
    let probe = https_client(client_config(&pki, &[b"h2"], false));
    wait_until("the gateway is ready", Duration::from_secs(20), || {
        let (probe, base) = (&probe, &base);
        async move {
            probe
                .get(format!("{base}/readyz"))
                .send()
                .await
                .is_ok_and(|reply| reply.status() == 200)
        }
    })
    .await;
    let body = r#"{"batch":1,"wait_ms":20000}"#;
    stream
        .write_all(
            format!(
                "POST /fetch HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .await
        .expect("send the long poll");
    let in_progress = |expected: f64| {
        let pki = &pki;
        let base = https_base(&gateway.url(""));
        async move {
            let client = https_client(client_config(pki, &[b"h2"], false));
            let text = client
                .get(format!("{base}/metrics"))
                .send()
                .await
                .expect("metrics")
                .text()
                .await
                .expect("text");
            // The one consumer's series (labelled with its stream and name).
            text.lines().any(|line| {
                line.starts_with("ruststream_fetches_in_progress{")
                    && line.ends_with(&format!(" {expected}"))
            })
        }
    };
    wait_until("the fetch waits", Duration::from_secs(20), || {
        in_progress(1.0)
    })
    .await;
    let left = Instant::now();
    drop(stream);
    wait_until("the fetch is withdrawn", Duration::from_secs(5), || {
        in_progress(0.0)
    })
    .await;
    assert!(
        left.elapsed() < Duration::from_secs(5),
        "noticed at once, not after the 20 s wait"
    );
}
