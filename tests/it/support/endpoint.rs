//! A push endpoint for the push tests: a real HTTP server on a free port that records every
//! request it receives and answers each as the test says (a status, headers, a body, after
//! a delay).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use rustls_pki_types::pem::PemObject as _;
use tokio::time::Instant;

/// One request as the endpoint received it.
#[derive(Debug, Clone)]
pub struct Received {
    pub headers: HeaderMap,
    pub body: Vec<u8>,
    pub at: Instant,
}

impl Received {
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned)
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|err| {
            panic!("not JSON ({err}): {}", String::from_utf8_lossy(&self.body))
        })
    }
}

/// How the endpoint answers one request.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
    pub delay: Duration,
}

impl Reply {
    pub fn status(status: u16) -> Self {
        Self {
            status,
            headers: Vec::new(),
            body: String::new(),
            delay: Duration::ZERO,
        }
    }

    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.to_owned(), value.to_owned()));
        self
    }

    pub fn body(mut self, body: &str) -> Self {
        self.body = body.to_owned();
        self
    }

    pub fn after(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }
}

type Answer = Arc<dyn Fn(&Received, usize) -> Reply + Send + Sync>;

struct Shared {
    received: Mutex<Vec<Received>>,
    answer: Mutex<Answer>,
}

/// The endpoint, served until dropped.
pub struct Endpoint {
    pub url: String,
    shared: Arc<Shared>,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl Endpoint {
    /// An endpoint answering 204 to everything, until told otherwise.
    pub async fn start() -> Self {
        let shared = Arc::new(Shared {
            received: Mutex::default(),
            answer: Mutex::new(Arc::new(|_: &Received, _: usize| Reply::status(204))),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the endpoint");
        let url = format!("http://{}/hook", listener.local_addr().expect("address"));
        let server = serve(listener, shared.clone());
        Self {
            url,
            shared,
            server,
        }
    }

    /// An endpoint answering 204 over HTTPS with `pki`'s server certificate, accepting only
    /// clients with a certificate `pki`'s CA signed.
    pub async fn start_tls(pki: &super::pki::Pki) -> Self {
        use tokio_rustls::rustls;
        let shared = Arc::new(Shared {
            received: Mutex::default(),
            answer: Mutex::new(Arc::new(|_: &Received, _: usize| Reply::status(204))),
        });
        let pem = |path: &str| std::fs::read(path).expect("read a PEM file");
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls_pki_types::CertificateDer::pem_slice_iter(&pem(&pki.ca)) {
            roots.add(cert.expect("the CA")).expect("add the CA");
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let clients = rustls::server::WebPkiClientVerifier::builder_with_provider(
            Arc::new(roots),
            provider.clone(),
        )
        .build()
        .expect("a client verifier");
        let certs = rustls_pki_types::CertificateDer::pem_slice_iter(&pem(&pki.server_cert))
            .collect::<Result<Vec<_>, _>>()
            .expect("the server certificate");
        let key = rustls_pki_types::PrivateKeyDer::from_pem_slice(&pem(&pki.server_key))
            .expect("the server key");
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_client_cert_verifier(clients)
            .with_single_cert(certs, key)
            .expect("the server's identity");
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the endpoint");
        let url = format!("https://{}/hook", listener.local_addr().expect("address"));
        let router = router(shared.clone());
        let server = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let (acceptor, router) = (acceptor.clone(), router.clone());
                tokio::spawn(async move {
                    // A client without an acceptable certificate fails here.
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let service = hyper::service::service_fn(
                        move |request: hyper::Request<hyper::body::Incoming>| {
                            let mut router = router.clone();
                            async move { tower_service::Service::call(&mut router, request).await }
                        },
                    );
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                        .await;
                });
            }
        });
        Self {
            url,
            shared,
            server,
        }
    }

    /// Stop serving: connections are refused until [`Endpoint::restart`].
    pub fn stop(&mut self) {
        self.server.abort();
    }

    /// Serve again on the same port, with what was received so far.
    pub async fn restart(&mut self) {
        let address = self
            .url
            .trim_start_matches("http://")
            .trim_end_matches("/hook")
            .to_owned();
        let listener = tokio::net::TcpListener::bind(&address)
            .await
            .expect("bind the endpoint again");
        self.server = serve(listener, self.shared.clone());
    }

    /// Answer each request with `answer(request, its index among all received)`.
    pub fn answer(&self, answer: impl Fn(&Received, usize) -> Reply + Send + Sync + 'static) {
        *self.shared.answer.lock().expect("answer") = Arc::new(answer);
    }

    pub fn received(&self) -> Vec<Received> {
        self.shared.received.lock().expect("received").clone()
    }

    /// Wait until at least `count` requests came; all received then.
    pub async fn wait_for(&self, count: usize, within: Duration) -> Vec<Received> {
        let deadline = Instant::now() + within;
        loop {
            let received = self.received();
            if received.len() >= count {
                return received;
            }
            assert!(
                Instant::now() < deadline,
                "the endpoint received {} of {count} requests within {within:?}",
                received.len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

fn router(shared: Arc<Shared>) -> axum::Router {
    axum::Router::new()
        .route("/hook", axum::routing::post(receive))
        .with_state(shared)
}

fn serve(listener: tokio::net::TcpListener, shared: Arc<Shared>) -> tokio::task::JoinHandle<()> {
    let app = router(shared);
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    })
}

async fn receive(
    axum::extract::State(shared): axum::extract::State<Arc<Shared>>,
    headers: HeaderMap,
    body: Bytes,
) -> axum::response::Response {
    let received = Received {
        headers,
        body: body.to_vec(),
        at: Instant::now(),
    };
    let index = {
        let mut all = shared.received.lock().expect("received");
        all.push(received.clone());
        all.len() - 1
    };
    let answer = shared.answer.lock().expect("answer").clone();
    let reply = answer(&received, index);
    if !reply.delay.is_zero() {
        tokio::time::sleep(reply.delay).await;
    }
    let mut response = axum::response::Response::new(axum::body::Body::from(reply.body));
    *response.status_mut() = StatusCode::from_u16(reply.status).expect("status");
    for (name, value) in reply.headers {
        response.headers_mut().insert(
            axum::http::HeaderName::from_bytes(name.as_bytes()).expect("name"),
            value.parse().expect("value"),
        );
    }
    response
}
