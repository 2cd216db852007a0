//! Several replicas on one consumer, no sticky sessions — keeping in step: a loop per
//! consumer sees who else is busy on it (from the process's heartbeats, see
//! [`crate::gateway`]'s fleet, for `GET /consumer` and the share of max_waiting), whether
//! the consumer's max_ack_pending is reached across all of them, and the consumer's
//! settings as the server enforces them. What the replicas ask and forward one another
//! (settles of leases another replica issued, fetches for the pinned one) is
//! [`super::exchange`]'s.
//!
//! May import: as the rest of `gateway`.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use time::OffsetDateTime;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use super::super::process::HEARTBEAT_TTL;
use super::Consumer;
use crate::domain::lease_id::InstanceId;
use crate::nats::Bound;
use crate::nats::replicas::ReplicaRecord;

/// How often a busy consumer looks at the others and at the consumer.
const STEP_EVERY: Duration = Duration::from_secs(1);

/// A live replica, as `GET /consumer` shows it.
#[derive(Debug, Clone)]
pub(crate) struct ReplicaView {
    pub(crate) instance_id: String,
    pub(crate) started_at: OffsetDateTime,
    pub(crate) leases_in_flight: usize,
    pub(crate) listen: String,
    /// Whether it signs lease ids with the same key as this replica (else settles between
    /// the two answer 404).
    pub(crate) lease_key_matches: bool,
    pub(crate) this_replica: bool,
    /// Pinned to this ordered consumer.
    pub(crate) pinned: bool,
}

impl Consumer {
    /// This process, as its lease ids name it.
    pub(crate) fn instance(&self) -> InstanceId {
        self.process.instance
    }

    /// The live replicas as last seen (this one always among them).
    pub(crate) fn replicas(&self) -> Vec<ReplicaView> {
        let mine = self.state.signer().key_fingerprint();
        let seen = self
            .replicas
            .lock()
            .map(|seen| seen.clone())
            .unwrap_or_default();
        let me = self.process.instance.to_string();
        let pinned = self
            .process
            .fleet
            .pinned_on(&self.name)
            .map(|instance| instance.to_string());
        let mut views: Vec<ReplicaView> = seen
            .into_iter()
            .filter(|record| record.instance_id != me)
            .map(|record| ReplicaView {
                pinned: pinned.as_deref() == Some(record.instance_id.as_str()),
                lease_key_matches: record.lease_key_fingerprint == mine,
                instance_id: record.instance_id,
                started_at: record.started_at,
                leases_in_flight: record.leases_in_flight,
                listen: record.listen,
                this_replica: false,
            })
            .collect();
        let record = self.own_record();
        views.push(ReplicaView {
            instance_id: record.instance_id,
            started_at: record.started_at,
            leases_in_flight: record.leases_in_flight,
            listen: record.listen,
            lease_key_matches: true,
            this_replica: true,
            pinned: self.is_pinned(),
        });
        views.sort_by_key(|view| view.started_at);
        views
    }

    fn own_record(&self) -> ReplicaRecord {
        ReplicaRecord {
            instance_id: self.process.instance.to_string(),
            started_at: self.process.started_at,
            leases_in_flight: self.leases_in_flight(),
            lease_key_fingerprint: self.state.signer().key_fingerprint().to_owned(),
            listen: self.config.listen.to_string(),
            consumers: Vec::new(),
            reads_expiring_lease_ids: true,
        }
    }

    /// Look at the other replicas and at the consumer every [`STEP_EVERY`] while busy,
    /// until `stop`; where an earlier release's replicas may be (the consumer's own shared
    /// stream), beat there too.
    pub(super) async fn keep_in_step(
        self,
        consumer_full: watch::Sender<bool>,
        stop: CancellationToken,
    ) {
        let mut tick = tokio::time::interval(STEP_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut reported_keys: HashSet<String> = HashSet::new();
        let mut bindings = self.bound.clone();
        let mut nats_up = self.nats_up.clone();
        let fleet = &self.process.fleet;
        loop {
            let mut fresh_view = false;
            tokio::select! {
                () = stop.cancelled() => return,
                _ = tick.tick() => {}
                // A new binding is in the process's next heartbeat at once: a replica
                // starting now must see this one.
                changed = bindings.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    fleet.ring();
                },
                // The binding is usable only once the connection is marked up, a moment
                // after it is published: step then, not a tick later.
                changed = nats_up.changed() => if changed.is_err() {
                    return;
                },
                // A request for a consumer that fell silent.
                () = self.activity.rung() => {}
            }
            if self.activity.is_idle(self.state.in_flight()) {
                if self.activity.set_asleep(true) {
                    debug!(consumer = %self.config.consumer, "idle: left out of the heartbeat, no reads of the consumer until the next request");
                }
                continue;
            }
            if self.activity.set_asleep(false) {
                // Woken: listed in the next heartbeat, and the others' view is old.
                fresh_view = true;
            }
            let Ok(bound) = self.connected() else {
                continue;
            };
            // Boxed: this task lives as long as its consumer, and most of a thousand
            // consumers are idle; the step's futures would make every one of them 4 KB.
            Box::pin(self.step(&bound, fresh_view, &mut reported_keys, &consumer_full)).await;
            self.activity.stepped();
        }
    }

