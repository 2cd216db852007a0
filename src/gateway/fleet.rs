//! The replicas of a fleet, as one process sees them: one heartbeat per process (not per
//! consumer) listing the consumers it is busy on, the other replicas' last heartbeats, and
//! one subscription for the settles other replicas forward to this process, whichever
//! consumer they are for. What replicas exchange per second grows with the replicas, never
//! with the consumers: an idle consumer adds nothing, and with every consumer idle the
//! process only beats.
//!
//! May import: as the rest of `gateway`.

use std::collections::HashSet;
use std::time::Duration;

use futures::StreamExt as _;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, warn};

use crate::domain::consumers::ConsumerName;
use crate::nats::forward::{self, ForwardedSettle, RemoteResult};
use crate::nats::replicas::{BusyOn, ReplicaRecord};
use crate::telemetry;

use super::Gateway;
use super::process::{HEARTBEAT_EVERY, HEARTBEAT_TTL};

/// How long a process that cannot write its heartbeat waits before it serves without.
const UNANNOUNCED_AT_MOST: Duration = Duration::from_secs(10);
impl Gateway {
    /// Beat every [`HEARTBEAT_EVERY`] (or when rung) once the fleet stream is set up, and
    /// look at the other replicas while any consumer here is busy, until `stop`.
    pub(super) async fn keep_beating(self, stop: CancellationToken) {
        let fleet = &self.0.process.fleet;
        let mut tick = tokio::time::interval(HEARTBEAT_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut reported_keys: HashSet<String> = HashSet::new();
        let mut failing = false;
        let mut unannounced_since: Option<tokio::time::Instant> = None;
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = tick.tick() => {}
                () = fleet.rung() => {}
            }
            let Some(shared) = fleet.stream.get() else {
                continue;
            };
            if !self.0.process.connection.is_connected() {
                continue;
            }
            let busy = self.busy_consumers();
            let record = self.own_record(busy.clone());
            match shared
                .announce(self.0.process.instance, &record, HEARTBEAT_TTL)
                .await
            {
                Ok(()) => {
                    failing = false;
                    fleet.set_announced();
                }
                Err(err) => {
                    if !failing {
                        failing = true;
                        warn!(error = %format!("{err:#}"), "cannot announce this replica to the others; retrying");
                    }
                }
            }
            // A stream it can read but never write to (a NATS user without publish rights
            // on the prefix) must not keep the gateway from serving at all.
            if !fleet.announced() {
                let since = *unannounced_since.get_or_insert_with(tokio::time::Instant::now);
                if since.elapsed() >= UNANNOUNCED_AT_MOST {
                    error!(
                        "this replica could not announce itself for {UNANNOUNCED_AT_MOST:?}: serving without, and other replicas may answer 410 for its leases until it can"
                    );
                    fleet.set_announced();
                }
            }
            // Nobody here needs the others' view while every consumer is idle.
            if !busy.is_empty() {
                match shared.replicas().await {
                    Ok(records) => self.saw_replicas(records, &mut reported_keys),
                    Err(err) => debug!(error = %format!("{err:#}"), "cannot list the replicas"),
                }
            }
            fleet.stepped();
        }
    }

    /// The consumers this process is busy on (bound, not fallen silent), with their leases.
    fn busy_consumers(&self) -> Vec<BusyOn> {
        self.0
            .registry
            .all()
            .into_iter()
            // The replica pinned to an ordered consumer is listed even while idle: the
            // others forward to it.
            .filter(|(_, served)| served.consumer.is_busy() || served.consumer.is_pinned())
            .map(|(name, served)| BusyOn {
                stream: name.stream.clone(),
                consumer: name.consumer.clone(),
                leases_in_flight: served.consumer.leases_in_flight(),
                pinned: served.consumer.is_pinned(),
            })
            .collect()
    }

    fn own_record(&self, consumers: Vec<BusyOn>) -> ReplicaRecord {
        let process = &self.0.process;
        ReplicaRecord {
            instance_id: process.instance.to_string(),
            started_at: process.started_at,
            leases_in_flight: consumers.iter().map(|busy| busy.leases_in_flight).sum(),
            lease_key_fingerprint: process.fleet_fingerprint.clone(),
            listen: process.config.listen.to_string(),
            consumers,
            reads_expiring_lease_ids: true,
        }
    }

    fn saw_replicas(&self, records: Vec<ReplicaRecord>, reported_keys: &mut HashSet<String>) {
        let process = &self.0.process;
        let me = process.instance.to_string();
        let others: Vec<ReplicaRecord> = records
            .into_iter()
            .filter(|record| record.instance_id != me)
            .collect();
        for record in &others {
            if record.lease_key_fingerprint != process.fleet_fingerprint
                && reported_keys.insert(record.instance_id.clone())
            {
                error!(
                    replica = %record.instance_id,
                    listen = %record.listen,
                    started_at = %record.started_at,
                    "another replica signs lease ids with a different --lease-key-file: settles of its leases here (and of ours there) answer 404. Give every replica the same key file"
                );
            }
        }
        process.fleet.saw(others);
    }

    /// Answer the settles other replicas forward to this process, for any consumer it
    /// serves, until `stop` (which comes after the shutdown grace: a replica being rolled
    /// keeps settling its leases).
    pub(super) async fn serve_forwarded(self, stop: CancellationToken) {
        let process = self.0.process.clone();
        let client = tokio::select! {
            () = stop.cancelled() => return,
            client = process.connection.client() => match client {
                Some(client) => client,
                None => return,
            },
        };
        // `<prefix>.<stream>.<consumer>.settle.<instance>`: names never hold dots.
        let prefix = &process.config.internal_prefix;
        let subject = format!("{prefix}.*.*.settle.{}", process.instance);
        let mut requests = loop {
            match forward::listen(&client, subject.clone()).await {
                // Listening only once the server has the subscription: a lease issued after
                // that can be settled at any replica.
                Ok(requests)
                    if tokio::time::timeout(Duration::from_secs(5), client.flush())
                        .await
                        .is_ok_and(|flushed| flushed.is_ok()) =>
                {
                    process.fleet.set_listening();
                    break requests;
                }
                Ok(_) => warn!("cannot confirm the subscription for forwarded settles yet"),
                Err(err) => {
                    warn!(error = %format!("{err:#}"), "cannot listen for forwarded settles yet");
                }
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        };
        loop {
            let message = tokio::select! {
                () = stop.cancelled() => return,
                message = requests.next() => match message {
                    Some(message) => message,
                    None => return,
                },
            };
            let Some(reply) = message.reply.clone() else {
                continue;
            };
            // The seal covers the subject: a settle sealed for one consumer cannot be
            // replayed to another's.
            if !forward::believe(&process.trust, &message) {
                continue;
            }
            let name = message
                .subject
                .strip_prefix(prefix.as_str())
                .and_then(|rest| rest.strip_prefix('.'))
                .and_then(|rest| {
                    let mut tokens = rest.split('.');
                    Some(ConsumerName::new(tokens.next()?, tokens.next()?))
                });
            let served = name.and_then(|name| self.0.registry.get(&name));
            let (client, trust) = (client.clone(), process.trust.clone());
            let fetch = serde_json::from_slice::<ForwardedSettle>(&message.payload)
                .ok()
                .and_then(|request| request.fetch);
            if let Some(demand) = fetch {
                tokio::spawn(async move {
                    let leased = match served {
                        Some(served) => served.consumer.fetch_forwarded(demand).await,
                        None => Err("the consumer is not served by this replica".to_owned()),
                    };
                    let (results, leases) = match leased {
                        Ok(leases) => (Vec::new(), Some(leases)),
                        Err(detail) => (vec![RemoteResult::Unavailable { detail }], None),
                    };
                    forward::answer(&client, &trust, reply, results, leases).await;
                });
                continue;
            }
            tokio::spawn(async move {
                let results = match served {
                    // The owner's settle spans are children of the forwarding replica's.
                    Some(served) => {
                        telemetry::spans::forwarded_from(
                            message.headers.as_ref(),
                            served.consumer.settle_forwarded(&message.payload),
                        )
                        .await
                    }
                    // Not served here (any more): none of its leases can be live here.
                    None => serde_json::from_slice::<ForwardedSettle>(&message.payload)
                        .map(|request| request.ids.iter().map(|_| RemoteResult::Gone).collect())
                        .unwrap_or_default(),
                };
                forward::answer(&client, &trust, reply, results, None).await;
            });
        }
    }

    /// Leave the fleet: others stop counting this process at once.
    pub(super) async fn withdraw(&self) {
        if let Some(shared) = self.0.process.fleet.stream.get()
            && let Err(err) = shared.withdraw(self.0.process.instance).await
        {
            debug!(error = %format!("{err:#}"), "could not withdraw the heartbeat; it expires by itself");
        }
    }
}
