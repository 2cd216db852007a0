//! Binding to the consumer: find (or create) the stream, bind the consumer (made and
//! reconciled by the `reconcile` module, below this one), find the streams replicas share,
//! set up the advisory stream that dead-lettering needs, and read back what is in force;
//! after a reconnect, only the read back.
//!
//! May import: `config`. Nothing of the gateway above the NATS boundary.

use std::sync::Arc;
use std::time::Duration;

use async_nats::Client;
use async_nats::jetstream::{self, consumer, stream};
use tracing::{info, warn};

use crate::config::Config;
use crate::domain::lease_id::InstanceId;
use crate::domain::schedule::namespace;

use super::API_TIMEOUT;
use super::reconcile::{BindError, bind_durable, config_to_create, create_consumer};
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
    /// Every other replica seen while binding reads lease ids that carry their expiry
    /// (version 4): this one may issue them.
    pub(crate) everyone_reads_expiring_ids: bool,
    /// The stream sequence below which the server has every message of the consumer
    /// settled (its ack floor), as last read.
    pub(crate) ack_floor_stream_sequence: u64,
    /// How durable its settles are, as found at bind.
    pub(crate) durability: crate::domain::durability::Facts,
    /// Where the consumer's confirmed acks and terms are recorded for every gateway; `None`
    /// with `--ephemeral` (the consumer dies with this process) or where the server refused
    /// the records stream (then only this process remembers them).
    pub(crate) settled_records: Option<Arc<super::settled::Records>>,
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
    if config.ordering_key.is_some() {
        let version = client.server_info().version;
        if !super::seek::at_least(&version, (2, 11)) {
            return Err(BindError::Fatal(format!(
                "consumer {}/{} has an ordering key, which needs nats-server 2.11 or later (priority groups with pinned_client); the server is {version}",
                config.stream, config.consumer
            )));
        }
    }
    let js = jetstream::new(client.clone());
    let stream = get_or_create_stream(config, &js).await?;
    let stream_subjects = stream.cached_info().config.subjects.clone();
    let deletes_on_term =
        super::dead_letter::is_deleted_on_term(stream.cached_info().config.retention);
    let stream_config = stream.cached_info().config.clone();
    let settled_records = if config.ephemeral {
        None
    } else {
        records(config, &js, binder, &stream_config).await?
    };
    let (mut consumer, shared, per_consumer, everyone_reads_expiring_ids) = if config.ephemeral {
        let mut ephemeral = config_to_create(config, &stream, None);
        ephemeral.name = Some(binder.ephemeral_name.to_owned());
        // This process's alone: no other replica settles its leases.
        (create_consumer(&stream, ephemeral).await?, None, None, true)
    } else {
        let replicas = stream.cached_info().config.num_replicas;
        let seen = share(config, &js, binder, replicas).await?;
        let consumer = bind_durable(config, &stream, &seen.others, binder.first).await?;
        (
            consumer,
            seen.fleet,
            seen.per_consumer,
            seen.everyone_reads_expiring_ids,
        )
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
    let mut bound = Bound {
        client: client.clone(),
        jetstream: js,
        consumer_name: String::new(),
        created: time::OffsetDateTime::UNIX_EPOCH,
        delivered_consumer_sequence: 0,
        epoch: 0,
        stream_subjects,
        deletes_on_term,
        ack_wait: Duration::ZERO,
        max_ack_pending: 0,
        max_waiting: 0,
        max_batch: None,
        max_expires: None,
        consumer,
        shared,
        per_consumer,
        everyone_reads_expiring_ids,
        ack_floor_stream_sequence: 0,
        durability: durability_of(config, &stream_config, &info, settled_records.as_deref()).await,
        settled_records,
    };
    bound.read_back(&info);
    Ok(bound)
}

impl Bound {
    /// What the server has of the consumer, as its info says: identity, position, settings.
    fn read_back(&mut self, info: &consumer::Info) {
        self.consumer_name.clone_from(&info.name);
        self.created = info.created;
        self.delivered_consumer_sequence = info.delivered.consumer_sequence;
        self.ack_floor_stream_sequence = info.ack_floor.stream_sequence;
        self.ack_wait = info.config.ack_wait;
        self.max_ack_pending = usize::try_from(info.config.max_ack_pending).unwrap_or(usize::MAX);
        self.max_waiting = usize::try_from(info.config.max_waiting).unwrap_or(512);
        self.max_batch = usize::try_from(info.config.max_batch)
            .ok()
            .filter(|max| *max > 0);
        self.max_expires = Some(info.config.max_expires).filter(|max| !max.is_zero());
    }
}

