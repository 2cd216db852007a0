//! Pulls: a pull request for one waiting fetch, on an inbox of its own, and the stream of
//! what that inbox brings — each delivery stamped with its arrival and parsed — until the
//! server ends the pull.
//!
//! Each pull has its own inbox subscription (a delivery carries its stream subject, so only
//! the subscription tells which pull it answers). The dispatcher polls every open pull's
//! inbox itself rather than through a task per pull: a task in between cost every fetch a
//! spawn and a wake-up of one more task on its way back to the client. A subject or header
//! block NATS clients cannot parse arrives (patched client, `vendor/async-nats/PATCHED.md`)
//! as reserved headers; the inbox turns them back into the exact bytes ([`Unparsed`]) so such
//! a message is leased like any other.
//!
//! May import: `domain`. Nothing of the gateway above the NATS boundary.

use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use anyhow::Context as _;
use async_nats::header::{UNPARSED_HEADERS, UNPARSED_REPLY, UNPARSED_SUBJECT};
use async_nats::jetstream::consumer;
use async_nats::{HeaderMap, Subject};
use bytes::Bytes;
use futures::StreamExt as _;
use futures::stream::{AbortHandle, Abortable, Stream};
use tokio::time::Instant;
use tracing::{info, warn};

use crate::domain::delivery::{Delivery, Unparsed};
use crate::domain::lease_id::{DeliveryKey, LeaseCoordinates};

use super::{API_TIMEOUT, Bound};

/// Subscribing only queues a command; it blocks when the queue is full while disconnected.
const SUBSCRIBE_TIMEOUT: Duration = Duration::from_secs(1);

/// What a pull's inbox yields to the dispatcher. Nearly every one is a delivery, so it
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

/// A pull's inbox as the dispatcher polls it: ends once the server ended the pull, or when
/// its [`PullHandle`] aborted it.
pub(crate) type PullInbox = Abortable<Inbox>;

/// Open a pull for up to `batch` messages: subscribe a fresh inbox and send the pull request.
/// The inbox, to poll for what arrives, and its handle; `None` (logged) when the
/// subscription or the request could not be made: the caller tries again later.
pub(crate) async fn open(
    bound: &Bound,
    pull_id: u64,
    batch: usize,
    expires: Option<Duration>,
    keep_open: bool,
    pin: Option<&PinRequest<'_>>,
) -> Option<(PullInbox, PullHandle)> {
    let inbox = bound.client.new_inbox();
    // Subscribe before asking: the server delivers only where there is interest.
    let subscribed =
        tokio::time::timeout(SUBSCRIBE_TIMEOUT, bound.client.subscribe(inbox.clone())).await;
    let Ok(Ok(subscriber)) = subscribed else {
        warn!("could not subscribe a pull inbox");
        return None;
    };
    if let Err(err) = request_pull(bound, inbox, batch, expires, keep_open, pin).await {
        warn!(error = %err, "pull request failed");
        return None;
    }
    let alive = Arc::new(());
    let handle_alive = Arc::downgrade(&alive);
    let inbox = Inbox {
        pull_id,
        batch,
        epoch: bound.epoch,
        delivered: 0,
        ended: false,
        subscriber,
        jetstream: Some(bound.jetstream.clone()),
        _alive: alive,
    };
    let (abort, registration) = AbortHandle::new_pair();
    Some((
        Abortable::new(inbox, registration),
        PullHandle {
            abort,
            alive: handle_alive,
        },
    ))
}

/// The consumer's leader elections (`$JS.EVENT.ADVISORY.CONSUMER.LEADER_ELECTED`, on a
/// cluster): a pull waiting at a leader that died outright (killed: one that steps down ends
/// its pulls with a status) is gone without a word, and an idle stream's pull waits for up
/// to a minute. `None` when the subscription cannot be made (no permission): pulls are then
/// asked again when they expire.
pub(crate) async fn leader_elections(bound: &Bound) -> Option<async_nats::Subscriber> {
    let stream = &bound.consumer.cached_info().stream_name;
    let subject = format!(
        "$JS.EVENT.ADVISORY.CONSUMER.LEADER_ELECTED.{stream}.{}",
        bound.consumer_name
    );
    match tokio::time::timeout(SUBSCRIBE_TIMEOUT, bound.client.subscribe(subject)).await {
        Ok(Ok(subscriber)) => Some(subscriber),
        _ => {
            info!(
                "cannot follow the consumer's leader elections: a pull lost with a killed leader is asked again when it expires"
            );
            None
        }
    }
}

/// Give up this process's pin of an ordered consumer's priority group (it is stopping): the
/// server pins the next replica that pulls at once, not after the pin timeout.
pub(crate) async fn unpin(bound: &Bound, group: &str) -> anyhow::Result<()> {
    let info = bound.consumer.cached_info();
    let subject = format!("CONSUMER.UNPIN.{}.{}", info.stream_name, info.name);
    let answer: serde_json::Value = tokio::time::timeout(
        API_TIMEOUT,
        bound
            .jetstream
            .request(subject, &serde_json::json!({ "group": group })),
    )
    .await
    .context("timed out asking to unpin")?
    .context("asking to unpin")?;
    if let Some(error) = answer.get("error") {
        anyhow::bail!("the server refused to unpin: {error}");
    }
    Ok(())
}

