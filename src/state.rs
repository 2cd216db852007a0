//! The lease state shared by the request paths and the dispatcher: the lease table, the
//! signer of lease ids and its epoch, the consumer settings in force, capacity accounting
//! against max_ack_pending, and the wake-ups between them. Ordering per key (the gate, its
//! fence, the pin) is in [`ordering`].
//!
//! May import: `domain`, `metrics`. Never `nats`, `dispatch`, `gateway` or `http`.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::domain::delivery::{Delivery, Leased};
use crate::domain::finals::{Final, Finals, FleetFloor, MessageKey, Source};
use crate::domain::lease_id::{DeliveryKey, LeaseCoordinates, LeaseSigner};
use crate::domain::leases::LeaseTable;
use crate::domain::ordering::{OrderingGate, OrderingKeySpec};
use crate::domain::settle::AckCommand;
use crate::metrics::Metrics;
use crate::telemetry;

mod ordering;

/// How long settled and expired leases are remembered, so that retries get the first answer.
const LEASE_MEMORY: Duration = Duration::from_secs(600);
/// At most this many settled or expired leases are remembered.
const LEASE_MEMORY_MAX: usize = 500_000;
/// How long a higher count of replicas holds for the share of max_waiting: longer than a
/// heartbeat lives (4 s), so one late heartbeat never halves anybody's restraint.
const SHARE_HOLD: Duration = Duration::from_secs(10);

/// State shared by the request paths and the dispatcher.
pub(crate) struct LeaseState {
    /// Messages whose ack or term the server confirmed: it may forget them in a crash.
    finals: Mutex<Finals>,
    leases: Mutex<LeaseTable>,
    signer: LeaseSigner,
    /// Bumped when the consumer is recreated; ids of an earlier epoch are void.
    epoch: AtomicU32,
    /// The highest consumer sequence delivered to the gateway in this epoch.
    highest_consumer_sequence: AtomicU64,
    ack_wait_ms: AtomicU64,
    max_ack_pending: AtomicUsize,
    rebind: Notify,
    /// Wakes the dispatcher (one waiter) when a settle frees capacity.
    capacity_freed: Arc<Notify>,
    /// Wakes every shutdown wait when a settle lands.
    settled: Notify,
    /// Fetches wait for capacity: the next settle wakes the dispatcher.
    starved: AtomicBool,
    /// Live replicas on the consumer, this one included, as last seen.
    replicas: AtomicUsize,
    /// The replicas counted for the share of max_waiting, and since when: the most seen in
    /// the last [`SHARE_HOLD`].
    sharing: Mutex<(usize, Instant)>,
    /// Ordering per key, on a consumer that has an ordering key.
    ordering: Option<KeyOrder>,
    /// See [`LeaseState::set_dispatcher_holding`].
    dispatcher_holding: AtomicUsize,
    /// An ordered consumer's pin (priority group `pinned_client`): the id the server gave
    /// this process, while it has it.
    pin: Mutex<Option<Arc<str>>>,
    /// What to ask the other replicas (set by the gateway).
    elsewhere: std::sync::OnceLock<Elsewhere>,
    /// The highest stream sequence delivered to this process, whatever the server forgot.
    highest_stream_sequence: AtomicU64,
    /// The settled records of the fleet are not all read (the connection was lost, the
    /// consumer is being bound): nothing is leased until they are.
    fleet_behind: AtomicBool,
    /// Held by a seek while it moves the consumer, and by the compactor from reading the ack
    /// floor to writing its floor record: a floor read before a move is never written after.
    still: tokio::sync::Mutex<()>,
    pub(crate) metrics: Metrics,
}

/// What a replica newly pinned to an ordered consumer asks the others (set by the gateway):
/// how each of some messages ended through them, if it did (in order), and the highest
/// stream sequence delivered to any of them.
#[derive(Clone)]
pub(crate) struct Elsewhere {
    pub(crate) finals: Arc<dyn Fn(Vec<MessageKey>) -> FinalsAnswer + Send + Sync>,
    pub(crate) highest: Arc<dyn Fn() -> futures::future::BoxFuture<'static, u64> + Send + Sync>,
}

