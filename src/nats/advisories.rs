//! The advisory stream: a consumer's `MAX_DELIVERIES` and `MSG_TERMINATED` advisories are
//! plain publishes, missed by whoever is not subscribed at that instant (a gateway killed,
//! restarting, or not yet connected). A stream the gateway creates per consumed stream,
//! `RUSTSTREAM_ADVISORIES_<stream>_<hash>`, captures those of every consumer of that stream,
//! and a durable pull consumer per dead-lettering consumer, `ruststream-dead-letters_<name>`,
//! filtered to its advisories, hands each to a gateway until one acks it — after its copy is
//! stored, or known to have nothing to copy — so every advisory is handled at least once.
//! Replicas of the gateway share the durable consumer, and so the work.
//!
//! Releases before made a stream per consumer (`RUSTSTREAM_ADVISORIES_<stream>_<consumer>`,
//! durable `ruststream-dead-letters`): where one exists it is used as before, and while one
//! exists on a stream the server refuses the per-stream one (their subjects overlap), so a
//! consumer of that stream gets one of its own, as before.
//!
//! May import: `config`, `domain`, `metrics`. Nothing of the gateway above the boundary.

use std::sync::Arc;
use std::time::Duration;

use async_nats::Client;
use async_nats::jetstream::{self, AckKind, consumer, stream};
use futures::StreamExt as _;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::metrics::Metrics;

use super::API_TIMEOUT;
use super::dead_letter::{self, CONCURRENCY, Handled, Target};

/// Advisories older than this are dropped: long enough for a gateway to be restarted, short
/// enough that the stream stays small.
pub(crate) const MAX_AGE: Duration = Duration::from_secs(60 * 60);
/// And the stream never holds more than this (an advisory is about 400 bytes: some 160 000).
pub(crate) const MAX_BYTES: i64 = 64 * 1024 * 1024;
/// The durable consumer on a per-consumer advisory stream of an earlier release, and the
/// start of the names of those on a per-stream one.
pub(crate) const CONSUMER: &str = "ruststream-dead-letters";
/// How long a gateway may hold an advisory unacked before the server hands it to another
/// (or to the same after a restart): short, so a crashed gateway's advisories come back
/// soon. A copy that takes longer keeps its advisory with in-progress acks.
const ACK_WAIT: Duration = Duration::from_secs(10);

/// The per-consumer advisory stream of `stream`/`consumer`: see [`super::gateway_stream_name`].
pub(crate) fn stream_name(stream: &str, consumer: &str) -> String {
    super::gateway_stream_name("RUSTSTREAM_ADVISORIES", stream, consumer)
}

/// The advisory stream of every consumer of `stream`: see [`super::gateway_stream_name_of`].
pub(crate) fn stream_name_of(stream: &str) -> String {
    super::gateway_stream_name_of("RUSTSTREAM_ADVISORIES", stream)
}

/// The durable consumer of `consumer`'s advisories on its stream's advisory stream.
fn consumer_name(consumer: &str) -> String {
    let name = format!("{CONSUMER}_{consumer}");
    if name.len() <= 255 {
        return name;
    }
    format!("{CONSUMER}_{}", super::sha256_hex(consumer.as_bytes(), 16))
}

/// What the advisory stream of all consumers of `stream` captures.
fn stream_subjects(stream: &str) -> Vec<String> {
    vec![
        format!("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.*"),
        format!("$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{stream}.*"),
    ]
}

/// The name of the per-consumer stream an earlier release made for `target`, where a
/// stream of that name (the oldest, or the one with a hash) captures exactly these advisories
/// (and so is this pair's, not another's whose names run together).
async fn existing_per_consumer(
    js: &jetstream::Context,
    target: &Target,
    subjects: &[String],
) -> Option<String> {
    for name in [
        super::legacy_gateway_stream_name(
            "RUSTSTREAM_ADVISORIES",
            &target.stream,
            &target.consumer,
        ),
        stream_name(&target.stream, &target.consumer),
    ] {
        let Ok(Ok(existing)) = tokio::time::timeout(API_TIMEOUT, js.get_stream(&name)).await else {
            continue;
        };
        let mut theirs = existing.cached_info().config.subjects.clone();
        theirs.sort();
        if theirs == subjects {
            return Some(name);
        }
    }
    None
}

/// Why the advisory stream or its consumer could not be set up.
enum SetupError {
    /// The server refused (another stream captures the subjects, the name is taken by a
    /// stream capturing something else): retrying will not help.
    Refused(String),
    /// NATS is unreachable or slow; try again.
    Transient(anyhow::Error),
}

impl From<anyhow::Error> for SetupError {
    fn from(err: anyhow::Error) -> Self {
        Self::Transient(err)
    }
}

