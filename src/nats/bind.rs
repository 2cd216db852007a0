//! Binding to the consumer: find (or create) the stream, create or bind the durable (or
//! ephemeral) pull consumer, reconcile its mutable settings, set up the advisory stream that
//! dead-lettering needs, and read back what is in force.
//!
//! May import: `config`. Nothing of the gateway above the NATS boundary.

use std::sync::Arc;
use std::time::Duration;

use async_nats::Client;
use async_nats::jetstream::{self, consumer, stream};
use tracing::{info, warn};

use crate::config::{Config, DeliverPolicy};
use crate::domain::lease_id::InstanceId;

use super::API_TIMEOUT;
use super::replicas::{FleetStream, ReplicaRecord, Shared};

/// A consumer the gateway is bound to, and what it needs to use it.
#[derive(Clone)]
pub(crate) struct Bound {
    pub(crate) client: Client,
    pub(crate) jetstream: jetstream::Context,
    pub(crate) consumer: consumer::PullConsumer,
    /// The consumer's name.
    pub(crate) consumer_name: String,
    /// When the consumer was created: with the name, its identity across rebinds.
    pub(crate) created: time::OffsetDateTime,
    /// The last consumer sequence the server has on record as delivered.
    pub(crate) delivered_consumer_sequence: u64,
    /// The lease epoch of this binding (set by the supervisor): stamped on every delivery
    /// pulled through it.
    pub(crate) epoch: u32,
    /// Subjects the stream captures: what `POST /publish` may publish to.
    pub(crate) stream_subjects: Vec<String>,
    /// Whether the stream deletes a message once it is terminated (work-queue or interest
    /// retention): a term must then copy a dead letter before it is sent.
    pub(crate) deletes_on_term: bool,
    /// Effective settings read back from the server.
    pub(crate) ack_wait: Duration,
    pub(crate) max_ack_pending: usize,
    pub(crate) max_waiting: usize,
    /// The consumer's own limits on one pull request, when it has any.
    pub(crate) max_batch: Option<usize>,
    pub(crate) max_expires: Option<Duration>,
    /// What the fleet's replicas share; `None` with `--ephemeral`, whose consumer is this
    /// process's alone (or where the fleet stream cannot be had).
    pub(crate) shared: Option<Arc<Shared>>,
    /// The consumer's own shared stream, where an earlier release made one: its replicas
    /// still meet there during a rolling upgrade.
    pub(crate) per_consumer: Option<Box<Shared>>,
}

impl Bound {
    /// Where what replicas share is written and read: the fleet stream, and the consumer's
    /// own of an earlier release while it exists.
    pub(crate) fn shared(&self) -> impl Iterator<Item = &Shared> {
        self.shared.iter().map(|shared| &**shared).chain(
            self.per_consumer
                .iter()
                .map(|per_consumer| &**per_consumer)
                .filter(|per_consumer| !per_consumer.is_gone()),
        )
    }
}

/// Why binding failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BindError {
    /// Retrying cannot help: the operator must change something.
    #[error("{0}")]
    Fatal(String),
    /// NATS is unreachable or slow; try again.
    #[error(transparent)]
    Transient(#[from] anyhow::Error),
}

impl Bound {
    /// Whether the connection under this binding is up now.
    pub(crate) fn is_connected(&self) -> bool {
        super::is_connected(&self.client)
    }
}

/// Who is binding: this process, and whether for the first time.
pub(crate) struct Binder<'a> {
    pub(crate) instance: InstanceId,
    /// `--ephemeral`: chosen once per process, so binding again after a reconnect finds the
    /// same consumer instead of making a new one that replays the stream.
    pub(crate) ephemeral_name: &'a str,
    /// The first bind of this process: a replica that would change the settings of a
    /// consumer other live replicas use refuses to start. Later (a rebind after a
    /// reconnect), it takes the consumer's settings as they are.
    pub(crate) first: bool,
    /// The seal on what replicas share.
    pub(crate) trust: &'a std::sync::Arc<super::trust::Trust>,
    /// The fleet stream, made by the first binding that needs it.
    pub(crate) fleet: &'a FleetStream,
    /// Whether an earlier release may have served this consumer (the default one), and
    /// made it a shared stream of its own.
    pub(crate) served_by_earlier_releases: bool,
}

