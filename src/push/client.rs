//! The HTTP client of one push table: HTTP/1.1 keep-alive connections to its endpoint (its
//! TLS, its timeout, no redirects, no proxy), and what the worker reads of an answer or a
//! failure.
//!
//! Built on hyper's connection API rather than a general-purpose client: a push goes to one
//! endpoint, so the general client's per-request work (URL parsing for its redirect policy,
//! pool keys, a task per connection woken for every request) was most of the push path's
//! cost. Each request drives its own connection while it lasts; a connection is handed to
//! the next request once its answer was read whole.
//!
//! May import: as the rest of `push`.

use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use bytes::Bytes;
use futures::FutureExt as _;
use http_body_util::{BodyExt as _, Full};
use hyper::client::conn::http1;
use hyper::header::{AUTHORIZATION, HOST, HeaderMap, HeaderValue};
use hyper::{Method, Request, Uri};
use hyper_util::rt::TokioIo;
use rustls_pki_types::ServerName;
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;
use tokio_util::either::Either;

use crate::config::PushSpec;

/// The most of an answer's body read (a batch's results): more is an endpoint's mistake.
const MOST_ANSWER_BYTES: usize = 1 << 20;
/// A connection unused this long is closed rather than reused (most servers close theirs
/// sooner; reusing one they closed costs a failed write).
const IDLE_AT_MOST: Duration = Duration::from_secs(90);

type Io = TokioIo<Either<TcpStream, TlsStream<TcpStream>>>;
type Driver = Pin<Box<http1::Connection<Io, Full<Bytes>>>>;

/// One keep-alive connection: the handle requests go through, and the connection itself,
/// which is polled by whoever uses it.
struct Connection {
    send: http1::SendRequest<Full<Bytes>>,
    driver: Driver,
    /// False once the connection ended: it is never polled again.
    alive: bool,
    idle_since: Instant,
}

/// Where the requests go, and how.
struct Target {
    host: String,
    port: u16,
    tls: Option<(TlsConnector, ServerName<'static>)>,
    /// The request target (origin form: path and query) and the `Host` header.
    path: Uri,
    host_header: HeaderValue,
    /// From the URL's userinfo: sent as Basic authentication unless the table's own
    /// headers set `Authorization`.
    basic_auth: Option<HeaderValue>,
}

/// The HTTP client of one push table.
pub(super) struct Endpoint {
    target: Target,
    timeout: Duration,
    idle: Mutex<Vec<Connection>>,
}

/// An endpoint's answer, as far as the worker reads it.
pub(super) struct Answer {
    pub(super) status: u16,
    pub(super) settle: Option<String>,
    pub(super) retry_after: Option<String>,
    pub(super) body: Vec<u8>,
}

/// Why a request got no answer. Its text never holds the URL (its query may hold a secret).
#[derive(Debug)]
pub(super) enum Failure {
    TimedOut,
    /// No connection: the name did not resolve, the connection was refused, TLS failed.
    Connect(String),
    /// The connection broke (reset, closed) or the answer was not HTTP.
    Broken(String),
}

impl Failure {
    /// What a status and a log say of it.
    pub(super) fn describe(&self) -> String {
        match self {
            Self::TimedOut => "timed out".to_owned(),
            Self::Connect(why) => format!("cannot connect: {why}"),
            Self::Broken(why) => format!("request failed: {why}"),
        }
    }
}

/// An error and its causes, on one line.
fn chain(err: &dyn std::error::Error) -> String {
    let mut why = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        why.push_str(": ");
        why.push_str(&cause.to_string());
        source = cause.source();
    }
    why
}

