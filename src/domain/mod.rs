//! The pure domain: lease ids, the lease table, idempotency records, subject rules and the
//! values that travel between the rooms above. State and time only — no HTTP, no NATS I/O.
//!
//! May import: nothing of the crate but `domain` itself (async-nats types such as a
//! delivery's subject and headers pass through as plain values).

pub(crate) mod delivery;
pub(crate) mod finals;
pub(crate) mod idempotency;
pub(crate) mod lease_id;
pub(crate) mod leases;
pub(crate) mod settle;
pub(crate) mod subject;

use time::OffsetDateTime;
use tokio::time::Instant;

/// The wall-clock time of a monotonic instant.
pub(crate) fn wall_clock(at: Instant) -> OffsetDateTime {
    let now = Instant::now();
    let wall_now = OffsetDateTime::now_utc();
    if at >= now {
        wall_now + (at - now)
    } else {
        wall_now - (now - at)
    }
}
