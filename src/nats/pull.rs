//! Pulls: a pull request for one waiting fetch, on an inbox of its own, and the task that
//! reads that inbox — stamping each delivery with its arrival time and parsing it — until
//! the server ends the pull.
//!
//! Each pull has its own inbox subscription (a delivery carries its stream subject, so only
//! the subscription tells which pull it answers). The reader parses on arrival, which keeps
//! parsing off the dispatcher's path, and a lease counts from when the delivery arrived,
//! however busy the dispatcher is. A subject or header block NATS clients cannot parse
//! arrives (patched client, `vendor/async-nats/PATCHED.md`) as reserved headers; the reader
//! turns them back into the exact bytes ([`Unparsed`]) so such a message is leased like any
//! other.
//!
//! May import: `domain`. Nothing of the gateway above the NATS boundary.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use async_nats::header::{UNPARSED_HEADERS, UNPARSED_REPLY, UNPARSED_SUBJECT};
use async_nats::jetstream::consumer;
use async_nats::{HeaderMap, Subject};
use bytes::Bytes;
use futures::StreamExt as _;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{info, warn};

use crate::domain::delivery::{Delivery, Unparsed};
use crate::domain::lease_id::{DeliveryKey, LeaseCoordinates};

use super::{API_TIMEOUT, Bound};

/// Subscribing only queues a command; it blocks when the queue is full while disconnected.
const SUBSCRIBE_TIMEOUT: Duration = Duration::from_secs(1);

/// What a pull's reader forwards to the dispatcher. Nearly every one is a delivery, so it
/// travels unboxed: boxing would cost an allocation per message to save space on the rare
/// end-of-pull status.
#[allow(clippy::large_enum_variant)]
pub(crate) enum PullEvent {
    Delivery {
        pull_id: u64,
        delivery: Delivery,
    },
    /// A message the pull brought that is not a usable delivery (nak'd on its reply, if any).
    Unusable {
        pull_id: u64,
        reply: Option<Subject>,
    },
    /// The server ended the pull with this status.
    Ended {
        pull_id: u64,
        status: u16,
        description: String,
    },
}

/// Open a pull for up to `batch` messages: subscribe a fresh inbox, send the pull request,
/// and start the task that forwards what arrives on `events`. `None` (logged) when the
/// subscription or the request could not be made; the caller tries again later.
pub(crate) async fn open(
    bound: &Bound,
    pull_id: u64,
    batch: usize,
    expires: Option<Duration>,
    keep_open: bool,
    events: mpsc::UnboundedSender<PullEvent>,
) -> Option<JoinHandle<()>> {
    let inbox = bound.client.new_inbox();
    // Subscribe before asking: the server delivers only where there is interest.
    let subscribed =
        tokio::time::timeout(SUBSCRIBE_TIMEOUT, bound.client.subscribe(inbox.clone())).await;
    let Ok(Ok(subscriber)) = subscribed else {
        warn!("could not subscribe a pull inbox");
        return None;
    };
    if let Err(err) = request_pull(bound, inbox, batch, expires, keep_open).await {
        warn!(error = %err, "pull request failed");
        return None;
    }
    Some(tokio::spawn(read_pull(
        pull_id,
        batch,
        bound.epoch,
        subscriber,
        bound.jetstream.clone(),
        events,
    )))
}

/// Ask the server for up to `batch` messages on `inbox`. With `expires`, the request waits up
/// to that long for a first message; it ends as soon as it delivered something and nothing
/// more is available (`no_wait`), which is exactly a fetch's contract — unless `keep_open`
/// (a stream's pull, always with `expires`): then it delivers messages as they come until
/// its batch is full or it expires.
async fn request_pull(
    bound: &Bound,
    inbox: String,
    batch: usize,
    expires: Option<Duration>,
    keep_open: bool,
) -> anyhow::Result<()> {
    let request = consumer::pull::BatchConfig {
        batch,
        expires,
        no_wait: !(keep_open && expires.is_some()),
        ..Default::default()
    };
    tokio::time::timeout(
        API_TIMEOUT,
        bound.consumer.request_batch(request, inbox.into()),
    )
    .await
    .context("timed out sending a pull request")?
    .context("sending a pull request")
}

