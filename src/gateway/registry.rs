//! The consumers a process serves, by stream and name: the default one, those of the
//! consumers file, and existing ones bound on demand — each with its core, its tasks, where
//! it came from, and whether it still takes fetches.
//!
//! May import: as the rest of `gateway`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::Duration;

use tokio::time::Instant;

use crate::domain::consumers::ConsumerName;

use super::consumer::{Consumer, Tasks};

/// Where a served consumer comes from (the `source` of `GET /consumers`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    /// `--stream`/`--consumer`.
    Default,
    /// `--consumers-file`.
    File,
    /// `--serve-existing`, bound on first use.
    Existing,
}

impl Source {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Default => "default",
            Self::File => "file",
            Self::Existing => "existing",
        }
    }
}

/// One served consumer.
pub(crate) struct Served {
    pub(crate) consumer: Consumer,
    pub(crate) source: Source,
    tasks: Mutex<Option<Tasks>>,
    /// Removed from the consumers file: no new leases, but its live leases still settle.
    retired: AtomicBool,
    /// Retired only until its live leases end, then bound anew with changed settings.
    awaiting_rebind: AtomicBool,
    /// When it was made; `last_used` counts from here.
    born: Instant,
    /// Milliseconds from `born` to the last request that named it, for `--idle-unbind`:
    /// an atomic, as every settle stamps it.
    last_used: AtomicU64,
}

impl Served {
    pub(crate) fn new(consumer: Consumer, source: Source, tasks: Tasks) -> Self {
        Self {
            consumer,
            source,
            tasks: Mutex::new(Some(tasks)),
            retired: AtomicBool::new(false),
            awaiting_rebind: AtomicBool::new(false),
            born: Instant::now(),
            last_used: AtomicU64::new(0),
        }
    }

    pub(crate) fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Relaxed)
    }

    /// No new leases from now on: its open streams end, saying `why`; its live leases
    /// still settle.
    pub(crate) fn retire(&self, why: &str) {
        if !self.retired.swap(true, Ordering::Relaxed) {
            self.consumer.end_streams(why);
        }
    }

    /// Declared again before its last lease ended: it takes fetches again.
    /// Retired until its live leases have ended, then served anew (its settings changed in
    /// a way only a new binding applies): meanwhile it exists, and its requests are told to
    /// come back shortly.
    pub(crate) fn retire_until_rebound(&self, why: &str) {
        self.awaiting_rebind.store(true, Ordering::Relaxed);
        self.retire(why);
    }

    pub(crate) fn awaits_rebind(&self) -> bool {
        self.awaiting_rebind.load(Ordering::Relaxed)
    }

    pub(crate) fn reinstate(&self) {
        self.awaiting_rebind.store(false, Ordering::Relaxed);
        self.retired.store(false, Ordering::Relaxed);
    }

    pub(crate) fn touch(&self) {
        let since = u64::try_from(self.born.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_used.store(since, Ordering::Relaxed);
    }

    pub(crate) fn last_used(&self) -> Instant {
        self.born + Duration::from_millis(self.last_used.load(Ordering::Relaxed))
    }

    /// The tasks, once: whoever stops the consumer takes them.
    pub(crate) fn take_tasks(&self) -> Option<Tasks> {
        self.tasks.lock().ok().and_then(|mut tasks| tasks.take())
    }
}

/// The served consumers.
#[derive(Default)]
pub(crate) struct Registry {
    entries: RwLock<HashMap<ConsumerName, Arc<Served>>>,
    default: Option<ConsumerName>,
    /// The default consumer once served: every settle of a version 2 id reaches it, so
    /// without a lookup (it is served from start to stop).
    default_served: OnceLock<Arc<Served>>,
}

impl Registry {
    pub(crate) fn new(default: Option<ConsumerName>) -> Self {
        Self {
            entries: RwLock::default(),
            default,
            default_served: OnceLock::new(),
        }
    }

    pub(crate) fn get(&self, name: &ConsumerName) -> Option<Arc<Served>> {
        self.entries.read().ok()?.get(name).cloned()
    }

    pub(crate) fn default_consumer(&self) -> Option<Arc<Served>> {
        self.default_served.get().cloned()
    }

    /// Add `served` unless one of that name is there; returns the one in force.
    pub(crate) fn insert(&self, name: ConsumerName, served: Arc<Served>) -> Arc<Served> {
        let is_default = self.default.as_ref() == Some(&name);
        let in_force = match self.entries.write() {
            Ok(mut entries) => entries.entry(name).or_insert(served).clone(),
            Err(_) => served,
        };
        if is_default {
            let _ = self.default_served.set(in_force.clone());
        }
        in_force
    }

    pub(crate) fn remove(&self, name: &ConsumerName) -> Option<Arc<Served>> {
        self.entries.write().ok()?.remove(name)
    }

    /// Every served consumer, ordered by stream and name.
    pub(crate) fn all(&self) -> Vec<(ConsumerName, Arc<Served>)> {
        let mut all: Vec<_> = self
            .entries
            .read()
            .map(|entries| {
                entries
                    .iter()
                    .map(|(name, served)| (name.clone(), served.clone()))
                    .collect()
            })
            .unwrap_or_default();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }
}
