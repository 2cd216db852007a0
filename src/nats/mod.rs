//! The NATS boundary: everything that speaks to NATS lives here, and nothing outside it
//! imports `async_nats` except for types passed through (a delivery's subject and headers,
//! consumer info, a publish acknowledgement).
//!
//! - [`connect`]: connect with the configured auth and TLS; connection events.
//! - [`bind`]: find the stream, create or bind the consumer, read back its settings.
//! - [`pull`]: pull requests, their inboxes, and parsing deliveries.
//! - [`settle`]: ack/nak/term/in-progress with the server's confirmation; release.
//! - [`settled`]: the records of confirmed acks and terms every gateway reads back.
//! - [`publish`]: publish to the stream; the consumer's server-side state.
//! - [`dead_letter`]: advisories of exhausted or terminated messages → dead-letter copies.
//! - [`dead_letter_reader`]: the dead-letter stream read (found by subject), never changed.
//! - [`redrive`]: redrive tasks' bucket; a dead letter published back, then removed.
//! - [`schedules`]: message schedules made, read and cancelled at the server.
//! - [`advisories`]: the stream capturing those advisories, drained by a durable consumer.
//! - [`replicas`]: what replicas on one consumer share: heartbeats, keyed fetch answers.
//! - [`forward`]: settles forwarded to the replica that issued the lease.
//! - [`monitor`]: the server's sync policy, from its monitoring endpoint.
//! - [`trust`]: seals on all of that, and which messages under the prefix to believe.
//!
//! May import: `config`, `domain`, `metrics`. Never `state`, `dispatch`, `gateway` or `http`.

pub(crate) mod advisories;
pub(crate) mod bind;
pub(crate) mod connect;
pub(crate) mod dead_letter;
pub(crate) mod dead_letter_reader;
pub(crate) mod forward;
pub(crate) mod monitor;
pub(crate) mod publish;
pub(crate) mod pull;
pub(crate) mod reconcile;
pub(crate) mod redrive;
pub(crate) mod replicas;
pub(crate) mod schedules;
pub(crate) mod seek;
pub(crate) mod seek_mark;
pub(crate) mod settle;
pub(crate) mod settled;
pub(crate) mod trust;

use std::time::Duration;

pub(crate) use async_nats::Client;
pub(crate) use bind::{Bound, bind};
pub(crate) use connect::{ConnectionEvent, connect, is_connected};
pub(crate) use reconcile::BindError;

/// How long any JetStream API call may take before it is given up (and, on the start-up
/// path, retried).
const API_TIMEOUT: Duration = Duration::from_secs(5);

/// Whether looking up a stream failed because there is none of that name.
fn is_stream_not_found(err: &async_nats::jetstream::context::GetStreamError) -> bool {
    use async_nats::jetstream::{ErrorCode, context::GetStreamErrorKind};
    matches!(
        err.kind(),
        GetStreamErrorKind::JetStream(js) if js.error_code() == ErrorCode::STREAM_NOT_FOUND
    )
}

/// The name of a stream the gateway makes for `stream`/`consumer`:
/// `<kind>_<stream>_<consumer>_<hash>`, the hash (64 bits of SHA-256 over both names, apart)
/// telling `X_Y`/`c` from `X`/`Y_c`; where that is longer than NATS allows (255), `<kind>_`
/// and a longer hash alone.
fn gateway_stream_name(kind: &str, stream: &str, consumer: &str) -> String {
    let digest = names_digest(stream, consumer);
    let name = format!("{kind}_{stream}_{consumer}_{}", &digest[..16]);
    if name.len() <= 255 {
        return name;
    }
    format!("{kind}_{digest}")
}

/// The name of a stream the gateway makes for all consumers of `stream`:
/// `<kind>_<stream>_<hash>` (the hash over the stream's name alone, so that it never equals a
/// per-consumer name); where that is longer than NATS allows, `<kind>_` and the hash.
fn gateway_stream_name_of(kind: &str, stream: &str) -> String {
    let hex = sha256_hex(format!("{stream}\n").as_bytes(), 8);
    let name = format!("{kind}_{stream}_{hex}");
    if name.len() <= 255 {
        return name;
    }
    format!("{kind}_{hex}")
}

/// The name releases before [`gateway_stream_name`] gave: ambiguous (`X_Y`/`c` and `X`/`Y_c`
/// both map to `<kind>_X_Y_c`), so it is only used where a stream of that name already
/// captures the pair's own subjects.
fn legacy_gateway_stream_name(kind: &str, stream: &str, consumer: &str) -> String {
    let name = format!("{kind}_{stream}_{consumer}");
    if name.len() <= 255 {
        return name;
    }
    format!("{kind}_{}", names_digest(stream, consumer))
}

/// 128 bits of SHA-256 over a stream and a consumer name, as hex.
fn names_digest(stream: &str, consumer: &str) -> String {
    sha256_hex(format!("{stream}\n{consumer}").as_bytes(), 16)
}

/// The first `bytes` bytes of SHA-256 over `input`, as hex: what the names and keys the
/// gateway makes are told apart by.
fn sha256_hex(input: &[u8], bytes: usize) -> String {
    use sha2::{Digest as _, Sha256};
    let digest = Sha256::digest(input);
    crate::domain::hex(&digest[..bytes.min(digest.len())])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_run_together_get_streams_of_their_own() {
        let one = gateway_stream_name("RUSTSTREAM_SHARED", "X_Y", "c");
        let two = gateway_stream_name("RUSTSTREAM_SHARED", "X", "Y_c");
        assert_ne!(one, two);
        assert!(one.starts_with("RUSTSTREAM_SHARED_X_Y_c_"), "{one}");
        assert_eq!(
            legacy_gateway_stream_name("RUSTSTREAM_SHARED", "X_Y", "c"),
            legacy_gateway_stream_name("RUSTSTREAM_SHARED", "X", "Y_c")
        );
    }

    #[test]
    fn long_names_fit_the_limit() {
        let long = "s".repeat(200);
        let name = gateway_stream_name("RUSTSTREAM_ADVISORIES", &long, &long);
        assert!(name.len() <= 255, "{name}");
        assert_ne!(
            name,
            gateway_stream_name("RUSTSTREAM_ADVISORIES", &long, "other")
        );
    }
}