/// Forward a pull's messages, stamped with their arrival, until the server ended the pull
/// (a status, or the whole batch delivered); then dropping the subscriber unsubscribes.
/// Parsing here, on arrival, also keeps it off the dispatcher's path.
async fn read_pull(
    pull_id: u64,
    batch: usize,
    epoch: u32,
    mut subscriber: async_nats::Subscriber,
    mut jetstream: async_nats::jetstream::Context,
    inbound: mpsc::UnboundedSender<PullEvent>,
) {
    let mut delivered = 0;
    while let Some(message) = subscriber.next().await {
        let received_at = Instant::now();
        let (forward, ended) = match message.status {
            Some(status) if status.as_u16() == 100 => (None, false),
            Some(status) => (
                Some(PullEvent::Ended {
                    pull_id,
                    status: status.as_u16(),
                    description: message.description.unwrap_or_default(),
                }),
                true,
            ),
            None => {
                delivered += 1;
                let (parsed, lent_back) = delivery(jetstream, epoch, message, received_at);
                jetstream = lent_back;
                let forward = match parsed {
                    Ok(delivery) => PullEvent::Delivery { pull_id, delivery },
                    Err(reply) => PullEvent::Unusable { pull_id, reply },
                };
                let forward = Some(forward);
                (forward, delivered >= batch)
            }
        };
        if let Some(forward) = forward
            && inbound.send(forward).is_err()
        {
            return;
        }
        if ended {
            return;
        }
    }
}

/// A delivery from a JetStream message, or `None` (logged) for anything else; and the
/// JetStream context, lent to the message for its parsing and given back: `info()` is a
/// method of a JetStream message, which owns a context, and a clone of one per message cost
/// several allocations (its prefix, the client's channels).
fn delivery(
    jetstream: async_nats::jetstream::Context,
    epoch: u32,
    message: async_nats::Message,
    received_at: Instant,
) -> (
    Result<Delivery, Option<Subject>>,
    async_nats::jetstream::Context,
) {
    let message = async_nats::jetstream::Message {
        message,
        context: jetstream,
    };
    let parsed = match message.info() {
        Ok(info) => Ok(FromReply {
            coordinates: LeaseCoordinates {
                epoch,
                key: DeliveryKey {
                    stream_sequence: info.stream_sequence,
                    delivered: u64::try_from(info.delivered).unwrap_or(1),
                },
                consumer_sequence: info.consumer_sequence,
                published_unix_nanos: i64::try_from(info.published.unix_timestamp_nanos())
                    .unwrap_or(0),
            },
            stream: info.stream.to_owned(),
            consumer: info.consumer.to_owned(),
            pending: info.pending,
            published_at: info.published,
        }),
        Err(err) => {
            warn!(error = %err, subject = %message.subject, "a message that is not a JetStream delivery; nak'ing it");
            Err(())
        }
    };
    let async_nats::jetstream::Message {
        message,
        context: jetstream,
    } = message;
    let Ok(from_reply) = parsed else {
        return (Err(message.reply), jetstream);
    };
    (Ok(delivery_of(message, from_reply, received_at)), jetstream)
}

/// What a JetStream delivery's reply subject says of it.
struct FromReply {
    coordinates: LeaseCoordinates,
    stream: String,
    consumer: String,
    pending: u64,
    published_at: time::OffsetDateTime,
}

/// The [`Delivery`] of a JetStream message, given what its reply subject says.
fn delivery_of(
    message: async_nats::Message,
    from_reply: FromReply,
    received_at: Instant,
) -> Delivery {
    let FromReply {
        coordinates,
        stream,
        consumer,
        pending,
        published_at,
    } = from_reply;
    let reply: Arc<str> = Arc::from(message.reply.as_deref().unwrap_or_default());
    let (headers, unparsed) = take_unparsed(message.headers);
    if unparsed != Unparsed::default() {
        info!(
            stream_sequence = coordinates.key.stream_sequence,
            subject = %message.subject,
            subject_unparsed = unparsed.subject.is_some(),
            headers_unparsed = unparsed.headers.is_some(),
            "a message whose subject or headers are not what NATS clients parse; leased with their exact bytes"
        );
    }
    Delivery {
        coordinates,
        reply,
        subject: message.subject,
        payload: message.payload,
        headers,
        unparsed,
        stream,
        consumer,
        pending,
        published_at,
        received_at,
    }
}

