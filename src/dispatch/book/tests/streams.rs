//! The book's unit tests of a stream's pull: kept open between the stream's demands, asking
//! beyond its slice, a push worker's patient pull, a pull turned away as behind others.

use super::*;

/// An ordinary (not patient) stream's demand for `batch`, its credit the same.
fn stream_demand(stream: u64, batch: usize) -> Demand {
    Demand {
        stream: Some(stream),
        ..demand(batch, 10_000)
    }
}

#[test]
fn a_streams_pull_stays_open_and_its_next_demand_takes_it_over() {
    let now = Instant::now();
    let mut book = Book::<()>::new();
    let stream = |batch| stream_demand(42, batch);
    let (_answered, pull_id) = waiting(&mut book, stream(10), now);
    assert!(
        book.pulls[&pull_id].stream == Some(42),
        "a stream's pull waits at the server"
    );
    let owner = book.count_delivery(pull_id, now);
    book.place(owner, delivery(1, 10, now));
    let finished = book.take_finished(now, false, EPOCH);
    assert_eq!(finished.len(), 1, "answered at once, its pull still open");
    assert_eq!(sequences(&finished[0].got), [1]);
    book.detach_pull(finished[0].pull);

    // Between two demands, what the pull brings is held.
    let owner = book.count_delivery(pull_id, now);
    assert_eq!(owner, None);
    book.place(owner, delivery(2, 10, now));

    // Another stream's demand opens a pull of its own; the same stream's takes this one.
    let (other, _) = oneshot::channel();
    book.enqueue(2, stream_demand(7, 5), other, now);
    let (next, _) = oneshot::channel();
    book.enqueue(3, stream(9), next, now);
    let planned = book.plan_pulls(now, 1000, LIMITS);
    assert_eq!(planned.len(), 1, "{planned:?}");
    assert_eq!((planned[0].fetch, planned[0].keep_open), (2, true));
    assert_eq!(book.pulls[&pull_id].owner, Some(3));
    assert_eq!(book.count_delivery(pull_id, now), Some(3));

    // A fetch's pull is never kept open, nor taken over.
    let (fetch, _) = oneshot::channel();
    book.enqueue(4, demand(5, 10_000), fetch, now);
    let planned = book.plan_pulls(now, 1000, LIMITS);
    let for_fetch = planned.iter().find(|pull| pull.fetch == 4);
    assert!(for_fetch.is_some_and(|pull| !pull.keep_open), "{planned:?}");
}

#[test]
fn a_streams_pull_asks_for_its_credit_and_each_demand_takes_a_slice_of_it() {
    let now = Instant::now();
    let mut book = Book::<()>::new();
    let stream = |batch, credit| Demand {
        stream: Some(42),
        credit,
        ..demand(batch, 10_000)
    };
    let (_answered, pull_id) = waiting(&mut book, stream(100, 1000), now);
    assert_eq!(
        book.pulls[&pull_id].remaining, 1000,
        "the pull kept open asks for the stream's whole credit"
    );
    for sequence in 1..=150 {
        let owner = book.count_delivery(pull_id, now);
        book.place(owner, delivery(sequence, 10, now));
    }
    let finished = book.take_finished(now, false, EPOCH);
    assert_eq!(finished.len(), 1);
    assert_eq!(
        finished[0].got.len(),
        100,
        "a demand takes its slice, no more"
    );
    book.detach_pull(finished[0].pull);
    assert_eq!(book.held_len(), 50, "the rest is held, not leased");

    // The next demand takes the held rest at once, and the pull still open.
    let (next, _) = oneshot::channel();
    book.enqueue(3, stream(100, 900), next, now);
    book.hand_out_held();
    assert!(book.plan_pulls(now, 1000, LIMITS).is_empty(), "no new pull");
    assert_eq!(book.pulls[&pull_id].owner, Some(3));
    let finished = book.take_finished(now, false, EPOCH);
    assert_eq!(sequences(&finished[0].got), (101..=150).collect::<Vec<_>>());

    // A fetch's pull, and a patient stream's (never kept open), ask for their batch only.
    let (fetch, _) = oneshot::channel();
    book.enqueue(4, demand(5, 10_000), fetch, now);
    let (patient, _) = oneshot::channel();
    let patient_demand = Demand {
        stream: Some(43),
        patient: true,
        credit: 1000,
        ..demand(4, 10_000)
    };
    book.enqueue(5, patient_demand, patient, now);
    let planned = book.plan_pulls(now, 1000, LIMITS);
    let batches: Vec<_> = planned
        .iter()
        .map(|pull| (pull.fetch, pull.batch))
        .collect();
    assert_eq!(batches, [(4, 5), (5, 4)]);
}

#[test]
fn an_idle_push_workers_pull_waits_a_minute_is_never_kept_open_and_ends_with_its_stream() {
    let now = Instant::now();
    let mut book = Book::<()>::new();
    let patient = patient_stream(42, 4);
    let (_answered, pull_id) = waiting(&mut book, patient, now);
    let pull = &book.pulls[&pull_id];
    assert_eq!(pull.stream, None, "not kept open for the next demand");
    assert_eq!(pull.patient_for, Some(42));
    assert_eq!(
        pull.give_up_at,
        now + MAX_PATIENT_PULL_EXPIRES + PULL_GRACE,
        "waits at the server for a minute, not a second"
    );
    book.withdraw(1);

    // Another stream's pull stays; this stream's ends with it, and at shutdown every patient one.
    let (other, _) = oneshot::channel();
    book.enqueue(2, stream_demand(7, 5), other, now);
    let plan = book.plan_pulls(now, 1000, LIMITS)[0];
    let other_pull = book.next_pull_id();
    book.pull_opened(plan, other_pull, ());
    assert_eq!(book.end_patient_pulls(Some(7), now).len(), 0);
    assert_eq!(book.end_patient_pulls(Some(42), now).len(), 1);
    assert!(!book.is_open(pull_id) && book.is_open(other_pull));
    let (_answered, again) = waiting(&mut book, patient_stream(43, 1), now);
    assert_eq!(book.end_patient_pulls(None, now).len(), 1);
    assert!(!book.is_open(again) && book.is_open(other_pull));
}

#[test]
fn a_streams_pull_turned_away_as_behind_others_pulls_again_waiting_in_line() {
    let now = Instant::now();
    let mut book = Book::<()>::new();
    let patient = patient_stream(42, 4);
    let (_answered, pull_id) = waiting(&mut book, patient, now);
    assert!(
        book.pulls[&pull_id].patient_for.is_some(),
        "a no_wait patient pull first"
    );
    book.end_pull_behind_others(pull_id, now);
    assert!(
        book.plan_pulls(now, 10, LIMITS).is_empty(),
        "waits PULL_RETRY"
    );
    let plan = book.plan_pulls(now + PULL_RETRY, 10, LIMITS);
    assert_eq!(plan.len(), 1);
    assert!(plan[0].keep_open, "waits in line: not no_wait");
    assert!(!plan[0].patient);
}
