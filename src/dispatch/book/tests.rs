//! The book's unit tests: waiters, pulls, held deliveries and capacity, driven by hand (a
//! stream's pull in `streams`).

use std::sync::Arc;

use bytes::Bytes;
use time::OffsetDateTime;

use super::plan::{MAX_PATIENT_PULL_EXPIRES, MAX_PULL_EXPIRES};
use super::*;
use crate::domain::lease_id::{DeliveryKey, LeaseCoordinates};

mod streams;

const EPOCH: u32 = 7;
const LIMITS: PullLimits = PullLimits {
    max_waiting: 512,
    max_batch: None,
    max_expires: None,
};

fn delivery(stream_sequence: u64, bytes: usize, received_at: Instant) -> Delivery {
    Delivery {
        coordinates: LeaseCoordinates {
            epoch: EPOCH,
            key: DeliveryKey {
                stream_sequence,
                delivered: 1,
            },
            consumer_sequence: stream_sequence,
            published_unix_nanos: 0,
        },
        reply: Arc::from(format!(
            "$JS.ACK.S.C.1.{stream_sequence}.{stream_sequence}.0.0"
        )),
        subject: "orders.created".into(),
        payload: Bytes::from(vec![b'x'; bytes]),
        headers: None,
        unparsed: Default::default(),
        stream: "S".into(),
        consumer: "C".into(),
        pending: 0,
        published_at: OffsetDateTime::UNIX_EPOCH,
        received_at,
    }
}

fn demand(batch: usize, wait_ms: u64) -> Demand {
    Demand {
        batch,
        credit: batch,
        wait: Duration::from_millis(wait_ms),
        max_bytes: None,
        stream: None,
        patient: false,
    }
}

/// What an idle push worker's stream `stream` asks for: `batch`, waiting up to 2 minutes.
fn patient_stream(stream: u64, batch: usize) -> Demand {
    Demand {
        stream: Some(stream),
        patient: true,
        ..demand(batch, 120_000)
    }
}

/// A book with one waiting fetch (id 1) whose pull is open; returns the answer receiver.
fn waiting(
    book: &mut Book<()>,
    demand: Demand,
    now: Instant,
) -> (oneshot::Receiver<Vec<Leased>>, u64) {
    let (answer, answered) = oneshot::channel();
    book.enqueue(1, demand, answer, now);
    let planned = book.plan_pulls(now, 1000, LIMITS);
    assert_eq!(planned.len(), 1);
    let pull_id = book.next_pull_id();
    book.pull_opened(planned[0], pull_id, ());
    (answered, pull_id)
}

fn sequences(deliveries: &[Delivery]) -> Vec<u64> {
    deliveries
        .iter()
        .map(|delivery| delivery.coordinates.key.stream_sequence)
        .collect()
}

#[test]
fn a_pull_asks_for_the_batch_within_capacity_and_max_pull_expires() {
    let now = Instant::now();
    let mut book = Book::<()>::new();
    let (answer, _answered) = oneshot::channel();
    book.enqueue(1, demand(100, 20_000), answer, now);
    let planned = book.plan_pulls(now, 30, LIMITS);
    assert_eq!(
        planned,
        vec![PlannedPull {
            fetch: 1,
            batch: 30,
            expires: Some(MAX_PULL_EXPIRES),
            keep_open: false,
            patient: false,
            give_up_at: now + MAX_PULL_EXPIRES + PULL_GRACE,
        }]
    );
    assert!(
        book.plan_pulls(now, 0, LIMITS).is_empty(),
        "no capacity, no pull"
    );
}

#[test]
fn pulls_stop_at_half_of_max_waiting() {
    let now = Instant::now();
    let mut book = Book::<()>::new();
    for id in 0..5 {
        let (answer, _) = oneshot::channel();
        book.enqueue(id, demand(1, 1000), answer, now);
    }
    let limits = PullLimits {
        max_waiting: 6,
        ..LIMITS
    };
    let planned = book.plan_pulls(now, 1000, limits);
    assert_eq!(
        planned.iter().map(|p| p.fetch).collect::<Vec<_>>(),
        [0, 1, 2]
    );
    for plan in planned {
        let pull_id = book.next_pull_id();
        book.pull_opened(plan, pull_id, ());
    }
    assert!(book.plan_pulls(now, 1000, limits).is_empty());
    assert!(book.at_pull_limit(limits));
}

