//! The lease table's unit tests: issue, settle, extend, expiry and retirement of leases,
//! driven on a paused clock.

use super::*;

const WAIT: Duration = Duration::from_secs(30);

fn key(stream_sequence: u64, delivered: u64) -> DeliveryKey {
    DeliveryKey {
        stream_sequence,
        delivered,
    }
}

fn table() -> LeaseTable {
    LeaseTable::new(Duration::from_secs(60), 1000)
}

fn reply() -> Arc<str> {
    Arc::from("$JS.ACK.ORDERS.billing.1.1.1.0.0")
}

#[tokio::test(start_paused = true)]
async fn ack_then_retry_answers_the_same_and_other_outcomes_conflict() {
    let mut leases = table();
    let now = Instant::now();
    leases.issue(key(1, 1), reply(), now + WAIT);
    assert_eq!(leases.in_flight(now), 1);
    assert_eq!(
        leases.begin_settle(key(1, 1), SettleKind::Ack, now),
        Ok(SettleStart::Send(reply()))
    );
    leases.finish_settle(key(1, 1), SettleKind::Ack, true, now);
    assert_eq!(leases.in_flight(now), 0);
    assert_eq!(
        leases.begin_settle(key(1, 1), SettleKind::Ack, now),
        Ok(SettleStart::AlreadyDone)
    );
    assert_eq!(
        leases.begin_settle(key(1, 1), SettleKind::Nak, now),
        Err(Refusal::Conflict(SettleKind::Ack))
    );
    assert_eq!(
        leases.begin_extend(key(1, 1), now),
        Err(Refusal::Settled(SettleKind::Ack))
    );
}

#[tokio::test(start_paused = true)]
async fn a_lowered_ack_wait_ends_live_leases_at_the_servers_new_deadline() {
    let mut leases = table();
    let now = Instant::now();
    leases.issue(key(1, 1), reply(), now + WAIT);
    leases.issue(key(2, 1), reply(), now + Duration::from_secs(5));
    // ack_wait 30 s → 20 s: the first lease now ends 10 s later, the second at once.
    assert_eq!(leases.shorten_live(Duration::from_secs(10), now), 2);
    assert_eq!(leases.in_flight(now), 1);
    assert_eq!(
        leases.begin_settle(key(2, 1), SettleKind::Ack, now),
        Err(Refusal::Gone)
    );
    assert!(leases.is_live(key(1, 1), now + Duration::from_secs(19)));
    assert!(!leases.is_live(key(1, 1), now + Duration::from_secs(20)));
}

#[tokio::test(start_paused = true)]
async fn unconfirmed_settle_leaves_the_lease_valid() {
    let mut leases = table();
    let now = Instant::now();
    leases.issue(key(1, 1), reply(), now + WAIT);
    assert!(leases.begin_settle(key(1, 1), SettleKind::Ack, now).is_ok());
    leases.finish_settle(key(1, 1), SettleKind::Ack, false, now);
    assert_eq!(leases.in_flight(now), 1);
    assert_eq!(
        leases.begin_settle(key(1, 1), SettleKind::Nak, now),
        Ok(SettleStart::Send(reply()))
    );
}

#[tokio::test(start_paused = true)]
async fn expired_lease_is_gone() {
    let mut leases = table();
    let now = Instant::now();
    leases.issue(key(1, 1), reply(), now + WAIT);
    tokio::time::advance(WAIT).await;
    let later = Instant::now();
    assert_eq!(leases.in_flight(later), 0);
    assert_eq!(leases.take_expired(), 1);
    assert_eq!(leases.take_expired(), 0, "counted once");
    assert_eq!(
        leases.begin_settle(key(1, 1), SettleKind::Ack, later),
        Err(Refusal::Gone)
    );
    assert_eq!(leases.begin_extend(key(1, 1), later), Err(Refusal::Gone));
}

