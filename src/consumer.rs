//! The NATS boundary: connect, create or bind the consumer, send pull requests, and settle
//! deliveries with the server's confirmation.
//!
//! Everything that speaks to NATS lives here; callers see plain results and typed failures.

use std::time::Duration;

use anyhow::Context as _;
use async_nats::jetstream::{self, consumer, stream};
use async_nats::{Client, ConnectOptions, Event};
use bytes::Bytes;
use tokio::sync::mpsc;
use tracing::{info, warn};

use crate::config::{Config, DeliverPolicy, UrlCredentials};

/// How long any JetStream API call on the start-up path may take before it is retried.
const API_TIMEOUT: Duration = Duration::from_secs(5);

/// A consumer the gateway is bound to, and what it needs to use it.
#[derive(Clone)]
pub struct Bound {
    pub client: Client,
    pub jetstream: jetstream::Context,
    pub consumer: consumer::PullConsumer,
    /// The consumer's name.
    pub consumer_name: String,
    /// When the consumer was created: with the name, its identity across rebinds.
    pub created: time::OffsetDateTime,
    /// The last consumer sequence the server has on record as delivered.
    pub delivered_consumer_sequence: u64,
    /// The lease epoch of this binding (set by the supervisor): stamped on every delivery
    /// pulled through it.
    pub epoch: u32,
    /// Subjects the stream captures: what `POST /publish` may publish to.
    pub stream_subjects: Vec<String>,
    /// Effective settings read back from the server.
    pub ack_wait: Duration,
    pub max_ack_pending: usize,
    pub max_waiting: usize,
    /// The consumer's own limits on one pull request, when it has any.
    pub max_batch: Option<usize>,
    pub max_expires: Option<Duration>,
}

/// Why binding failed.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// Retrying cannot help: the operator must change something.
    #[error("{0}")]
    Fatal(String),
    /// NATS is unreachable or slow; try again.
    #[error(transparent)]
    Transient(#[from] anyhow::Error),
}

/// Connect to NATS. Returns at once; the client keeps (re)connecting in the background and
/// reports connection events on `events`.
pub async fn connect(
    config: &Config,
    events: mpsc::UnboundedSender<Event>,
) -> anyhow::Result<Client> {
    let mut options = ConnectOptions::new()
        .name("ruststream-nats")
        .retry_on_initial_connect()
        // The default 60 s ping notices a dead socket only after minutes; leases are shorter.
        .ping_interval(Duration::from_secs(10))
        .event_callback(move |event| {
            let events = events.clone();
            async move {
                let _ = events.send(event);
            }
        });
    options = authenticate(options, config).await?;
    // async-nats parses a string as one URL; a cluster's list is comma-separated. Credentials
    // in the URLs go in as options: the client logs the URLs it connects to.
    let servers = config.nats_servers().map_err(anyhow::Error::msg)?;
    options = match servers.credentials {
        Some(UrlCredentials::UserPassword(user, password)) => {
            options.user_and_password(user, password.expose().to_owned())
        }
        Some(UrlCredentials::Token(token)) => options.token(token.expose().to_owned()),
        None => options,
    };
    let urls: Vec<&str> = servers.urls.iter().map(String::as_str).collect();
    options
        .connect(urls.as_slice())
        .await
        .with_context(|| format!("connecting to {}", config.nats_url_redacted()))
}