/// The last stream sequence the server delivered on the consumer, now; `None` when it cannot
/// be read.
pub(crate) async fn delivered_stream_sequence(bound: &Bound) -> Option<u64> {
    let info = tokio::time::timeout(SUBSCRIBE_TIMEOUT, bound.consumer.get_info()).await;
    match info {
        Ok(Ok(info)) => Some(info.delivered.stream_sequence),
        _ => None,
    }
}

/// How many messages the server counts delivered and not yet acked on the consumer, now;
/// `None` when it cannot be read.
pub(crate) async fn ack_pending(bound: &Bound) -> Option<usize> {
    let info = tokio::time::timeout(SUBSCRIBE_TIMEOUT, bound.consumer.get_info()).await;
    match info {
        Ok(Ok(info)) => Some(info.num_ack_pending),
        _ => None,
    }
}

/// What the dispatcher keeps of an open pull's inbox: stops reading it, and tells whether
/// it is still read.
pub(crate) struct PullHandle {
    abort: AbortHandle,
    alive: Weak<()>,
}

impl PullHandle {
    /// Stop reading the inbox: it ends at its next poll, and unsubscribes.
    pub(crate) fn abort(&self) {
        self.abort.abort();
    }

    /// Whether the inbox ended (the server ended the pull, or it was aborted) and is gone.
    pub(crate) fn is_finished(&self) -> bool {
        self.alive.strong_count() == 0
    }
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
    pin: Option<&PinRequest<'_>>,
) -> anyhow::Result<()> {
    let no_wait = !(keep_open && expires.is_some());
    if let Some(pin) = pin {
        return request_pinned_pull(bound, inbox, batch, expires, no_wait, pin).await;
    }
    let request = consumer::pull::BatchConfig {
        batch,
        expires,
        no_wait,
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

/// The priority group an ordered consumer's pulls name, and the pin this process holds.
pub(crate) struct PinRequest<'a> {
    pub(crate) group: &'a str,
    pub(crate) id: Option<&'a str>,
}

/// A pull request naming a priority group, and the pin id once the server gave one
/// (async-nats' `BatchConfig` has no field for the id).
#[derive(serde::Serialize)]
struct PinnedPull<'a> {
    batch: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    expires: Option<u64>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    no_wait: bool,
    group: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a str>,
}

async fn request_pinned_pull(
    bound: &Bound,
    inbox: String,
    batch: usize,
    expires: Option<Duration>,
    no_wait: bool,
    pin: &PinRequest<'_>,
) -> anyhow::Result<()> {
    let info = bound.consumer.cached_info();
    let subject = format!(
        "$JS.API.CONSUMER.MSG.NEXT.{}.{}",
        info.stream_name, info.name
    );
    let request = PinnedPull {
        batch,
        expires: expires.map(|expires| u64::try_from(expires.as_nanos()).unwrap_or(u64::MAX)),
        no_wait,
        group: pin.group,
        id: pin.id,
    };
    let payload = serde_json::to_vec(&request).context("encoding a pull request")?;
    tokio::time::timeout(
        API_TIMEOUT,
        bound
            .client
            .publish_with_reply(subject, inbox, payload.into()),
    )
    .await
    .context("timed out sending a pull request")?
    .context("sending a pull request")
}

/// One pull's inbox: yields its messages, stamped with their arrival and parsed, until the
/// server ended the pull (a status, or the whole batch delivered); dropping it unsubscribes.
pub(crate) struct Inbox {
    pull_id: u64,
    batch: usize,
    epoch: u32,
    delivered: usize,
    ended: bool,
    subscriber: async_nats::Subscriber,
    /// Lent to each message for its parsing (see [`delivery`]); `None` only meanwhile.
    jetstream: Option<async_nats::jetstream::Context>,
    /// Held while the inbox lives; its [`PullHandle`] watches it.
    _alive: Arc<()>,
}

impl Stream for Inbox {
    type Item = PullEvent;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<PullEvent>> {
        let this = &mut *self;
        loop {
            if this.ended {
                return Poll::Ready(None);
            }
            let Some(message) = ready!(this.subscriber.poll_next_unpin(cx)) else {
                return Poll::Ready(None);
            };
            let received_at = Instant::now();
            let pull_id = this.pull_id;
            match message.status {
                Some(status) if status.as_u16() == 100 => {}
                Some(status) => {
                    this.ended = true;
                    return Poll::Ready(Some(PullEvent::Ended {
                        pull_id,
                        status: status.as_u16(),
                        description: message.description.unwrap_or_default(),
                    }));
                }
                None => {
                    this.delivered += 1;
                    this.ended = this.delivered >= this.batch;
                    let Some(jetstream) = this.jetstream.take() else {
                        return Poll::Ready(None);
                    };
                    let (parsed, lent_back) = delivery(jetstream, this.epoch, message, received_at);
                    this.jetstream = Some(lent_back);
                    return Poll::Ready(Some(match parsed {
                        Ok(delivery) => PullEvent::Delivery { pull_id, delivery },
                        Err(reply) => PullEvent::Unusable { pull_id, reply },
                    }));
                }
            }
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