#[test]
fn the_consumers_own_pull_limits_apply_and_short_waits_are_no_wait_pulls() {
    let now = Instant::now();
    let mut book = Book::<()>::new();
    let (answer, _) = oneshot::channel();
    book.enqueue(1, demand(500, 5), answer, now);
    let limits = PullLimits {
        max_waiting: 512,
        max_batch: Some(50),
        max_expires: Some(Duration::from_millis(200)),
    };
    let planned = book.plan_pulls(now, 1000, limits);
    assert_eq!(planned[0].batch, 50);
    assert_eq!(planned[0].expires, None, "5 ms is below MIN_EXPIRES");
}

#[test]
fn a_fetch_is_answered_with_what_its_pull_brought_once_the_pull_ends() {
    let now = Instant::now();
    let mut book = Book::<()>::new();
    let (_answered, pull_id) = waiting(&mut book, demand(10, 5000), now);
    for sequence in 1..=3 {
        let owner = book.count_delivery(pull_id, now);
        assert_eq!(owner, Some(1));
        book.place(owner, delivery(sequence, 10, now));
    }
    assert!(
        book.take_finished(now, false, EPOCH).is_empty(),
        "pull still open"
    );
    book.end_pull(pull_id, false, now);
    let finished = book.take_finished(now, false, EPOCH);
    assert_eq!(finished.len(), 1);
    assert_eq!(sequences(&finished[0].got), [1, 2, 3]);
    assert_eq!(finished[0].pull, None);
}

#[test]
fn max_bytes_holds_the_overflow_for_the_next_fetch() {
    let now = Instant::now();
    let mut book = Book::<()>::new();
    let mut limited = demand(10, 5000);
    limited.max_bytes = Some(25);
    let (_answered, pull_id) = waiting(&mut book, limited, now);
    for sequence in 1..=3 {
        let owner = book.count_delivery(pull_id, now);
        book.place(owner, delivery(sequence, 10, now));
    }
    let finished = book.take_finished(now, false, EPOCH);
    assert_eq!(
        sequences(&finished[0].got),
        [1, 2],
        "the third would exceed 25 bytes"
    );
    assert_eq!(book.held_len(), 1);
    // The first message always fits, however large.
    let (answer, _) = oneshot::channel();
    let mut tiny = demand(10, 5000);
    tiny.max_bytes = Some(1);
    book.enqueue(2, tiny, answer, now);
    book.hand_out_held();
    let finished = book.take_finished(now, false, EPOCH);
    assert_eq!(sequences(&finished[0].got), [3]);
}

#[test]
fn a_fetch_handed_what_the_ordering_gate_released_is_answered_at_once_though_its_pull_is_open() {
    // An ordered consumer: the messages wait in the gate here, so the fetch's pull waits at
    // the server with nothing to bring; what the gate releases for it once a key is settled
    // must not wait out that pull's expiry.
    let now = Instant::now();
    let mut book = Book::<()>::new();
    let (_answered, pull_id) = waiting(&mut book, demand(100, 5000), now);
    assert!(book.take_finished(now, false, EPOCH).is_empty());
    book.hand_out_released(vec![delivery(4, 1, now), delivery(5, 1, now)]);
    let finished = book.take_finished(now, false, EPOCH);
    assert_eq!(finished.len(), 1, "answered before its pull ended");
    assert_eq!(sequences(&finished[0].got), [4, 5]);
    assert_eq!(finished[0].pull, Some(pull_id));
    // What the pull still brings then is held for the next fetch.
    book.detach_pull(finished[0].pull);
    let owner = book.count_delivery(pull_id, now);
    assert_eq!(owner, None);
    book.place(owner, delivery(6, 1, now));
    assert_eq!(book.held_len(), 1);

    // Held deliveries of another fetch's pull end no fetch early: more may follow them.
    let mut book = Book::<()>::new();
    let (_answered, _pull_id) = waiting(&mut book, demand(100, 5000), now);
    book.give_back(None, vec![delivery(7, 1, now)]);
    book.hand_out_held();
    assert!(book.take_finished(now, false, EPOCH).is_empty());

    // Nor does the gate's release when the fetch's own pull brought messages to the gate
    // (a fence lifted while they come in): the rest of them may free other keys.
    let mut book = Book::<()>::new();
    let (_answered, _pull_id) = waiting(&mut book, demand(100, 5000), now);
    book.diverted(Some(1));
    book.hand_out_released(vec![delivery(8, 1, now)]);
    assert!(book.take_finished(now, false, EPOCH).is_empty());

    // Nor when its pull was just sent while the server still had messages: the fence lifts
    // between that pull going out and its first delivery (a busy key's head released, the
    // other keys' messages on their way). Once the server has nothing more, it is.
    let mut book = Book::<()>::new();
    let (_answered, first_pull) = waiting(&mut book, demand(10, 5000), now);
    let owner = book.count_delivery_from(first_pull, now, 25);
    book.diverted(owner);
    book.end_pull(first_pull, false, now);
    let planned = book.plan_pulls(now, 1000, LIMITS);
    let next_pull = book.next_pull_id();
    book.pull_opened(planned[0], next_pull, ());
    book.hand_out_released(vec![delivery(1, 1, now)]);
    assert!(
        book.take_finished(now, false, EPOCH).is_empty(),
        "the server had 25 more: this pull brings some"
    );
    let owner = book.count_delivery_from(next_pull, now, 0);
    book.place(owner, delivery(31, 1, now));
    book.end_pull(next_pull, false, now);
    let finished = book.take_finished(now, false, EPOCH);
    assert_eq!(sequences(&finished[0].got), [1, 31]);

    // A fetch whose pull is bringing messages still takes what that pull brings.
    let mut book = Book::<()>::new();
    let (_answered, pull_id) = waiting(&mut book, demand(100, 5000), now);
    let owner = book.count_delivery(pull_id, now);
    book.place(owner, delivery(1, 1, now));
    book.hand_out_released(vec![delivery(2, 1, now)]);
    assert!(
        book.take_finished(now, false, EPOCH).is_empty(),
        "its pull is still bringing"
    );
    book.end_pull(pull_id, false, now);
    let finished = book.take_finished(now, false, EPOCH);
    assert_eq!(sequences(&finished[0].got), [1, 2]);
}

