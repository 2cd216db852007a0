//! Lease rules: lease_expires_at is one margin short of the server's ack timer, and the
//! gateway hoards nothing: without HTTP demand nothing is delivered, pulls are slices of at
//! most a second and half of max_waiting, and a client hanging up mid-poll strands nothing.

use std::time::{Duration, Instant};

use futures::StreamExt as _;
use serde_json::{Value, json};
use time::OffsetDateTime;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use crate::support::{
    Action, Deadline, Gateway, Js, STREAM, Scrape, Setup, assert_stays, server_ack_pending,
    wait_for, wait_until,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redelivery_never_comes_before_lease_expires_at() {
    let (_server, js, gateway) = Setup::consumer("timing").ack_wait("2s").start().await;
    let sequence = js.publish("orders.1", "x").await;
    let first = gateway.fetch_n(1, 1000).await.remove(0);
    let expires = first.lease_expires();

    let (again, seen_at) = wait_for(
        "the message is redelivered",
        Duration::from_secs(10),
        || {
            let gateway = &gateway;
            async move {
                let found = gateway
                    .fetch_n(10, 100)
                    .await
                    .into_iter()
                    .find(|m| m.stream_sequence == sequence)?;
                Some((found, OffsetDateTime::now_utc()))
            }
        },
    )
    .await;
    assert_eq!(again.delivered, 2);
    assert!(
        seen_at >= expires,
        "the server redelivered at {seen_at}, before the first lease expired at {expires}"
    );
    assert_ne!(again.id, first.id);
    assert_eq!(gateway.ack(&again.id).await, 204);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_http_demand_the_server_keeps_the_messages() {
    let (_server, js, gateway) = Setup::consumer("nohoard").start().await;
    js.publish_many("orders.1", 20, "m").await;

    let idle = || async {
        let info = js.consumer_info(STREAM, "nohoard").await;
        info.num_ack_pending == 0 && info.num_pending == 20 && gateway.leases_in_flight().await == 0
    };
    assert_stays(
        "nothing is delivered without a fetch",
        Duration::from_millis(1500),
        idle,
    )
    .await;

    let held = gateway.fetch_n(3, 1000).await;
    assert_eq!(held.len(), 3);
    let matches = |count: u64| {
        let js = &js;
        let gateway = &gateway;
        move || async move {
            server_ack_pending(js, gateway).await as u64 == count
                && gateway.leases_in_flight().await == count
        }
    };
    wait_until(
        "num_ack_pending == leases == 3",
        Duration::from_secs(5),
        matches(3),
    )
    .await;
    assert_stays(
        "num_ack_pending == leases == 3",
        Duration::from_millis(1000),
        matches(3),
    )
    .await;
    let info = js.consumer_info(STREAM, "nohoard").await;
    assert_eq!(info.num_pending, 17, "the rest stays in the stream");

    for message in &held {
        assert_eq!(gateway.ack(&message.id).await, 204);
    }
    assert_stays(
        "num_ack_pending == leases == 0",
        Duration::from_millis(500),
        matches(0),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_for_a_client_that_left_goes_to_the_next_fetch() {
    let (_server, js, gateway) = Setup::consumer("abandoned").ack_wait("30s").start().await;

    // A client starts a long poll and gives up after 300 ms.
    let abandoned = gateway
        .http
        .post(gateway.url("/fetch"))
        .json(&json!({ "batch": 1, "wait_ms": 10_000 }))
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(abandoned.is_err(), "the client timed out");

    let sequence = js.publish("orders.1", "for whoever asks next").await;
    // Within a fraction of ack_wait (30 s) the next client gets it.
    let messages = gateway.fetch_n(1, 5000).await;
    if messages.is_empty() {
        let info = js.consumer_info(STREAM, "abandoned").await;
        panic!(
            "the message was lost to the client that left: the server has it delivered and \
             unacked (num_ack_pending {}, delivered up to stream sequence {}), the gateway \
             holds {} leases, and the next fetch got nothing for 5 s",
            info.num_ack_pending,
            info.delivered.stream_sequence,
            gateway.leases_in_flight().await
        );
    }
    assert_eq!(messages.len(), 1);
    assert_eq!(messages[0].stream_sequence, sequence);
    assert!(messages[0].delivered <= 2);
    let left = messages[0].lease_expires() - OffsetDateTime::now_utc();
    assert!(
        left > time::Duration::seconds(10),
        "handed out with enough of its lease left: {left}"
    );
    assert_eq!(gateway.ack(&messages[0].id).await, 204);
    wait_until(
        "nothing pending anywhere",
        Duration::from_secs(5),
        || async {
            server_ack_pending(&js, &gateway).await == 0 && gateway.leases_in_flight().await == 0
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_ids_are_distinct_and_url_safe_across_many_messages() {
    let (_server, js, gateway) = Setup::consumer("ids").start().await;
    js.publish_many("orders.1", 50, "m").await;
    let mut ids = Vec::new();
    let deadline = Deadline::after("all 50 messages were leased", Duration::from_secs(10));
    while ids.len() < 50 {
        ids.extend(gateway.fetch_n(20, 250).await.into_iter().map(|m| m.id));
        if ids.len() < 50 {
            deadline.tick().await;
        }
    }
    assert_eq!(ids.len(), 50);
    for id in &ids {
        assert!(
            id.len() >= 22
                && id
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'),
            "URL-safe, unguessable id: {id:?}"
        );
    }
    let mut unique = ids.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), 50, "ids are unique");
    gateway
        .settle_many_all_204(Action::Ack, &json!(ids), "the batch settle")
        .await;
    assert_eq!(server_ack_pending(&js, &gateway).await, 0);
}

/// Open a raw long poll (`POST /fetch`, wait_ms 10 000), let it wait at the server for
/// `patience`, hang up, and publish at once. The next ordinary fetch must get the message
/// as its first delivery, with the gateway's and the server's counts in step.
async fn hang_up_then_publish(gateway: &Gateway, js: &Js, consumer: &str, patience: Duration) {
    let body = json!({ "batch": 10, "wait_ms": 10_000 }).to_string();
    let addr = gateway.base().trim_start_matches("http://").to_string();
    let mut socket = TcpStream::connect(&addr).await.expect("connect to gateway");
    let request = format!(
        "POST /fetch HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    socket
        .write_all(request.as_bytes())
        .await
        .expect("send the long poll");
    // The long poll is under way once the gateway has a pull waiting at the server.
    wait_until(
        "the long poll has a pull waiting at the server",
        Duration::from_secs(5),
        || async { js.consumer_info(STREAM, consumer).await.num_waiting >= 1 },
    )
    .await;
    // The client's patience: pacing, not a condition.
    tokio::time::sleep(patience).await;
    drop(socket);

    let sequence = js.publish("orders.1", "after the hang-up").await;
    let started = Instant::now();
    let messages = gateway.fetch_n(10, 5000).await;
    let took = started.elapsed();
    if messages.is_empty() {
        let info = js.consumer_info(STREAM, consumer).await;
        panic!(
            "(patience {patience:?}) the next fetch got nothing in {took:?}: server \
             num_ack_pending {}, num_pending {}, delivered up to {}; gateway leases in flight {}",
            info.num_ack_pending,
            info.num_pending,
            info.delivered.stream_sequence,
            gateway.leases_in_flight().await
        );
    }
    assert_eq!(messages.len(), 1, "{messages:?}");
    assert_eq!(messages[0].stream_sequence, sequence);
    assert_eq!(
        messages[0].delivered, 1,
        "(patience {patience:?}) handed on, not redelivered after a nak or ack_wait"
    );
    assert!(took < Duration::from_secs(5), "took {took:?}");

    let view: Value = gateway.consumer_view().await;
    assert_eq!(view["leases_in_flight"], 1, "{view}");
    assert_eq!(server_ack_pending(js, gateway).await, 1, "{view}");

    assert_eq!(gateway.ack(&messages[0].id).await, 204);
    assert_eq!(gateway.leases_in_flight().await, 0);
    assert_eq!(server_ack_pending(js, gateway).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_hanging_up_mid_poll_does_not_strand_the_next_message() {
    let consumer = "rv-hangup";
    let (_server, js, gateway) = Setup::consumer(consumer).ack_wait("30s").start().await;
    hang_up_then_publish(&gateway, &js, consumer, Duration::from_millis(200)).await;
    // Sharper: the publish right on the heels of the hang-up, while the gateway may not
    // have noticed it yet. A few rounds, since it is a race.
    for _ in 0..10 {
        hang_up_then_publish(&gateway, &js, consumer, Duration::ZERO).await;
    }
}

/// A lease ends one margin (ack_wait/20, at most 1 s) before the server's own redelivery
/// time, which is its delivery time (`delivered.last_active` in consumer info) + ack_wait.
/// A margin of 0 (or the uncapped 2 s at ack_wait 40 s) puts `lease_expires_at` outside
/// the window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_ends_one_margin_before_the_servers_redelivery() {
    let (server, js, first) = Setup::consumer("margin-short")
        .ack_wait("10s")
        .start()
        .await;
    let second = Setup::consumer("margin-long")
        .ack_wait("40s")
        .ready(&server.url())
        .await;
    js.publish("orders.1", "timed").await;
    // How late after the server's delivery the gateway may read it and issue the lease.
    const RECEIPT: time::Duration = time::Duration::milliseconds(300);
    for (gateway, ack_wait, margin) in [
        (
            &first,
            time::Duration::seconds(10),
            time::Duration::milliseconds(500),
        ),
        (
            &second,
            time::Duration::seconds(40),
            time::Duration::seconds(1),
        ),
    ] {
        let leased = gateway.fetch_n(1, 1000).await.remove(0);
        let info = js.consumer_info(STREAM, &gateway.consumer).await;
        let delivered_at = info
            .delivered
            .last_active
            .expect("the server records when it delivered");
        let redelivery = delivered_at + ack_wait;
        let expires = leased.lease_expires();
        assert!(
            expires >= redelivery - margin && expires <= redelivery - margin + RECEIPT,
            "{}: lease_expires_at {expires} must be the server's redelivery at {redelivery} \
             less the margin {margin} (+ at most {RECEIPT} of receipt)",
            gateway.consumer
        );
    }
}

/// Waiting fetches get pulls of at most 1 s each (`expires` in the request the server sees),
/// and never more than half the consumer's max_waiting (512: 256) are open at once, however
/// many fetches wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pulls_are_slices_of_a_second_and_at_most_half_of_max_waiting() {
    const POLLS: usize = 400;
    let (_server, js, gateway) = Setup::consumer("slices").start().await;
    let mut pulls = js
        .client
        .subscribe(format!("$JS.API.CONSUMER.MSG.NEXT.{STREAM}.slices"))
        .await
        .expect("subscribe to the pull requests");
    js.client.flush().await.expect("flush");

    let mut polls = Vec::with_capacity(POLLS);
    for _ in 0..POLLS {
        let client = gateway.client().clone();
        polls.push(tokio::spawn(
            async move { client.fetch_n(1, 6000).await.len() },
        ));
    }
    wait_until(
        "the gateway has as many pulls open as it may",
        Duration::from_secs(10),
        || async { js.consumer_info(STREAM, "slices").await.num_waiting >= 200 },
    )
    .await;
    // Deliberately a while (2 s): long enough for every pull to have been renewed.
    assert_stays(
        "at most 256 pulls are open (half of max_waiting)",
        Duration::from_secs(2),
        || async { js.consumer_info(STREAM, "slices").await.num_waiting <= 256 },
    )
    .await;

    let mut seen = 0;
    while let Ok(Some(pull)) = tokio::time::timeout(Duration::from_millis(100), pulls.next()).await
    {
        let request: Value = serde_json::from_slice(&pull.payload).expect("a JSON pull request");
        let expires = request["expires"]
            .as_u64()
            .unwrap_or_else(|| panic!("a pull for a waiting fetch has expires: {request}"));
        assert!(
            expires <= 1_000_000_000,
            "a pull of at most 1 s, got {expires} ns: {request}"
        );
        assert_eq!(request["no_wait"], true, "{request}");
        seen += 1;
    }
    assert!(seen >= 256, "the pulls were seen: {seen}");
    for poll in polls {
        assert_eq!(poll.await.expect("poll task"), 0, "nothing was published");
    }
}

/// A client that sends a fetch for a message that is already there and hangs up at once:
/// whether the gateway notices before leasing (the fetch is withdrawn) or after (the leases
/// are given back, `ruststream_leases_withdrawn_total`), the message goes to the next fetch
/// as its first delivery. Only when the client left after its answer was already written
/// (a slow client task) did that answer reach it: then the message comes back after
/// ack_wait (2 s here) as its second delivery — never lost, never stranded longer. Every
/// lease issued either reached a client or was given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_as_its_leases_are_issued_strands_nothing() {
    let (_server, js, gateway) = Setup::consumer("gone").ack_wait("2s").start().await;
    let addr = gateway.base().trim_start_matches("http://").to_string();
    let body = json!({ "batch": 1, "wait_ms": 1000 }).to_string();
    let request = format!(
        "POST /fetch HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let before = Scrape::of(&gateway).await;
    const ROUNDS: u64 = 10;
    let mut answered_before_leaving = 0_u64;
    for round in 0..ROUNDS {
        let sequence = js.publish("orders.1", "for a vanishing client").await;
        let mut socket = TcpStream::connect(&addr).await.expect("connect to gateway");
        socket
            .write_all(request.as_bytes())
            .await
            .expect("send the fetch");
        drop(socket);
        let messages = gateway.fetch_n(1, 5000).await;
        assert_eq!(
            messages.len(),
            1,
            "round {round}: the next fetch got nothing"
        );
        assert_eq!(messages[0].stream_sequence, sequence, "round {round}");
        match messages[0].delivered {
            1 => {}
            2 => answered_before_leaving += 1,
            other => panic!("round {round}: delivered {other}"),
        }
        assert_eq!(gateway.ack(&messages[0].id).await, 204, "round {round}");
    }
    assert!(
        answered_before_leaving < ROUNDS,
        "the gateway never noticed a client leaving"
    );
    let after = Scrape::of(&gateway).await;
    let delta = |series: &str| after.get(series) - before.get(series);
    let given_back = delta("ruststream_leases_withdrawn_total");
    assert_eq!(
        delta("ruststream_leases_granted_total") - given_back,
        (ROUNDS + answered_before_leaving) as f64,
        "every lease issued reached a client or was given back ({given_back} given back, \
         {answered_before_leaving} answered before the client left)"
    );
    assert_eq!(gateway.leases_in_flight().await, 0);
    assert_eq!(server_ack_pending(&js, &gateway).await, 0);
}
