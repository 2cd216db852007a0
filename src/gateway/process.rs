//! What every consumer a gateway process serves shares: the process's identity in lease ids,
//! its lease key, the seal on replica traffic, the metrics registry, the NATS connection and
//! the settings given at start.
//!
//! May import: as the rest of `gateway`.

use std::sync::Arc;

use time::OffsetDateTime;

use crate::config::Config;
use crate::domain::lease_id::{InstanceId, LeaseKey, LeaseSigner};
use crate::domain::seal::Sealer;
use crate::metrics::ProcessMetrics;
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
        Self {
            instance,
            key,
            trust,
            metrics,
            connection,
            started_at: OffsetDateTime::now_utc(),
            config,
        }
    }

    /// The signer of one consumer's lease ids, as this process issues them.
    pub(crate) fn signer(&self, stream: &str, consumer: &str) -> LeaseSigner {
        LeaseSigner::with_key(&self.key, stream, consumer, self.instance)
    }
}
