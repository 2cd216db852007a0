//! Which replica runs which redrive task: every replica watches the redrive bucket and
//! claims, by compare-and-set on its record, a running task nobody holds (a new one, one
//! released at a shutdown, one whose holder stopped renewing its claim: killed), then runs
//! it here until it ends, is claimed elsewhere, or this replica stops.
//!
//! May import: as the rest of `gateway`.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use futures::StreamExt as _;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

use super::run::Run;
use super::task;
use crate::gateway::Gateway;
use crate::nats::redrive::{self, TaskState, Versioned, Written};

/// How often a replica without the redrive bucket looks for it.
const BUCKET_LOOKED_FOR_EVERY: Duration = Duration::from_secs(30);

type Bucket = async_nats::jetstream::kv::Store;

/// The redrive tasks this replica runs.
#[derive(Default)]
pub(in crate::gateway) struct Redrives {
    /// Wakes the watcher when this replica made the bucket.
    wake: Notify,
    running: std::sync::Mutex<HashSet<String>>,
    tracker: TaskTracker,
    pub(super) stop: CancellationToken,
    /// The bucket once found: reading a task is then one direct get, never a stream-info
    /// request queued behind a running redrive's removals at the server's API.
    bucket: std::sync::Mutex<Option<Bucket>>,
}

impl Redrives {
    /// Stop every task run here at its chunk's end, each released for another replica.
    pub(in crate::gateway) async fn stop(&self) {
        self.stop.cancel();
        self.tracker.close();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.tracker.wait()).await;
    }

    /// A task was made here: look for the bucket (and its tasks) now.
    pub(super) fn made_one(&self) {
        self.wake.notify_one();
    }

    pub(super) fn known_bucket(&self) -> Option<Bucket> {
        self.bucket_mut(|bucket| bucket.clone())
    }

    pub(super) fn keep_bucket(&self, found: &Bucket) {
        self.bucket_mut(|bucket| *bucket = Some(found.clone()));
    }

    fn bucket_mut<T>(&self, change: impl FnOnce(&mut Option<Bucket>) -> T) -> T {
        let mut bucket = self
            .bucket
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        change(&mut bucket)
    }

    fn running_mut<T>(&self, change: impl FnOnce(&mut HashSet<String>) -> T) -> T {
        let mut running = self
            .running
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        change(&mut running)
    }
}

impl Gateway {
    /// Watch the redrive bucket until `stop`, claiming and running the tasks nobody holds.
    pub(in crate::gateway) async fn keep_redriving(self, stop: CancellationToken) {
        let me = self.0.process.instance.to_string();
        let redrives = &self.0.redrives;
        loop {
            let bucket = match self.jetstream() {
                Ok(js) => match redrives.known_bucket() {
                    Some(bucket) => Some(bucket),
                    None => redrive::bucket(&js).await.ok().flatten(),
                },
                Err(_) => None,
            };
            let Some(bucket) = bucket else {
                // No bucket yet: look again now and then (an idle gateway's only cost here),
                // or at once when one is made here (its first task is run here then).
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = redrives.wake.notified() => {}
                    () = tokio::time::sleep(BUCKET_LOOKED_FOR_EVERY) => {}
                }
                continue;
            };
            // With history: the tasks made before this replica started are claimed too.
            let mut watch = match bucket.watch_with_history(">").await {
                Ok(watch) => watch,
                Err(err) => {
                    // Perhaps deleted: found again (or not) from scratch.
                    redrives.bucket_mut(|bucket| *bucket = None);
                    warn!(error = %err, "cannot watch the redrive bucket; trying again");
                    tokio::select! {
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                    continue;
                }
            };
            let mut known: HashMap<String, Versioned> = HashMap::new();
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    entry = watch.next() => match entry {
                        Some(Ok(entry)) => {
                            // The register of running tasks does not read as a task: skipped.
                            if entry.operation == async_nats::jetstream::kv::Operation::Put {
                                if let Ok(versioned) = redrive::decode(&entry) {
                                    known.insert(entry.key.clone(), versioned);
                                }
                            } else {
                                known.remove(&entry.key);
                            }
                            if let Some(versioned) = known.get(&entry.key) {
                                self.claim(&bucket, versioned.clone(), &me).await;
                            }
                        }
                        Some(Err(err)) => {
                            warn!(error = %err, "the redrive bucket's watch failed; watching again");
                            break;
                        }
                        None => break,
                    },
                    _ = tick.tick() => {
                        known.retain(|_, versioned| versioned.record.state == TaskState::Running);
                        for versioned in known.values() {
                            self.claim(&bucket, versioned.clone(), &me).await;
                        }
                    }
                }
            }
        }
    }

    /// Take `versioned` and run it here, when nobody holds it and it is running.
    async fn claim(&self, bucket: &Bucket, mut versioned: Versioned, me: &str) {
        let redrives = &self.0.redrives;
        let record = &versioned.record;
        if record.state != TaskState::Running
            || task::is_held(record)
            || redrives.stop.is_cancelled()
        {
            return;
        }
        let id = record.task.clone();
        if !redrives.running_mut(|running| running.insert(id.clone())) {
            return;
        }
        task::claim(&mut versioned.record, me);
        match redrive::update(bucket, &versioned.record, versioned.revision).await {
            Ok(Written::At(revision)) => {
                versioned.revision = revision;
                info!(task = %id, "running the redrive task here");
                let gateway = self.clone();
                let bucket = bucket.clone();
                let me = me.to_owned();
                redrives.tracker.spawn(async move {
                    let run = Run {
                        gateway: gateway.clone(),
                        bucket,
                        me,
                        versioned,
                    };
                    run.run_to_the_end().await;
                    gateway
                        .0
                        .redrives
                        .running_mut(|running| running.remove(&id));
                });
            }
            Ok(Written::Conflict) | Err(_) => {
                redrives.running_mut(|running| running.remove(&id));
            }
        }
    }
}
