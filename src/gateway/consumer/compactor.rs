//! Keeps the consumer's settled records bounded by what is still pending, not by traffic:
//! once the consumer's ack floor has been at F long enough to be in the server's files (a
//! server killed -9 no longer forgets it), a floor record says "everything at or under F
//! ended" — for a consumer made again, whose floor starts at 0 — and the records stored
//! before the first one that names a message above F are dropped.
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
use crate::nats::seek_mark;
use crate::nats::settled::Records;
use crate::state::LeaseState;

/// How long after the ack floor was seen it is in the server's files: nats-server writes
/// consumer state at most ~10 times a second (NATS-FACTS), so a kill -9 after that no longer
/// takes it back. A power cut can take back more at the default `sync_interval`, but then
/// it also takes back the records written since the last sync: waiting for the sync would
/// keep records that are themselves no safer.
const FLOOR_IN_FILES_AFTER: Duration = Duration::from_secs(1);
/// How often the compactor wakes up.
const LOOK_EVERY: Duration = Duration::from_secs(1);
/// A consumer whose records name this many new stream sequences since the floor was last
/// looked at is looked at on the next wake-up; others every [`LOOK_IDLE_EVERY`]. Busy
/// consumers so keep about two seconds of traffic in records, and quiet ones cost one
/// consumer info request every few seconds.
const BUSY_AFTER_SEQUENCES: u64 = 256;
const LOOK_IDLE_EVERY: Duration = Duration::from_secs(5);

/// What the reader saw, shared with the task that drops records.
pub(super) struct Compactor {
    seen: Mutex<Seen>,
}

#[derive(Default)]
struct Seen {
    /// Ack floors seen, oldest first, each above the one before; forgotten on a reconnect.
    floors: VecDeque<(Instant, FleetFloor)>,
    /// Bumped on every reconnect: a floor asked for before it is not kept.
    connection: u64,
    /// The consumer's seek mark at the last look: the floors seen were all seen under it
    /// (a floor seen under another speaks of the consumer before or after a move).
    mark: Option<String>,
    /// A move under way, as its mark, and when this replica first saw it.
    move_seen: Option<(String, Instant)>,
    /// Records read, by their sequence in the records stream: the highest stream sequence
    /// each names.
    spans: BTreeMap<u64, u64>,
    /// The highest stream sequence a record read names, and what it was when the floor
    /// was last looked at (then).
    highest_named: u64,
    looked: Option<(Instant, u64)>,
    /// The floor record with the highest floor read or written (the floor, and its
    /// sequence in the records stream): dropped only once a higher one is stored.
    floor_record: Option<(u64, u64)>,
}

/// What one look at the floor decided.
#[derive(Debug, PartialEq, Eq)]
struct Plan {
    /// A floor record to write first.
    store: Option<FleetFloor>,
    /// Then drop the records before this sequence of the records stream.
    drop_before: Option<u64>,
}

impl Compactor {
    pub(super) fn new() -> Self {
        Self {
            seen: Mutex::default(),
        }
    }

    fn seen(&self) -> MutexGuard<'_, Seen> {
        self.seen
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The reader read the record at `sequence`, naming messages up to `max_sequence`
    /// (`floor`: a floor record of another gateway's, with its floor).
    pub(super) fn read(&self, sequence: u64, max_sequence: u64, floor: Option<u64>) {
        let mut seen = self.seen();
        seen.spans.insert(sequence, max_sequence);
        seen.highest_named = seen.highest_named.max(max_sequence);
        if let Some(floor) = floor
            && seen.floor_record.is_none_or(|(highest, _)| highest < floor)
        {
            seen.floor_record = Some((floor, sequence));
        }
    }

    /// This gateway stored a floor record of `floor` at `sequence`: the highest now (it
    /// is written only above every floor known).
    fn stored_floor(&self, floor: u64, sequence: u64) {
        self.seen().floor_record = Some((floor, sequence));
    }

    /// Whether `mark` is of a move under way that this replica first saw less than
    /// [`seek_mark::MOVE_DIES_AFTER`] ago (its own clock: the mover's may be off).
    fn move_under_way(&self, mark: &str, now: Instant) -> bool {
        if !seek_mark::is_under_way(mark) {
            return false;
        }
        let mut seen = self.seen();
        let since = match &seen.move_seen {
            Some((seen_mark, since)) if seen_mark == mark => *since,
            _ => {
                seen.move_seen = Some((mark.to_owned(), now));
                now
            }
        };
        now.duration_since(since) < seek_mark::MOVE_DIES_AFTER
    }

