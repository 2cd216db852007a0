//! The NATS boundary: everything that speaks to NATS lives here, and nothing outside it
//! imports `async_nats` except for types passed through (a delivery's subject and headers,
//! consumer info, a publish acknowledgement).
//!
//! - [`connect`]: connect with the configured auth and TLS; connection events.
//! - [`bind`]: find the stream, create or bind the consumer, read back its settings.
//! - [`pull`]: pull requests, their inboxes, and parsing deliveries.
//! - [`settle`]: ack/nak/term/in-progress with the server's confirmation; release.
//! - [`publish`]: publish to the stream; the consumer's server-side state.
//! - [`dead_letter`]: advisories of exhausted or terminated messages → dead-letter copies.
//! - [`advisories`]: the stream capturing those advisories, drained by a durable consumer.
//! - [`replicas`]: what replicas on one consumer share: heartbeats, keyed fetch answers.
//! - [`forward`]: settles forwarded to the replica that issued the lease.
//!
//! May import: `config`, `domain`, `metrics`. Never `state`, `dispatch`, `gateway` or `http`.

pub(crate) mod advisories;
pub(crate) mod bind;
pub(crate) mod connect;
pub(crate) mod dead_letter;
pub(crate) mod forward;
pub(crate) mod publish;
pub(crate) mod pull;
pub(crate) mod replicas;
pub(crate) mod settle;

use std::time::Duration;

pub(crate) use async_nats::Client;
pub(crate) use bind::{BindError, Bound, bind};
pub(crate) use connect::{ConnectionEvent, connect, is_connected};

/// How long any JetStream API call may take before it is given up (and, on the start-up
/// path, retried).
const API_TIMEOUT: Duration = Duration::from_secs(5);

/// The name of a stream the gateway makes for `stream`/`consumer`: `<kind>_<stream>_<consumer>`,
/// or, where that is longer than NATS allows (255), `<kind>_` and a hash of both names.
fn gateway_stream_name(kind: &str, stream: &str, consumer: &str) -> String {
    use sha2::{Digest as _, Sha256};
    let name = format!("{kind}_{stream}_{consumer}");
    if name.len() <= 255 {
        return name;
    }
    let digest = Sha256::digest(format!("{stream}\n{consumer}").as_bytes());
    let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("{kind}_{hex}")
}
