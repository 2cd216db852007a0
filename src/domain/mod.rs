//! The pure domain: lease ids, the lease table, idempotency records, subject rules and the
//! values that travel between the rooms above. State and time only — no HTTP, no NATS I/O.
//!
//! May import: nothing of the crate but `domain` itself (async-nats types such as a
//! delivery's subject and headers pass through as plain values).

pub(crate) mod consumers;
pub(crate) mod delivery;
pub(crate) mod durability;
pub(crate) mod finals;
pub(crate) mod idempotency;
pub(crate) mod lease_id;
pub(crate) mod leases;
pub(crate) mod ordering;
pub(crate) mod push;
pub(crate) mod schedule;
pub(crate) mod seal;
pub(crate) mod settle;
pub(crate) mod subject;
pub(crate) mod ticket;

use time::OffsetDateTime;
use tokio::time::Instant;

/// A hash map keyed by sequence numbers the server assigns (or derived from them), touched
/// several times per message: foldhash instead of std's SipHash, whose resistance to chosen
/// keys these keys do not need (a client's lease id is checked against its HMAC before it
/// is looked up), at a fraction of the cost per lookup.
pub(crate) type SequenceMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// The wall-clock time of a monotonic instant.
pub(crate) fn wall_clock(at: Instant) -> OffsetDateTime {
    wall_clock_from(at, Instant::now(), OffsetDateTime::now_utc())
}

/// [`wall_clock`] of `at` in Unix milliseconds, the clocks read once by the caller
/// (`now`, `wall_now`) for many instants.
pub(crate) fn unix_ms_from(at: Instant, now: Instant, wall_now: OffsetDateTime) -> i64 {
    let nanos = wall_clock_from(at, now, wall_now).unix_timestamp_nanos() / 1_000_000;
    i64::try_from(nanos).unwrap_or(i64::MAX)
}

fn wall_clock_from(at: Instant, now: Instant, wall_now: OffsetDateTime) -> OffsetDateTime {
    if at >= now {
        wall_now + (at - now)
    } else {
        wall_now - (now - at)
    }
}

/// `bytes` as lower-case hex.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}
