//! What every consumer a gateway process serves shares: the process's identity in lease ids,
//! its lease key, the seal on replica traffic, the metrics registry, the NATS connection,
//! its place among the replicas (kept by [`super::fleet`]) and the settings given at start.
//!
//! May import: as the rest of `gateway`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use time::OffsetDateTime;
use tokio::sync::{Notify, watch};

use crate::config::Config;
use crate::domain::consumers::ConsumerName;
use crate::domain::lease_id::{InstanceId, LeaseKey, LeaseSigner};
use crate::domain::seal::Sealer;
use crate::domain::ticket::TicketSigner;
use crate::metrics::ProcessMetrics;
use crate::nats::replicas::{FleetStream, ReplicaRecord};
use crate::nats::trust::Trust;

use super::connection::Connection;

/// The process, as each consumer's core sees it.
pub(crate) struct Process {
    /// This process, as its lease ids name it.
    pub(crate) instance: InstanceId,
    /// The lease key: `--lease-key-file`, or random (ids then die with the process).
    key: Vec<u8>,
    pub(crate) trust: Arc<Trust>,
    pub(crate) metrics: Arc<ProcessMetrics>,
    pub(crate) connection: Connection,
    pub(crate) started_at: OffsetDateTime,
    /// The settings given at start (the default consumer's among them).
    pub(crate) config: Arc<Config>,
    /// This process among the replicas.
    pub(crate) fleet: Fleet,
    /// What its heartbeat says of its lease key: equal between processes with equal keys.
    pub(crate) fleet_fingerprint: String,
    /// Signs the stream tickets browsers open streams with (valid at every replica with
    /// the same key).
    pub(crate) tickets: TicketSigner,
}

impl Process {
    pub(crate) fn new(
        config: Arc<Config>,
        lease_key: Option<LeaseKey>,
        metrics: Arc<ProcessMetrics>,
        connection: Connection,
    ) -> Self {
        let instance = InstanceId::random();
        // Without a key file nothing is shared: lease ids and seals die with the process.
        let key = match &lease_key {
            Some(key) => key.bytes().to_vec(),
            None => rand::random::<[u8; 32]>().to_vec(),
        };
        let trust = Arc::new(Trust::new(
            Sealer::new(&key, instance),
            config.accept_unsigned_replicas,
            metrics.internal_messages_rejected(),
        ));
        let fleet_fingerprint = LeaseSigner::with_key(&key, "", "", instance)
            .key_fingerprint()
            .to_owned();
        Self {
            instance,
            tickets: TicketSigner::new(&key),
            key,
            trust,
            metrics,
            connection,
            started_at: OffsetDateTime::now_utc(),
            config,
            fleet: Fleet::default(),
            fleet_fingerprint,
        }
    }

    /// The signer of one consumer's lease ids, as this process issues them.
    pub(crate) fn signer(&self, stream: &str, consumer: &str) -> LeaseSigner {
        LeaseSigner::with_key(&self.key, stream, consumer, self.instance)
    }
}

/// How often a process says it is live, and looks at the others.
pub(crate) const HEARTBEAT_EVERY: Duration = Duration::from_secs(1);
/// A replica whose heartbeat is older than this is no longer counted.
pub(crate) const HEARTBEAT_TTL: Duration = Duration::from_secs(4);
/// How long [`Fleet::step_now`] waits for the heartbeat loop.
const STEP_WAIT: Duration = Duration::from_secs(2);

/// This process among the replicas.
#[derive(Default)]
pub(crate) struct Fleet {
    /// The fleet stream, set up by the first binding of a durable consumer.
    pub(crate) stream: FleetStream,
    /// The other replicas' last heartbeats.
    seen: Mutex<Vec<ReplicaRecord>>,
    /// This process's heartbeat is in the fleet stream (or it gave up waiting for that).
    announced: AtomicBool,
    /// It listens for settles forwarded to it.
    listening: AtomicBool,
    /// Rings the heartbeat loop before its tick (a consumer woke or was bound).
    ring: Notify,
    /// Bumped after each beat.
    steps: watch::Sender<u64>,
}