/// Add the configured NATS authentication and TLS to `options`. Files are read and checked
/// here, so a wrong path or a malformed seed stops the start with a clear error instead of an
/// endless reconnect loop. No error names a secret: only paths and what is wrong with them.
async fn authenticate(
    mut options: ConnectOptions,
    config: &Config,
) -> anyhow::Result<ConnectOptions> {
    if let Some(creds) = &config.nats_creds {
        options = options
            .credentials_file(creds)
            .await
            .with_context(|| format!("reading NATS credentials file {}", creds.display()))?;
    }
    if let Some(path) = &config.nats_nkey {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading NATS nkey seed file {}", path.display()))?;
        // The file may hold comments or other lines (as `nsc` writes them): take the seed line.
        let seed = text
            .lines()
            .map(str::trim)
            .find(|line| line.starts_with("SU"))
            .filter(|seed| nkeys::KeyPair::from_seed(seed).is_ok())
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "NATS nkey seed file {} holds no valid user seed (a line starting with SU)",
                    path.display()
                )
            })?;
        options = options.nkey(seed.to_owned());
    }
    if let (Some(user), Some(password)) = (&config.nats_user, &config.nats_password) {
        options = options.user_and_password(user.clone(), password.expose().to_owned());
    }
    if let Some(token) = &config.nats_token {
        options = options.token(token.expose().to_owned());
    }
    let readable = |path: &std::path::Path, what: &str| {
        std::fs::metadata(path)
            .map(|_| ())
            .with_context(|| format!("reading NATS {what} {}", path.display()))
    };
    if let Some(ca) = &config.nats_tls_ca {
        readable(ca, "TLS CA certificate")?;
        options = options.add_root_certificates(ca.clone()).require_tls(true);
    }
    if let (Some(cert), Some(key)) = (&config.nats_tls_cert, &config.nats_tls_key) {
        readable(cert, "TLS client certificate")?;
        readable(key, "TLS client key")?;
        options = options
            .add_client_certificate(cert.clone(), key.clone())
            .require_tls(true);
    }
    Ok(options)
}

/// Find the stream, create or bind the consumer, and reconcile its mutable settings.
///
/// `ephemeral_name` (with `--ephemeral`) is chosen once per process: binding again after a
/// reconnect finds the same consumer instead of making a new one that replays the stream.
pub async fn bind(
    config: &Config,
    client: &Client,
    ephemeral_name: &str,
) -> Result<Bound, BindError> {
    let js = jetstream::new(client.clone());
    let stream = get_or_create_stream(config, &js).await?;
    let stream_subjects = stream.cached_info().config.subjects.clone();
    let mut consumer = if config.ephemeral {
        let mut ephemeral = desired_config(config, None);
        ephemeral.name = Some(ephemeral_name.to_owned());
        create_consumer(&stream, ephemeral).await?
    } else {
        bind_durable(config, &stream).await?
    };
    // Read the consumer's state back: the create/update reply right after a server restart
    // carries a fresh `created`, consumer info the real one (and the delivered position).
    let info = tokio::time::timeout(API_TIMEOUT, consumer.info())
        .await
        .map_err(|_| anyhow::anyhow!("timed out reading consumer info"))?
        .map_err(|err| anyhow::Error::new(err).context("reading consumer info"))?
        .clone();
    info!(
        stream = %config.stream,
        consumer = %info.name,
        ack_wait = ?info.config.ack_wait,
        max_ack_pending = info.config.max_ack_pending,
        "bound to consumer"
    );
    Ok(Bound {
        client: client.clone(),
        jetstream: js,
        consumer_name: info.name.clone(),
        created: info.created,
        delivered_consumer_sequence: info.delivered.consumer_sequence,
        epoch: 0,
        stream_subjects,
        ack_wait: info.config.ack_wait,
        max_ack_pending: usize::try_from(info.config.max_ack_pending).unwrap_or(usize::MAX),
        max_waiting: usize::try_from(info.config.max_waiting).unwrap_or(512),
        max_batch: usize::try_from(info.config.max_batch)
            .ok()
            .filter(|max| *max > 0),
        max_expires: Some(info.config.max_expires).filter(|max| !max.is_zero()),
        consumer,
    })
}

