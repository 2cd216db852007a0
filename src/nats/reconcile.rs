//! The consumer itself: the config the flags describe, made or bound and reconciled (only
//! the settings the server lets change, and never under other live replicas), and whether a
//! consumer on the server is one the gateway can lease (a durable pull consumer with explicit
//! ack) — for the one configured, and for those `--serve-existing` finds and lists.
//!
//! May import: `config`. Nothing of the gateway above the NATS boundary.

use async_nats::Client;
use async_nats::jetstream::{self, consumer, stream};
use tracing::{info, warn};

use crate::config::{Config, DeliverPolicy};
use crate::domain::consumers::{ConsumerName, ConsumerPatterns};
use crate::domain::ordering::{PIN_GROUP, PIN_TIMEOUT};
use crate::domain::schedule::{ScheduleId, subject_of};
use crate::domain::subject;

use super::API_TIMEOUT;
use super::replicas::ReplicaRecord;

/// Why binding to a consumer failed: finding its stream, or making, reconciling or
/// judging the consumer itself (here, where most of the reasons arise).
#[derive(Debug, thiserror::Error)]
pub(crate) enum BindError {
    /// Retrying cannot help: the operator must change something.
    #[error("{0}")]
    Fatal(String),
    /// The consumer is of a kind the gateway cannot lease (a push consumer, an ack policy
    /// other than explicit): the message names the field. A request for it is a 409.
    #[error("{0}")]
    Unsuitable(String),
    /// Its settles are less durable than `--require-durability` asks: the field of its
    /// `durability` that falls short. A request for it is a 503.
    #[error("{detail}")]
    Insufficient { field: &'static str, detail: String },
    /// NATS is unreachable or slow; try again.
    #[error(transparent)]
    Transient(#[from] anyhow::Error),
}

/// The consumer config the flags describe. Only ack_wait, max_ack_pending and the deliver
/// policy are always sent (plus filter and max_deliver when given): everything else is left
/// to the server's defaults.
pub(super) fn desired_config(
    config: &Config,
    durable_name: Option<String>,
) -> consumer::pull::Config {
    let ordered = config.ordering_key.is_some();
    consumer::pull::Config {
        durable_name,
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait: config.ack_wait,
        max_ack_pending: i64::from(config.max_ack_pending),
        max_deliver: config.max_deliver.map(i64::from).unwrap_or_default(),
        filter_subject: config.filter_subject.clone().unwrap_or_default(),
        deliver_policy: deliver_policy(&config.deliver_policy),
        // Ordered per key: one replica at a time pulls (the pinned one), so that one gate
        // sees every message of a key.
        priority_policy: if ordered {
            consumer::PriorityPolicy::PinnedClient
        } else {
            consumer::PriorityPolicy::default()
        },
        priority_groups: if ordered {
            vec![PIN_GROUP.to_owned()]
        } else {
            Vec::new()
        },
        priority_timeout: if ordered {
            PIN_TIMEOUT
        } else {
            std::time::Duration::ZERO
        },
        ..Default::default()
    }
}

/// The config of a consumer the gateway makes: [`desired_config`], and, when no filter is
/// given and the stream captures the gateway's schedule subjects, a filter of the stream's
/// other subjects — so that the consumer never leases a schedule (docs/producers.md). Left
/// unfiltered when those subjects would take schedules too (a stream on `>`).
pub(super) fn config_to_create(
    config: &Config,
    stream: &stream::Stream,
    durable_name: Option<String>,
) -> consumer::pull::Config {
    let mut wanted = desired_config(config, durable_name);
    if config.filter_subject.is_some() {
        return wanted;
    }
    let schedules = format!("{}.schedule.", config.internal_prefix);
    let probe = subject_of(&config.internal_prefix, &ScheduleId::new(&config.stream));
    let subjects = &stream.cached_info().config.subjects;
    let others: Vec<String> = subjects
        .iter()
        .filter(|subject| !subject.starts_with(&schedules))
        .cloned()
        .collect();
    let captures_schedules = others.len() < subjects.len();
    let others_take_schedules = others.iter().any(|filter| subject::matches(filter, &probe));
    if captures_schedules && !others.is_empty() && !others_take_schedules {
        match <[String; 1]>::try_from(others) {
            Ok([only]) => wanted.filter_subject = only,
            Err(others) => wanted.filter_subjects = others,
        }
    }
    wanted
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

pub(super) async fn bind_durable(
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
            config_to_create(config, stream, Some(config.consumer.clone())),
        )
        .await;
    };
    let current = existing.config;
    let wanted = desired_config(config, Some(config.consumer.clone()));
    check_immutable(config, &current, &wanted)?;

    let mut updated = current.clone();
    // An ordering key turned on or off changes how the consumer is pulled.
    if config.ordering_key.is_some() || current.priority_groups == [PIN_GROUP] {
        updated.priority_policy = wanted.priority_policy.clone();
        updated.priority_groups = wanted.priority_groups.clone();
        updated.priority_timeout = wanted.priority_timeout;
    }
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
    // Made again since it was first bound, perhaps as something the gateway cannot lease.
    let Some(existing) = find_consumer(stream, &config.consumer).await? else {
        return Err(BindError::Transient(anyhow::anyhow!(
            "consumer {}/{} does not exist on the server (any more)",
            config.stream,
            config.consumer
        )));
    };
    suitable(&config.stream, &config.consumer, &existing.config)?;
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
    suitable(&config.stream, &config.consumer, current)
}

/// Refuse a consumer the gateway cannot lease, naming the field: a push consumer, or one
/// whose ack policy is not explicit.
fn suitable(stream: &str, name: &str, current: &consumer::Config) -> Result<(), BindError> {
    if current.deliver_subject.is_some() {
        return Err(BindError::Unsuitable(format!(
            "consumer {stream}/{name} is a push consumer (deliver_subject is set); the gateway serves pull consumers only"
        )));
    }
    if current.ack_policy != consumer::AckPolicy::Explicit {
        return Err(BindError::Unsuitable(format!(
            "consumer {stream}/{name} has ack_policy {:?}; the gateway needs ack_policy explicit, which cannot be changed",
            current.ack_policy
        )));
    }
    Ok(())
}

pub(super) async fn create_consumer(
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

/// The consumers on the server that `patterns` name and the gateway could serve (durable
/// pull consumers with explicit ack), by stream and name.
pub(crate) async fn existing_consumers(
    client: &Client,
    patterns: &ConsumerPatterns,
) -> anyhow::Result<Vec<ConsumerName>> {
    use futures::TryStreamExt as _;
    let js = jetstream::new(client.clone());
    let listing = async {
        let streams: Vec<String> = js.stream_names().try_collect().await?;
        let mut found = Vec::new();
        for stream in streams
            .into_iter()
            .filter(|name| patterns.matches_stream(name))
        {
            let handle = js.get_stream_no_info(&stream).await?;
            let infos: Vec<consumer::Info> = handle.consumers().try_collect().await?;
            found.extend(
                infos
                    .into_iter()
                    .filter(|info| {
                        info.config.durable_name.is_some()
                            && suitable(&stream, &info.name, &info.config).is_ok()
                    })
                    .map(|info| ConsumerName::new(&stream, &info.name))
                    .filter(|name| patterns.matches(name)),
            );
        }
        anyhow::Ok(found)
    };
    tokio::time::timeout(API_TIMEOUT, listing)
        .await
        .map_err(|_| anyhow::anyhow!("timed out listing the existing consumers"))?
}