#[test]
fn a_withdrawn_fetch_gives_its_deliveries_to_the_next_one_first() {
    let now = Instant::now();
    let mut book = Book::<()>::new();
    let (_answered, pull_id) = waiting(&mut book, demand(10, 5000), now);
    book.hold(delivery(9, 1, now));
    let owner = book.count_delivery(pull_id, now);
    book.place(owner, delivery(1, 1, now));
    book.withdraw(1);
    // What its pull still brings is no one's.
    assert_eq!(book.count_delivery(pull_id, now), None);
    let (answer, _) = oneshot::channel();
    book.enqueue(2, demand(10, 5000), answer, now);
    book.hand_out_held();
    let finished = book.take_finished(now, false, EPOCH);
    assert_eq!(
        sequences(&finished[0].got),
        [1, 9],
        "given back ahead of the held one"
    );
}

#[test]
fn a_closed_answer_channel_withdraws_the_fetch() {
    let now = Instant::now();
    let mut book = Book::<()>::new();
    let (answered, pull_id) = waiting(&mut book, demand(10, 5000), now);
    let owner = book.count_delivery(pull_id, now);
    book.place(owner, delivery(1, 1, now));
    drop(answered);
    book.withdraw_hung_up();
    assert_eq!(book.held_len(), 1);
    assert!(!book.is_starving());
}

#[test]
fn held_deliveries_are_released_by_the_callers_rule_in_order() {
    let now = Instant::now();
    let hold = Duration::from_secs(2);
    let mut book = Book::<()>::new();
    book.hold(delivery(1, 1, now));
    book.hold(delivery(2, 1, now + Duration::from_secs(1)));
    book.hold(delivery(3, 1, now));
    assert_eq!(book.next_wake(now, hold, || None), Some(now + hold));
    let later = now + hold;
    let released = book.take_held(|d| d.received_at + hold <= later);
    assert_eq!(sequences(&released), [1, 3]);
    assert_eq!(book.held_len(), 1);
}

#[test]
fn a_refused_pull_is_retried_after_a_pause_and_a_zero_wait_fetch_pulls_once() {
    let now = Instant::now();
    let mut book = Book::<()>::new();
    let (_answered, pull_id) = waiting(&mut book, demand(1, 5000), now);
    book.end_pull(pull_id, true, now);
    assert!(
        book.plan_pulls(now, 10, LIMITS).is_empty(),
        "waits PULL_RETRY"
    );
    assert_eq!(book.plan_pulls(now + PULL_RETRY, 10, LIMITS).len(), 1);

    let mut book = Book::<()>::new();
    let (_answered, pull_id) = waiting(&mut book, demand(1, 0), now);
    book.end_pull(pull_id, false, now);
    assert!(
        book.plan_pulls(now, 10, LIMITS).is_empty(),
        "a zero-wait fetch gets exactly one no_wait pull"
    );
    assert_eq!(book.take_finished(now, false, EPOCH).len(), 1);
}