/// The other replicas' answer: how each message ended there, if it did.
pub(crate) type FinalsAnswer = futures::future::BoxFuture<'static, Vec<Option<Final>>>;

/// A consumer's ordering key and its gate.
struct KeyOrder {
    spec: OrderingKeySpec,
    gate: Mutex<OrderingGate>,
}

impl LeaseState {
    pub(crate) fn new(
        signer: LeaseSigner,
        ack_wait: Duration,
        max_ack_pending: usize,
        ordering_key: Option<OrderingKeySpec>,
        metrics: Metrics,
    ) -> Self {
        let state = Self {
            finals: Mutex::new(Finals::new(LEASE_MEMORY_MAX)),
            leases: Mutex::new(LeaseTable::new(LEASE_MEMORY, LEASE_MEMORY_MAX)),
            signer,
            // A random first epoch: with a shared --lease-key-file, the ids of a previous
            // process (whose settle state and reply subjects died with it) or of a consumer
            // recreated meanwhile must not name this process's deliveries, whose sequences
            // may repeat. They verify (genuine) but answer 410.
            epoch: AtomicU32::new(rand::random()),
            highest_consumer_sequence: AtomicU64::new(0),
            ack_wait_ms: AtomicU64::new(0),
            max_ack_pending: AtomicUsize::new(0),
            rebind: Notify::new(),
            capacity_freed: Arc::new(Notify::new()),
            settled: Notify::new(),
            starved: AtomicBool::new(false),
            replicas: AtomicUsize::new(1),
            sharing: Mutex::new((1, Instant::now())),
            ordering: ordering_key.map(|spec| KeyOrder {
                spec,
                gate: Mutex::default(),
            }),
            dispatcher_holding: AtomicUsize::new(0),
            pin: Mutex::new(None),
            elsewhere: std::sync::OnceLock::new(),
            highest_stream_sequence: AtomicU64::new(0),
            fleet_behind: AtomicBool::new(false),
            still: tokio::sync::Mutex::new(()),
            metrics,
        };
        state.apply_settings(ack_wait, max_ack_pending);
        state.metrics.replicas(1);
        state
    }

    /// The consumer settings in force, as read back from the server.
    pub(crate) fn apply_settings(&self, ack_wait: Duration, max_ack_pending: usize) {
        self.ack_wait_ms.store(
            u64::try_from(ack_wait.as_millis()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        self.max_ack_pending
            .store(max_ack_pending, Ordering::Relaxed);
    }

    /// How many replicas share the consumer (at least this one).
    pub(crate) fn replicas(&self) -> usize {
        self.replicas.load(Ordering::Relaxed).max(1)
    }

    pub(crate) fn set_replicas(&self, count: usize) {
        let count = count.max(1);
        self.replicas.store(count, Ordering::Relaxed);
        self.metrics.replicas(count);
        if let Ok(mut sharing) = self.sharing.lock() {
            let now = Instant::now();
            if count >= sharing.0 || now.duration_since(sharing.1) >= SHARE_HOLD {
                *sharing = (count, now);
            }
        }
    }

    /// How many replicas share the consumer's max_waiting: the most seen lately. A replica
    /// missed for a moment (its heartbeat late under load) must not let this one open more
    /// pulls than its share; one really gone is let go after [`SHARE_HOLD`].
    pub(crate) fn sharing_replicas(&self) -> usize {
        self.sharing.lock().map_or(1, |sharing| sharing.0).max(1)
    }

    /// The server's ack_wait was lowered by `by`: live leases end that much earlier (see
    /// [`LeaseTable::shorten_live`]). Returns how many were shortened.
    pub(crate) fn shorten_leases(&self, by: Duration) -> usize {
        self.leases().shorten_live(by, Instant::now())
    }

    /// The highest consumer sequence delivered to the gateway in this epoch.
    pub(crate) fn highest_consumer_sequence(&self) -> u64 {
        self.highest_consumer_sequence.load(Ordering::Relaxed)
    }

    /// The signer of lease ids.
    pub(crate) fn signer(&self) -> &LeaseSigner {
        &self.signer
    }

    /// Resolves at the next settle that frees capacity while fetches wait for it.
    pub(crate) fn capacity_freed(&self) -> Arc<Notify> {
        self.capacity_freed.clone()
    }

    /// Resolves when any settle lands (register before looking, see `Notified::enable`).
    pub(crate) fn settled(&self) -> tokio::sync::futures::Notified<'_> {
        self.settled.notified()
    }

    /// Resolves when a rebind is asked for.
    pub(crate) fn rebind_requested(&self) -> tokio::sync::futures::Notified<'_> {
        self.rebind.notified()
    }