    /// The consumer's seek mark now is `mark`: floors seen under another are forgotten.
    fn under_mark(&self, mark: Option<&str>) {
        let mut seen = self.seen();
        if seen.mark.as_deref() != mark {
            seen.mark = mark.map(str::to_owned);
            seen.floors.clear();
        }
    }

    /// The reader reads everything again from the start.
    pub(super) fn read_again(&self) {
        self.seen().spans.clear();
    }

    /// The connection came back, maybe to a server restarted that forgot what it had not
    /// written: no floor seen before is known to be in its files.
    pub(super) fn reconnected(&self) {
        let mut seen = self.seen();
        seen.floors.clear();
        seen.connection += 1;
    }

    /// Whether to look at the floor `now`: there are records to drop (more than the newest
    /// floor record), and either they name
    /// [`BUSY_AFTER_SEQUENCES`] more than at the last look or that was a while ago.
    fn due(&self, now: Instant) -> bool {
        let seen = self.seen();
        let only_the_floor_record = seen.spans.len() == 1
            && seen
                .floor_record
                .is_some_and(|(_, sequence)| seen.spans.contains_key(&sequence));
        if seen.spans.is_empty() || only_the_floor_record {
            return false;
        }
        let floor_now_in_files = seen
            .floors
            .front()
            .is_some_and(|(seen_at, _)| now.duration_since(*seen_at) >= FLOOR_IN_FILES_AFTER);
        floor_now_in_files
            || seen.looked.is_none_or(|(at, highest_named)| {
                seen.highest_named.saturating_sub(highest_named) >= BUSY_AFTER_SEQUENCES
                    || now.duration_since(at) >= LOOK_IDLE_EVERY
            })
    }

    /// Look at the floor, counted as seen at the wake-up `asked_at` (a few ms before the
    /// answer: the server writes it to its files well within the second waited); write a
    /// floor record and drop the records under it once one seen is in the server's files.
    async fn compact(
        &self,
        records: &Records,
        state: &LeaseState,
        last_read: u64,
        asked_at: Instant,
    ) -> anyhow::Result<()> {
        // A seek waits: a floor read before it must not be written after it.
        let _still = state.hold_still().await;
        let asked_on = self.seen().connection;
        let (floor, mark) = records.consumer_floor().await?;
        if let Some(mark) = mark.as_deref()
            && self.move_under_way(mark, Instant::now())
        {
            // A seek under way: the floor is the consumer's before the move.
            debug!("a move of the consumer is under way; no floor record until it is done");
            return Ok(());
        }
        self.under_mark(mark.as_deref());
        let plan = self.plan(floor, asked_on, asked_at, state.fleet_floor(), last_read);
        if let Some(floor) = plan.store {
            let stored_at = records.store_floor(floor, mark.as_deref()).await?;
            if records.seek_mark().await? != mark {
                // Moved since the floor was read: the move forgot the records before it, and
                // this one, of the consumer before it, is believed nowhere (see
                // `Records::floor_believed`); nothing is taken from it or dropped for it.
                debug!(
                    floor = floor.stream_sequence,
                    "the consumer moved while its floor record was written; the record is void"
                );
                return Ok(());
            }
            state.raise_fleet_floor(floor);
            self.stored_floor(floor.stream_sequence, stored_at);
        }
        if let Some(keep_from) = plan.drop_before {
            // Every record before it names only messages under a floor record stored.
            records.drop_before(keep_from).await?;
            let mut seen = self.seen();
            seen.spans = seen.spans.split_off(&keep_from);
        }
        Ok(())
    }

