//! Ordering per key across replicas and delivery modes: the pinned replica and a killed one
//! handing over, push one message of a key at a time, a SIGTERM'd pin handed over before its
//! timeout, and an existing consumer made ordered when its gateway restarts with a key.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::json;
use tokio::time::Instant;

use crate::support::streams::EventStream;
use crate::support::{Setup, server_with_stream, wait_until};

use super::keys::{assert_ordered, drain_in_turn, fetch_keys, next_message};

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