impl Fleet {
    /// Whether the others can tell this process's leases from a dead owner's: its heartbeat
    /// is stored (or there is no fleet stream to store it in).
    pub(crate) fn announced(&self) -> bool {
        self.announced.load(Ordering::Relaxed) || self.stream.get().is_none()
    }

    /// Whether a lease issued now can be settled at any replica: this process listens for
    /// forwarded settles.
    pub(crate) fn listening(&self) -> bool {
        self.listening.load(Ordering::Relaxed)
    }

    /// Beat before the next tick.
    pub(crate) fn ring(&self) {
        self.ring.notify_one();
    }

    /// Beat now and wait (bounded) until that is done, for a view of the others that is
    /// not older than this call.
    pub(crate) async fn step_now(&self) {
        let mut steps = self.steps.subscribe();
        steps.mark_unchanged();
        self.ring();
        let _ = tokio::time::timeout(STEP_WAIT, steps.changed()).await;
    }

    /// Whether the replica whose instance id prints `instance` beat in the last round.
    pub(crate) fn has_instance(&self, instance: &str) -> bool {
        self.seen
            .lock()
            .is_ok_and(|seen| seen.iter().any(|record| record.instance_id == instance))
    }

    /// Every other replica process that beat in the last round.
    pub(crate) fn others(&self, me: InstanceId) -> Vec<InstanceId> {
        let Ok(seen) = self.seen.lock() else {
            return Vec::new();
        };
        seen.iter()
            .filter_map(|record| InstanceId::parse(&record.instance_id))
            .filter(|instance| *instance != me)
            .collect()
    }

    /// Whether every other replica that beat in the last round reads lease ids that carry
    /// their expiry; `false` without a fleet stream to tell.
    pub(crate) fn all_read_expiring_ids(&self) -> bool {
        self.stream.get().is_some()
            && self
                .seen
                .lock()
                .is_ok_and(|seen| seen.iter().all(|record| record.reads_expiring_lease_ids))
    }

    /// The replica pinned to ordered consumer `name`, as the last heartbeat round said.
    pub(crate) fn pinned_on(&self, name: &ConsumerName) -> Option<InstanceId> {
        let seen = self.seen.lock().ok()?;
        seen.iter()
            .find(|record| record.pinned_to(&name.stream, &name.consumer))
            .and_then(|record| InstanceId::parse(&record.instance_id))
    }

    /// The other replicas busy on `name`, each with its leases of that consumer; a
    /// replica with the process's lease key is shown with `fingerprint`, the consumer's.
    pub(crate) fn busy_on(
        &self,
        name: &ConsumerName,
        fleet_fingerprint: &str,
        fingerprint: &str,
    ) -> Vec<ReplicaRecord> {
        let Ok(seen) = self.seen.lock() else {
            return Vec::new();
        };
        seen.iter()
            .filter_map(|record| {
                let leases = record.busy_on(&name.stream, &name.consumer)?;
                Some(ReplicaRecord {
                    leases_in_flight: leases,
                    lease_key_fingerprint: if record.lease_key_fingerprint == fleet_fingerprint {
                        fingerprint.to_owned()
                    } else {
                        record.lease_key_fingerprint.clone()
                    },
                    consumers: Vec::new(),
                    ..record.clone()
                })
            })
            .collect()
    }
}

impl Fleet {
    pub(super) fn set_announced(&self) {
        self.announced.store(true, Ordering::Relaxed);
    }

    pub(super) fn set_listening(&self) {
        self.listening.store(true, Ordering::Relaxed);
    }

    /// The other replicas' heartbeats, as just read.
    pub(super) fn saw(&self, others: Vec<ReplicaRecord>) {
        if let Ok(mut seen) = self.seen.lock() {
            *seen = others;
        }
    }

    /// Resolves when someone rings.
    pub(super) async fn rung(&self) {
        self.ring.notified().await;
    }

    /// One beat is done.
    pub(super) fn stepped(&self) {
        self.steps
            .send_modify(|steps| *steps = steps.wrapping_add(1));
    }
}