    pub(crate) fn leases(&self) -> MutexGuard<'_, LeaseTable> {
        // A panic while holding the lock cannot leave the table half-updated in a way that
        // matters more than stopping service would, so keep going with it.
        self.leases
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(crate) fn ack_wait(&self) -> Duration {
        Duration::from_millis(self.ack_wait_ms.load(Ordering::Relaxed))
    }

    /// How long before the server's own redelivery a lease ends: the server starts its timer
    /// when it sends, a little before the gateway receives.
    pub(crate) fn margin(&self) -> Duration {
        crate::domain::leases::lease_margin(self.ack_wait())
    }

    /// How long a delivery nobody waits for is kept for the next fetch before it is nak'd:
    /// short, so that the gateway never sits on messages, and so that a client still gets
    /// at least three quarters of the ack_wait.
    pub(crate) fn hold(&self) -> Duration {
        (self.ack_wait() / 4).min(Duration::from_secs(2))
    }

    pub(crate) fn max_ack_pending(&self) -> usize {
        self.max_ack_pending.load(Ordering::Relaxed)
    }

    pub(crate) fn in_flight(&self) -> usize {
        self.leases().in_flight(Instant::now())
    }

    /// The lease epoch in force (see [`LeaseCoordinates::epoch`]).
    pub(crate) fn epoch(&self) -> u32 {
        self.epoch.load(Ordering::Relaxed)
    }

    pub(crate) fn next_expiry(&self) -> Option<Instant> {
        self.leases().next_expiry()
    }

    /// Slots of max_ack_pending in use (see [`LeaseTable::taken`]).
    pub(crate) fn taken(&self) -> usize {
        self.leases().taken(Instant::now())
    }

    /// When a slot of max_ack_pending frees by itself.
    pub(crate) fn next_release(&self) -> Option<Instant> {
        self.leases().next_release()
    }

    /// The consumer was recreated: every earlier lease is void, and its id must not match a
    /// delivery of the new consumer that happens to have the same sequence numbers.
    pub(crate) fn new_epoch(&self) {
        self.epoch.fetch_add(1, Ordering::Relaxed);
        self.highest_consumer_sequence.store(0, Ordering::Relaxed);
        let mut leases = self.leases();
        let successor = leases.successor();
        let mut old = std::mem::replace(&mut *leases, successor);
        drop(leases);
        self.metrics.leases_expired(old.take_expired());
    }

    /// A delivery arrived; `true` when the server made it before (see
    /// [`LeaseTable::note_delivery`]).
    pub(crate) fn note_delivery(&self, coordinates: &LeaseCoordinates) -> bool {
        self.metrics.delivery_received(coordinates.key.delivered);
        self.highest_consumer_sequence
            .fetch_max(coordinates.consumer_sequence, Ordering::Relaxed);
        self.highest_stream_sequence
            .fetch_max(coordinates.key.stream_sequence, Ordering::Relaxed);
        self.leases().note_delivery(coordinates.key, Instant::now())
    }

