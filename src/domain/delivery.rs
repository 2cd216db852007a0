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
    pub(crate) stream: String,
    pub(crate) consumer: String,
    pub(crate) pending: u64,
    pub(crate) published_at: OffsetDateTime,
    pub(crate) received_at: Instant,
}

/// A delivery handed to a client, with its lease.
#[derive(Debug)]
pub(crate) struct Leased {
    pub(crate) id: String,
    pub(crate) delivery: Delivery,
    pub(crate) expires_at: Instant,
}

/// What a fetch asks for (already validated).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Demand {
    pub(crate) batch: usize,
    pub(crate) wait: Duration,
    pub(crate) max_bytes: Option<usize>,
}