    /// One step of a consumer that is not idle: the other replicas' view (and an earlier
    /// release's, in the consumer's own shared stream), and the consumer as the server has it.
    async fn step(
        &self,
        bound: &Arc<Bound>,
        fresh_view: bool,
        reported_keys: &mut HashSet<String>,
        consumer_full: &watch::Sender<bool>,
    ) {
        let fleet = &self.process.fleet;
        if fresh_view {
            fleet.step_now().await;
        }
        let mut others = fleet.busy_on(
            &self.name,
            &self.process.fleet_fingerprint,
            self.state.signer().key_fingerprint(),
        );
        if let Some(per_consumer) = bound.per_consumer.as_ref().filter(|p| !p.is_gone()) {
            let beat = per_consumer
                .announce(self.process.instance, &self.own_record(), HEARTBEAT_TTL)
                .await;
            if let Err(err) = beat {
                debug!(error = %format!("{err:#}"), "cannot beat in the shared stream of an earlier release");
                per_consumer.look_again().await;
            }
            match per_consumer.replicas().await {
                Ok(records) => {
                    for record in records {
                        if !others
                            .iter()
                            .any(|other| other.instance_id == record.instance_id)
                        {
                            others.push(record);
                        }
                    }
                }
                Err(err) => {
                    debug!(error = %format!("{err:#}"), "cannot list the replicas of an earlier release")
                }
            }
        }
        self.saw_replicas(others, reported_keys);
        let pause_mark = self.pause_mark();
        match crate::nats::publish::consumer_info(bound).await {
            // Made again under the same name (perhaps as something the gateway cannot
            // lease) while no pull was open to hear of the deletion: bound anew.
            Ok(info) if info.created != bound.created => {
                info!(consumer = %info.name, "the consumer was made again; binding it anew");
                self.state.request_rebind();
            }
            Ok(info) => {
                let max_ack_pending =
                    usize::try_from(info.config.max_ack_pending).unwrap_or(usize::MAX);
                self.follow_settings(info.config.ack_wait, max_ack_pending);
                self.follow_pause(pause_mark, info.paused, info.config.pause_until);
                self.follow_moves(&info);
                // Other replicas hold slots this one does not count: the server's count
                // of unacknowledged deliveries says when all of them together are full.
                let full = self.state.replicas() > 1
                    && max_ack_pending > 0
                    && info.num_ack_pending >= max_ack_pending;
                consumer_full.send_if_modified(|was| std::mem::replace(was, full) != full);
            }
            Err(err) => debug!(error = %format!("{err:#}"), "cannot read the consumer's state"),
        }
    }

    /// The other replicas busy on this consumer, as just seen; an earlier release's with a
    /// differing lease key is reported once (the fleet reports the others).
    fn saw_replicas(&self, records: Vec<ReplicaRecord>, reported_keys: &mut HashSet<String>) {
        let me = self.process.instance.to_string();
        let mine = self.state.signer().key_fingerprint();
        let records: Vec<ReplicaRecord> = records
            .into_iter()
            .filter(|record| record.instance_id != me)
            .collect();
        self.state.set_replicas(records.len() + 1);
        // Any replica may be asked to settle a lease, busy on this consumer or not.
        self.state.signer().issue_expiring(
            self.process.fleet.all_read_expiring_ids()
                && records.iter().all(|record| record.reads_expiring_lease_ids),
        );
        for record in &records {
            if record.lease_key_fingerprint != mine
                && !self.process.fleet.has_instance(&record.instance_id)
                && reported_keys.insert(record.instance_id.clone())
            {
                error!(
                    replica = %record.instance_id,
                    listen = %record.listen,
                    started_at = %record.started_at,
                    "another replica on this consumer signs lease ids with a different --lease-key-file: settles of its leases here (and of ours there) answer 404. Give every replica the same key file"
                );
            }
        }
        if let Ok(mut seen) = self.replicas.lock() {
            *seen = records;
        }
    }

    /// The consumer's settings as the server now has them: a change made outside the
    /// gateways (`nats consumer edit`) takes effect for new leases, and a lowered ack_wait
    /// ends live leases at the server's new deadline.
    pub(super) fn follow_settings(&self, ack_wait: Duration, max_ack_pending: usize) {
        // Compared as the state keeps it, in whole milliseconds.
        let ack_wait =
            Duration::from_millis(u64::try_from(ack_wait.as_millis()).unwrap_or(u64::MAX));
        let old_ack_wait = self.state.ack_wait();
        let old_max = self.state.max_ack_pending();
        if ack_wait.is_zero() || (ack_wait == old_ack_wait && max_ack_pending == old_max) {
            return;
        }
        let shortened = if ack_wait < old_ack_wait {
            self.state.shorten_leases(old_ack_wait - ack_wait)
        } else {
            0
        };
        self.state.apply_settings(ack_wait, max_ack_pending);
        warn!(
            ack_wait = %humantime::format_duration(ack_wait),
            was = %humantime::format_duration(old_ack_wait),
            max_ack_pending,
            max_ack_pending_was = old_max,
            leases_shortened = shortened,
            "the consumer's settings were changed on the server; new leases follow them, and live leases end no later than the server now redelivers"
        );
        self.state.freed_capacity();
    }

    /// Leave the consumer's own shared stream of an earlier release: its replicas stop
    /// counting this one at once (the fleet's heartbeat is withdrawn by the process).
    pub(super) async fn withdraw(&self) {
        if let Ok(bound) = self.bound()
            && let Some(per_consumer) = bound.per_consumer.as_ref().filter(|p| !p.is_gone())
            && let Err(err) = per_consumer.withdraw(self.process.instance).await
        {
            debug!(error = %format!("{err:#}"), "could not withdraw the heartbeat; it expires by itself");
        }
    }
}