    /// Note `floor`, read `now` (asked for on connection `asked_on`), and decide what to
    /// write and drop, with `known` the highest floor record read or written and
    /// `last_read` the sequence of the last record read.
    fn plan(
        &self,
        floor: Option<FleetFloor>,
        asked_on: u64,
        now: Instant,
        known: Option<FleetFloor>,
        last_read: u64,
    ) -> Plan {
        let in_files = self.floor_in_files(floor, asked_on, now);
        let mut seen = self.seen();
        seen.looked = Some((now, seen.highest_named));
        let store = in_files.filter(|floor| {
            known.is_none_or(|known| known.stream_sequence < floor.stream_sequence)
        });
        let Some(under) = in_files
            .into_iter()
            .chain(known)
            .map(|floor| floor.stream_sequence)
            .max()
        else {
            return Plan {
                store,
                drop_before: None,
            };
        };
        // A floor record stored now comes after `last_read`, and the one with the highest
        // floor before it is dropped only with it.
        let keep_from = seen
            .spans
            .iter()
            .find(|(_, max)| **max > under)
            .map_or(last_read + 1, |(sequence, _)| *sequence)
            .min(last_read + 1);
        let keep_from = match (store, seen.floor_record) {
            (None, Some((_, highest))) => keep_from.min(highest),
            _ => keep_from,
        };
        let drop_before = seen
            .spans
            .range(..keep_from)
            .next()
            .is_some()
            .then_some(keep_from);
        Plan { store, drop_before }
    }