async fn get_or_create_stream(
    config: &Config,
    js: &jetstream::Context,
) -> Result<stream::Stream, BindError> {
    let found = tokio::time::timeout(API_TIMEOUT, js.get_stream(&config.stream))
        .await
        .map_err(|_| anyhow::anyhow!("timed out asking for stream {}", config.stream))?;
    match found {
        Ok(stream) => Ok(stream),
        Err(err) if is_stream_not_found(&err) => {
            if !config.create_stream {
                return Err(BindError::Fatal(format!(
                    "stream {} does not exist on {} (create it, or pass --create-stream)",
                    config.stream,
                    config.nats_url_redacted()
                )));
            }
            let created = tokio::time::timeout(
                API_TIMEOUT,
                js.create_stream(stream::Config {
                    name: config.stream.clone(),
                    subjects: config.stream_subjects.clone(),
                    ..Default::default()
                }),
            )
            .await
            .map_err(|_| anyhow::anyhow!("timed out creating stream {}", config.stream))?;
            let created = created.map_err(|err| {
                BindError::Fatal(format!(
                    "could not create stream {} on {}: {err}",
                    config.stream,
                    config.nats_url_redacted()
                ))
            })?;
            info!(stream = %config.stream, subjects = ?config.stream_subjects, "created stream");
            Ok(created)
        }
        Err(err) => Err(BindError::Transient(
            anyhow::Error::new(err).context(format!("looking up stream {}", config.stream)),
        )),
    }
}

fn is_stream_not_found(err: &jetstream::context::GetStreamError) -> bool {
    matches!(
        err.kind(),
        jetstream::context::GetStreamErrorKind::JetStream(js)
            if js.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
    )
}

/// The consumer config the flags describe. Only ack_wait, max_ack_pending and the deliver
/// policy are always sent (plus filter and max_deliver when given): everything else is left
/// to the server's defaults.
fn desired_config(config: &Config, durable_name: Option<String>) -> consumer::pull::Config {
    consumer::pull::Config {
        durable_name,
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait: config.ack_wait,
        max_ack_pending: i64::from(config.max_ack_pending),
        max_deliver: config.max_deliver.map(i64::from).unwrap_or_default(),
        filter_subject: config.filter_subject.clone().unwrap_or_default(),
        deliver_policy: deliver_policy(&config.deliver_policy),
        ..Default::default()
    }
}

fn deliver_policy(policy: &DeliverPolicy) -> consumer::DeliverPolicy {
    match policy {
        DeliverPolicy::All => consumer::DeliverPolicy::All,
        DeliverPolicy::Last => consumer::DeliverPolicy::Last,
        DeliverPolicy::New => consumer::DeliverPolicy::New,
        DeliverPolicy::LastPerSubject => consumer::DeliverPolicy::LastPerSubject,
        DeliverPolicy::ByStartSequence(start_sequence) => {
            consumer::DeliverPolicy::ByStartSequence {
                start_sequence: *start_sequence,
            }
        }
        DeliverPolicy::ByStartTime(start_time) => consumer::DeliverPolicy::ByStartTime {
            start_time: *start_time,
        },
    }
}

/// A server deliver policy in `--deliver-policy` syntax, for error messages.
fn flag_syntax(policy: &consumer::DeliverPolicy) -> String {
    let policy = match policy {
        consumer::DeliverPolicy::All => DeliverPolicy::All,
        consumer::DeliverPolicy::Last => DeliverPolicy::Last,
        consumer::DeliverPolicy::New => DeliverPolicy::New,
        consumer::DeliverPolicy::LastPerSubject => DeliverPolicy::LastPerSubject,
        consumer::DeliverPolicy::ByStartSequence { start_sequence } => {
            DeliverPolicy::ByStartSequence(*start_sequence)
        }
        consumer::DeliverPolicy::ByStartTime { start_time } => {
            DeliverPolicy::ByStartTime(*start_time)
        }
    };
    policy.to_string()
}