/// After a resume the server keeps this gateway's pulls from before it (it serves them no
/// more) until it sees them gone, and turns a no_wait pull away as behind them for as long
/// (408 "Requests Pending"), up to a minute: a stream's fetch then pulls waiting in line.
#[test]
fn a_fetch_whose_pull_stays_silent_is_answered_after_the_grace() {
    let now = Instant::now();
    let mut book = Book::<()>::new();
    let (_answered, _pull_id) = waiting(&mut book, demand(1, 100), now);
    let deadline = now + Duration::from_millis(100);
    assert_eq!(
        book.next_wake(now, Duration::from_secs(2), || None),
        Some(deadline + PULL_GRACE)
    );
    assert!(book.take_finished(deadline, false, EPOCH).is_empty());
    let inboxes = book.give_up_silent_pulls(deadline + PULL_GRACE);
    assert_eq!(inboxes.len(), 1, "the inbox is handed back to be read on");
    assert_eq!(
        book.take_finished(deadline + PULL_GRACE, false, EPOCH)
            .len(),
        1
    );
}

#[test]
fn capacity_counts_held_taken_and_asked_for_messages() {
    let now = Instant::now();
    let mut book = Book::<()>::new();
    let (_answered, pull_id) = waiting(&mut book, demand(10, 5000), now);
    book.hold(delivery(5, 1, now));
    let owner = book.count_delivery(pull_id, now);
    book.place(owner, delivery(1, 1, now));
    // 1 held + 1 taken + 9 still asked of the pull.
    assert_eq!(book.reserved(), 11);
    book.forget_pulls();
    assert_eq!(
        book.reserved(),
        2,
        "a forgotten pull asks nothing of the server"
    );
}

#[test]
fn deliveries_of_another_epoch_are_never_answered() {
    let now = Instant::now();
    let mut book = Book::<()>::new();
    let (_answered, pull_id) = waiting(&mut book, demand(10, 5000), now);
    let owner = book.count_delivery(pull_id, now);
    book.place(owner, delivery(1, 1, now));
    let finished = book.take_finished(now, true, EPOCH + 1);
    assert!(finished[0].got.is_empty());
    assert_eq!(book.held_len(), 1, "kept to be released");
}

#[test]
fn a_pull_given_up_on_counts_toward_the_limit_until_its_status_or_a_while() {
    let now = Instant::now();
    let mut book = Book::<()>::new();
    let limits = PullLimits {
        max_waiting: 2,
        ..LIMITS
    };
    let (_answered, first_pull) = waiting(&mut book, demand(1, 100), now);
    let given_up = now + Duration::from_millis(100) + PULL_GRACE;
    assert_eq!(book.give_up_silent_pulls(given_up).len(), 1);
    assert_eq!(book.take_finished(given_up, false, EPOCH).len(), 1);

    // The server may still hold it: a second fetch waits for room.
    let (answer, _second) = oneshot::channel();
    book.enqueue(2, demand(1, 10_000), answer, given_up);
    assert!(book.plan_pulls(given_up, 1000, limits).is_empty());
    assert!(book.at_pull_limit(limits));
    assert_eq!(
        book.next_wake(given_up, Duration::from_secs(2), || None),
        Some(given_up + SILENT_COUNTS_FOR),
        "woken when it stops counting"
    );
    // Its status, late: room again.
    book.end_pull(first_pull, false, given_up);
    assert_eq!(book.plan_pulls(given_up, 1000, limits).len(), 1);

    // A status that never comes: it stops counting after a while.
    let mut book = Book::<()>::new();
    let (_answered, _pull) = waiting(&mut book, demand(1, 100), now);
    book.give_up_silent_pulls(given_up);
    book.take_finished(given_up, false, EPOCH);
    let (answer, _third) = oneshot::channel();
    book.enqueue(3, demand(1, 10_000), answer, given_up);
    assert!(book.plan_pulls(given_up, 1000, limits).is_empty());
    let later = given_up + SILENT_COUNTS_FOR;
    book.give_up_silent_pulls(later);
    assert_eq!(book.plan_pulls(later, 1000, limits).len(), 1);
}