    /// Note `floor`, seen `now` (asked for on connection `asked_on`), and take the newest
    /// floor seen long enough ago to be in the server's files.
    fn floor_in_files(
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
                    // It went back: what was seen above it was never in its files.
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
        let mut in_files = None;
        while let Some(&(seen_at, floor)) = seen.floors.front() {
            if now.duration_since(seen_at) < FLOOR_IN_FILES_AFTER {
                break;
            }
            in_files = Some(floor);
            seen.floors.pop_front();
        }
        in_files
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
    let mut ticks = tokio::time::interval(LOOK_EVERY);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        let tick = tokio::select! {
            () = stop.cancelled() => return,
            tick = ticks.tick() => tick,
        };
        if !compactor.due(tick) {
            continue;
        }
        let last_read = read.borrow().1;
        let compacted = tokio::select! {
            () = stop.cancelled() => return,
            compacted = compactor.compact(&records, &state, last_read, tick) => compacted,
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

    fn secs(secs: f64) -> Duration {
        Duration::from_secs_f64(secs)
    }

    #[test]
    fn a_floor_is_in_the_servers_files_once_seen_long_enough_ago_and_not_across_a_reconnect() {
        let compactor = Compactor::new();
        let start = Instant::now();
        let at = |s| start + secs(s);
        assert_eq!(compactor.floor_in_files(floor(5), 0, at(0.0)), None);
        assert_eq!(compactor.floor_in_files(floor(8), 0, at(0.5)), None);
        assert_eq!(compactor.floor_in_files(floor(9), 0, at(1.0)), floor(5));
        assert_eq!(compactor.floor_in_files(floor(9), 0, at(1.6)), floor(8));
        compactor.reconnected();
        assert_eq!(
            compactor.floor_in_files(floor(12), 0, at(3.0)),
            None,
            "asked before the reconnect"
        );
        assert_eq!(compactor.floor_in_files(floor(3), 1, at(3.0)), None);
        assert_eq!(compactor.floor_in_files(floor(3), 1, at(4.0)), floor(3));
    }

    #[test]
    fn a_floor_that_went_back_forgets_what_was_seen_above_it() {
        let compactor = Compactor::new();
        let start = Instant::now();
        let at = |s| start + secs(s);
        compactor.floor_in_files(floor(5), 0, at(0.0));
        compactor.floor_in_files(floor(2), 0, at(0.1));
        assert_eq!(compactor.floor_in_files(floor(2), 0, at(1.0)), None);
        assert_eq!(compactor.floor_in_files(floor(2), 0, at(1.1)), floor(2));
    }

    #[test]
    fn a_consumer_with_nothing_acked_forgets_the_floors_of_the_one_before() {
        let compactor = Compactor::new();
        let start = Instant::now();
        compactor.floor_in_files(floor(5), 0, start);
        assert_eq!(compactor.floor_in_files(None, 0, start + secs(2.0)), None);
    }

    #[test]
    fn the_floor_is_looked_at_when_records_name_many_new_messages_or_after_a_while() {
        let compactor = Compactor::new();
        let start = Instant::now();
        assert!(!compactor.due(start), "no records: nothing to drop");
        compactor.read(1, 10, None);
        assert!(compactor.due(start), "never looked");
        compactor.plan(None, 0, start, None, 1);
        compactor.read(2, 10 + BUSY_AFTER_SEQUENCES - 1, None);
        assert!(!compactor.due(start + secs(1.0)));
        assert!(compactor.due(start + LOOK_IDLE_EVERY), "a while since");
        compactor.read(3, 10 + BUSY_AFTER_SEQUENCES, None);
        assert!(compactor.due(start + secs(1.0)), "busy");
        compactor.seen().spans.clear();
        compactor.read(4, 400, None);
        compactor.seen().floor_record = Some((400, 4));
        assert!(
            !compactor.due(start + LOOK_IDLE_EVERY * 2),
            "only the newest floor record is left"
        );
    }

    #[test]
    fn the_floor_record_with_the_highest_floor_goes_only_with_a_higher_one() {
        let compactor = Compactor::new();
        let start = Instant::now();
        // Records 1 and 2 name messages to 10, record 3 is another gateway's floor record
        // at 10, record 4 names 12, record 5 is a late floor record at 8.
        compactor.read(1, 5, None);
        compactor.read(2, 10, None);
        compactor.read(3, 10, Some(10));
        compactor.read(4, 12, None);
        compactor.read(5, 8, Some(8));
        let plan = compactor.plan(floor(10), 0, start, floor(10), 5);
        assert_eq!(
            plan,
            Plan {
                store: None,
                drop_before: Some(3)
            },
            "the floor record at 10 stays"
        );
        compactor.plan(floor(12), 0, start + secs(1.0), floor(10), 5);
        let plan = compactor.plan(floor(12), 0, start + secs(2.0), floor(10), 5);
        assert_eq!(
            plan,
            Plan {
                store: floor(12),
                drop_before: Some(6)
            },
            "the floor record at 12, stored after record 5, covers all"
        );
    }

    /// An hour of traffic at 1 000 000 acks an hour (about 278 a second), acked in order,
    /// single settles (a record each) and batches of 100: the records kept never name more
    /// messages than the consumer's pending window (max_ack_pending 1 024) nor number more;
    /// a few seconds after the last ack, only the floor record is left.
    #[test]
    fn an_hour_of_acks_keeps_the_records_within_the_pending_window() {
        const ACKS: u64 = 1_000_000;
        const PENDING_WINDOW: u64 = 1024;
        for per_record in [1_u64, 100] {
            let compactor = Compactor::new();
            let start = Instant::now();
            // The records stream: sequence -> the lowest and highest stream sequence each
            // names (a floor record names none).
            let mut stored: BTreeMap<u64, Option<(u64, u64)>> = BTreeMap::new();
            let mut acked = 0_u64;
            let mut next_record = 1_u64;
            let mut floor_record: Option<FleetFloor> = None;
            let (mut most_named, mut most_records) = (0_u64, 0_usize);
            for second in 1..=3600 + 10 {
                let now = start + LOOK_EVERY * second;
                let target = (u64::from(second) * ACKS / 3600).min(ACKS);
                while acked < target {
                    let first = acked + 1;
                    acked = (acked + per_record).min(target);
                    stored.insert(next_record, Some((first, acked)));
                    compactor.read(next_record, acked, None);
                    next_record += 1;
                }
                let lowest = stored.values().flatten().map(|(low, _)| *low).min();
                let named = lowest.map_or(0, |lowest| acked + 1 - lowest);
                most_named = most_named.max(named);
                most_records = most_records.max(stored.len());
                if !compactor.due(now) {
                    continue;
                }
                // The server's floor: everything acked so far.
                let plan = compactor.plan(floor(acked), 0, now, floor_record, next_record - 1);
                if let Some(floor) = plan.store {
                    stored.insert(next_record, None);
                    compactor.stored_floor(floor.stream_sequence, next_record);
                    // Its own floor record, read back (not opened: its writer's).
                    compactor.read(next_record, floor.stream_sequence, None);
                    next_record += 1;
                    floor_record = Some(floor);
                }
                if let Some(keep_from) = plan.drop_before {
                    stored = stored.split_off(&keep_from);
                    let mut seen = compactor.seen();
                    seen.spans = seen.spans.split_off(&keep_from);
                }
            }
            assert!(
                most_named <= PENDING_WINDOW && most_records <= PENDING_WINDOW as usize,
                "{per_record} a record: at most {most_named} messages named by {most_records} records kept"
            );
            assert_eq!(stored.len(), 1, "{stored:?} kept at the end");
            assert_eq!(floor_record, floor(ACKS));
        }
    }
}