/// The client of one push table: its endpoint, its TLS settings, its timeout.
pub(super) fn client_for(spec: &PushSpec) -> Result<Arc<Endpoint>, String> {
    let url = &spec.url;
    let shown_host = url.host_str().ok_or("the endpoint's URL has no host")?;
    // An IPv6 address is written in brackets in a URL, and without them everywhere else.
    let host = shown_host
        .strip_prefix('[')
        .and_then(|inner| inner.strip_suffix(']'))
        .unwrap_or(shown_host)
        .to_owned();
    let port = url
        .port_or_known_default()
        .ok_or("the endpoint's URL has no port")?;
    let tls = if url.scheme() == "https" {
        let mut config = crate::tls_client::config_for(
            spec.tls.ca.as_deref(),
            spec.tls
                .client
                .as_ref()
                .map(|(cert, key)| (cert.as_slice(), key.as_slice())),
        )?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let name = ServerName::try_from(host.clone())
            .map_err(|err| format!("the endpoint's host is no TLS server name: {err}"))?;
        Some((TlsConnector::from(Arc::new(config)), name))
    } else {
        None
    };
    let mut path = url.path().to_owned();
    if let Some(query) = url.query() {
        path.push('?');
        path.push_str(query);
    }
    let path: Uri = path
        .parse()
        .map_err(|err| format!("the endpoint's path: {err}"))?;
    let authority = match url.port() {
        Some(port) => format!("{shown_host}:{port}"),
        None => shown_host.to_owned(),
    };
    let host_header =
        HeaderValue::from_str(&authority).map_err(|err| format!("the endpoint's host: {err}"))?;
    let basic_auth = if url.username().is_empty() && url.password().is_none() {
        None
    } else {
        let user = percent_encoding::percent_decode_str(url.username()).decode_utf8_lossy();
        let password = url
            .password()
            .map(|password| percent_encoding::percent_decode_str(password).decode_utf8_lossy());
        let credentials = format!("{user}:{}", password.unwrap_or_default());
        // Base64 is always a valid header value.
        let mut value = HeaderValue::from_str(&format!("Basic {}", STANDARD.encode(credentials)))
            .map_err(|err| format!("the endpoint's credentials: {err}"))?;
        value.set_sensitive(true);
        Some(value)
    };
    Ok(Arc::new(Endpoint {
        target: Target {
            host,
            port,
            tls,
            path,
            host_header,
            basic_auth,
        },
        timeout: spec.timeout,
        idle: Mutex::new(Vec::new()),
    }))
}

impl Endpoint {
    /// POST `body` with `headers`: the answer (its body read up to [`MOST_ANSWER_BYTES`]),
    /// or why there was none, within the table's timeout.
    pub(super) async fn post(&self, headers: HeaderMap, body: Vec<u8>) -> Result<Answer, Failure> {
        let request = self.request(headers, Bytes::from(body));
        match tokio::time::timeout(self.timeout, self.exchange(request)).await {
            Ok(answered) => answered,
            Err(_) => Err(Failure::TimedOut),
        }
    }

    fn request(&self, mut headers: HeaderMap, body: Bytes) -> Request<Full<Bytes>> {
        headers.insert(HOST, self.target.host_header.clone());
        if let Some(basic) = &self.target.basic_auth
            && !headers.contains_key(AUTHORIZATION)
        {
            headers.insert(AUTHORIZATION, basic.clone());
        }
        let mut request = Request::new(Full::new(body));
        *request.method_mut() = Method::POST;
        *request.uri_mut() = self.target.path.clone();
        *request.headers_mut() = headers;
        request
    }

