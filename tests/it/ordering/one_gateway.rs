//! Ordering per key on one gateway: one message of a key out at a time in stream order, no
//! other key held back, a head the server gives up on, fetching and streaming workers
//! together, a hot key filling max_ack_pending, a restart fenced behind the killed one's
//! leases, and bad keys refused.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::time::Instant;

use crate::support::streams::EventStream;
use crate::support::{
    Deadline, GatewayProcess, Msg, Scrape, Setup, server_with_stream, sleep_past, wait_until,
};

use super::keys::{Seen, fetch_keys, key_of, next_message, publish_keyed};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_message_of_a_key_is_out_and_it_goes_on_in_stream_order() {
    let (_server, _js, gateway) = Setup::consumer("ordered")
        .ack_wait("2s")
        .flag("--ordering-key", "header")
        .start()
        .await;
    let a1 = publish_keyed(&gateway, Some("a"), "a1").await;
    let b1 = publish_keyed(&gateway, Some("b"), "b1").await;
    let a2 = publish_keyed(&gateway, Some("a"), "a2").await;
    let a3 = publish_keyed(&gateway, Some("a"), "a3").await;
    let b2 = publish_keyed(&gateway, Some("b"), "b2").await;
    let loose = publish_keyed(&gateway, None, "no key").await;
    let started = Instant::now();

    // The first pin holds keyed messages for a moment (nothing may be out elsewhere).
    let mut first = Vec::new();
    let deadline = Deadline::after("three messages are leased", Duration::from_secs(5));
    while first.len() < 3 {
        first.extend(gateway.fetch_n(10, 500).await);
        deadline.tick().await;
    }
    first.sort_by_key(|message| message.stream_sequence);
    let keys: Vec<(Option<String>, u64)> = first
        .iter()
        .map(|message| (key_of(message), message.stream_sequence))
        .collect();
    assert_eq!(
        keys,
        [
            (Some("a".into()), a1),
            (Some("b".into()), b1),
            (None, loose)
        ],
        "one message per key, and the one without a key"
    );
    let view = gateway.consumer_view().await;
    assert_eq!(view["ordering_key"], "header");
    assert_eq!(
        (view["held"].as_u64(), view["busy_keys"].as_u64()),
        (Some(3), Some(2))
    );
    let scrape = Scrape::of(&gateway).await;
    assert_eq!(scrape.get("ruststream_ordering_held"), 3.0);
    assert_eq!(scrape.get("ruststream_ordering_busy_keys"), 2.0);
    assert!(fetch_keys(&gateway, 300).await.is_empty(), "the rest waits");

    // A nak brings the same message back first, not the next of its key.
    assert_eq!(gateway.nak(&first[0].id, None).await, 204);
    let again = next_message(&gateway).await;
    assert_eq!((again.stream_sequence, again.delivered), (a1, 2));
    assert!(fetch_keys(&gateway, 300).await.is_empty());
    // An ack lets the key go on.
    assert_eq!(gateway.ack(&again.id).await, 204);
    let second = next_message(&gateway).await;
    assert_eq!((second.stream_sequence, second.delivered), (a2, 1));
    // So does a term.
    assert_eq!(gateway.term(&first[1].id, Some("bad")).await, 204);
    let b_next = next_message(&gateway).await;
    assert_eq!((b_next.stream_sequence, b_next.delivered), (b2, 1));
    assert_eq!(gateway.ack(&b_next.id).await, 204);
    assert_eq!(gateway.ack(&first[2].id).await, 204);

    // An expired lease brings the same message back, and its successor still waits.
    sleep_past(second.lease_expires(), Duration::from_millis(100)).await;
    let expired = next_message(&gateway).await;
    assert_eq!((expired.stream_sequence, expired.delivered), (a2, 2));
    assert_eq!(gateway.ack(&expired.id).await, 204);
    let last = next_message(&gateway).await;
    assert!(
        started.elapsed() > Duration::from_secs(2),
        "a3 was held past its ack_wait"
    );
    assert_eq!(
        (last.stream_sequence, last.delivered),
        (a3, 1),
        "held past its ack_wait, kept alive: never delivered again"
    );
    assert_eq!(gateway.ack(&last.id).await, 204);
    wait_until(
        "nothing held, no key busy",
        Duration::from_secs(5),
        || async {
            let view = gateway.consumer_view().await;
            view["held"] == 0 && view["busy_keys"] == 0
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_key_holds_back_no_other_key() {
    let (_server, js, gateway) = Setup::consumer("hotkey")
        .flag("--ordering-key", "subject:2")
        .start()
        .await;
    js.publish_many("orders.hot.created", 30, "hot").await;
    for customer in 0..5 {
        js.publish(&format!("orders.c{customer}.created"), "x")
            .await;
    }
    let got = gateway.fetch_n(10, 2000).await;
    let mut subjects: Vec<&str> = got.iter().map(|message| message.subject.as_str()).collect();
    subjects.sort_unstable();
    assert_eq!(
        subjects,
        [
            "orders.c0.created",
            "orders.c1.created",
            "orders.c2.created",
            "orders.c3.created",
            "orders.c4.created",
            "orders.hot.created"
        ],
        "the hot key's head and every other key, in one fetch"
    );
    assert_eq!(gateway.consumer_view().await["held"], 29);

    // A key longer than 1 KiB is no key: leased at once, unordered, and counted.
    let long = format!("orders.{}.created", "k".repeat(1025));
    js.publish(&long, "x").await;
    js.publish(&long, "y").await;
    // Both leased while neither is settled (a key would hold the second back). They may
    // come in two fetches: a fetch answered with what the gate released leaves its pull
    // open at the server for the next one, which can catch them one by one.
    let mut unordered = Vec::new();
    let deadline = Deadline::after("both messages of the over-long key", Duration::from_secs(5));
    while unordered.len() < 2 {
        unordered.extend(gateway.fetch_n(10, 1000).await);
        if unordered.len() < 2 {
            deadline.tick_seeing(unordered.len()).await;
        }
    }
    assert_eq!(
        unordered.len(),
        2,
        "both messages of the over-long key, neither settled"
    );
    assert_eq!(
        Scrape::of(&gateway)
            .await
            .get("ruststream_ordering_keys_rejected_total"),
        2.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_the_server_gives_up_on_lets_its_key_go_on() {
    let (_server, js, gateway) = Setup::consumer("sidelined")
        .max_deliver(1)
        .flag("--ordering-key", "subject:2")
        .start()
        .await;
    let first = js.publish("orders.k.1", "1").await;
    let second = js.publish("orders.k.2", "2").await;
    let head = next_message(&gateway).await;
    assert_eq!(head.stream_sequence, first);
    assert!(fetch_keys(&gateway, 300).await.is_empty(), "the next waits");
    // Its one delivery nak'd: max_deliver is reached, the server will not deliver it again.
    assert_eq!(gateway.nak(&head.id, None).await, 204);
    let next = next_message(&gateway).await;
    assert_eq!((next.stream_sequence, next.delivered), (second, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fetching_worker_and_a_streaming_one_never_hold_one_key_at_once() {
    let (_server, js, gateway) = Setup::consumer("workers")
        .flag("--ordering-key", "subject:2")
        .start()
        .await;
    const KEYS: usize = 6;
    const PER_KEY: usize = 8;
    for round in 0..PER_KEY {
        for key in 0..KEYS {
            js.publish(&format!("orders.k{key}.{round}"), "x").await;
        }
    }
    let total = KEYS * PER_KEY;
    let done = std::sync::Arc::new(tokio::sync::Mutex::new(Vec::<Seen>::new()));
    let fetcher = {
        let gateway = gateway.client().clone();
        let done = done.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(30);
            while done.lock().await.len() < total && Instant::now() < deadline {
                for message in gateway.fetch_n(3, 200).await {
                    let got = Instant::now();
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    let record = Seen::of(&message, got);
                    assert_eq!(gateway.ack(&message.id).await, 204);
                    done.lock().await.push(record);
                }
            }
        }
    };
    let streamer = {
        let gateway = gateway.client().clone();
        let done = done.clone();
        async move {
            let mut stream = EventStream::open(&gateway, "?max_in_flight=2").await;
            let deadline = Instant::now() + Duration::from_secs(30);
            while done.lock().await.len() < total && Instant::now() < deadline {
                let Some(message) = stream.message(Duration::from_millis(300)).await else {
                    continue;
                };
                let got = Instant::now();
                let message: Msg = serde_json::from_value(message).expect("a message");
                tokio::time::sleep(Duration::from_millis(5)).await;
                let record = Seen::of(&message, got);
                assert_eq!(gateway.ack(&message.id).await, 204);
                done.lock().await.push(record);
            }
        }
    };
    tokio::join!(fetcher, streamer);
    let mut done = std::mem::take(&mut *done.lock().await);
    assert_eq!(done.len(), total, "every message leased and acked once");
    done.sort_by_key(|seen| seen.got);
    let mut by_key: BTreeMap<String, Vec<&Seen>> = BTreeMap::new();
    for seen in &done {
        by_key.entry(seen.key.clone()).or_default().push(seen);
    }
    for (key, leases) in by_key {
        for pair in leases.windows(2) {
            assert!(
                pair[0].sequence < pair[1].sequence,
                "key {key}: {} leased after {}",
                pair[1].sequence,
                pair[0].sequence
            );
            assert!(
                pair[1].got >= pair[0].ack_sent,
                "key {key}: {} leased before {} was acked",
                pair[1].sequence,
                pair[0].sequence
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_key_filling_max_ack_pending_is_named_and_nothing_is_lost() {
    let (server, js) = server_with_stream().await;
    js.publish_many("orders.hot.created", 20, "hot").await;
    for customer in 0..4 {
        js.publish(&format!("orders.c{customer}.created"), "x")
            .await;
    }
    let mut gateway = Setup::consumer("crowded")
        .max_ack_pending(8)
        .flag("--ordering-key", "subject:2")
        .process(&server.url())
        .await;
    let head = next_message(&gateway).await;
    assert_eq!(head.subject, "orders.hot.created");
    // The next pull brings only the hot key's messages: held until max_ack_pending is full.
    assert!(fetch_keys(&gateway, 300).await.is_empty());
    let named = || {
        gateway
            .log()
            .lines()
            .any(|line| line.contains("WARN") && line.contains("hot (7 held)"))
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !named() {
        assert!(
            Instant::now() < deadline,
            "no WARN names the hot key:\n{}",
            gateway.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The other keys wait behind the held messages.
    assert!(fetch_keys(&gateway, 300).await.is_empty());
    assert_eq!(gateway.ack(&head.id).await, 204);
    let mut acked = vec![head.stream_sequence];
    let deadline = Deadline::after("every message is acked", Duration::from_secs(30));
    while acked.len() < 24 {
        for message in gateway.fetch_n(10, 300).await {
            assert_eq!(gateway.ack(&message.id).await, 204);
            acked.push(message.stream_sequence);
        }
        deadline
            .tick_seeing(format_args!("{} acked", acked.len()))
            .await;
    }
    acked.sort_unstable();
    acked.dedup();
    assert_eq!(acked, (1..=24).collect::<Vec<u64>>(), "each once");
    gateway.kill9();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_gateway_leases_nothing_of_a_key_before_what_the_killed_one_held() {
    let (server, js) = server_with_stream().await;
    let first = js.publish("orders.k.1", "1").await;
    let second = js.publish("orders.k.2", "2").await;
    let mut gateway = Setup::consumer("fenced")
        .ack_wait("2s")
        .flag("--ordering-key", "subject:2")
        .process(&server.url())
        .await;
    let head = next_message(&gateway).await;
    assert_eq!(head.stream_sequence, first);
    // The second is held by this process when it dies.
    assert!(fetch_keys(&gateway, 300).await.is_empty());
    wait_until("the second is held", Duration::from_secs(5), || async {
        gateway.consumer_view().await["held"] == 1
    })
    .await;
    gateway.kill9();
    let third = js.publish("orders.k.3", "3").await;
    gateway.restart().await;
    let mut order = Vec::new();
    while order.len() < 3 {
        let message = next_message(&gateway).await;
        order.push(message.stream_sequence);
        assert_eq!(gateway.ack(&message.id).await, 204);
    }
    assert_eq!(
        order,
        [first, second, third],
        "the new message waited for the ones the killed gateway held"
    );
    gateway.kill9();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_ordering_keys_are_refused() {
    let (server, _js) = server_with_stream().await;
    let mut refused = GatewayProcess::spawn(
        &Setup::consumer("badkey").flag("--ordering-key", "subject:0"),
        &server.url(),
    );
    let status = refused.wait_exit(Duration::from_secs(10)).await;
    assert_eq!(status.code(), Some(2), "{}", refused.log());
    assert!(refused.log().contains("subject:0"), "{}", refused.log());

    let dir = tempfile::tempdir().expect("a temp dir");
    let path = dir.path().join("consumers.toml");
    std::fs::write(
        &path,
        "[[consumer]]\nstream = \"ORDERS\"\nname = \"keyed\"\nordering_key = \"header:\"\n",
    )
    .expect("write the consumers file");
    let mut refused = GatewayProcess::spawn(
        &Setup::defaults().flag("--consumers-file", path.display().to_string()),
        &server.url(),
    );
    let status = refused.wait_exit(Duration::from_secs(10)).await;
    assert_eq!(status.code(), Some(2), "{}", refused.log());
    assert!(refused.log().contains("ordering_key"), "{}", refused.log());

    let gateway = Setup::consumer("keys").ready(&server.url()).await;
    for (key, why) in [(json!(""), "empty"), (json!("k".repeat(1025)), "too long")] {
        let reply = gateway
            .post(
                "/publish",
                Some(&json!({"subject": "orders.x", "data": "x", "ordering_key": key})),
            )
            .await;
        assert_eq!(reply.status, 422, "{why}: {}", reply.text);
        reply.assert_invalid("ordering_key");
    }
    let _: Value = gateway.consumer_view().await;
}
