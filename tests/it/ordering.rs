//! Ordering per key: at most one message of a key out at a time, a key's messages in stream
//! order through naks, expiries and terms, nothing of other keys held back, held messages
//! kept alive, a restarted gateway fenced behind what the killed one held, and bad specs
//! refused.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::time::Instant;

use crate::support::streams::EventStream;
use crate::support::{
    Client, Deadline, GatewayProcess, Msg, Scrape, Setup, server_with_stream, sleep_past,
    wait_until,
};

/// The message's ordering key, as `POST /publish` wrote it.
fn key_of(message: &Msg) -> Option<String> {
    let value = message.headers.get("Ruststream-Ordering-Key")?;
    let value = value
        .as_array()
        .and_then(|values| values.first())
        .unwrap_or(value);
    value.as_str().map(str::to_owned)
}

async fn publish_keyed(gateway: &Client, key: Option<&str>, data: &str) -> u64 {
    let mut body = json!({"subject": "orders.created", "data": data});
    if let Some(key) = key {
        body["ordering_key"] = json!(key);
    }
    let reply = gateway.post("/publish", Some(&body)).await;
    assert_eq!(reply.status, 201, "publish: {}", reply.text);
    reply.body["sequence"].as_u64().expect("a sequence")
}

/// What one fetch brings within `wait_ms`, as (key, stream sequence, delivered).
async fn fetch_keys(gateway: &Client, wait_ms: u64) -> Vec<(Option<String>, u64, u64)> {
    gateway
        .fetch_n(10, wait_ms)
        .await
        .iter()
        .map(|message| (key_of(message), message.stream_sequence, message.delivered))
        .collect()
}

/// Fetch until a message comes (within 10 s).
async fn next_message(gateway: &Client) -> Msg {
    let deadline = Deadline::after("a message is leased", Duration::from_secs(10));
    loop {
        if let Some(message) = gateway.fetch_n(1, 500).await.into_iter().next() {
            return message;
        }
        deadline.tick().await;
    }
}

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

/// One lease as a worker saw it: when it came, and when its ack was sent.
struct Seen {
    key: String,
    sequence: u64,
    got: Instant,
    ack_sent: Instant,
}

