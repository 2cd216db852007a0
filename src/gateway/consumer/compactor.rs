//! Keeps the consumer's settled records bounded by what is still pending, not by traffic:
//! once the consumer's ack floor has been at F long enough to be on disk (the server would
//! no longer forget it), a floor record says "everything at or under F ended" — for a
//! consumer made again, whose floor starts at 0 — and the records stored before the first
//! one that names a message above F are dropped.
//!
//! May import: as the rest of `gateway`.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::domain::finals::FleetFloor;
use crate::nats::settled::Records;
use crate::state::LeaseState;

/// What the reader saw, shared with the task that drops records.
pub(super) struct Compactor {
    floor_on_disk_after: Duration,
    seen: Mutex<Seen>,
}

#[derive(Default)]
struct Seen {
    /// Ack floors seen, oldest first, each above the one before; forgotten on a reconnect.
    floors: VecDeque<(Instant, FleetFloor)>,
    /// Bumped on every reconnect: a floor asked for before it is not kept.
    connection: u64,
    /// Records read, by their sequence in the records stream: the highest stream sequence
    /// each names.
    spans: BTreeMap<u64, u64>,
}

impl Compactor {
    pub(super) fn new(floor_on_disk_after: Duration) -> Self {
        Self {
            floor_on_disk_after,
            seen: Mutex::default(),
        }
    }

    fn seen(&self) -> MutexGuard<'_, Seen> {
        self.seen
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// How often the floor is looked at: a few times per wait for it to be on disk, at
    /// most every 30 s and at least every 5 s (one consumer info request each).
    fn every(&self) -> Duration {
        (self.floor_on_disk_after / 4).clamp(Duration::from_secs(5), Duration::from_secs(30))
    }

    /// The reader read the record at `sequence`, naming messages up to `max_sequence`.
    pub(super) fn read(&self, sequence: u64, max_sequence: u64) {
        self.seen().spans.insert(sequence, max_sequence);
    }

    /// The reader reads everything again from the start.
    pub(super) fn read_again(&self) {
        self.seen().spans.clear();
    }

    /// The connection came back, maybe to a server restarted that forgot what it had not
    /// written: no floor seen before is known to be on disk.
    pub(super) fn reconnected(&self) {
        let mut seen = self.seen();
        seen.floors.clear();
        seen.connection += 1;
    }

    /// Look at the floor; write a floor record and drop the records under it once one seen
    /// is on disk.
    async fn compact(
        &self,
        records: &Records,
        state: &LeaseState,
        last_read: u64,
    ) -> anyhow::Result<()> {
        let asked_on = self.seen().connection;
        let floor = records.consumer_floor().await?;
        let now = Instant::now();
        let Some(on_disk) = self.floor_on_disk(floor, asked_on, now) else {
            return Ok(());
        };
        let known = state.fleet_floor();
        if known.is_none_or(|known| known.stream_sequence < on_disk.stream_sequence) {
            records.store_floor(on_disk).await?;
            state.raise_fleet_floor(on_disk);
        }
        let under = on_disk
            .stream_sequence
            .max(known.map_or(0, |known| known.stream_sequence));
        let keep_from = {
            let seen = self.seen();
            let keep_from = seen
                .spans
                .iter()
                .find(|(_, max)| **max > under)
                .map_or(last_read + 1, |(sequence, _)| *sequence);
            if seen.spans.range(..keep_from).next().is_none() {
                return Ok(());
            }
            keep_from
        };
        // Every record before `keep_from` names only messages under a floor record stored.
        records.drop_before(keep_from).await?;
        let mut seen = self.seen();
        seen.spans = seen.spans.split_off(&keep_from);
        Ok(())
    }