async fn bind_durable(
    config: &Config,
    stream: &stream::Stream,
) -> Result<consumer::PullConsumer, BindError> {
    let existing = tokio::time::timeout(API_TIMEOUT, stream.consumer_info(&config.consumer))
        .await
        .map_err(|_| anyhow::anyhow!("timed out asking for consumer {}", config.consumer))?;
    let existing = match existing {
        Ok(info) => info,
        Err(err)
            if matches!(
                err.kind(),
                jetstream::context::ConsumerInfoErrorKind::NotFound
            ) =>
        {
            info!(consumer = %config.consumer, "creating durable consumer");
            return create_consumer(
                stream,
                desired_config(config, Some(config.consumer.clone())),
            )
            .await;
        }
        Err(err) => {
            return Err(BindError::Transient(
                anyhow::Error::new(err).context(format!("looking up consumer {}", config.consumer)),
            ));
        }
    };
    let current = existing.config;
    let wanted = desired_config(config, Some(config.consumer.clone()));
    check_immutable(config, &current, &wanted)?;

    let mut updated = current.clone();
    updated.ack_wait = wanted.ack_wait;
    updated.max_ack_pending = wanted.max_ack_pending;
    if config.max_deliver.is_some() {
        updated.max_deliver = wanted.max_deliver;
    }
    if config.filter_subject.is_some() {
        updated.filter_subject = wanted.filter_subject.clone();
        updated.filter_subjects.clear();
    }
    let pull_current =
        <consumer::pull::Config as consumer::FromConsumer>::try_from_consumer_config(current)
            .map_err(|err| {
                BindError::Fatal(format!(
                    "consumer {} is not a pull consumer: {err}",
                    config.consumer
                ))
            })?;
    let pull_updated =
        <consumer::pull::Config as consumer::FromConsumer>::try_from_consumer_config(updated)
            .map_err(|err| {
                BindError::Fatal(format!(
                    "consumer {} is not a pull consumer: {err}",
                    config.consumer
                ))
            })?;
    if pull_updated == pull_current {
        info!(consumer = %config.consumer, "bound to existing consumer");
    } else {
        info!(consumer = %config.consumer, "updating existing consumer's ack_wait/max_ack_pending/max_deliver/filter");
    }
    create_consumer(stream, pull_updated).await
}

/// Refuse to start when a field the server cannot change differs from what the flags ask for.
fn check_immutable(
    config: &Config,
    current: &consumer::Config,
    wanted: &consumer::pull::Config,
) -> Result<(), BindError> {
    if current.deliver_policy != wanted.deliver_policy {
        return Err(BindError::Fatal(format!(
            "consumer {} exists with deliver_policy {}, but --deliver-policy is {}; deliver_policy cannot be changed (delete the consumer or change the flag)",
            config.consumer,
            flag_syntax(&current.deliver_policy),
            config.deliver_policy
        )));
    }
    if current.ack_policy != consumer::AckPolicy::Explicit {
        return Err(BindError::Fatal(format!(
            "consumer {} exists with ack_policy {:?}; the gateway needs ack_policy explicit, which cannot be changed",
            config.consumer, current.ack_policy
        )));
    }
    if current.deliver_subject.is_some() {
        return Err(BindError::Fatal(format!(
            "consumer {} is a push consumer (deliver_subject set); the gateway needs a pull consumer",
            config.consumer
        )));
    }
    Ok(())
}

async fn create_consumer(
    stream: &stream::Stream,
    config: consumer::pull::Config,
) -> Result<consumer::PullConsumer, BindError> {
    let created = tokio::time::timeout(API_TIMEOUT, stream.create_consumer(config))
        .await
        .map_err(|_| anyhow::anyhow!("timed out creating consumer"))?;
    created.map_err(|err| match err.kind() {
        // A 4xx API error is about the config itself; 5xx ones (cluster not ready) pass.
        jetstream::stream::ConsumerErrorKind::JetStream(js) if js.code() < 500 => {
            BindError::Fatal(format!("the server refused the consumer config: {err}"))
        }
        _ => BindError::Transient(anyhow::Error::new(err).context("creating consumer")),
    })
}