#[tokio::test(start_paused = true)]
async fn a_delivery_made_again_with_the_same_count_is_reported() {
    let mut leases = table();
    let now = Instant::now();
    assert!(!leases.note_delivery(key(3, 1), now), "a first delivery");
    leases.issue(key(3, 1), reply(), now + WAIT);
    assert!(
        leases.note_delivery(key(3, 1), now),
        "the server made the leased delivery again"
    );
    assert!(
        !leases.note_delivery(key(3, 2), now),
        "a redelivery is not a replay"
    );
}

#[tokio::test(start_paused = true)]
async fn redelivery_supersedes_the_older_lease() {
    let mut leases = table();
    let now = Instant::now();
    leases.issue(key(5, 1), reply(), now + WAIT);
    leases.note_delivery(key(5, 2), now);
    assert_eq!(leases.in_flight(now), 0);
    assert_eq!(
        leases.begin_settle(key(5, 1), SettleKind::Ack, now),
        Err(Refusal::Gone)
    );
    leases.issue(key(5, 2), reply(), now + WAIT);
    assert!(leases.begin_settle(key(5, 2), SettleKind::Ack, now).is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_nakked_lease_keeps_its_answer_after_redelivery() {
    let mut leases = table();
    let now = Instant::now();
    leases.issue(key(5, 1), reply(), now + WAIT);
    assert!(leases.begin_settle(key(5, 1), SettleKind::Nak, now).is_ok());
    leases.finish_settle(key(5, 1), SettleKind::Nak, true, now);
    leases.note_delivery(key(5, 2), now);
    assert_eq!(
        leases.begin_settle(key(5, 1), SettleKind::Nak, now),
        Ok(SettleStart::AlreadyDone)
    );
    assert_eq!(
        leases.begin_settle(key(5, 1), SettleKind::Ack, now),
        Err(Refusal::Conflict(SettleKind::Nak))
    );
}

#[tokio::test(start_paused = true)]
async fn extension_moves_the_expiry_and_keeps_the_lease_live() {
    let mut leases = table();
    let now = Instant::now();
    leases.issue(key(1, 1), reply(), now + WAIT);
    tokio::time::advance(WAIT / 2).await;
    let mid = Instant::now();
    assert_eq!(leases.begin_extend(key(1, 1), mid), Ok(reply()));
    assert_eq!(
        leases.finish_extend(key(1, 1), Some(mid + WAIT)),
        Some(mid + WAIT)
    );
    tokio::time::advance(WAIT * 3 / 4).await;
    assert_eq!(leases.in_flight(Instant::now()), 1);
    assert_eq!(leases.next_expiry(), Some(mid + WAIT));
}

#[tokio::test(start_paused = true)]
async fn outcomes_are_forgotten_after_retention() {
    let mut leases = LeaseTable::new(Duration::from_secs(60), 1000);
    let now = Instant::now();
    leases.issue(key(1, 1), reply(), now + WAIT);
    assert!(
        leases
            .begin_settle(key(1, 1), SettleKind::Term, now)
            .is_ok()
    );
    leases.finish_settle(key(1, 1), SettleKind::Term, true, now);
    tokio::time::advance(Duration::from_secs(61)).await;
    leases.expire(Instant::now());
    assert_eq!(
        leases.begin_settle(key(1, 1), SettleKind::Term, Instant::now()),
        Err(Refusal::Unknown)
    );
}

#[tokio::test(start_paused = true)]
async fn delayed_naks_hold_a_slot_until_due_or_redelivered() {
    let mut leases = table();
    let now = Instant::now();
    leases.issue(key(1, 1), reply(), now + WAIT);
    assert!(leases.begin_settle(key(1, 1), SettleKind::Nak, now).is_ok());
    leases.finish_settle(key(1, 1), SettleKind::Nak, true, now);
    leases.park(1, now + Duration::from_secs(10));
    leases.park(2, now + Duration::from_secs(20));
    assert_eq!(leases.taken(now), 2);
    assert_eq!(leases.delayed_naks(), 2);
    assert_eq!(leases.next_release(), Some(now + Duration::from_secs(10)));
    leases.note_delivery(key(2, 2), now);
    assert_eq!(leases.taken(now), 1);
    tokio::time::advance(Duration::from_secs(10)).await;
    assert_eq!(leases.taken(Instant::now()), 0);
}

#[tokio::test(start_paused = true)]
async fn revoked_leases_are_gone_and_their_subjects_returned() {
    let mut leases = table();
    let now = Instant::now();
    leases.issue(key(1, 1), reply(), now + WAIT);
    leases.issue(
        key(2, 1),
        Arc::from("$JS.ACK.ORDERS.billing.1.2.2.0.0"),
        now + WAIT,
    );
    assert!(leases.begin_settle(key(2, 1), SettleKind::Ack, now).is_ok());
    assert_eq!(leases.revoke_live(now), vec![reply()]);
    assert_eq!(
        leases.begin_settle(key(1, 1), SettleKind::Ack, now),
        Err(Refusal::Gone)
    );
    assert_eq!(leases.in_flight(now), 1, "the one being settled stays");
}

#[tokio::test(start_paused = true)]
async fn a_lease_given_back_is_unknown_and_not_in_flight() {
    let mut leases = table();
    let now = Instant::now();
    leases.issue(key(1, 1), reply(), now + WAIT);
    leases.give_back(key(1, 1));
    assert_eq!(leases.in_flight(now), 0);
    assert_eq!(
        leases.begin_settle(key(1, 1), SettleKind::Ack, now),
        Err(Refusal::Unknown)
    );
}

#[tokio::test(start_paused = true)]
async fn a_message_is_ending_while_an_ack_or_term_of_it_is_on_its_way() {
    let mut leases = table();
    let now = Instant::now();
    leases.issue(key(1, 1), reply(), now + WAIT);
    leases.issue(key(2, 1), reply(), now + WAIT);
    // A nak does not end the message: a new delivery of it may be leased at once.
    assert!(leases.begin_settle(key(2, 1), SettleKind::Nak, now).is_ok());
    assert!(!leases.is_ending(2));
    leases.finish_settle(key(2, 1), SettleKind::Nak, true, now);
    // Two attempts of one ack overlap: ending until both have their answer.
    assert!(leases.begin_settle(key(1, 1), SettleKind::Ack, now).is_ok());
    assert!(leases.begin_settle(key(1, 1), SettleKind::Ack, now).is_ok());
    assert!(leases.is_ending(1));
    // The server delivers the message again meanwhile: still ending.
    assert!(!leases.note_delivery(key(1, 2), now));
    leases.finish_settle(key(1, 1), SettleKind::Ack, false, now);
    assert!(leases.is_ending(1));
    leases.finish_settle(key(1, 1), SettleKind::Ack, true, now);
    assert!(!leases.is_ending(1));
    // Refused or already done: nothing sent, nothing ending.
    assert_eq!(
        leases.begin_settle(key(1, 1), SettleKind::Ack, now),
        Err(Refusal::Gone)
    );
    assert!(!leases.is_ending(1));
}

#[tokio::test(start_paused = true)]
async fn a_new_epoch_keeps_the_settles_in_motion_and_no_lease() {
    let mut leases = table();
    let now = Instant::now();
    leases.issue(key(1, 1), reply(), now + WAIT);
    assert!(
        leases
            .begin_settle(key(1, 1), SettleKind::Term, now)
            .is_ok()
    );
    // The server forgot its deliveries: a new epoch, while the term is on its way.
    let mut next = leases.successor();
    assert!(
        next.is_ending(1),
        "the term's answer may still end the message"
    );
    assert_eq!(next.in_flight(now), 0);
    assert_eq!(
        next.begin_settle(key(1, 1), SettleKind::Term, now),
        Err(Refusal::Unknown)
    );
    next.finish_settle(key(1, 1), SettleKind::Term, true, now);
    assert!(!next.is_ending(1));
}