/// Split off the reserved headers the NATS client (patched: `vendor/async-nats/PATCHED.md`)
/// sets where it met a subject or header block it cannot parse, instead of dropping the
/// connection: the message's own headers, and the exact bytes the reserved ones carry. The
/// client sets them only itself (a publisher's block naming them arrives unparsed), so they
/// are trusted here.
fn take_unparsed(headers: Option<HeaderMap>) -> (Option<HeaderMap>, Unparsed) {
    let Some(headers) = headers else {
        return (None, Unparsed::default());
    };
    let reserved = [UNPARSED_HEADERS, UNPARSED_SUBJECT, UNPARSED_REPLY];
    if reserved.iter().all(|name| headers.get(*name).is_none()) {
        return (Some(headers), Unparsed::default());
    }
    let bytes = |name: &str| {
        let text = headers.get(name)?.as_str();
        let decoded = from_hex(text);
        if decoded.is_none() {
            warn!(
                header = name,
                "the NATS client's record of unparsed bytes is not hex; ignored"
            );
        }
        decoded
    };
    let unparsed = Unparsed {
        subject: bytes(UNPARSED_SUBJECT),
        headers: bytes(UNPARSED_HEADERS),
    };
    let mut own = HeaderMap::new();
    for (name, values) in headers.iter() {
        let text: &str = name.as_ref();
        if reserved.contains(&text) {
            continue;
        }
        for value in values {
            own.append(name.clone(), value.clone());
        }
    }
    let own = (!own.is_empty()).then_some(own);
    (own, unparsed)
}

/// Lowercase or uppercase hex to bytes; `None` for anything else.
fn from_hex(text: &str) -> Option<Bytes> {
    let digits = text.as_bytes();
    if !digits.len().is_multiple_of(2) {
        return None;
    }
    let digit = |d: u8| char::from(d).to_digit(16);
    digits
        .chunks_exact(2)
        .map(|pair| u8::try_from(digit(pair[0])? * 16 + digit(pair[1])?).ok())
        .collect::<Option<Vec<u8>>>()
        .map(Bytes::from)
}

#[cfg(test)]
mod tests {
    use async_nats::HeaderMap;
    use async_nats::header::{UNPARSED_HEADERS, UNPARSED_SUBJECT};

    use super::{from_hex, take_unparsed};

    #[test]
    fn reserved_headers_become_bytes_and_leave_the_others() {
        let mut headers = HeaderMap::new();
        headers.insert(UNPARSED_SUBJECT, "6fff");
        headers.insert("X-Ok", "yes");
        let (own, unparsed) = take_unparsed(Some(headers));
        let own = own.expect("X-Ok stays");
        assert_eq!(own.len(), 1);
        assert_eq!(own.get("X-Ok").map(|v| v.as_str()), Some("yes"));
        assert_eq!(unparsed.subject.as_deref(), Some(&b"o\xff"[..]));
        assert_eq!(unparsed.headers, None);

        let mut headers = HeaderMap::new();
        headers.insert(UNPARSED_HEADERS, "4e");
        let (own, unparsed) = take_unparsed(Some(headers));
        assert!(own.is_none());
        assert_eq!(unparsed.headers.as_deref(), Some(&b"N"[..]));
    }

    #[test]
    fn hex_decodes_pairs_only() {
        assert_eq!(from_hex("00fFa0").as_deref(), Some(&[0, 255, 160][..]));
        assert_eq!(from_hex(""), Some(bytes::Bytes::new()));
        for bad in ["0", "0g", "+1", "é0"] {
            assert_eq!(from_hex(bad), None, "{bad}");
        }
    }
}
