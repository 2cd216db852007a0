//! The one error type a client can see; the HTTP layer turns it into problem+json.
//!
//! May import: `domain` (the settle vocabulary). Usable from every room above.

use std::time::Duration;

use crate::domain::settle::SettleKind;

#[derive(Debug, Clone, thiserror::Error)]
pub(crate) enum Error {
    /// The request body is not JSON at all.
    #[error("{detail}")]
    Malformed { detail: String },
    /// The request itself is not one this route takes (HTTP/1.1 without `Host`, `GET /ws`
    /// without a WebSocket upgrade).
    #[error("{detail}")]
    BadRequest { detail: String },
    /// The JSON is well-formed but a field is wrong, missing, unknown or out of range.
    #[error("{detail}")]
    Invalid {
        field: Option<String>,
        detail: String,
    },
    #[error("the request body is larger than {limit} bytes")]
    PayloadTooLarge { limit: usize },
    #[error("no lease with this id was issued by this gateway")]
    UnknownLease,
    #[error("the lease is no longer valid: it expired or the message was delivered again")]
    LeaseGone,
    /// A lease of another replica that is gone: nobody received the forwarded settle.
    #[error(
        "the lease is no longer valid: the replica that issued it is gone, and its leases with it"
    )]
    OwnerGone,
    #[error("the lease was already settled with {}", settled.as_str())]
    AlreadySettled { settled: SettleKind },
    #[error(
        "all {max_ack_pending} max_ack_pending slots of the consumer are taken (leases of this gateway or of its replicas); settle some or retry after {}s",
        retry_after.as_secs()
    )]
    AtCapacity {
        max_ack_pending: usize,
        retry_after: Duration,
    },
    #[error("{0}")]
    Unavailable(String),
    /// A consumer being bound anew (its settings changed): it exists, and serves again
    /// shortly.
    #[error("{0}")]
    Rebinding(String),
    /// The gateway is shutting down: no new fetches, and not ready.
    #[error("the gateway is shutting down; no new fetches")]
    ShuttingDown,
    /// A publish whose expectation did not hold: one of its `Nats-Expected-*` headers
    /// (`by_header`), or its `expected_last_sequence`/`expected_last_subject_sequence`
    /// field; the sequence the server compared with, when it said.
    #[error("{detail}")]
    PublishPrecondition {
        detail: String,
        last_sequence: Option<u64>,
        by_header: bool,
    },
    /// An atomic batch whose msg ids the stream already has: an earlier attempt stored it.
    #[error("{0}")]
    BatchAlreadyStored(String),
    /// A cancel too close to the schedule's fire time to be sure it stops it: the server
    /// fires what it took up before a delete that lands after (retry once it fired).
    #[error("{detail}")]
    ScheduleFiring {
        detail: String,
        retry_after: std::time::Duration,
    },
    /// The consumer's settles are less durable than `--require-durability` asks: the
    /// field of its `durability` that falls short.
    #[error("{detail}")]
    DurabilityInsufficient { field: &'static str, detail: String },
    /// The stream's configuration does not allow what a publish asks for (a TTL, an atomic
    /// batch, a schedule): the stream setting that would.
    #[error("{detail}")]
    StreamDisallows {
        setting: &'static str,
        detail: String,
    },
    #[error(
        "the NATS server did not confirm in time; the lease is still valid and retrying is safe"
    )]
    TimedOut,
    #[error("{0}")]
    NotFound(String),
    /// The request names a consumer this gateway does not serve (or the server lacks).
    #[error("{0}")]
    ConsumerNotFound(String),
    /// The consumer exists but cannot be served (push, or ack policy not explicit).
    #[error("{0}")]
    ConsumerUnsuitable(String),
    /// The consumer is paused at the server (`pause_until`): nothing is leased or pushed
    /// until then.
    #[error(
        "consumer {consumer} is paused until {}: nothing is fetched, streamed or pushed before then; POST /streams/{{stream}}/consumers/{{consumer}}/push/resume resumes it now",
        until.map_or_else(|| "it is resumed".to_owned(), |until| until.format(&time::format_description::well_known::Rfc3339).unwrap_or_default())
    )]
    ConsumerPaused {
        consumer: String,
        /// `None`: until resumed.
        until: Option<time::OffsetDateTime>,
    },
    /// A redrive would take dead letters a running redrive task takes.
    #[error(
        "redrive task {task} is running and takes some of the same dead letters: wait until it ends (GET /dead-letters/redrive/{task}) or cancel it (DELETE), then ask again"
    )]
    RedriveOverlaps { task: String },
    #[error("{0}")]
    MethodNotAllowed(String),
    /// The NATS server lacks what the request needs (its version named).
    #[error("{0}")]
    NotImplemented(String),
    /// No bearer token, or one that is not configured.
    #[error("{}", if *invalid { "the bearer token is not valid" } else { "this endpoint needs a bearer token (Authorization: Bearer <token>)" })]
    Unauthorized { invalid: bool },
    /// A valid token without the scope the endpoint needs.
    #[error("the token lacks the `{scope}` scope this endpoint needs")]
    Forbidden { scope: &'static str },
    /// This token already has as many fetches waiting as it may.
    #[error("this token already has {limit} fetches waiting; retry after one returns")]
    TooManyWaitingFetches { limit: usize, retry_after: Duration },
    /// The request body did not arrive in time.
    #[error("the request body did not arrive within {}s", timeout.as_secs_f64())]
    BodyTimeout { timeout: Duration },
    /// The request target is longer than the gateway takes.
    #[error("the request URI is longer than {limit} bytes")]
    UriTooLong { limit: usize },
    /// The request's header section is larger than the gateway takes.
    #[error("the request headers are larger than {limit} bytes in all")]
    HeadersTooLarge { limit: usize },
    /// The client hung up before its answer was ready; nobody reads this.
    #[error("the client closed the connection")]
    ClientGone,
}

impl Error {
    pub(crate) fn invalid(field: &str, detail: impl Into<String>) -> Self {
        Self::Invalid {
            field: Some(field.to_owned()),
            detail: detail.into(),
        }
    }
}