    /// Note `floor`, seen `now` (asked for on connection `asked_on`), and take the newest
    /// floor seen long enough ago to be on disk.
    fn floor_on_disk(
        &self,
        floor: Option<FleetFloor>,
        asked_on: u64,
        now: Instant,
    ) -> Option<FleetFloor> {
        let mut seen = self.seen();
        if seen.connection != asked_on {
            // Asked before a reconnect: says nothing of the server now.
        } else if let Some(floor) = floor {
            match seen.floors.back() {
                Some((_, last)) if last.stream_sequence == floor.stream_sequence => {}
                Some((_, last)) if last.stream_sequence > floor.stream_sequence => {
                    // It went back: what was seen above it was never on disk.
                    seen.floors.clear();
                    seen.floors.push_back((now, floor));
                }
                _ => seen.floors.push_back((now, floor)),
            }
        } else {
            // Nothing acked: the consumer is new (made again, or moved by a seek), and
            // nothing seen of the one before it stands.
            seen.floors.clear();
        }
        let mut on_disk = None;
        while let Some(&(seen_at, floor)) = seen.floors.front() {
            if now.duration_since(seen_at) < self.floor_on_disk_after {
                break;
            }
            on_disk = Some(floor);
            seen.floors.pop_front();
        }
        on_disk
    }
}

/// Drop the records under the floor from time to time, until `stop`.
pub(super) async fn keep_bounded(
    compactor: Arc<Compactor>,
    records: Arc<Records>,
    state: Arc<LeaseState>,
    read: watch::Receiver<(u64, u64)>,
    stop: CancellationToken,
) {
    let mut ticks = tokio::time::interval(compactor.every());
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = ticks.tick() => {}
        }
        let last_read = read.borrow().1;
        let compacted = tokio::select! {
            () = stop.cancelled() => return,
            compacted = compactor.compact(&records, &state, last_read) => compacted,
        };
        if let Err(err) = compacted {
            debug!(error = %format!("{err:#}"), "could not drop settled records under the floor; trying again later");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn floor(stream_sequence: u64) -> Option<FleetFloor> {
        Some(FleetFloor {
            stream_sequence,
            published_by_unix_nanos: 1,
        })
    }

    #[test]
    fn a_floor_is_on_disk_once_seen_long_enough_ago_and_not_across_a_reconnect() {
        let compactor = Compactor::new(Duration::from_secs(10));
        let start = Instant::now();
        let at = |secs| start + Duration::from_secs(secs);
        assert_eq!(compactor.floor_on_disk(floor(5), 0, at(0)), None);
        assert_eq!(compactor.floor_on_disk(floor(8), 0, at(5)), None);
        assert_eq!(compactor.floor_on_disk(floor(9), 0, at(10)), floor(5));
        assert_eq!(compactor.floor_on_disk(floor(9), 0, at(16)), floor(8));
        compactor.reconnected();
        assert_eq!(
            compactor.floor_on_disk(floor(12), 0, at(30)),
            None,
            "asked before the reconnect"
        );
        assert_eq!(compactor.floor_on_disk(floor(3), 1, at(30)), None);
        assert_eq!(compactor.floor_on_disk(floor(3), 1, at(40)), floor(3));
    }

    #[test]
    fn a_floor_that_went_back_forgets_what_was_seen_above_it() {
        let compactor = Compactor::new(Duration::from_secs(10));
        let start = Instant::now();
        let at = |secs| start + Duration::from_secs(secs);
        compactor.floor_on_disk(floor(5), 0, at(0));
        compactor.floor_on_disk(floor(2), 0, at(1));
        assert_eq!(compactor.floor_on_disk(floor(2), 0, at(10)), None);
        assert_eq!(compactor.floor_on_disk(floor(2), 0, at(11)), floor(2));
    }

    #[test]
    fn a_consumer_with_nothing_acked_forgets_the_floors_of_the_one_before() {
        let compactor = Compactor::new(Duration::from_secs(10));
        let start = Instant::now();
        let at = |secs| start + Duration::from_secs(secs);
        compactor.floor_on_disk(floor(5), 0, at(0));
        assert_eq!(compactor.floor_on_disk(None, 0, at(20)), None);
    }
}
