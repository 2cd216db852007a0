//! The accept loop: HTTP/1.1 and HTTP/2 on one port (h2c with prior knowledge, told by
//! peeking at the first bytes, or h2 by ALPN over TLS), a header-read timeout (slowloris;
//! the TLS handshake has the same bound), a cap on open connections, the hang-up watch of
//! [`super::client`], graceful shutdown.
//!
//! A waiting fetch notices its client leaving through the socket watch (HTTP/1.1), or —
//! over HTTP/2, where one connection carries many requests — because hyper drops the
//! request's future when its stream is reset.
//!
//! `axum::serve` sets no timer, so hyper's header-read timeout never fires there; this loop
//! gives hyper a Tokio timer and otherwise does what `axum::serve` does.
//!
//! May import: as the rest of `http`.

use std::future::Future;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulConnection;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tokio_util::task::TaskTracker;
use tower_service::Service as _;
use tracing::{debug, error};

use super::client::BodyRules;
use super::client::{Connection, watch as watch_connection};
use super::tls::{MaybeTls, Tls};

/// Most header lines a request may have (hyper's default is 100, and it refuses more with a
/// bare 431): room for proxies and tracing headers; beyond it hyper still answers 431.
///
/// Above 100, hyper parses each head into two vectors of 32 bytes a line, allocated and
/// freed per request. Not 256: two 8 KiB vectors share jemalloc's size class with hyper's
/// per-connection read and write buffers, which then land on the pages those vectors wrote,
/// so every idle connection held both buffers resident (10 000 idle SSE streams: 232 MB at
/// 256, 115 MB at 200; `scripts/footprint.sh`). 200 lines make 6400-byte vectors, a class
/// of their own.
pub(crate) const MAX_HEADERS: usize = 200;

/// Connection-level limits.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// Most connections open at once; past it the loop stops accepting (clients wait in the
    /// kernel's listen backlog) until one closes.
    pub(crate) max_connections: usize,
    /// How long a client may take to send a request's headers, and how long an idle
    /// keep-alive connection stays open.
    pub(crate) header_read_timeout: Duration,
    /// How long a handler waits for a request body.
    pub(crate) body_read_timeout: Duration,
    /// Most bytes a request body may have (413 beyond).
    pub(crate) max_body_bytes: usize,
}

