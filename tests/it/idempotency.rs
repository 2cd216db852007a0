//! Retry-safe fetch: `POST /fetch` repeated with the same `Idempotency-Key` while its leases
//! are live answers with the same leases; the same key with another body is a 422.

use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

use crate::support::{Gateway, Reply, Scrape, Setup, server_ack_pending, sleep_past, wait_until};

async fn fetch_with_key(gateway: &Gateway, key: &str, auth: Option<&str>, body: &Value) -> Reply {
    let mut request = gateway
        .http
        .post(gateway.url("/fetch"))
        .header("Idempotency-Key", key)
        .json(body);
    if let Some(auth) = auth {
        request = request.header("Authorization", auth);
    }
    Reply::read(request.send().await.expect("POST /fetch")).await
}

fn replayed(reply: &Reply) -> bool {
    reply
        .headers
        .get("idempotent-replayed")
        .is_some_and(|value| value == "true")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_fetch_returns_the_same_leases_while_they_are_live() {
    let (_server, js, gateway) = Setup::consumer("retry").ack_wait("30s").start().await;
    js.publish_many("orders.1", 3, "m").await;
    let request = json!({ "batch": 2, "wait_ms": 1000, "encoding": "utf8" });

    let first = fetch_with_key(&gateway, "order-batch-1", None, &request).await;
    assert_eq!(first.status, 200, "{}", first.text);
    assert!(!replayed(&first));
    let leased = first.messages();
    assert_eq!(leased.len(), 2);

    let again = fetch_with_key(&gateway, "order-batch-1", None, &request).await;
    assert_eq!(again.status, 200, "{}", again.text);
    assert!(replayed(&again), "a replay says so: {:?}", again.headers);
    assert_eq!(again.body, first.body, "the same leases, ids and messages");
    assert_eq!(
        server_ack_pending(&js, &gateway).await,
        2,
        "nothing more leased"
    );

    // The third message is still there for anyone else.
    let other = gateway.fetch_n(10, 1000).await;
    assert_eq!(other.len(), 1);
    assert_eq!(gateway.ack(&other[0].id).await, 204);

    // One lease settled, one live: still the same answer; settling again keeps its answer.
    assert_eq!(gateway.ack(&leased[0].id).await, 204);
    let after_one = fetch_with_key(&gateway, "order-batch-1", None, &request).await;
    assert_eq!(after_one.body, first.body);
    assert_eq!(
        gateway.ack(&leased[0].id).await,
        204,
        "retrying the ack is safe"
    );

    // Every lease ended: the key is free and fetches afresh.
    assert_eq!(gateway.nak(&leased[1].id, None).await, 204);
    let fresh = fetch_with_key(&gateway, "order-batch-1", None, &request).await;
    assert_eq!(fresh.status, 200, "{}", fresh.text);
    assert!(!replayed(&fresh));
    let fresh = fresh.messages();
    assert_eq!(fresh.len(), 1, "the nak'd message, redelivered");
    assert_eq!(fresh[0].stream_sequence, leased[1].stream_sequence);
    assert_ne!(fresh[0].id, leased[1].id);
    assert_eq!(gateway.ack(&fresh[0].id).await, 204);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_key_with_a_different_body_is_422() {
    let (_server, js, gateway) = Setup::consumer("mismatch").start().await;
    js.publish("orders.1", "x").await;
    let first = fetch_with_key(
        &gateway,
        "k-1",
        None,
        &json!({ "batch": 1, "wait_ms": 1000 }),
    )
    .await;
    assert_eq!(first.messages().len(), 1);
    fetch_with_key(
        &gateway,
        "k-1",
        None,
        &json!({ "batch": 5, "wait_ms": 1000 }),
    )
    .await
    .assert_invalid("Idempotency-Key");
    // Defaults are the same request: `{"batch": 1, "wait_ms": 1000, "encoding": "base64"}`.
    let same = fetch_with_key(
        &gateway,
        "k-1",
        None,
        &json!({ "batch": 1, "wait_ms": 1000, "encoding": "base64" }),
    )
    .await;
    assert_eq!(same.body, first.body);
    for bad in ["", &"k".repeat(256)] {
        fetch_with_key(&gateway, bad, None, &json!({ "batch": 1 }))
            .await
            .assert_invalid("Idempotency-Key");
    }
}

/// `POST /fetch` with `key` in a task of its own; its answer as JSON.
fn spawn_keyed_fetch(gateway: &Gateway, key: &'static str, request: &Value) -> JoinHandle<Value> {
    let url = gateway.url("/fetch");
    let http = gateway.http.clone();
    let request = request.clone();
    tokio::spawn(async move {
        let response = http
            .post(url)
            .header("Idempotency-Key", key)
            .json(&request)
            .send()
            .await
            .expect("POST /fetch");
        response.json::<Value>().await.expect("json")
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeat_while_the_first_still_waits_gets_the_first_answer() {
    let (_server, js, gateway) = Setup::consumer("concurrent-retry").start().await;
    let request = json!({ "batch": 5, "wait_ms": 8000 });
    let first = spawn_keyed_fetch(&gateway, "slow", &request);
    wait_until(
        "the first fetch waits at the server",
        Duration::from_secs(10),
        || async {
            js.consumer_info(&gateway.stream, &gateway.consumer)
                .await
                .num_waiting
                >= 1
        },
    )
    .await;
    let repeat = spawn_keyed_fetch(&gateway, "slow", &request);
    // The repeat waits in the gateway for the first's answer before anything is published.
    wait_until(
        "the repeat waits beside the first",
        Duration::from_secs(10),
        || async {
            Scrape::of(&gateway)
                .await
                .get("ruststream_fetches_in_progress")
                == 2.0
        },
    )
    .await;
    js.publish_many("orders.1", 2, "m").await;
    let first = first.await.expect("first");
    let repeat = repeat.await.expect("repeat");
    let messages = first["messages"].as_array().expect("messages");
    assert!(!messages.is_empty(), "{first}");
    assert_eq!(repeat, first, "the repeat carries the first's leases");
    let leased: usize = messages.len();
    assert_eq!(server_ack_pending(&js, &gateway).await, leased);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_are_scoped_by_credential() {
    let (_server, js, gateway) = Setup::consumer("scoped").start().await;
    js.publish_many("orders.1", 2, "m").await;
    let request = json!({ "batch": 1, "wait_ms": 1000 });
    let alice = fetch_with_key(&gateway, "same", Some("Bearer alice"), &request).await;
    let bob = fetch_with_key(&gateway, "same", Some("Bearer bob"), &request).await;
    let alice = alice.messages();
    let bob = bob.messages();
    assert_eq!((alice.len(), bob.len()), (1, 1));
    assert_ne!(
        alice[0].stream_sequence, bob[0].stream_sequence,
        "another credential's key does not reveal its leases"
    );
}

/// A key is forgotten once the leases of its answer expired: the same request then fetches
/// afresh (the expired message, redelivered under a new id), not the old answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_is_released_when_its_leases_expire() {
    let (_server, js, gateway) = Setup::consumer("key-expiry").ack_wait("1s").start().await;
    js.publish("orders.1", "x").await;
    let request = json!({ "batch": 1, "wait_ms": 1000 });
    let first = fetch_with_key(&gateway, "expiring", None, &request).await;
    let leased = first.messages();
    assert_eq!(leased.len(), 1);
    let again = fetch_with_key(&gateway, "expiring", None, &request).await;
    assert!(replayed(&again), "still live: the same answer");

    // The condition is the time: past the lease's end.
    sleep_past(leased[0].lease_expires(), Duration::from_millis(100)).await;
    let fresh = fetch_with_key(
        &gateway,
        "expiring",
        None,
        &json!({ "batch": 1, "wait_ms": 5000 }),
    )
    .await;
    assert_eq!(fresh.status, 200, "{}", fresh.text);
    assert!(!replayed(&fresh), "the key was released with the expiry");
    let fresh = fresh.messages();
    assert_eq!(fresh.len(), 1, "the message, redelivered");
    assert_eq!(fresh[0].stream_sequence, leased[0].stream_sequence);
    assert_eq!(fresh[0].delivered, 2);
    assert_ne!(fresh[0].id, leased[0].id);
}

/// A first answer is kept even when its client hangs up without reading it: the retry with
/// the same key gets those very leases (replayed) instead of stranding them until ack_wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_whose_client_hung_up_unread_is_kept_for_the_retry() {
    let (_server, js, gateway) = Setup::consumer("unread").ack_wait("30s").start().await;
    let body = json!({ "batch": 1, "wait_ms": 10_000 });
    let text = body.to_string();
    let addr = gateway.base().trim_start_matches("http://").to_string();
    let mut socket = TcpStream::connect(&addr).await.expect("connect to gateway");
    let request = format!(
        "POST /fetch HTTP/1.1\r\nHost: {addr}\r\nIdempotency-Key: unread\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{text}",
        text.len()
    );
    socket
        .write_all(request.as_bytes())
        .await
        .expect("send the keyed fetch");
    wait_until(
        "the keyed fetch waits at the server",
        Duration::from_secs(10),
        || async {
            js.consumer_info(&gateway.stream, &gateway.consumer)
                .await
                .num_waiting
                >= 1
        },
    )
    .await;
    let sequence = js.publish("orders.1", "answered, never read").await;
    wait_until(
        "the gateway leased the message to the keyed fetch",
        Duration::from_secs(10),
        || async { gateway.leases_in_flight().await == 1 },
    )
    .await;
    drop(socket);

    let retry = fetch_with_key(&gateway, "unread", None, &body).await;
    assert_eq!(retry.status, 200, "{}", retry.text);
    assert!(
        replayed(&retry),
        "the first answer, replayed: {:?}",
        retry.headers
    );
    let messages = retry.messages();
    assert_eq!(messages.len(), 1, "{}", retry.text);
    assert_eq!(messages[0].stream_sequence, sequence);
    assert_eq!(
        messages[0].delivered, 1,
        "the same delivery, not a redelivery"
    );
    assert_eq!(gateway.ack(&messages[0].id).await, 204, "its lease is live");
    assert_eq!(server_ack_pending(&js, &gateway).await, 0);
}