    /// The server confirmed `command` for `message`: if it ends the message (ack, term),
    /// remember it.
    pub(crate) fn confirmed(&self, message: MessageKey, command: &AckCommand) {
        if let Some(outcome) = Final::of(command) {
            self.finals().record(message, outcome);
            self.with_gate(|gate| gate.finished(message.stream_sequence));
        } else if matches!(command, AckCommand::Nak { .. }) {
            self.with_gate(|gate| gate.returned(message.stream_sequence));
        }
    }

    /// How the message a delivery carries ended through this gateway, if it did: then it is
    /// never leased again, whatever its delivery count says and whichever consumer (a
    /// recreated one included) delivers it.
    pub(crate) fn final_of(&self, coordinates: &LeaseCoordinates) -> Option<Final> {
        self.finals().get(MessageKey::of(coordinates))
    }

    /// Whether an ack or term of the message a delivery carries is on its way to the server
    /// from this process: the delivery waits for that answer before it may be leased.
    pub(crate) fn is_ending(&self, coordinates: &LeaseCoordinates) -> bool {
        self.leases().is_ending(coordinates.key.stream_sequence)
    }

    /// How `message` ended through this process, if it did.
    pub(crate) fn final_of_message(&self, message: MessageKey) -> Option<Final> {
        self.finals().get(message)
    }

    /// Remember that `message` ended elsewhere (another replica confirmed it, and the
    /// server lost that): a later redelivery here is settled again, not leased.
    pub(crate) fn ended_elsewhere(&self, message: MessageKey, outcome: Final) {
        self.finals().record_from_fleet(message, outcome);
    }

    /// Records of the fleet say these messages ended (see `nats::settled`): a redelivery of
    /// one is settled again, not leased. Those at or below `floor` (the consumer's ack
    /// floor) are not kept: the server does not deliver them again unless it forgets, and
    /// then its floor goes back and the records are read again. `voided`: an earlier record
    /// said these ended, and their settle then went unconfirmed; forgotten again.
    pub(crate) fn ended_in_fleet(
        &self,
        ended: Vec<(MessageKey, Final)>,
        voided: &[MessageKey],
        floor: u64,
    ) {
        let mut finals = self.finals();
        for (message, outcome) in ended {
            if message.stream_sequence > floor {
                finals.record_from_fleet(message, outcome);
            }
        }
        for message in voided {
            finals.void_from_fleet(*message);
        }
    }

    /// A floor record of the fleet's (see `nats::settled`): every message under it ended.
    pub(crate) fn raise_fleet_floor(&self, floor: FleetFloor) {
        self.finals().raise_floor_from_fleet(floor);
    }

    /// The highest floor record read or written.
    pub(crate) fn fleet_floor(&self) -> Option<FleetFloor> {
        self.finals().fleet_floor()
    }

    /// Who confirmed how the message a delivery carries ended (when it did).
    pub(crate) fn final_source(&self, coordinates: &LeaseCoordinates) -> Option<Source> {
        self.finals().source(MessageKey::of(coordinates))
    }

    /// Whether the fleet's settled records may be missing some: then nothing is leased.
    pub(crate) fn fleet_behind(&self) -> bool {
        self.fleet_behind.load(Ordering::Acquire)
    }

    /// The fleet's settled records are (`false`), or may not be (`true`), all read.
    pub(crate) fn set_fleet_behind(&self, behind: bool) {
        self.fleet_behind.store(behind, Ordering::Release);
    }

    /// Keep the consumer where it is (no seek, no floor record) while the guard lives.
    pub(crate) async fn hold_still(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.still.lock().await
    }

    /// The consumer was moved on purpose (a seek): every live lease is void, and what
    /// ended through this gateway before may be delivered again as meant, not settled again.
    pub(crate) fn moved(&self) {
        *self.finals() = Finals::new(LEASE_MEMORY_MAX);
        self.new_epoch();
        self.request_rebind();
    }