/// Serve `app` on `listener` until `shutdown` resolves; then stop accepting, let every open
/// connection finish its request in flight, and return.
pub(crate) async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    tls: Option<Tls>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    // A watch rather than a cancellation token: every wake-up of every connection's task
    // polls it, and a token's check takes a mutex all connections share.
    let (stopping, stop) = watch::channel(());
    let connections = TaskTracker::new();
    let mut http1 = http1::Builder::new();
    http1
        .timer(TokioTimer::new())
        .max_headers(MAX_HEADERS)
        .header_read_timeout(limits.header_read_timeout);
    let mut either = auto::Builder::new(TokioExecutor::new());
    either
        .http1()
        .timer(TokioTimer::new())
        .max_headers(MAX_HEADERS)
        .header_read_timeout(limits.header_read_timeout);
    either.http2().timer(TokioTimer::new());
    let speakers = Arc::new(Speakers {
        http1,
        http2: either.clone().http2_only(),
        either,
    });
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break,
            },
            () = &mut shutdown => break,
        };
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(err) => {
                    accept_failed(err).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        let body = BodyRules {
            read_timeout: limits.body_read_timeout,
            limit: limits.max_body_bytes,
        };
        let mut stop = stop.clone();
        let speakers = speakers.clone();
        let tls = tls.clone();
        let handshake_timeout = limits.header_read_timeout;
        connections.spawn(async move {
            let _slot = slot;
            // A plain connection is told by peeking before hyper reads anything; a TLS one by
            // ALPN once the handshake is done.
            let peeked = match tls {
                Some(_) => None,
                None => {
                    let told = tokio::select! {
                        told = in_time(
                            handshake_timeout,
                            plain_protocol(&stream),
                            "connection ended before its first request",
                            "no request within the header-read timeout; connection closed",
                        ) => told,
                        // Nothing sent yet, so nothing to finish: close at once.
                        _ = stop.changed() => return,
                    };
                    let Some(protocol) = told else { return };
                    Some(protocol)
                }
            };
            let (io, client) = watch_connection(stream);
            let connection = Connection { client, body };
            let service =
                hyper::service::service_fn(move |mut request: hyper::Request<Incoming>| {
                    request.extensions_mut().insert(connection.clone());
                    let mut app = app.clone();
                    async move { app.call(request).await }
                });
            let tls_accepted = tls.is_some();
            let (io, protocol) = match tls {
                None => (MaybeTls::Plain(io), peeked),
                Some(tls) => {
                    // Boxed: its state is large, and unboxed it would be part of every
                    // connection's task, TLS or not, for the connection's whole life.
                    let handshake = in_time(
                        handshake_timeout,
                        Box::pin(tls.accept(io)),
                        "TLS handshake failed",
                        "TLS handshake too slow; connection closed",
                    );
                    let Some(stream) = handshake.await else {
                        return;
                    };
                    let protocol = (stream.get_ref().1.alpn_protocol() == Some(&b"h2"[..]))
                        .then_some(Protocol::Http2);
                    (MaybeTls::Tls(Box::new(stream)), protocol)
                }
            };
            // A plain connection's first bytes were already waited for (peeked) under this
            // bound; a TLS one's come only now.
            let first_bytes_within = tls_accepted.then_some(handshake_timeout);
            let io = TokioIo::new(FirstByteDeadline::new(io, first_bytes_within));
            match protocol {
                Some(Protocol::Http1) => {
                    // With upgrades: GET /ws takes the connection over.
                    let connection = speakers.http1.serve_connection(io, service).with_upgrades();
                    drive(connection, |c| c.graceful_shutdown(), &mut stop).await;
                }
                // Boxed: HTTP/2's connection state is large, and unboxed it would be part of
                // every connection's task (an idle long poll's too), HTTP/1.1 or not.
                Some(Protocol::Http2) => {
                    Box::pin(drive(
                        speakers.http2.serve_connection(io, service),
                        GracefulConnection::graceful_shutdown,
                        &mut stop,
                    ))
                    .await;
                }
                None => {
                    Box::pin(drive(
                        speakers.either.serve_connection_with_upgrades(io, service),
                        GracefulConnection::graceful_shutdown,
                        &mut stop,
                    ))
                    .await;
                }
            }
        });
    }
    drop(listener);
    let _ = stopping.send(());
    connections.close();
    connections.wait().await;
}

/// `step`'s result when it succeeds within `timeout`; otherwise `None`, logged at debug as
/// `failed` (with the error) or `too_slow`.
async fn in_time<T, E: std::fmt::Display>(
    timeout: Duration,
    step: impl Future<Output = Result<T, E>>,
    failed: &str,
    too_slow: &str,
) -> Option<T> {
    match tokio::time::timeout(timeout, step).await {
        Ok(Ok(value)) => Some(value),
        Ok(Err(err)) => {
            debug!(error = %err, "{failed}");
            None
        }
        Err(_) => {
            debug!("{too_slow}");
            None
        }
    }
}

/// Serve `connection` to its end; once `stop` changes, let it finish the request in flight
/// (`drain` tells it to) and close. A connection a request upgraded (GET /ws) is no longer
/// the serve loop's: it ends with its own task.
async fn drive<C, E>(
    connection: C,
    drain: impl FnOnce(std::pin::Pin<&mut C>),
    stop: &mut watch::Receiver<()>,
) where
    C: Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    let mut connection = std::pin::pin!(connection);
    tokio::select! {
        result = connection.as_mut() => {
            if let Err(err) = result {
                debug!(error = %err, "connection ended with an error");
            }
        }
        _ = stop.changed() => {
            drain(connection.as_mut());
            if let Err(err) = connection.await {
                debug!(error = %err, "connection ended with an error");
            }
        }
    }
}

