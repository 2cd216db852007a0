//! An idle consumer costs nothing: after [`IDLE_AFTER`] without a fetch, a stream or a live
//! lease, its loop stops reading the consumer's state and the process's heartbeat stops
//! listing it (no NATS traffic for it at all; the other replicas stop counting this one on
//! it, which is right: it holds no lease anyone could settle through it). The next request
//! wakes it and waits for one full step — the others' view fresh, settings read — before it
//! leases.
//!
//! May import: as the rest of `gateway`.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, watch};
use tokio::time::Instant;

/// How long a consumer goes without demand or live lease before it falls silent.
pub(super) const IDLE_AFTER: Duration = Duration::from_secs(10);
/// How long a request waits for a silent consumer to wake (one heartbeat step).
const WAKE_WAIT: Duration = Duration::from_secs(2);

/// What keeps a consumer awake, and the wake-up of one that fell silent.
pub(super) struct Activity {
    /// Fetches waiting and streams open now.
    holders: AtomicUsize,
    /// When the last of them ended (or began).
    last: Mutex<Instant>,
    /// The heartbeat loop is silent.
    asleep: AtomicBool,
    /// Rings the heartbeat loop out of its silence.
    wake: Notify,
    /// Bumped by the heartbeat loop after each full step.
    steps: watch::Sender<u64>,
}

impl Default for Activity {
    fn default() -> Self {
        Self {
            holders: AtomicUsize::new(0),
            last: Mutex::new(Instant::now()),
            asleep: AtomicBool::new(false),
            wake: Notify::new(),
            steps: watch::channel(0).0,
        }
    }
}

/// Keeps the consumer awake while it lives.
pub(crate) struct Held(Arc<Activity>);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.touch();
        self.0.holders.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Activity {
    /// A fetch or a stream begins: the consumer stays awake until the guard goes.
    pub(super) fn hold(self: &Arc<Self>) -> Held {
        self.holders.fetch_add(1, Ordering::AcqRel);
        self.touch();
        Held(self.clone())
    }

    /// Whether a fetch waits or a stream is open now.
    pub(super) fn is_held(&self) -> bool {
        self.holders.load(Ordering::Acquire) > 0
    }

    fn touch(&self) {
        if let Ok(mut last) = self.last.lock() {
            *last = Instant::now();
        }
    }

    /// Whether the consumer is idle: no demand now, none for [`IDLE_AFTER`], no live lease.
    pub(super) fn is_idle(&self, leases_in_flight: usize) -> bool {
        leases_in_flight == 0
            && self.holders.load(Ordering::Acquire) == 0
            && self
                .last
                .lock()
                .is_ok_and(|last| last.elapsed() >= IDLE_AFTER)
    }

    /// The heartbeat loop falls silent (`true`) or speaks again; whether that changed.
    pub(super) fn set_asleep(&self, asleep: bool) -> bool {
        self.asleep.swap(asleep, Ordering::AcqRel) != asleep
    }

    /// Whether the heartbeat loop speaks (the consumer has not fallen silent).
    pub(super) fn is_awake(&self) -> bool {
        !self.asleep.load(Ordering::Acquire)
    }

    /// Resolves when a request rings.
    pub(super) async fn rung(&self) {
        self.wake.notified().await;
    }

    /// One full heartbeat step is done.
    pub(super) fn stepped(&self) {
        self.steps
            .send_modify(|steps| *steps = steps.wrapping_add(1));
    }

    /// Wake a silent heartbeat loop and wait (bounded) for its next full step; at once when
    /// it is not silent.
    pub(super) async fn wake_up(&self) {
        if !self.asleep.load(Ordering::Acquire) {
            return;
        }
        let mut steps = self.steps.subscribe();
        steps.mark_unchanged();
        self.wake.notify_one();
        let _ = tokio::time::timeout(WAKE_WAIT, steps.changed()).await;
    }
}
