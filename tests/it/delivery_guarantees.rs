//! What a delivery may and may not do, one test each: only the newest delivery settles (and a
//! fenced settle never reaches NATS), no two valid leases of a message at once, no re-lease
//! after a confirmed ack or term (after server crashes and a recreated consumer too), and
//! neither a graceful stop nor a crash of the gateway leaves a message waiting longer than
//! ack_wait.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt as _;
use time::OffsetDateTime;

use crate::support::{
    Action, Gateway, Msg, STREAM, Scrape, Setup, assert_stays, server_ack_pending, wait_for,
    wait_until,
};

/// The delivery count token of a v1 ack subject
/// `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>`.
fn delivered_of(ack_subject: &str) -> Option<u64> {
    ack_subject.split('.').nth(4)?.parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_newest_delivery_settles_and_stale_settles_never_reach_nats() {
    let (_server, js, gateway) = Setup::consumer("newest").ack_wait("1s").start().await;
    // Everything the gateway sends on the consumer's ack subjects, as a plain NATS client.
    let mut wire = js
        .client
        .subscribe(format!("$JS.ACK.{STREAM}.newest.>"))
        .await
        .expect("subscribe to the ack subjects");
    js.client.flush().await.expect("flush");
    let sequence = js.publish("orders.1", "once").await;
    let a = gateway.fetch_n(1, 1000).await.remove(0);
    let b = wait_for("the redelivery", Duration::from_secs(10), || async {
        gateway
            .fetch_n(1, 250)
            .await
            .into_iter()
            .find(|m| m.stream_sequence == sequence && m.delivered == 2)
    })
    .await;

    for action in [Action::Ack, Action::Nak, Action::InProgress] {
        gateway
            .settle(&a.id, action, None)
            .await
            .assert_problem(410);
    }
    assert_eq!(gateway.ack(&b.id).await, 204);
    // One connection's publishes arrive in order: had any of A's settles gone out, it would
    // come before B's ack.
    let first_on_the_wire = tokio::time::timeout(Duration::from_secs(5), wire.next())
        .await
        .expect("B's ack is on the wire")
        .expect("subscription open");
    assert_eq!(
        (
            delivered_of(first_on_the_wire.subject.as_str()),
            first_on_the_wire.payload.as_ref()
        ),
        (Some(2), b"+ACK".as_ref()),
        "the first ack-subject message is B's ack, not one of A's: {}",
        first_on_the_wire.subject
    );
    let info = js.consumer_info(STREAM, "newest").await;
    assert_eq!(info.num_ack_pending, 0);
    assert_eq!(info.ack_floor.stream_sequence, sequence, "acked once, by B");
    assert_stays(
        "the acked message never comes again",
        Duration::from_millis(1500),
        || async { gateway.fetch_n(1, 100).await.is_empty() },
    )
    .await;
    assert!(
        tokio::time::timeout(Duration::from_millis(200), wire.next())
            .await
            .is_err(),
        "nothing else was sent on the ack subjects"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_two_valid_leases_of_one_message_exist_at_once() {
    const MESSAGES: usize = 40;
    const WORKERS: usize = 16;
    let (_server, js, gateway) = Setup::consumer("exclusive").ack_wait("1s").start().await;
    js.publish_many("orders.1", MESSAGES, "m").await;
    let gateway = Arc::new(gateway);
    // The newest lease seen per stream sequence, and everything that went wrong.
    let newest: Arc<Mutex<HashMap<u64, Msg>>> = Arc::default();
    let acked: Arc<Mutex<HashSet<u64>>> = Arc::default();
    let violations: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut workers = Vec::new();
    for worker in 0..WORKERS {
        let (gateway, newest, acked, violations) = (
            gateway.clone(),
            newest.clone(),
            acked.clone(),
            violations.clone(),
        );
        workers.push(tokio::spawn(async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
            while acked.lock().expect("lock").len() < MESSAGES
                && tokio::time::Instant::now() < deadline
            {
                for msg in gateway.fetch_n(2, 300).await {
                    let received = OffsetDateTime::now_utc();
                    let previous = newest
                        .lock()
                        .expect("lock")
                        .insert(msg.stream_sequence, msg.clone());
                    if let Some(previous) = previous {
                        // The older lease must be over: by its clock, and by the gateway's.
                        if received < previous.lease_expires() {
                            violations.lock().expect("lock").push(format!(
                                "seq {}: delivery {} received at {received} before delivery {}'s lease ended at {}",
                                msg.stream_sequence, msg.delivered, previous.delivered, previous.lease_expires_at
                            ));
                        }
                        let probe = gateway.in_progress(&previous.id).await;
                        if probe.status != 410 && probe.status != 409 {
                            violations.lock().expect("lock").push(format!(
                                "seq {}: the older lease (delivery {}) still answers {} after delivery {} was handed out",
                                msg.stream_sequence, previous.delivered, probe.status, msg.delivered
                            ));
                        }
                    }
                    // A first delivery of every third message is abandoned: it expires and
                    // goes to someone else.
                    let abandon = msg.delivered == 1 && (msg.stream_sequence + worker as u64).is_multiple_of(3);
                    if !abandon && gateway.ack(&msg.id).await == 204 {
                        acked.lock().expect("lock").insert(msg.stream_sequence);
                    }
                }
            }
        }));
    }
    for worker in workers {
        worker.await.expect("worker");
    }
    let violations = violations.lock().expect("lock").clone();
    assert!(violations.is_empty(), "{violations:#?}");
    assert_eq!(
        acked.lock().expect("lock").len(),
        MESSAGES,
        "every message acked"
    );
    let redelivered = newest
        .lock()
        .expect("lock")
        .values()
        .filter(|msg| msg.delivered > 1)
        .count();
    assert!(
        redelivered > 0,
        "some leases expired and were handed out again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_confirmed_ack_or_term_is_never_followed_by_a_re_lease() {
    const MESSAGES: usize = 60;
    let (_server, js, gateway) = Setup::consumer("final").ack_wait("1s").start().await;
    js.publish_many("orders.1", MESSAGES, "m").await;
    let gateway = Arc::new(gateway);
    let settled: Arc<Mutex<HashSet<u64>>> = Arc::default();
    let re_leased: Arc<Mutex<Vec<(u64, u64)>>> = Arc::default();
    let mut workers = Vec::new();
    for _ in 0..8 {
        let (gateway, settled, re_leased) = (gateway.clone(), settled.clone(), re_leased.clone());
        workers.push(tokio::spawn(async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
            while settled.lock().expect("lock").len() < MESSAGES
                && tokio::time::Instant::now() < deadline
            {
                let fetched = gateway.fetch_n(5, 200).await;
                let mut ids = Vec::new();
                for msg in &fetched {
                    if settled.lock().expect("lock").contains(&msg.stream_sequence) {
                        re_leased
                            .lock()
                            .expect("lock")
                            .push((msg.stream_sequence, msg.delivered));
                    }
                    ids.push(msg.id.clone());
                }
                for (i, msg) in fetched.iter().enumerate() {
                    let status = if i % 4 == 3 {
                        gateway.term(&msg.id, Some("done with it")).await
                    } else {
                        gateway.ack(&msg.id).await
                    };
                    if status == 204 {
                        settled.lock().expect("lock").insert(msg.stream_sequence);
                    }
                }
            }
        }));
    }
    for worker in workers {
        worker.await.expect("worker");
    }
    assert_eq!(settled.lock().expect("lock").len(), MESSAGES);
    // Past ack_wait (1 s) nothing settled may come back.
    assert_stays(
        "no settled message is handed out again",
        Duration::from_millis(2500),
        || async {
            let again = gateway.fetch_n(10, 100).await;
            if !again.is_empty() {
                re_leased
                    .lock()
                    .expect("lock")
                    .extend(again.iter().map(|m| (m.stream_sequence, m.delivered)));
            }
            again.is_empty()
        },
    )
    .await;
    assert!(
        re_leased.lock().expect("lock").is_empty(),
        "{:?}",
        re_leased.lock()
    );
    assert_eq!(server_ack_pending(&js, &gateway).await, 0);
}

/// A message the server delivers again while an ack of it is on its way (its consumer leader
/// stalled, ack_wait ran out meanwhile) waits for that ack's answer: acked, it is settled
/// again, never leased. A paused nats-server serves both the ack and the redelivery on
/// resume, in either order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_delivered_again_under_its_ack_in_motion_is_not_leased_after_the_ack() {
    const MESSAGES: usize = 8;
    let (mut server, js, gateway) = Setup::consumer("in-motion")
        .ack_wait("1s")
        .settle_timeout("10s")
        .start()
        .await;
    js.publish_many("orders.1", MESSAGES, "m").await;
    let leased = gateway.fetch_n(MESSAGES as u64, 2000).await;
    assert_eq!(leased.len(), MESSAGES);
    let gateway = Arc::new(gateway);

    server.pause();
    let acks: Vec<_> = leased
        .iter()
        .map(|msg| {
            let (gateway, id) = (gateway.clone(), msg.id.clone());
            tokio::spawn(async move { gateway.ack(&id).await })
        })
        .collect();
    // A fetch waits meanwhile: its pull reaches the server with the acks.
    let waiting = {
        let gateway = gateway.clone();
        tokio::spawn(async move { gateway.fetch_n(MESSAGES as u64, 6000).await })
    };
    // The fault: the server stalls past ack_wait with the acks unanswered.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    server.resume();

    let mut acked = HashSet::new();
    for (ack, msg) in acks.into_iter().zip(&leased) {
        let status = ack.await.expect("ack task");
        assert!(matches!(status, 204 | 410), "ack answered {status}");
        if status == 204 {
            acked.insert(msg.stream_sequence);
        }
    }
    let mut handed_out: Vec<Msg> = waiting.await.expect("fetch task");
    // Past ack_wait again: what the server still redelivers comes here too.
    handed_out.extend(gateway.fetch_n(MESSAGES as u64, 2500).await);
    let again: Vec<(u64, u64)> = handed_out
        .iter()
        .filter(|msg| acked.contains(&msg.stream_sequence))
        .map(|msg| (msg.stream_sequence, msg.delivered))
        .collect();
    assert!(
        again.is_empty(),
        "messages leased again after their ack was answered 204: {again:?}"
    );
}

/// Fetch (and ack) from `gateway` until every one of `sequences` came back; panics when that
/// takes longer than `within`.
async fn all_come_back(gateway: &Gateway, sequences: &HashSet<u64>, within: Duration) {
    let deadline = crate::support::Deadline::after(
        format!("stream sequences {sequences:?} are delivered again"),
        within,
    );
    let mut back = HashSet::new();
    while !sequences.is_subset(&back) {
        for msg in gateway.fetch_n(10, 200).await {
            back.insert(msg.stream_sequence);
            assert_eq!(gateway.ack(&msg.id).await, 204);
        }
        if !sequences.is_subset(&back) {
            deadline.tick_seeing(format_args!("{back:?}")).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_naks_the_leases_still_out_so_they_come_back_at_once() {
    let (server, js) = crate::support::server_with_stream().await;
    js.publish_many("orders.1", 3, "m").await;
    let mut first = Setup::consumer("stopping")
        .ack_wait("60s")
        .shutdown_grace("1s")
        .process(&server.url())
        .await;
    let held: HashSet<u64> = first
        .fetch_n(3, 1000)
        .await
        .iter()
        .map(|m| m.stream_sequence)
        .collect();
    assert_eq!(held.len(), 3);
    assert!(
        first.terminate(Duration::from_secs(15)).await.success(),
        "exit 0 after SIGTERM"
    );

    let second = Setup::consumer("stopping")
        .ack_wait("60s")
        .ready(&server.url())
        .await;
    // Back at once: well within ack_wait (60 s), which is when they would come back had
    // the stop not nak'd them.
    all_come_back(&second, &held, Duration::from_secs(10)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_gateway_leaves_nothing_waiting_longer_than_ack_wait() {
    const ACK_WAIT: Duration = Duration::from_secs(3);
    let (server, js) = crate::support::server_with_stream().await;
    js.publish_many("orders.1", 3, "m").await;
    let setup = Setup::consumer("crashing").ack_wait("3s");
    let mut crashed = setup.process(&server.url()).await;
    let held: HashSet<u64> = crashed
        .fetch_n(3, 1000)
        .await
        .iter()
        .map(|m| m.stream_sequence)
        .collect();
    let leased_at = tokio::time::Instant::now();
    assert_eq!(held.len(), 3);
    crashed.kill9();

    let second = setup.ready(&server.url()).await;
    all_come_back(&second, &held, ACK_WAIT + Duration::from_secs(5)).await;
    let took = leased_at.elapsed();
    assert!(
        took <= ACK_WAIT + Duration::from_secs(2),
        "redelivered within ack_wait (+ a pull's latency) of the crash: {took:?}"
    );
    assert_eq!(server_ack_pending(&js, &second).await, 0);
}

/// nats-server confirms an ack (or a term) before its consumer state is on disk: killed -9
/// right after, it delivers those messages again — and, killed again after it came back, the
/// settles it confirmed since. The gateway remembers what it settled and settles such a
/// redelivery again itself — the ack as an ack, the term with its reason — so no client is
/// handed a message whose ack or term it got a 2xx for, after one crash or two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_acked_or_termed_before_a_server_crash_are_never_leased_again() {
    let consumer = "finals";
    // A short ack_wait: what the server forgot it redelivers once that passes. The server
    // runs at its default sync_interval, as most deployments do.
    let (mut server, js, mut gateway) = Setup::consumer(consumer).ack_wait("2s").start().await;
    for round in 1..=2 {
        let forgotten = settle_then_crash(&mut server, &js, &mut gateway, consumer).await;
        // This process confirmed them: source="process".
        let again = |kind: &str| {
            format!(
                "ruststream_redeliveries_settled_again_total{{kind=\"{kind}\",source=\"process\"}}"
            )
        };
        let before = Scrape::of(&gateway).await;
        // Fetches pull again: the forgotten settles come back, and not one reaches a client.
        let fetched = gateway.fetch_n(CRASH_MESSAGES as u64, 4000).await;
        assert!(
            fetched.is_empty(),
            "round {round}: a settled message was leased again: {fetched:?}"
        );
        let settled_again = wait_for(
            "the server holds nothing pending",
            Duration::from_secs(15),
            || async {
                let info = js.consumer_info(STREAM, consumer).await;
                if info.num_ack_pending as u64 + info.num_pending > 0 {
                    let fetched = gateway.fetch_n(CRASH_MESSAGES as u64, 200).await;
                    assert!(
                        fetched.is_empty(),
                        "round {round}: leased again: {fetched:?}"
                    );
                    return None;
                }
                let after = Scrape::of(&gateway).await;
                Some(
                    after.get_or_zero(&again("ack")) + after.get_or_zero(&again("term"))
                        - before.get_or_zero(&again("ack"))
                        - before.get_or_zero(&again("term")),
                )
            },
        )
        .await;
        assert_eq!(
            settled_again, forgotten as f64,
            "round {round}: each message the server forgot was settled again, once"
        );
    }
    assert_stays(
        "no settled message is leased again",
        Duration::from_secs(2),
        || async { gateway.fetch_n(10, 200).await.is_empty() },
    )
    .await;
}

const CRASH_MESSAGES: usize = 40;

/// Lease, settle (a quarter by term) and kill the server at once, inside its write-behind
/// window, then restart it; the server itself says how much it forgot (if it wrote
/// everything in time, try again). Returns that count.
async fn settle_then_crash(
    server: &mut crate::support::NatsServer,
    js: &crate::support::Js,
    gateway: &mut Gateway,
    consumer: &str,
) -> u64 {
    for _ in 0..5 {
        js.publish_many("orders.1", CRASH_MESSAGES, "m").await;
        let leased = gateway.fetch_n(CRASH_MESSAGES as u64, 2000).await;
        assert_eq!(leased.len(), CRASH_MESSAGES);
        let (terms, acks) = leased.split_at(CRASH_MESSAGES / 4);
        let ack_ids: Vec<&str> = acks.iter().map(|m| m.id.as_str()).collect();
        let acked = gateway
            .settle_many_ok(Action::Ack, &serde_json::json!({ "ids": ack_ids }))
            .await;
        assert!(acked.iter().all(|(_, status)| *status == 204), "{acked:?}");
        for message in terms {
            let reply = gateway
                .settle(
                    &message.id,
                    Action::Term,
                    Some(&serde_json::json!({ "reason": "bad order" })),
                )
                .await;
            assert_eq!(reply.status, 204, "{}", reply.text);
        }
        server.kill();
        gateway.wait_unready().await;
        server.restart().await;
        gateway.wait_ready().await;
        let info = js.consumer_info(STREAM, consumer).await;
        let forgotten = info.num_ack_pending as u64 + info.num_pending;
        if forgotten > 0 {
            return forgotten;
        }
    }
    panic!("no kill inside the server's write-behind window in 5 tries");
}

/// A consumer deleted and made again (or one a restarted server recovered as new) delivers
/// from the start, every message with `delivered` 1: what was acked or termed through this
/// gateway is settled again, never leased; a nak'd message is leased as it should be.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recreated_consumer_leases_only_what_did_not_end_here() {
    let consumer = "finals-recreated";
    let (_server, js, gateway) = Setup::consumer(consumer).start().await;
    js.publish_many("orders.1", 6, "m").await;
    let leased = gateway.fetch_n(6, 2000).await;
    assert_eq!(leased.len(), 6);
    for message in &leased[..2] {
        assert_eq!(gateway.ack(&message.id).await, 204);
    }
    for message in &leased[2..4] {
        assert_eq!(gateway.term(&message.id, Some("bad order")).await, 204);
    }
    for message in &leased[4..] {
        assert_eq!(gateway.nak(&message.id, Some(60_000)).await, 204);
    }
    let nakd: HashSet<u64> = leased[4..].iter().map(|m| m.stream_sequence).collect();
    let before = Scrape::of(&gateway).await;
    js.delete_consumer(STREAM, consumer).await;

    let mut seen = HashSet::new();
    let deadline = crate::support::Deadline::after(
        "the nak'd messages from the recreated consumer",
        Duration::from_secs(20),
    );
    while seen != nakd {
        for message in gateway.fetch_n(6, 500).await {
            assert!(
                nakd.contains(&message.stream_sequence),
                "a message that ended here was leased again: {message:?}"
            );
            assert_eq!(message.delivered, 1, "from the new consumer");
            seen.insert(message.stream_sequence);
            assert_eq!(gateway.ack(&message.id).await, 204);
        }
        deadline.tick_seeing(format_args!("{seen:?}")).await;
    }
    let kind = |kind: &str| {
        format!("ruststream_redeliveries_settled_again_total{{kind=\"{kind}\",source=\"process\"}}")
    };
    wait_until(
        "the four are settled again",
        Duration::from_secs(10),
        || async {
            let after = Scrape::of(&gateway).await;
            after.get_or_zero(&kind("ack")) - before.get_or_zero(&kind("ack")) == 2.0
                && after.get_or_zero(&kind("term")) - before.get_or_zero(&kind("term")) == 2.0
        },
    )
    .await;
    assert_stays("nothing else is leased", Duration::from_secs(2), || async {
        gateway.fetch_n(10, 200).await.is_empty()
    })
    .await;
}