    fn finals(&self) -> MutexGuard<'_, Finals> {
        // As for the lease table: keep going with a table a panic left behind.
        self.finals
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A delivery was nak'd back without ever being leased.
    pub(crate) fn released(&self, key: DeliveryKey) {
        self.metrics.delivery_released();
        self.leases().note_unleased(key, Instant::now());
        self.with_gate(|gate| gate.returned(key.stream_sequence));
    }

    /// A settle freed a slot: wake the dispatcher only if fetches wait for one (a batch ack
    /// would otherwise wake it once per lease), and any shutdown grace.
    pub(crate) fn freed_capacity(&self) {
        if self.starved.swap(false, Ordering::Relaxed) {
            self.capacity_freed.notify_one();
        }
        self.settled.notify_waiters();
    }

    /// The dispatcher has fetches waiting for capacity.
    pub(crate) fn starving(&self) {
        self.starved.store(true, Ordering::Relaxed);
    }

    pub(crate) fn request_rebind(&self) {
        self.rebind.notify_one();
    }

    /// Issue leases for deliveries about to be handed to a client.
    pub(crate) fn lease(&self, deliveries: Vec<Delivery>) -> Vec<Leased> {
        let lifetime = self.ack_wait().saturating_sub(self.margin());
        self.metrics.leases_granted(deliveries.len());
        self.with_gate(|gate| {
            for delivery in &deliveries {
                gate.leased(delivery.coordinates.key.stream_sequence);
            }
        });
        let mut leases = self.leases();
        // Read once for the batch: each id carries its expiry as wall-clock time.
        let (now, wall_now) = (Instant::now(), time::OffsetDateTime::now_utc());
        deliveries
            .into_iter()
            .map(|delivery| {
                let expires_at = delivery.received_at + lifetime;
                let expires_unix_ms = crate::domain::unix_ms_from(expires_at, now, wall_now);
                leases.issue(delivery.coordinates.key, delivery.reply.clone(), expires_at);
                if let Some(note) =
                    telemetry::spans::note_of(&delivery.subject, delivery.headers.as_ref())
                {
                    leases.annotate(delivery.coordinates.key, note);
                }
                Leased {
                    id: self.signer.encode(&delivery.coordinates, expires_unix_ms),
                    delivery,
                    expires_at,
                }
            })
            .collect()
    }

    /// Take back leases whose client never got them.
    pub(crate) fn give_back(&self, leased: Vec<Leased>) -> Vec<Delivery> {
        self.metrics.leases_given_back(leased.len());
        self.with_gate(|gate| {
            for leased in &leased {
                gate.given_back(leased.delivery.coordinates.key.stream_sequence);
            }
        });
        let mut leases = self.leases();
        leased
            .into_iter()
            .map(|leased| {
                leases.give_back(leased.delivery.coordinates.key);
                leased.delivery
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::lease_id::InstanceId;
    use crate::metrics::ProcessMetrics;

    fn state() -> LeaseState {
        let metrics = ProcessMetrics::new().for_consumer("ORDERS", "billing");
        let signer = LeaseSigner::with_key(&[7; 32], "ORDERS", "billing", InstanceId::random());
        LeaseState::new(signer, Duration::from_secs(30), 1024, None, metrics)
    }

    #[tokio::test(start_paused = true)]
    async fn a_replica_missed_for_a_moment_keeps_its_share_of_max_waiting() {
        let state = state();
        state.set_replicas(3);
        // One heartbeat late: the count drops, the share does not.
        state.set_replicas(2);
        assert_eq!(state.replicas(), 2);
        assert_eq!(state.sharing_replicas(), 3);
        tokio::time::advance(SHARE_HOLD - Duration::from_secs(1)).await;
        state.set_replicas(2);
        assert_eq!(state.sharing_replicas(), 3);
        // Gone for good: after the hold the share follows.
        tokio::time::advance(Duration::from_secs(1)).await;
        state.set_replicas(2);
        assert_eq!(state.sharing_replicas(), 2);
        // More replicas count at once.
        state.set_replicas(4);
        assert_eq!(state.sharing_replicas(), 4);
    }
}