/// Find the stream, create or bind the consumer, and reconcile its mutable settings —
/// unless other live replicas use the consumer (see [`Binder::first`]).
pub(crate) async fn bind(
    config: &Config,
    client: &Client,
    binder: &Binder<'_>,
) -> Result<Bound, BindError> {
    let js = jetstream::new(client.clone());
    let stream = get_or_create_stream(config, &js).await?;
    let stream_subjects = stream.cached_info().config.subjects.clone();
    let deletes_on_term =
        super::dead_letter::is_deleted_on_term(stream.cached_info().config.retention);
    let (mut consumer, shared, per_consumer) = if config.ephemeral {
        let mut ephemeral = desired_config(config, None);
        ephemeral.name = Some(binder.ephemeral_name.to_owned());
        (create_consumer(&stream, ephemeral).await?, None, None)
    } else {
        let replicas = stream.cached_info().config.num_replicas;
        let (shared, per_consumer, others) = share(config, &js, binder, replicas).await?;
        let consumer = bind_durable(config, &stream, &others, binder.first).await?;
        (consumer, shared, per_consumer)
    };
    if let Some(subject) = &config.dead_letter_subject
        && !config.ephemeral
    {
        let target = super::dead_letter::Target {
            stream: config.stream.clone(),
            consumer: config.consumer.clone(),
            subject: subject.clone(),
        };
        super::advisories::prepare(&js, &target)
            .await
            .map_err(|err| err.context("setting up the advisory stream"))?;
    }
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
        deletes_on_term,
        ack_wait: info.config.ack_wait,
        max_ack_pending: usize::try_from(info.config.max_ack_pending).unwrap_or(usize::MAX),
        max_waiting: usize::try_from(info.config.max_waiting).unwrap_or(512),
        max_batch: usize::try_from(info.config.max_batch)
            .ok()
            .filter(|max| *max > 0),
        max_expires: Some(info.config.max_expires).filter(|max| !max.is_zero()),
        consumer,
        shared,
        per_consumer,
    })
}

/// How long the check after a reconnect waits for the consumer's info before asking again:
/// answered by the consumer's leader, it is quick unless that leader is moving.
const RECHECK_TIMEOUT: Duration = Duration::from_secs(1);

/// What the check after a reconnect found.
pub(crate) enum Recheck {
    /// The same consumer: `previous` with the server's state and settings read anew.
    Same(Box<Bound>),
    /// Another consumer under the name (recreated), or none: bind anew.
    Changed,
}

/// After a reconnect, the binding held before only needs the consumer's state read back
/// (has the server forgotten deliveries? were its settings changed meanwhile?): its stream,
/// its fleet and advisory streams were set up by the bind that made it, and going through
/// all of that again costs a JetStream API round trip each — seconds while a cluster's meta
/// leader moves, though the consumer's own leader answers at once. One request, one second
/// at most; anything but an answer about the same consumer leaves the caller to bind anew.
pub(crate) async fn recheck(previous: &Bound) -> Result<Recheck, BindError> {
    let mut consumer = previous.consumer.clone();
    let info = match tokio::time::timeout(RECHECK_TIMEOUT, consumer.info()).await {
        Err(_) => return Err(anyhow::anyhow!("timed out reading consumer info").into()),
        Ok(Err(err)) if is_not_found(&err) => return Ok(Recheck::Changed),
        Ok(Err(err)) => {
            return Err(anyhow::Error::new(err)
                .context("reading consumer info")
                .into());
        }
        Ok(Ok(info)) => info.clone(),
    };
    if info.created != previous.created || info.name != previous.consumer_name {
        return Ok(Recheck::Changed);
    }
    Ok(Recheck::Same(Box::new(Bound {
        delivered_consumer_sequence: info.delivered.consumer_sequence,
        ack_wait: info.config.ack_wait,
        max_ack_pending: usize::try_from(info.config.max_ack_pending).unwrap_or(usize::MAX),
        max_waiting: usize::try_from(info.config.max_waiting).unwrap_or(512),
        max_batch: usize::try_from(info.config.max_batch)
            .ok()
            .filter(|max| *max > 0),
        max_expires: Some(info.config.max_expires).filter(|max| !max.is_zero()),
        consumer,
        ..previous.clone()
    })))
}