/// The records stream of the consumer's confirmed settles (see [`super::settled`]): made
/// or found; `None` where the server refuses it (said once per bind, loudly: the promise
/// is then this process's alone). NATS unreachable fails the bind, which is retried.
async fn records(
    config: &Config,
    js: &jetstream::Context,
    binder: &Binder<'_>,
    stream: &jetstream::stream::Config,
) -> Result<Option<Arc<super::settled::Records>>, BindError> {
    use super::settled::{EnsureError, Place, Records};
    let place = Place {
        prefix: &config.internal_prefix,
        stream: &config.stream,
        consumer: &config.consumer,
        replicas: stream.num_replicas,
        retention: config.settled_retention,
    };
    // Sealed only with a key a successor shares (see `settled`).
    let trust = config
        .lease_key_file
        .is_some()
        .then(|| binder.trust.clone());
    match Records::ensure(js, &place, trust).await {
        Ok(records) => Ok(Some(Arc::new(records))),
        Err(EnsureError::Refused(why)) => {
            warn!(reason = %why, stream = %config.stream, consumer = %config.consumer, "no settled records stream: a message whose ack the server confirmed and then forgot can be handed out again by another gateway or after a restart");
            Ok(None)
        }
        Err(EnsureError::Transient(err)) => Err(BindError::Transient(
            err.context("setting up the settled records stream"),
        )),
    }
}

/// What binding found of how durable the consumer's settles are (the server's sync policy
/// read from `--nats-monitor-url`, when given).
async fn durability_of(
    config: &Config,
    stream: &stream::Config,
    consumer: &consumer::Info,
    records: Option<&super::settled::Records>,
) -> crate::domain::durability::Facts {
    use crate::domain::durability::{Facts, ServerSync};
    let stream_replicas = stream.num_replicas.max(1);
    Facts {
        stream_replicas,
        consumer_replicas: match consumer.config.num_replicas {
            0 => stream_replicas,
            own => own,
        },
        storage: match stream.storage {
            stream::StorageType::File => "file",
            stream::StorageType::Memory => "memory",
        }
        .to_owned(),
        persist_mode: match stream.persist_mode {
            Some(stream::PersistenceMode::Async) => "async",
            _ => "default",
        }
        .to_owned(),
        server_sync: match &config.nats_monitor_url {
            Some(url) => super::monitor::server_sync(url).await,
            None => ServerSync::Unknown,
        },
        settled_record_replicas: records.map(super::settled::Records::replicas),
    }
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
    let mut bound = Box::new(previous.clone());
    bound.consumer = consumer;
    bound.read_back(&info);
    Ok(Recheck::Same(bound))
}

/// Whether the server answered that the consumer (or its stream) does not exist.
fn is_not_found(err: &jetstream::context::ConsumerInfoError) -> bool {
    use jetstream::context::ConsumerInfoErrorKind;
    matches!(
        err.kind(),
        ConsumerInfoErrorKind::NotFound | ConsumerInfoErrorKind::StreamNotFound
    )
}

/// What binding learnt of the other replicas: see [`share`].
struct Shares {
    fleet: Option<Arc<Shared>>,
    per_consumer: Option<Box<Shared>>,
    /// The other live replicas busy on this consumer.
    others: Vec<ReplicaRecord>,
    /// Every live replica listed reads lease ids that carry their expiry.
    everyone_reads_expiring_ids: bool,
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
) -> anyhow::Result<Shares> {
    let me = binder.instance.to_string();
    let mut others: Vec<ReplicaRecord> = Vec::new();
    // Unknown without the fleet's view: as if a replica of an earlier release were there.
    let mut everyone_reads_expiring_ids = false;
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
            Ok(records) => {
                // Any replica may be asked to settle a lease, busy on this consumer or not.
                everyone_reads_expiring_ids = records
                    .iter()
                    .all(|record| record.instance_id == me || record.reads_expiring_lease_ids);
                others.extend(records.into_iter().filter(|record| {
                    record.instance_id != me
                        && record.busy_on(&config.stream, &config.consumer).is_some()
                }));
            }
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
                    everyone_reads_expiring_ids &=
                        record.instance_id == me || record.reads_expiring_lease_ids;
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
    Ok(Shares {
        fleet,
        per_consumer,
        others,
        everyone_reads_expiring_ids,
    })
}

/// The stream `--create-stream` makes: the configured subjects, and ready for every producer
/// feature the server has (TTLs from 2.11; atomic batches and schedules from 2.12, with the
/// gateway's schedule subjects captured; docs/producers.md), so that a first try can use them.
fn stream_for_a_first_try(config: &Config, js: &jetstream::Context) -> stream::Config {
    let version = js.client().server_info().version;
    let since_2_12 = super::seek::at_least(&version, (2, 12));
    let mut subjects = config.stream_subjects.clone();
    if since_2_12 {
        subjects.push(namespace(&config.internal_prefix, &config.stream));
    }
    stream::Config {
        name: config.stream.clone(),
        subjects,
        allow_message_ttl: super::seek::at_least(&version, (2, 11)),
        allow_atomic_publish: since_2_12,
        allow_message_schedules: since_2_12,
        ..Default::default()
    }
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
                js.create_stream(stream_for_a_first_try(config, js)),
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
            info!(stream = %config.stream, subjects = ?created.cached_info().config.subjects, "created stream");
            Ok(created)
        }
        Err(err) => Err(BindError::Transient(
            anyhow::Error::new(err).context(format!("looking up stream {}", config.stream)),
        )),
    }
}
