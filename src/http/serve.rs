//! The accept loop: HTTP/1.1 and HTTP/2 on one port (h2c with prior knowledge, or h2 by
//! ALPN over TLS), a header-read timeout (slowloris; the TLS handshake has the same bound),
//! a cap on open connections, the hang-up watch of [`super::client`], graceful shutdown.
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
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower_service::Service as _;
use tracing::{debug, error};

use super::body::BodyRules;
use super::client::{Connection, watch as watch_connection};
use super::tls::{MaybeTls, Tls};

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
    let stop = CancellationToken::new();
    let connections = TaskTracker::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    builder.http2().timer(TokioTimer::new());
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
        let (io, client) = watch_connection(stream);
        let app = app.clone();
        let connection = Connection {
            client,
            body: BodyRules {
                read_timeout: limits.body_read_timeout,
                limit: limits.max_body_bytes,
            },
        };
        let service = hyper::service::service_fn(move |mut request: hyper::Request<Incoming>| {
            request.extensions_mut().insert(connection.clone());
            let mut app = app.clone();
            async move { app.call(request).await }
        });
        let stop = stop.clone();
        let builder = builder.clone();
        let tls = tls.clone();
        let handshake_timeout = limits.header_read_timeout;
        connections.spawn(async move {
            let _slot = slot;
            let io = match tls {
                None => MaybeTls::Plain(io),
                // Boxed: its state is large, and unboxed it would be part of every
                // connection's task, TLS or not, for the connection's whole life.
                Some(tls) => {
                    match tokio::time::timeout(handshake_timeout, Box::pin(tls.accept(io))).await {
                        Ok(Ok(stream)) => MaybeTls::Tls(Box::new(stream)),
                        Ok(Err(err)) => {
                            debug!(error = %err, "TLS handshake failed");
                            return;
                        }
                        Err(_) => {
                            debug!("TLS handshake too slow; connection closed");
                            return;
                        }
                    }
                }
            };
            let io = FirstByteDeadline::new(io, handshake_timeout);
            let connection = builder.serve_connection(TokioIo::new(io), service);
            let mut connection = std::pin::pin!(connection);
            tokio::select! {
                result = connection.as_mut() => {
                    if let Err(err) = result {
                        debug!(error = %err, "connection ended with an error");
                    }
                }
                () = stop.cancelled() => {
                    connection.as_mut().graceful_shutdown();
                    if let Err(err) = connection.await {
                        debug!(error = %err, "connection ended with an error");
                    }
                }
            }
        });
    }
    drop(listener);
    stop.cancel();
    connections.close();
    connections.wait().await;
}

/// A connection that sends nothing within the header-read timeout is closed: hyper's own
/// header-read timeout starts only once it knows the protocol (HTTP/1.1 or HTTP/2), and
/// telling them apart waits for the first bytes.
struct FirstByteDeadline<IO> {
    io: IO,
    deadline: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl<IO> FirstByteDeadline<IO> {
    fn new(io: IO, timeout: Duration) -> Self {
        Self {
            io,
            deadline: Some(Box::pin(tokio::time::sleep(timeout))),
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