    async fn exchange(&self, request: Request<Full<Bytes>>) -> Result<Answer, Failure> {
        let mut request = request;
        loop {
            let (mut connection, reused) = match self.idle_connection() {
                Some(connection) => (connection, true),
                // Boxed: rare, and large (TLS), it would make every request's future large.
                None => (Box::pin(self.connect()).await?, false),
            };
            let Connection {
                send,
                driver,
                alive,
                ..
            } = &mut connection;
            let ready = drive(driver, alive, send.ready()).await;
            if let Err(err) = ready {
                if reused {
                    // Closed while it waited for reuse: the request was not sent.
                    continue;
                }
                return Err(Failure::Broken(chain(&err)));
            }
            let response = match drive(driver, alive, send.try_send_request(request)).await {
                Ok(response) => response,
                Err(mut refused) => match refused.take_message() {
                    // Not sent (a reused connection the server had closed): again on another.
                    Some(unsent) if reused => {
                        request = unsent;
                        continue;
                    }
                    _ => return Err(Failure::Broken(chain(refused.error()))),
                },
            };
            let header = |name: &str| {
                response
                    .headers()
                    .get(name)
                    .and_then(|value| value.to_str().ok())
                    .map(str::to_owned)
            };
            let status = response.status().as_u16();
            // Every value, as sent: one that is not ASCII, or two of them, is a directive
            // the gateway cannot read — never one it did not get.
            let settles: Vec<String> = response
                .headers()
                .get_all("ruststream-settle")
                .iter()
                .map(|value| String::from_utf8_lossy(value.as_bytes()).into_owned())
                .collect();
            let settle = (!settles.is_empty()).then(|| settles.join(", "));
            let retry_after = header("retry-after");
            let (body, whole) = drive(driver, alive, read_some(response.into_body())).await;
            if whole {
                self.put_back(connection);
            }
            return Ok(Answer {
                status,
                settle,
                retry_after,
                body,
            });
        }
    }

    /// An idle connection still open, the most recently used first.
    fn idle_connection(&self) -> Option<Connection> {
        let mut idle = self.idle.lock().ok()?;
        while let Some(mut connection) = idle.pop() {
            if connection.idle_since.elapsed() < IDLE_AT_MOST && connection.still_open() {
                return Some(connection);
            }
        }
        None
    }

    fn put_back(&self, mut connection: Connection) {
        if !connection.still_open() {
            return;
        }
        connection.idle_since = Instant::now();
        if let Ok(mut idle) = self.idle.lock() {
            idle.push(connection);
        }
    }

    async fn connect(&self) -> Result<Connection, Failure> {
        let target = &self.target;
        let tcp = TcpStream::connect((target.host.as_str(), target.port))
            .await
            .map_err(|err| Failure::Connect(chain(&err)))?;
        // One write per request: nothing gains from waiting for more.
        let _ = tcp.set_nodelay(true);
        let stream = match &target.tls {
            None => Either::Left(tcp),
            Some((connector, name)) => Either::Right(
                connector
                    .connect(name.clone(), tcp)
                    .await
                    .map_err(|err| Failure::Connect(format!("TLS: {}", chain(&err))))?,
            ),
        };
        let (send, driver) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|err| Failure::Connect(chain(&err)))?;
        Ok(Connection {
            send,
            driver: Box::pin(driver),
            alive: true,
            idle_since: Instant::now(),
        })
    }
}

/// Await `asked` (of a connection's request handle), polling the connection meanwhile: it
/// does the reading and writing. Once the connection ended it is not polled again: what was
/// asked of it then ends too (answered, or failed as closed).
async fn drive<F: Future>(driver: &mut Driver, alive: &mut bool, asked: F) -> F::Output {
    let mut asked = pin!(asked);
    if *alive {
        tokio::select! {
            biased;
            out = &mut asked => return out,
            _ = driver.as_mut() => *alive = false,
        }
    }
    asked.await
}

impl Connection {
    /// Whether the connection may carry another request: it has not ended, and the server
    /// has not closed it meanwhile (what arrived while it was idle is read now).
    fn still_open(&mut self) -> bool {
        if self.alive && self.driver.as_mut().now_or_never().is_some() {
            self.alive = false;
        }
        self.alive && !self.send.is_closed()
    }
}

/// The body of an answer, up to [`MOST_ANSWER_BYTES`] (what it says past that is ignored),
/// and whether it was read to its end (the connection may then carry another request).
async fn read_some(mut body: hyper::body::Incoming) -> (Vec<u8>, bool) {
    let mut read = Vec::new();
    loop {
        match body.frame().await {
            None => return (read, true),
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    read.extend_from_slice(&data);
                    if read.len() >= MOST_ANSWER_BYTES {
                        return (read, false);
                    }
                }
            }
            Some(Err(_)) => return (read, false),
        }
    }
}
