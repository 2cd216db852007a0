//! A delivery as the gateway holds it, a delivery leased to a client, and what a fetch asks
//! for: the values that travel between the NATS boundary, the dispatcher and the handlers.
//!
//! May import: the rest of `domain` only.

use std::sync::Arc;
use std::time::Duration;

use async_nats::{HeaderMap, Subject};
use bytes::Bytes;
use time::OffsetDateTime;
use tokio::time::Instant;

use super::lease_id::LeaseCoordinates;

/// One delivery of one message, as received from the server.
#[derive(Debug, Clone)]
pub(crate) struct Delivery {
    pub(crate) coordinates: LeaseCoordinates,
    pub(crate) reply: Arc<str>,
    pub(crate) subject: Subject,
    pub(crate) payload: Bytes,
    pub(crate) headers: Option<HeaderMap>,
    /// What NATS clients cannot parse, exactly as the server sent it.
    pub(crate) unparsed: Unparsed,
    pub(crate) stream: String,
    pub(crate) consumer: String,
    pub(crate) pending: u64,
    pub(crate) published_at: OffsetDateTime,
    pub(crate) received_at: Instant,
}

/// The bytes of a delivery that are not UTF-8 text of the form NATS clients parse. The server
/// stores whatever a publisher sends; keeping these lets a client see the message exactly
/// rather than a lossy rendering, or none at all.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Unparsed {
    /// The subject, when it is not UTF-8 ([`Delivery::subject`] holds its lossy form).
    pub(crate) subject: Option<Bytes>,
    /// The whole header block, `NATS/1.0` line included, when it is not UTF-8 `Name: value`
    /// lines ([`Delivery::headers`] then holds none of it).
    pub(crate) headers: Option<Bytes>,
}

/// What a settle's trace span needs of the message it settles, kept with the lease while
/// tracing is on: the subject (the span's destination), its `Nats-Msg-Id`, and the trace
/// context its publisher left in its headers (the span's link).
#[derive(Debug)]
pub(crate) struct MessageNote {
    pub(crate) subject: Subject,
    pub(crate) message_id: Option<String>,
    pub(crate) context: Option<opentelemetry::trace::SpanContext>,
}

/// A delivery handed to a client, with its lease.
#[derive(Debug, Clone)]
pub(crate) struct Leased {
    pub(crate) id: String,
    pub(crate) delivery: Delivery,
    pub(crate) expires_at: Instant,
}

/// What a fetch asks for (already validated).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Demand {
    pub(crate) batch: usize,
    /// How many a stream's pull, kept open at the server between its demands, may ask for:
    /// at most the stream's credit, of which each demand takes at most `batch` and the next
    /// demand the rest — so that each slice of a stream does not wait for a pull of its own.
    /// What arrives between two demands is held, unleased, for whichever fetch comes first
    /// (and nak'd if none takes it within the hold), so a stream asks beyond `batch` only as
    /// much as its client settled lately (see `LeaseStream`). `batch` for a fetch.
    pub(crate) credit: usize,
    pub(crate) wait: Duration,
    pub(crate) max_bytes: Option<usize>,
    /// The open stream (SSE or WebSocket) asking, by its id; `None` for a fetch. A stream's
    /// pull stays open at the server between its demands, its next demand takes it over,
    /// and each demand is answered as soon as something came.
    pub(crate) stream: Option<u64>,
    /// A stream whose owner reads what comes the moment it comes, for as long as it is
    /// open (a push worker): its pull may wait at the server for a minute rather than a
    /// second, so an idle one costs the server two messages a minute, not two a second.
    pub(crate) patient: bool,
}