impl Seen {
    /// `message`, got at `got`, its ack about to be sent (its key: the subject's 2nd token).
    fn of(message: &Msg, got: Instant) -> Self {
        Self {
            key: message
                .subject
                .split('.')
                .nth(1)
                .unwrap_or_default()
                .to_owned(),
            sequence: message.stream_sequence,
            got,
            ack_sent: Instant::now(),
        }
    }
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

/// Fetch from `gateways` in turn (a balancer without sticky sessions) and ack each message
/// at the other one, until `total` are acked; returns (key, sequence, got, ack sent) per
/// lease, in the order they were leased.
async fn drain_in_turn(gateways: &[&Client], total: usize, within: Duration) -> Vec<Seen> {
    let mut done: Vec<Seen> = Vec::new();
    let deadline = Deadline::after("every message is acked", within);
    let mut turn = 0;
    while done.len() < total {
        let (fetching, settling) = (
            gateways[turn % gateways.len()],
            gateways[(turn + 1) % gateways.len()],
        );
        turn += 1;
        let reply = fetching
            .fetch_reply(Some(&json!({"batch": 5, "wait_ms": 300})))
            .await;
        if reply.status == 503 {
            // The pin moving (a replica killed): asked again, as a client would.
            tokio::time::sleep(Duration::from_millis(100)).await;
            deadline.tick().await;
            continue;
        }
        assert_eq!(reply.status, 200, "{}", reply.text);
        let fetched = reply.messages();
        let got = Instant::now();
        for message in fetched {
            let seen = Seen::of(&message, got);
            assert_eq!(settling.ack(&message.id).await, 204);
            done.push(seen);
        }
        deadline
            .tick_seeing(format_args!("{} of {total} acked", done.len()))
            .await;
    }
    done
}

/// Per key: stream order, and no lease before the one before it was acked.
fn assert_ordered(done: &[Seen]) {
    let mut by_key: BTreeMap<&str, Vec<&Seen>> = BTreeMap::new();
    for seen in done {
        by_key.entry(seen.key.as_str()).or_default().push(seen);
    }
    for (key, leases) in by_key {
        for pair in leases.windows(2) {
            assert!(
                pair[0].sequence < pair[1].sequence && pair[1].got >= pair[0].ack_sent,
                "key {key}: {} leased after {} (or before it was acked)",
                pair[1].sequence,
                pair[0].sequence
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_lease_an_ordered_consumer_through_the_pinned_one_and_a_killed_one_hands_over() {
    let (server, js) = server_with_stream().await;
    let key = crate::support::shared_key();
    let setup = Setup::consumer("pinned")
        .ack_wait("3s")
        .lease_key_file(key.path())
        .flag("--ordering-key", "subject:2");
    let mut a = setup.process(&server.url()).await;
    let mut b = setup.process(&server.url()).await;
    for round in 0..4 {
        for customer in 0..4 {
            js.publish(&format!("orders.c{customer}.{round}"), "x")
                .await;
        }
    }
    let info = js.consumer_info(crate::support::STREAM, "pinned").await;
    assert_eq!(
        serde_json::to_value(&info.config.priority_policy).ok(),
        Some(json!("pinned_client"))
    );
    let done = drain_in_turn(&[&a, &b], 16, Duration::from_secs(30)).await;
    assert_ordered(&done);
    let views = [a.consumer_view().await, b.consumer_view().await];
    let pinned: Vec<bool> = views
        .iter()
        .map(|view| {
            view["replicas"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|replica| replica["this_replica"] == true && replica["pinned"] == true)
        })
        .collect();
    assert_eq!(
        pinned.iter().filter(|pinned| **pinned).count(),
        1,
        "one replica is pinned: {views:?}"
    );

    // A stream at the replica not pinned is fed by the pinned one, within its credit,
    // which a settle at the pinned replica gives back.
    let (pinned, other) = if pinned[0] {
        (&mut a, &mut b)
    } else {
        (&mut b, &mut a)
    };
    let mut stream = EventStream::open(other, "?max_in_flight=1").await;
    js.publish("orders.s1.0", "x").await;
    js.publish("orders.s2.0", "x").await;
    let first = stream
        .message(Duration::from_secs(5))
        .await
        .expect("the stream at the replica not pinned gets a message");
    assert!(
        stream.message(Duration::from_millis(700)).await.is_none(),
        "max_in_flight 1 holds"
    );
    let id = first["id"].as_str().expect("an id");
    assert_eq!(pinned.ack(id).await, 204);
    let second = stream
        .message(Duration::from_secs(5))
        .await
        .expect("credit given back by a settle at the pinned replica");
    assert_eq!(pinned.ack(second["id"].as_str().expect("an id")).await, 204);
    drop(stream);

    // The pinned replica dies holding a lease and held messages; the other takes over
    // and each key goes on in order, nothing lost.
    for round in 4..7 {
        for customer in 0..4 {
            js.publish(&format!("orders.c{customer}.{round}"), "x")
                .await;
        }
    }
    let leased = pinned.fetch_n(2, 1000).await;
    assert!(!leased.is_empty());
    pinned.kill9();
    let mut after = drain_in_turn(&[&*other], 12, Duration::from_secs(40)).await;
    assert_ordered(&after);
    after.sort_by_key(|seen| seen.sequence);
    assert_eq!(
        after.iter().map(|seen| seen.sequence).collect::<Vec<_>>(),
        (19..=30).collect::<Vec<u64>>(),
        "every message once, the killed replica's leases included"
    );
    other.kill9();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_delivers_a_key_one_message_at_a_time_in_order_retrying_its_head_first() {
    use crate::support::endpoint::{Endpoint, Reply};
    let (server, js) = server_with_stream().await;
    let endpoint = Endpoint::start().await;
    const ANSWER_AFTER: Duration = Duration::from_millis(30);
    // The first attempt of each key's first message fails: it is retried before the
    // key's next.
    endpoint.answer(|received, _| {
        let body = received.json();
        let first_of_key = body["subject"]
            .as_str()
            .is_some_and(|subject| subject.ends_with(".0"));
        let first_attempt = received
            .headers
            .get("ruststream-delivered")
            .is_some_and(|value| value == "1");
        if first_of_key && first_attempt {
            Reply::status(500)
        } else {
            Reply::status(204).after(ANSWER_AFTER)
        }
    });
    let file = format!(
        "[[consumer]]\nstream = \"ORDERS\"\nname = \"pushed\"\nordering_key = \"subject:2\"\n\n[consumer.push]\nurl = \"{}\"\nretry_initial = \"100ms\"\nretry_max = \"200ms\"\n",
        endpoint.url
    );
    let (_gateway, _dir) = crate::support::with_consumers_file(&server, &file).await;
    for round in 0..4 {
        for key in 0..3 {
            js.publish(&format!("orders.p{key}.{round}"), "x").await;
        }
    }
    // 12 successes and the 3 failed first attempts.
    let received = endpoint.wait_for(15, Duration::from_secs(20)).await;
    let mut by_key: BTreeMap<String, Vec<(u64, u64, Instant)>> = BTreeMap::new();
    for request in &received {
        let body = request.json();
        let subject = body["subject"].as_str().expect("a subject");
        let key = subject.split('.').nth(1).expect("a key").to_owned();
        let round: u64 = subject
            .rsplit('.')
            .next()
            .and_then(|round| round.parse().ok())
            .expect("a round");
        let delivered = body["delivered"].as_u64().expect("delivered");
        by_key
            .entry(key)
            .or_default()
            .push((round, delivered, request.at));
    }
    for (key, pushes) in by_key {
        let order: Vec<(u64, u64)> = pushes
            .iter()
            .map(|(round, delivered, _)| (*round, *delivered))
            .collect();
        assert_eq!(
            order,
            [(0, 1), (0, 2), (1, 1), (2, 1), (3, 1)],
            "key {key}: its head retried first, then the rest in order"
        );
        for pair in pushes.windows(2).skip(1) {
            assert!(
                pair[1].2 >= pair[0].2 + ANSWER_AFTER,
                "key {key}: the next was pushed before the one before it was answered"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_replica_stopped_with_sigterm_hands_the_pin_over_before_its_timeout() {
    let (server, js) = server_with_stream().await;
    let key = crate::support::shared_key();
    let setup = Setup::consumer("handover")
        .lease_key_file(key.path())
        .flag("--ordering-key", "subject:2");
    let mut a = setup.process(&server.url()).await;
    let b = setup.process(&server.url()).await;
    js.publish("orders.h1.0", "x").await;
    let first = next_message(&a).await;
    assert_eq!(a.ack(&first.id).await, 204);
    wait_until("b sees a pinned", Duration::from_secs(10), || async {
        b.consumer_view().await["replicas"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|replica| replica["this_replica"] == false && replica["pinned"] == true)
    })
    .await;
    let status = a.terminate(Duration::from_secs(20)).await;
    assert!(status.success(), "{}", a.log());
    assert!(a.log().contains("gave up the pin"), "{}", a.log());
    let stopped = Instant::now();
    js.publish("orders.h1.1", "x").await;
    let next = next_message(&b).await;
    assert_eq!(next.subject, "orders.h1.1");
    assert!(
        stopped.elapsed() < Duration::from_secs(4),
        "taken over in {:?}, not after the 5 s pin timeout",
        stopped.elapsed()
    );
    assert_eq!(b.ack(&next.id).await, 204);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_existing_consumer_is_made_ordered_when_its_gateway_restarts_with_a_key() {
    let (server, js) = server_with_stream().await;
    let mut gateway = Setup::consumer("converted").process(&server.url()).await;
    js.publish("orders.c1.0", "x").await;
    let first = next_message(&gateway).await;
    assert_eq!(gateway.ack(&first.id).await, 204);
    let status = gateway.terminate(Duration::from_secs(20)).await;
    assert!(status.success());
    let gateway = Setup::consumer("converted")
        .flag("--ordering-key", "subject:2")
        .ready(&server.url())
        .await;
    let info = js.consumer_info(crate::support::STREAM, "converted").await;
    assert_eq!(
        serde_json::to_value(&info.config.priority_policy).ok(),
        Some(json!("pinned_client"))
    );
    js.publish("orders.c1.1", "x").await;
    js.publish("orders.c1.2", "x").await;
    let next = next_message(&gateway).await;
    assert_eq!(next.subject, "orders.c1.1");
    assert!(fetch_keys(&gateway, 300).await.is_empty(), "c1.2 waits");
    assert_eq!(gateway.ack(&next.id).await, 204);
    assert_eq!(next_message(&gateway).await.subject, "orders.c1.2");
}