/// Whether the server answered that the consumer (or its stream) does not exist.
fn is_not_found(err: &jetstream::context::ConsumerInfoError) -> bool {
    use jetstream::context::ConsumerInfoErrorKind;
    matches!(
        err.kind(),
        ConsumerInfoErrorKind::NotFound | ConsumerInfoErrorKind::StreamNotFound
    )
}

/// The streams replicas share (the fleet's; the consumer's own of an earlier release) and
/// the other live replicas on this consumer they list. Without the fleet stream (a NATS
/// user not allowed to make it) the gateway still works, and forwards settles; only what
/// replicas learn of each other is missing. Looking for the consumer's own fails the bind
/// (it is retried).
async fn share(
    config: &Config,
    js: &jetstream::Context,
    binder: &Binder<'_>,
    replicas: usize,
) -> anyhow::Result<(Option<Arc<Shared>>, Option<Box<Shared>>, Vec<ReplicaRecord>)> {
    let me = binder.instance.to_string();
    let mut others: Vec<ReplicaRecord> = Vec::new();
    let fleet = binder
        .fleet
        .ensure(js, &config.internal_prefix, replicas, binder.trust)
        .await;
    let fleet = match fleet {
        Ok(fleet) => Some(fleet.clone()),
        Err(err) => {
            warn!(error = %format!("{err:#}"), "cannot use the fleet stream replicas share: each replica counts only itself (max_waiting, capacity, Idempotency-Key) and cannot see others' settings");
            None
        }
    };
    if let Some(fleet) = &fleet {
        match fleet.replicas().await {
            Ok(records) => others.extend(records.into_iter().filter(|record| {
                record.instance_id != me
                    && record.busy_on(&config.stream, &config.consumer).is_some()
            })),
            Err(err) => warn!(error = %format!("{err:#}"), "cannot list the replicas"),
        }
    }
    // Not found is an answer; an error is not: bound without it, this replica could take
    // the live leases of an earlier release's replicas for a dead owner's.
    let per_consumer = if binder.served_by_earlier_releases {
        Shared::per_consumer(
            js,
            &config.internal_prefix,
            &config.stream,
            &config.consumer,
            binder.trust.clone(),
        )
        .await
        .map_err(|err| {
            err.context("looking for the shared stream an earlier release made for this consumer")
        })?
        .map(Box::new)
    } else {
        None
    };
    if let Some(per_consumer) = &per_consumer {
        match per_consumer.replicas().await {
            Ok(records) => {
                for record in records {
                    if record.instance_id != me
                        && !others
                            .iter()
                            .any(|other| other.instance_id == record.instance_id)
                    {
                        others.push(record);
                    }
                }
            }
            Err(err) => {
                warn!(error = %format!("{err:#}"), "cannot list the replicas of an earlier release")
            }
        }
    }
    Ok((fleet, per_consumer, others))
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
        Err(err) if super::is_stream_not_found(&err) => {
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
    others: &[ReplicaRecord],
    first: bool,
) -> Result<consumer::PullConsumer, BindError> {
    if config.adopt_existing {
        return adopt(config, stream).await;
    }
    let Some(existing) = find_consumer(stream, &config.consumer).await? else {
        info!(consumer = %config.consumer, "creating durable consumer");
        return create_consumer(
            stream,
            desired_config(config, Some(config.consumer.clone())),
        )
        .await;
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
    let not_pull = |err: Box<dyn std::error::Error + Send + Sync>| {
        BindError::Fatal(format!(
            "consumer {} is not a pull consumer: {err}",
            config.consumer
        ))
    };
    let pull_current =
        <consumer::pull::Config as consumer::FromConsumer>::try_from_consumer_config(current)
            .map_err(&not_pull)?;
    let pull_updated =
        <consumer::pull::Config as consumer::FromConsumer>::try_from_consumer_config(updated)
            .map_err(&not_pull)?;
    if pull_updated == pull_current {
        info!(consumer = %config.consumer, "bound to existing consumer");
        return create_consumer(stream, pull_updated).await;
    }
    if !others.is_empty() {
        // The consumer's settings are one for all its clients: changing them under live
        // replicas would let the server redeliver what they still hold as leased.
        let changes = shared_setting_changes(&pull_current, &pull_updated).join("; ");
        let users = others
            .iter()
            .map(|record| {
                format!(
                    "{} (listening on {}, started {})",
                    record.instance_id, record.listen, record.started_at
                )
            })
            .collect::<Vec<_>>()
            .join(", ");
        if first {
            return Err(BindError::Fatal(format!(
                "consumer {} is used by {} live replica(s): {users}; this replica would change its {changes}. A replica must not change a consumer other replicas use: start it with the consumer's values, or stop the others first",
                config.consumer,
                others.len(),
            )));
        }
        warn!(consumer = %config.consumer, %changes, replicas = %users, "rebinding to a consumer live replicas use: keeping its settings rather than this replica's flags");
        return create_consumer(stream, pull_current).await;
    }
    info!(consumer = %config.consumer, "updating existing consumer's ack_wait/max_ack_pending/max_deliver/filter");
    create_consumer(stream, pull_updated).await
}

/// Bind a consumer served through `--serve-existing` as it is: its settings are its
/// operator's, never sent; gone, it is not made again (fetches answer 503 until it is back).
async fn adopt(
    config: &Config,
    stream: &stream::Stream,
) -> Result<consumer::PullConsumer, BindError> {
    let found = tokio::time::timeout(
        API_TIMEOUT,
        stream.get_consumer::<consumer::pull::Config>(&config.consumer),
    )
    .await
    .map_err(|_| anyhow::anyhow!("timed out asking for consumer {}", config.consumer))?;
    found.map_err(|err| {
        BindError::Transient(anyhow::anyhow!(
            "binding existing consumer {}/{}: {err}",
            config.stream,
            config.consumer
        ))
    })
}

/// The shared settings that differ between the consumer as it is and as wanted, each as
/// `<field> from <current> to <wanted>`.
fn shared_setting_changes(
    current: &consumer::pull::Config,
    wanted: &consumer::pull::Config,
) -> Vec<String> {
    let filter = |config: &consumer::pull::Config| {
        if config.filter_subjects.is_empty() {
            format!("{:?}", config.filter_subject)
        } else {
            format!("{:?}", config.filter_subjects)
        }
    };
    let mut changes = Vec::new();
    if current.ack_wait != wanted.ack_wait {
        changes.push(format!(
            "ack_wait from {} to {}",
            humantime::format_duration(current.ack_wait),
            humantime::format_duration(wanted.ack_wait)
        ));
    }
    if current.max_ack_pending != wanted.max_ack_pending {
        changes.push(format!(
            "max_ack_pending from {} to {}",
            current.max_ack_pending, wanted.max_ack_pending
        ));
    }
    if current.max_deliver != wanted.max_deliver {
        changes.push(format!(
            "max_deliver from {} to {}",
            current.max_deliver, wanted.max_deliver
        ));
    }
    if filter(current) != filter(wanted) {
        changes.push(format!(
            "filter from {} to {}",
            filter(current),
            filter(wanted)
        ));
    }
    changes
}

/// Refuse to start when a field the server cannot change differs from what the flags ask for.
fn check_immutable(
    config: &Config,
    current: &consumer::Config,
    wanted: &consumer::pull::Config,
) -> Result<(), BindError> {
    if current.deliver_policy != wanted.deliver_policy {
        return Err(BindError::Fatal(format!(
            "consumer {}/{} exists with deliver_policy {}, but --deliver-policy (or the consumers file's deliver_policy) is {}; deliver_policy cannot be changed (delete the consumer or change the setting)",
            config.stream,
            config.consumer,
            flag_syntax(&current.deliver_policy),
            config.deliver_policy
        )));
    }
    if current.ack_policy != consumer::AckPolicy::Explicit {
        return Err(BindError::Fatal(format!(
            "consumer {}/{} exists with ack_policy {:?}; the gateway needs ack_policy explicit, which cannot be changed",
            config.stream, config.consumer, current.ack_policy
        )));
    }
    if current.deliver_subject.is_some() {
        return Err(BindError::Fatal(format!(
            "consumer {}/{} is a push consumer (deliver_subject set); the gateway needs a pull consumer",
            config.stream, config.consumer
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

/// What the server has of a consumer a request names, for `--serve-existing`.
pub(crate) enum Existing {
    /// A durable pull consumer with explicit ack: it can be served.
    Usable,
    /// Not there; the words say what is missing (the stream or the consumer).
    Missing(String),
    /// There, but not servable; the words name the setting.
    Unsuitable(String),
}

/// Look `stream`/`name` up on the server, changing nothing.
pub(crate) async fn inspect_existing(
    client: &Client,
    stream: &str,
    name: &str,
) -> Result<Existing, anyhow::Error> {
    let js = jetstream::new(client.clone());
    let found = tokio::time::timeout(API_TIMEOUT, js.get_stream(stream))
        .await
        .map_err(|_| anyhow::anyhow!("timed out asking for stream {stream}"))?;
    let stream_handle = match found {
        Ok(handle) => handle,
        Err(err) if super::is_stream_not_found(&err) => {
            return Ok(Existing::Missing(format!(
                "stream {stream} does not exist on the server"
            )));
        }
        Err(err) => {
            return Err(anyhow::Error::new(err).context(format!("looking up stream {stream}")));
        }
    };
    let Some(info) = find_consumer(&stream_handle, name).await? else {
        return Ok(Existing::Missing(format!(
            "consumer {stream}/{name} does not exist on the server"
        )));
    };
    let config = &info.config;
    if config.deliver_subject.is_some() {
        return Ok(Existing::Unsuitable(format!(
            "consumer {stream}/{name} is a push consumer (deliver_subject is set); the gateway serves pull consumers only"
        )));
    }
    if config.ack_policy != consumer::AckPolicy::Explicit {
        return Ok(Existing::Unsuitable(format!(
            "consumer {stream}/{name} has ack_policy {:?}; the gateway needs ack_policy explicit",
            config.ack_policy
        )));
    }
    if config.durable_name.is_none() {
        return Ok(Existing::Unsuitable(format!(
            "consumer {stream}/{name} is not durable (no durable_name); the gateway serves durable consumers only"
        )));
    }
    Ok(Existing::Usable)
}

/// The consumer `name` of `stream` as the server has it; `None` when there is none.
async fn find_consumer(
    stream: &stream::Stream,
    name: &str,
) -> Result<Option<consumer::Info>, anyhow::Error> {
    let found = tokio::time::timeout(API_TIMEOUT, stream.consumer_info(name))
        .await
        .map_err(|_| anyhow::anyhow!("timed out asking for consumer {name}"))?;
    match found {
        Ok(info) => Ok(Some(info)),
        Err(err)
            if matches!(
                err.kind(),
                jetstream::context::ConsumerInfoErrorKind::NotFound
            ) =>
        {
            Ok(None)
        }
        Err(err) => Err(anyhow::Error::new(err).context(format!("looking up consumer {name}"))),
    }
}