/// Ask the server for up to `batch` messages on `inbox`. With `expires`, the request waits up
/// to that long for a first message; either way it ends as soon as it delivered something
/// and nothing more is available (`no_wait`), which is exactly a fetch's contract.
pub async fn request_pull(
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

/// A settle to send on a delivery's ack subject.
#[derive(Debug, Clone)]
pub enum AckCommand {
    Ack,
    Nak { delay: Option<Duration> },
    Term { reason: Option<String> },
    InProgress,
}

impl AckCommand {
    pub fn payload(&self) -> Bytes {
        match self {
            Self::Ack => Bytes::from_static(b"+ACK"),
            Self::Nak { delay: None } => Bytes::from_static(b"-NAK"),
            Self::Nak { delay: Some(delay) } => {
                Bytes::from(format!("-NAK {{\"delay\": {}}}", delay.as_nanos()))
            }
            Self::Term { reason: None } => Bytes::from_static(b"+TERM"),
            Self::Term {
                reason: Some(reason),
            } => Bytes::from(format!("+TERM {reason}")),
            Self::InProgress => Bytes::from_static(b"+WPI"),
        }
    }
}

/// Why the server did not confirm a settle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfirmError {
    /// Not connected, or nobody answers on the ack subject (consumer gone).
    Unavailable,
    /// No confirmation within the timeout; the command may or may not have arrived.
    TimedOut,
}

/// Send `command` on `reply` and wait for the server's confirmation (an ack with a reply
/// subject is answered once the server processed it) until `deadline` resolves.
///
/// The deadline is a future, not a duration, so that the settles of one batch share one
/// timer: async-nats' own request timeout is off here, and a timer per settle would cost a
/// timer-wheel insert and, on a busy runtime, a wake-up of the thread parked on the driver,
/// for every message.
pub async fn confirm(
    client: &Client,
    reply: &str,
    command: &AckCommand,
    deadline: impl Future<Output = ()>,
) -> Result<(), ConfirmError> {
    if client.connection_state() != async_nats::connection::State::Connected {
        return Err(ConfirmError::Unavailable);
    }
    let request = async_nats::Request::new()
        .payload(command.payload())
        .timeout(None);
    tokio::select! {
        // A confirmation that is there wins over a deadline that passed meanwhile.
        biased;
        confirmed = client.send_request(reply.to_owned(), request) => match confirmed {
            Ok(_) => Ok(()),
            Err(err) => match err.kind() {
                async_nats::RequestErrorKind::TimedOut => Err(ConfirmError::TimedOut),
                async_nats::RequestErrorKind::NoResponders => Err(ConfirmError::Unavailable),
                _ => {
                    warn!(error = %err, "settle request failed");
                    Err(ConfirmError::Unavailable)
                }
            },
        },
        () = deadline => Err(ConfirmError::TimedOut),
    }
}

/// Tell the server to redeliver a message the gateway will not lease, without waiting.
pub async fn release(client: &Client, reply: &str) {
    let payload = AckCommand::Nak { delay: None }.payload();
    // Publishing only queues, but blocks once the queue is full while disconnected.
    let published =
        tokio::time::timeout(API_TIMEOUT, client.publish(reply.to_owned(), payload)).await;
    if !matches!(published, Ok(Ok(()))) {
        warn!("could not nak an unleased message; the server redelivers it after ack_wait");
    }
}

/// Server-side view of the consumer.
pub async fn consumer_info(bound: &Bound) -> anyhow::Result<consumer::Info> {
    let mut consumer = bound.consumer.clone();
    let info = tokio::time::timeout(API_TIMEOUT, consumer.info())
        .await
        .context("timed out asking for consumer info")?
        .context("asking for consumer info")?;
    Ok(info.clone())
}

/// Publish to the stream and wait for its acknowledgement.
pub async fn publish(
    bound: &Bound,
    subject: String,
    headers: async_nats::HeaderMap,
    payload: Bytes,
    timeout: Duration,
) -> anyhow::Result<jetstream::publish::PublishAck> {
    let ack = tokio::time::timeout(
        timeout,
        bound
            .jetstream
            .publish_with_headers(subject, headers, payload),
    )
    .await
    .context("timed out publishing")?
    .context("publishing")?;
    tokio::time::timeout(timeout, ack.into_future())
        .await
        .context("timed out waiting for the stream's acknowledgement")?
        .context("the stream did not acknowledge the message")
}
