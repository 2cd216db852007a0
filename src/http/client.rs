//! Noticing that an HTTP client hung up while its request is still waiting.
//!
//! hyper notices a closed connection only when it next polls the socket, which can be after
//! the dispatcher already leased messages for that request. The serve loop
//! ([`super::serve`]) shares each socket with the request it carries, so a waiting fetch peeks at it itself: it withdraws
//! the moment the client leaves, and checks once more before answering, handing anything
//! already leased back to the next fetch.
//!
//! May import: as the rest of `http`.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::gateway::Caller;

/// Share `stream` between hyper (the first half) and the requests it carries (the second).
pub(crate) fn watch(stream: TcpStream) -> (WatchedStream, Client) {
    let stream = Arc::new(stream);
    (WatchedStream(stream.clone()), Client { stream })
}

/// A connection, shared between hyper (reading and writing) and the request it carries
/// (peeking only).
pub(crate) struct WatchedStream(Arc<TcpStream>);

impl AsyncRead for WatchedStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            ready!(self.0.poll_read_ready(cx))?;
            // Into the unfilled part as it is: zeroing it first (`initialize_unfilled`) wrote
            // all of hyper's read buffer (8 to 16 KiB) on every read, a measurable share of a
            // small request's CPU, and made every idle connection's buffer resident memory.
            // SAFETY: `recv` only writes into the slice; `assume_init` covers exactly the bytes
            // it reports as written.
            let unfilled = unsafe { buf.unfilled_mut() };
            let received = self.0.try_io(tokio::io::Interest::READABLE, || {
                socket2::SockRef::from(self.0.as_ref()).recv(unfilled)
            });
            match received {
                Ok(read) => {
                    unsafe { buf.assume_init(read) };
                    buf.advance(read);
                    return Poll::Ready(Ok(()));
                }
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => {}
                Err(err) => return Poll::Ready(Err(err)),
            }
        }
    }
}

impl AsyncWrite for WatchedStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        loop {
            ready!(self.0.poll_write_ready(cx))?;
            match self.0.try_write(buf) {
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => {}
                result => return Poll::Ready(result),
            }
        }
    }

    /// Headers and body in one syscall, as with a plain `TcpStream`.
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        loop {
            ready!(self.0.poll_write_ready(cx))?;
            match self.0.try_write_vectored(bufs) {
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => {}
                result => return Poll::Ready(result),
            }
        }
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Writes go straight to the socket; there is nothing buffered here.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let socket = socket2::SockRef::from(self.0.as_ref());
        match socket.shutdown(std::net::Shutdown::Write) {
            Err(err) if err.kind() != io::ErrorKind::NotConnected => Poll::Ready(Err(err)),
            _ => Poll::Ready(Ok(())),
        }
    }
}

/// The limits on a request body, set per connection by the serve loop (absent: at most
/// `body::BODY_LIMIT` bytes, no time limit).
#[derive(Debug, Clone, Copy)]
pub(crate) struct BodyRules {
    /// How long a body may take to arrive.
    pub(crate) read_timeout: std::time::Duration,
    /// Most bytes a request body may have (413 beyond).
    pub(crate) limit: usize,
}

/// What the serve loop knows of the connection a request came on, given to the handlers as
/// one request extension (each extension costs an allocation per request).
#[derive(Clone)]
pub(crate) struct Connection {
    /// The client, to notice it hanging up.
    pub(crate) client: Client,
    /// The limits on the request's body.
    pub(crate) body: BodyRules,
}

/// The client connection a request came on.
#[derive(Clone)]
pub(crate) struct Client {
    stream: Arc<TcpStream>,
}

impl Caller for Client {
    /// Resolves when the client closed or reset the connection. Stays pending while it is
    /// open, including when it already sent more (a pipelined request): that client is there.
    async fn hung_up(&self) {
        let mut byte = [0u8; 1];
        match self.stream.peek(&mut byte).await {
            Ok(0) | Err(_) => {}
            Ok(_) => std::future::pending().await,
        }
    }

    /// Whether the client has gone, without waiting. Asks the socket itself: the
    /// runtime's readiness flags can lag behind a hang-up that just arrived.
    fn has_hung_up(&self) -> bool {
        let mut byte = [std::mem::MaybeUninit::<u8>::uninit(); 1];
        match socket2::SockRef::from(self.stream.as_ref()).peek(&mut byte) {
            Ok(0) => true,
            Ok(_) => false,
            Err(err) => err.kind() != io::ErrorKind::WouldBlock,
        }
    }
}