/// Dead-letter the advisories of `target` through its advisory stream until `stop`. When the
/// stream cannot be had, dead-letter from a live subscription instead (and say so).
pub(crate) async fn run<M>(client: Client, target: Target, metrics: M, stop: CancellationToken)
where
    M: AsRef<Metrics> + Clone + Send + 'static,
{
    let js = jetstream::new(client.clone());
    let target = Arc::new(target);
    let mut backoff = Duration::from_millis(250);
    loop {
        let consumer = match ensure(&js, &target).await {
            Ok(consumer) => consumer,
            Err(SetupError::Refused(reason)) => {
                error!(%reason, "no advisory stream; falling back to a live subscription");
                let target = Arc::unwrap_or_clone(target);
                return dead_letter::listen(client, target, metrics, stop).await;
            }
            Err(SetupError::Transient(err)) => {
                debug!(error = %format!("{err:#}"), retry_in = ?backoff, "cannot set up the advisory stream yet");
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        backoff = Duration::from_millis(250);
        if drain(&js, consumer, &target, &metrics, &stop)
            .await
            .is_err()
        {
            return;
        }
        // The consumer (or its stream) was deleted: set it up again.
    }
}

/// Set up the advisory stream and its consumer while binding, so that it captures the
/// advisories of every lease the binding issues. An error is one worth retrying; a refusal
/// is left to [`run`], which reports it and falls back.
pub(crate) async fn prepare(js: &jetstream::Context, target: &Target) -> anyhow::Result<()> {
    match ensure(js, target).await {
        Ok(_) | Err(SetupError::Refused(_)) => Ok(()),
        Err(SetupError::Transient(err)) => Err(err),
    }
}

/// Create the advisory stream and the durable consumer of `target`'s advisories on it, or
/// bring them to the config wanted.
async fn ensure(
    js: &jetstream::Context,
    target: &Target,
) -> Result<consumer::PullConsumer, SetupError> {
    let mut own = dead_letter::advisory_subjects(target).to_vec();
    own.sort();
    if let Some(name) = existing_per_consumer(js, target, &own).await {
        let stream = ensure_stream(js, target, &name, &own).await?;
        return ensure_consumer(&stream, &name, CONSUMER.to_owned(), Vec::new(), target).await;
    }
    let name = stream_name_of(&target.stream);
    match ensure_stream(js, target, &name, &stream_subjects(&target.stream)).await {
        Ok(stream) => {
            ensure_consumer(&stream, &name, consumer_name(&target.consumer), own, target).await
        }
        Err(SetupError::Refused(reason)) => {
            // Per-consumer streams of an earlier release on this stream overlap it.
            let name = stream_name(&target.stream, &target.consumer);
            info!(%reason, stream = %name, "no advisory stream for the whole stream; one for this consumer alone, as earlier releases made");
            let stream = ensure_stream(js, target, &name, &own).await?;
            ensure_consumer(&stream, &name, CONSUMER.to_owned(), Vec::new(), target).await
        }
        Err(err) => Err(err),
    }
}

/// Create the advisory stream `name` capturing `subjects`, or bring its limits to the
/// config wanted; refused when a stream of that name captures something else.
async fn ensure_stream(
    js: &jetstream::Context,
    target: &Target,
    name: &str,
    subjects: &[String],
) -> Result<stream::Stream, SetupError> {
    use anyhow::Context as _;
    let mut subjects = subjects.to_vec();
    subjects.sort();
    // As many replicas as the stream whose advisories it holds: as available as that one.
    let source = tokio::time::timeout(API_TIMEOUT, js.get_stream(&target.stream))
        .await
        .context("timed out looking up the consumed stream")?
        .context("looking up the consumed stream")?;
    let wanted = stream::Config {
        name: name.to_owned(),
        description: Some(format!(
            "ruststream-nats: dead-letter advisories of {} (made by the gateway)",
            target.stream
        )),
        subjects: subjects.clone(),
        retention: stream::RetentionPolicy::Limits,
        discard: stream::DiscardPolicy::Old,
        max_age: MAX_AGE,
        max_bytes: MAX_BYTES,
        storage: stream::StorageType::File,
        num_replicas: source.cached_info().config.num_replicas.max(1),
        ..Default::default()
    };
    let found = tokio::time::timeout(API_TIMEOUT, js.get_stream(name))
        .await
        .context("timed out looking up the advisory stream")?;
    match found {
        Ok(mut existing) => {
            let current = existing.cached_info().config.clone();
            let mut theirs = current.subjects.clone();
            theirs.sort();
            if theirs != subjects {
                return Err(SetupError::Refused(format!(
                    "stream {name} exists capturing {theirs:?}, not the advisories {subjects:?}"
                )));
            }
            if (current.max_age, current.max_bytes, current.discard)
                != (wanted.max_age, wanted.max_bytes, wanted.discard)
            {
                let mut updated = current;
                updated.max_age = wanted.max_age;
                updated.max_bytes = wanted.max_bytes;
                updated.discard = wanted.discard;
                let result = tokio::time::timeout(API_TIMEOUT, js.update_stream(updated))
                    .await
                    .context("timed out updating the advisory stream")?;
                result.map_err(|err| refused_or_transient(name, "update", err))?;
                info!(stream = %name, "updated the advisory stream's limits");
                existing = tokio::time::timeout(API_TIMEOUT, js.get_stream(name))
                    .await
                    .context("timed out looking up the advisory stream")?
                    .context("looking up the advisory stream")?;
            }
            Ok(existing)
        }
        Err(err) if super::is_stream_not_found(&err) => {
            let created = tokio::time::timeout(API_TIMEOUT, js.create_stream(wanted))
                .await
                .context("timed out creating the advisory stream")?;
            let created = created.map_err(|err| refused_or_transient(name, "create", err))?;
            info!(stream = %name, subjects = ?subjects, "created the advisory stream");
            Ok(created)
        }
        Err(err) => Err(SetupError::Transient(
            anyhow::Error::new(err).context("looking up the advisory stream"),
        )),
    }
}

/// Create (or update: every gateway sends the same config, so replicas agree) the durable
/// consumer `durable` on the advisory stream `name`, taking `filter_subjects` (all, when
/// empty).
async fn ensure_consumer(
    stream: &stream::Stream,
    name: &str,
    durable: String,
    filter_subjects: Vec<String>,
    target: &Target,
) -> Result<consumer::PullConsumer, SetupError> {
    use anyhow::Context as _;
    let config = consumer::pull::Config {
        durable_name: Some(durable.clone()),
        description: Some(format!(
            "ruststream-nats: copies dead letters of {}/{}",
            target.stream, target.consumer
        )),
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait: ACK_WAIT,
        filter_subjects,
        ..Default::default()
    };
    let created = tokio::time::timeout(API_TIMEOUT, stream.create_consumer(config))
        .await
        .context("timed out creating the advisory consumer")?;
    let consumer = created.map_err(|err| match err.kind() {
        jetstream::stream::ConsumerErrorKind::JetStream(js) if js.code() < 500 => {
            SetupError::Refused(format!(
                "the server refused consumer {durable} on {name}: {err}"
            ))
        }
        _ => {
            SetupError::Transient(anyhow::Error::new(err).context("creating the advisory consumer"))
        }
    })?;
    info!(stream = %name, consumer = %durable, dead_letter_subject = %target.subject, "dead-lettering from the advisory stream");
    Ok(consumer)
}

/// A 4xx from the JetStream API is about the request (subjects overlapping another stream's,
/// limits over the account's): the operator must act. Anything else may pass.
fn refused_or_transient(
    name: &str,
    action: &str,
    err: jetstream::context::CreateStreamError,
) -> SetupError {
    match err.kind() {
        // Another gateway created it between our look and our create: look again.
        jetstream::context::CreateStreamErrorKind::JetStream(js)
            if js.error_code() == jetstream::ErrorCode::STREAM_NAME_EXIST =>
        {
            SetupError::Transient(anyhow::Error::new(err).context(format!("{action} {name}")))
        }
        jetstream::context::CreateStreamErrorKind::JetStream(js) if js.code() < 500 => {
            SetupError::Refused(format!("cannot {action} stream {name}: {err}"))
        }
        _ => SetupError::Transient(anyhow::Error::new(err).context(format!("{action} {name}"))),
    }
}

/// Hand the consumer's advisories to copy tasks until the consumer goes away (`Ok`) or
/// `stop` (`Err`).
async fn drain<M>(
    js: &jetstream::Context,
    consumer: consumer::PullConsumer,
    target: &Arc<Target>,
    metrics: &M,
    stop: &CancellationToken,
) -> Result<(), ()>
where
    M: AsRef<Metrics> + Clone + Send + 'static,
{
    // Few at a time: an advisory waiting in the client burns its ack_wait.
    let pulled = consumer
        .stream()
        .max_messages_per_batch(CONCURRENCY)
        .expires(Duration::from_secs(10))
        .heartbeat(Duration::from_secs(5))
        .messages()
        .await;
    let mut advisories = match pulled {
        Ok(advisories) => advisories,
        Err(err) => {
            debug!(error = %err, "cannot pull advisories yet");
            tokio::select! {
                () = stop.cancelled() => return Err(()),
                () = tokio::time::sleep(Duration::from_secs(1)) => return Ok(()),
            }
        }
    };
    let handlers = dead_letter::Handlers::new(stop);
    loop {
        let next = tokio::select! {
            () = stop.cancelled() => return Err(()),
            next = advisories.next() => next,
        };
        let message = match next {
            None => return Ok(()),
            Some(Ok(message)) => message,
            Some(Err(err)) => match err.kind() {
                consumer::pull::MessagesErrorKind::ConsumerDeleted => {
                    warn!("the advisory consumer was deleted; setting it up again");
                    return Ok(());
                }
                // Expected while NATS is away; the stream pulls again on its own.
                consumer::pull::MessagesErrorKind::MissingHeartbeat
                | consumer::pull::MessagesErrorKind::NoResponders => {
                    debug!(error = %err, "pulling advisories");
                    continue;
                }
                _ => {
                    warn!(error = %err, "pulling advisories");
                    continue;
                }
            },
        };
        let (js, target, metrics) = (js.clone(), target.clone(), metrics.clone());
        // Stopped unacked, the advisory comes back after ACK_WAIT (to another replica, or to
        // this gateway's successor).
        let copy = async move { handle(&js, &target, message, metrics.as_ref()).await };
        if !handlers.spawn(copy).await {
            return Err(());
        }
    }
}

/// Copy the message one advisory names, then ack the advisory; terminate it when it cannot
/// be read or the copy gave up (it stays in the advisory stream until MAX_AGE, for an
/// operator to look at).
async fn handle(
    js: &jetstream::Context,
    target: &Target,
    message: jetstream::Message,
    metrics: &Metrics,
) {
    let read = dead_letter::read_advisory(message.subject.as_str(), &message.payload);
    let (advisory, cause) = match read {
        Ok(read) => read,
        Err(err) => {
            warn!(error = %err, subject = %message.subject, "unreadable advisory terminated");
            settle(&message, AckKind::Term).await;
            return;
        }
    };
    let copy = dead_letter::dead_letter(js, target, &advisory, &cause, metrics);
    // A copy retried for a while keeps its advisory rather than have it handed to another.
    let keep = async {
        let mut every = tokio::time::interval(ACK_WAIT / 3);
        every.tick().await;
        loop {
            every.tick().await;
            settle(&message, AckKind::Progress).await;
        }
    };
    let handled = tokio::select! {
        handled = copy => handled,
        never = keep => match never {},
    };
    match handled {
        Handled::Done => settle(&message, AckKind::Ack).await,
        Handled::GaveUp => settle(&message, AckKind::Term).await,
    }
}

/// Send an ack of `kind` for an advisory. Not confirmed: one that is lost brings the
/// advisory back after ACK_WAIT, and its copy is then a duplicate the dead-letter stream
/// drops.
async fn settle(message: &jetstream::Message, kind: AckKind) {
    // Publishing only queues, but blocks once the queue is full while disconnected.
    match tokio::time::timeout(API_TIMEOUT, message.ack_with(kind)).await {
        Ok(Ok(())) => {}
        Ok(Err(err)) => debug!(error = %err, "could not ack an advisory; it comes back"),
        Err(_) => debug!("timed out acking an advisory; it comes back"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stream_is_named_after_stream_and_consumer() {
        assert!(
            stream_name("ORDERS", "billing").starts_with("RUSTSTREAM_ADVISORIES_ORDERS_billing_")
        );
        let long = "c".repeat(250);
        let name = stream_name("ORDERS", &long);
        assert!(name.len() <= 255, "{name}");
        assert!(name.starts_with("RUSTSTREAM_ADVISORIES_"), "{name}");
        assert_ne!(name, stream_name("ORDERS2", &long));
    }

    #[test]
    fn one_stream_per_consumed_stream_one_durable_per_consumer() {
        let of_orders = stream_name_of("ORDERS");
        assert!(
            of_orders.starts_with("RUSTSTREAM_ADVISORIES_ORDERS_"),
            "{of_orders}"
        );
        // Never a per-consumer stream's name, whatever the consumer.
        assert_ne!(of_orders, stream_name("ORDERS", ""));
        assert_ne!(stream_name_of("A_b"), stream_name("A", "b"));
        assert_eq!(
            stream_subjects("ORDERS"),
            [
                "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.ORDERS.*",
                "$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.ORDERS.*"
            ]
        );
        assert_eq!(consumer_name("billing"), "ruststream-dead-letters_billing");
        let long = consumer_name(&"c".repeat(250));
        assert!(
            long.len() <= 255 && long.starts_with("ruststream-dead-letters_"),
            "{long}"
        );
    }
}