/// The connection builders, by what a connection is known to speak.
struct Speakers {
    http1: http1::Builder,
    http2: auto::Builder<TokioExecutor>,
    /// Told from the first bytes by hyper (TLS without ALPN `h2`: either may follow).
    either: auto::Builder<TokioExecutor>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    Http1,
    Http2,
}

/// How HTTP/2 with prior knowledge starts (RFC 9113 §3.4: `PRI * HTTP/2.0...`); no HTTP/1.1
/// method is `PRI`.
const HTTP2_PREFACE_START: &[u8] = b"PRI ";

/// What a plain connection speaks, told from its first bytes without consuming them.
///
/// hyper's own detection reads them into a buffer and hands them back first, which made
/// hyper's read buffer of every HTTP/1.1 connection grow from 8 to 16 KiB before the first
/// request (the prefix left less than a read's worth of room): with 10 000 idle long polls,
/// 80 MB. Peeking leaves hyper one buffer of 8 KiB.
async fn plain_protocol(stream: &tokio::net::TcpStream) -> io::Result<Protocol> {
    loop {
        let mut start = [0u8; HTTP2_PREFACE_START.len()];
        let seen = stream.peek(&mut start).await?;
        let start = &start[..seen];
        if seen == 0 || !HTTP2_PREFACE_START.starts_with(start) {
            // HTTP/1.1 (or a closed connection: hyper sees the end itself).
            return Ok(Protocol::Http1);
        }
        if start.len() == HTTP2_PREFACE_START.len() {
            return Ok(Protocol::Http2);
        }
        // Only the first bytes of "PRI " so far. A peek does not wait for more data than
        // it already saw, so look again shortly (the caller bounds this by the header-read
        // timeout); real clients send the preface in one segment.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A TLS connection that sends nothing within the header-read timeout of its handshake is
/// closed: hyper's own header-read timeout starts only once it knows the protocol, and
/// without ALPN `h2` telling HTTP/1.1 from HTTP/2 waits for the first bytes. (A plain
/// connection's first bytes are awaited, under the same bound, by the protocol peek.)
struct FirstByteDeadline<IO> {
    io: IO,
    deadline: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl<IO> FirstByteDeadline<IO> {
    /// `None`: no deadline (nothing but a pass-through, and no timer).
    fn new(io: IO, timeout: Option<Duration>) -> Self {
        Self {
            io,
            deadline: timeout.map(|timeout| Box::pin(tokio::time::sleep(timeout))),
        }
    }
}

impl<IO: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for FirstByteDeadline<IO> {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        use std::task::Poll;
        let this = self.get_mut();
        let before = buf.filled().len();
        match std::pin::Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    this.deadline = None;
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(err)) => Poll::Ready(Err(err)),
            Poll::Pending => {
                let expired = this
                    .deadline
                    .as_mut()
                    .is_some_and(|deadline| deadline.as_mut().poll(cx).is_ready());
                if expired {
                    Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "no request within the header-read timeout",
                    )))
                } else {
                    Poll::Pending
                }
            }
        }
    }
}

impl<IO: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for FirstByteDeadline<IO> {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<io::Result<usize>> {
        std::pin::Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// Per-connection errors (the client reset before we accepted) are nobody's business; others
/// (out of file descriptors) are logged, and accepting pauses briefly so the loop does not
/// spin on them.
async fn accept_failed(err: io::Error) {
    use io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(
        err.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset
    ) {
        return;
    }
    error!(error = %err, "accepting a connection failed; retrying in 1s");
    tokio::time::sleep(Duration::from_secs(1)).await;
}
