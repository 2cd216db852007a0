//! Pulls: a pull request for one waiting fetch, on an inbox of its own, and the task that
//! reads that inbox — stamping each delivery with its arrival time and parsing it — until
//! the server ends the pull.
//!
//! Each pull has its own inbox subscription (a delivery carries its stream subject, so only
//! the subscription tells which pull it answers). The reader parses on arrival, which keeps
//! parsing off the dispatcher's path, and a lease counts from when the delivery arrived,
//! however busy the dispatcher is.
//!
//! May import: `domain`. Nothing of the gateway above the NATS boundary.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use async_nats::Subject;
use async_nats::jetstream::consumer;
use futures::StreamExt as _;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::warn;

use crate::domain::delivery::Delivery;
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
    if let Err(err) = request_pull(bound, inbox, batch, expires).await {
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
/// to that long for a first message; either way it ends as soon as it delivered something
/// and nothing more is available (`no_wait`), which is exactly a fetch's contract.
async fn request_pull(
    bound: &Bound,
    inbox: String,
    batch: usize,
    expires: Option<Duration>,
) -> anyhow::Result<()> {
    let request = consumer::pull::BatchConfig {
        batch,
        expires,
        no_wait: true,
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
    jetstream: async_nats::jetstream::Context,
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
                let forward = match delivery(&jetstream, epoch, message, received_at) {
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

/// A delivery from a JetStream message, or `None` (logged) for anything else.
fn delivery(
    jetstream: &async_nats::jetstream::Context,
    epoch: u32,
    message: async_nats::Message,
    received_at: Instant,
) -> Result<Delivery, Option<Subject>> {
    let message = async_nats::jetstream::Message {
        message,
        context: jetstream.clone(),
    };
    let info = match message.info() {
        Ok(info) => info,
        Err(err) => {
            warn!(error = %err, subject = %message.subject, "a message that is not a JetStream delivery; nak'ing it");
            return Err(message.message.reply);
        }
    };
    let coordinates = LeaseCoordinates {
        // The binding the pull was made under: a delivery of an earlier one is never leased.
        epoch,
        key: DeliveryKey {
            stream_sequence: info.stream_sequence,
            delivered: u64::try_from(info.delivered).unwrap_or(1),
        },
        consumer_sequence: info.consumer_sequence,
        published_unix_nanos: i64::try_from(info.published.unix_timestamp_nanos()).unwrap_or(0),
    };
    let stream = info.stream.to_owned();
    let consumer = info.consumer.to_owned();
    let pending = info.pending;
    let published_at = info.published;
    let reply: Arc<str> = Arc::from(message.reply.as_deref().unwrap_or_default());
    let message = message.message;
    Ok(Delivery {
        coordinates,
        reply,
        subject: message.subject,
        payload: message.payload,
        headers: message.headers,
        stream,
        consumer,
        pending,
        published_at,
        received_at,
    })
}
