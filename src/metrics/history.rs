//! One consumer's recent activity at this replica — deliveries, acks, naks, terms and dead
//! letters — in ten-second buckets over the last fifteen minutes: what the console's chart
//! draws. A fixed ring of atomic counters, so that recording costs an add and never a lock.
//!
//! May import: nothing of the crate.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use time::OffsetDateTime;
use tokio::time::Instant;

/// One bucket's span, and how many the ring keeps.
pub(crate) const BUCKET: Duration = Duration::from_secs(10);
const BUCKETS: usize = 90;

/// What a bucket counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Activity {
    Delivered,
    Acked,
    Naked,
    Terminated,
    DeadLettered,
}

const KINDS: usize = 5;

/// One bucket as read: when it starts, and its counts by [`Activity`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Bucket {
    pub(crate) starts_at: OffsetDateTime,
    pub(crate) delivered: u64,
    pub(crate) acked: u64,
    pub(crate) naked: u64,
    pub(crate) terminated: u64,
    pub(crate) dead_lettered: u64,
}

/// 32-bit counts: a ten-second bucket never sees four billion of anything, and a thousand
/// consumers' rings are half the size.
#[derive(Default)]
struct Slot {
    /// The bucket number it counts now (buckets since the ring was made), plus one: 0 is
    /// "never used".
    number: AtomicU32,
    counts: [AtomicU32; KINDS],
}

/// The ring, made on the first count: an idle consumer (most of a thousand) keeps none of
/// its 4 KB.
pub(crate) struct History {
    made: Instant,
    made_at: OffsetDateTime,
    slots: OnceLock<Box<[Slot]>>,
}

impl Default for History {
    fn default() -> Self {
        Self {
            made: Instant::now(),
            made_at: OffsetDateTime::now_utc(),
            slots: OnceLock::new(),
        }
    }
}

impl History {
    fn number_now(&self) -> u32 {
        let elapsed = self.made.elapsed().as_millis() / BUCKET.as_millis();
        u32::try_from(elapsed).unwrap_or(u32::MAX - 1)
    }

    /// Count `count` of `activity` now.
    pub(crate) fn record(&self, activity: Activity, count: u64) {
        let number = self.number_now() + 1;
        let slots = self
            .slots
            .get_or_init(|| (0..BUCKETS).map(|_| Slot::default()).collect());
        let slot = &slots[(number as usize) % BUCKETS];
        let seen = slot.number.load(Ordering::Acquire);
        // A new bucket takes the slot over; the one who wins clears it. (An add racing the
        // clear at a bucket's first moment may be lost: a chart's error, never a metric's.)
        if seen != number
            && slot
                .number
                .compare_exchange(seen, number, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            for counter in &slot.counts {
                counter.store(0, Ordering::Relaxed);
            }
        }
        let count = u32::try_from(count).unwrap_or(u32::MAX);
        slot.counts[activity as usize].fetch_add(count, Ordering::Relaxed);
    }

    /// The buckets of the last fifteen minutes, oldest first, the current one last.
    pub(crate) fn buckets(&self) -> Vec<Bucket> {
        let now = self.number_now() + 1;
        let first = now.saturating_sub(BUCKETS as u32 - 1).max(1);
        (first..=now)
            .map(|number| {
                let slot = self
                    .slots
                    .get()
                    .map(|slots| &slots[(number as usize) % BUCKETS])
                    .filter(|slot| slot.number.load(Ordering::Acquire) == number);
                let counts: [u64; KINDS] = slot.map_or([0; KINDS], |slot| {
                    std::array::from_fn(|kind| u64::from(slot.counts[kind].load(Ordering::Relaxed)))
                });
                let offset = BUCKET * (number - 1);
                Bucket {
                    starts_at: self.made_at + offset,
                    delivered: counts[Activity::Delivered as usize],
                    acked: counts[Activity::Acked as usize],
                    naked: counts[Activity::Naked as usize],
                    terminated: counts[Activity::Terminated as usize],
                    dead_lettered: counts[Activity::DeadLettered as usize],
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn counts_land_in_their_bucket_and_age_out_after_fifteen_minutes() {
        let history = History::default();
        assert!(
            history.buckets().iter().all(|b| b.delivered == 0),
            "a ring never counted in reads as empty"
        );
        assert!(history.slots.get().is_none(), "and is not made by reading");
        history.record(Activity::Delivered, 3);
        history.record(Activity::Acked, 2);
        tokio::time::advance(BUCKET).await;
        history.record(Activity::Naked, 1);
        history.record(Activity::DeadLettered, 1);
        let buckets = history.buckets();
        assert_eq!(buckets.len(), 2);
        assert_eq!(
            (buckets[0].delivered, buckets[0].acked, buckets[0].naked),
            (3, 2, 0)
        );
        assert_eq!((buckets[1].naked, buckets[1].dead_lettered), (1, 1));
        assert_eq!(buckets[1].starts_at - buckets[0].starts_at, BUCKET);

        // Fifteen minutes on, the ring holds ninety buckets and the first ones are gone,
        // though their slots are used again.
        tokio::time::advance(BUCKET * 90).await;
        history.record(Activity::Terminated, 4);
        let buckets = history.buckets();
        assert_eq!(buckets.len(), 90);
        assert_eq!(
            buckets.iter().map(|b| b.delivered + b.naked).sum::<u64>(),
            0
        );
        let last = buckets.last().expect("the current bucket");
        assert_eq!((last.terminated, last.acked), (4, 0));
    }
}
