//! The pacing of pushes: a `Retry-After` holding every request (and what it catches kept
//! leased), the window shrinking and growing back, the rate limit, and a hanging endpoint
//! holding back nothing else.

use std::time::Duration;

use tokio::time::Instant;

use crate::support::endpoint::{Endpoint, Received, Reply};
use crate::support::{STREAM, assert_stays, server_with_stream, wait_until, with_consumers_file};

use super::fixtures::{PUSHED, delivered, entry, payload, push_view, wait_all_settled};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_holds_back_every_request_to_the_endpoint() {
    let (server, js) = server_with_stream().await;
    let endpoint = Endpoint::start().await;
    endpoint.answer(|request, index| {
        if index == 0 {
            Reply::status(429).header("Retry-After", "2")
        } else {
            let _ = request;
            Reply::status(204)
        }
    });
    let (gateway, _dir) = with_consumers_file(&server, &entry(PUSHED, &endpoint.url, "")).await;
    js.publish("orders.1", "first").await;
    let refused = endpoint.wait_for(1, Duration::from_secs(10)).await[0].at;
    // Another message, published right after the refusal, waits out the Retry-After too.
    js.publish("orders.1", "second").await;
    wait_until(
        "the consumer says it backs off",
        Duration::from_secs(1),
        || async { push_view(&gateway).await["push"]["state"] == "backing_off" },
    )
    .await;
    assert_eq!(
        push_view(&gateway).await["push"]["last_failure"]["status"],
        429
    );
    let received = endpoint.wait_for(3, Duration::from_secs(10)).await;
    for request in &received[1..] {
        assert!(
            request.at.duration_since(refused) >= Duration::from_millis(1900),
            "a request {:?} after a Retry-After: 2",
            request.at.duration_since(refused)
        );
    }
    wait_all_settled(&gateway).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_window_halves_on_refusals_and_grows_back_on_successes() {
    let (server, js) = server_with_stream().await;
    let endpoint = Endpoint::start().await;
    endpoint.answer(|_, index| {
        if index < 8 {
            Reply::status(429).after(Duration::from_millis(20))
        } else {
            Reply::status(204).after(Duration::from_millis(20))
        }
    });
    let (gateway, _dir) = with_consumers_file(&server, &entry(PUSHED, &endpoint.url, "")).await;
    js.publish_many("orders.1", 40, "m").await;
    let mut smallest = u64::MAX;
    let started = Instant::now();
    loop {
        let view = push_view(&gateway).await;
        if let Some(window) = view["push"]["window"].as_u64() {
            smallest = smallest.min(window);
        }
        if view["num_ack_pending"] == 0 && view["num_pending"] == 0 {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(20), "{view}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(smallest, 1, "the window came down to one");
    let grown = push_view(&gateway).await["push"]["window"]
        .as_u64()
        .expect("window");
    assert!(grown >= 3, "the window grew back: {grown}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_caught_while_a_retry_after_holds_is_kept_leased_and_pushed_as_its_first_delivery()
 {
    let (server, js) = server_with_stream().await;
    let endpoint = Endpoint::start().await;
    // The first request is answered late enough for the worker to be waiting patiently for
    // the next message (after a second with nothing), and refused with a hold longer than
    // ack_wait: what that wait catches must be kept leased until the hold ends.
    endpoint.answer(|_, index| {
        if index == 0 {
            Reply::status(503)
                .header("Retry-After", "6")
                .after(Duration::from_millis(2500))
        } else {
            Reply::status(204)
        }
    });
    let file = format!(
        "[[consumer]]\nstream = \"{STREAM}\"\nname = \"{PUSHED}\"\nack_wait = \"4s\"\n\n[consumer.push]\nurl = \"{}\"\ntimeout = \"3s\"\nretry_initial = \"100ms\"\nretry_max = \"200ms\"\n",
        endpoint.url
    );
    let (gateway, _dir) = with_consumers_file(&server, &file).await;
    js.publish("orders.1", "refused").await;
    endpoint.wait_for(1, Duration::from_secs(10)).await;
    wait_until(
        "the endpoint's Retry-After holds the pushes",
        Duration::from_secs(10),
        || async { push_view(&gateway).await["push"]["state"] == "backing_off" },
    )
    .await;
    let held_from = Instant::now();
    js.publish("orders.1", "caught").await;
    let received = endpoint.wait_for(3, Duration::from_secs(20)).await;
    let caught: Vec<&Received> = received
        .iter()
        .filter(|request| payload(request) == "caught")
        .collect();
    assert_eq!(caught.len(), 1, "pushed once: {received:?}");
    assert_eq!(
        delivered(caught[0]),
        1,
        "its first delivery reached the endpoint"
    );
    assert!(
        caught[0].at.duration_since(held_from) >= Duration::from_secs(3),
        "sent after the hold"
    );
    wait_all_settled(&gateway).await;
    assert_stays("nothing pushed again", Duration::from_secs(1), || async {
        endpoint.received().len() == 3
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_endpoint_holds_back_neither_another_push_consumer_nor_a_fetch() {
    let (server, js) = server_with_stream().await;
    let hanging = Endpoint::start().await;
    hanging.answer(|_, _| Reply::status(204).after(Duration::from_secs(15)));
    let answering = Endpoint::start().await;
    let file = format!(
        "{}{}",
        entry("stuck", &hanging.url, "timeout = \"10s\""),
        entry("quick", &answering.url, "")
    );
    let (gateway, _dir) = with_consumers_file(&server, &file).await;
    js.publish("orders.1", "for everyone").await;
    hanging.wait_for(1, Duration::from_secs(10)).await;
    // While the first endpoint holds its request, the other consumer's push and a fetch of
    // the default consumer go on.
    let received = answering.wait_for(1, Duration::from_secs(5)).await;
    assert_eq!(payload(&received[0]), "for everyone");
    let fetched = gateway.fetch_n(1, 0).await;
    assert_eq!(fetched.len(), 1, "the default consumer's fetch");
    assert_eq!(
        hanging.received().len(),
        1,
        "the hanging push is still in flight"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rate_limit_and_a_retry_after_date_pace_the_requests() {
    let (server, js) = server_with_stream().await;
    let endpoint = Endpoint::start().await;
    endpoint.answer(|request, index| {
        if index == 0 {
            // An HTTP date two seconds ahead (whole seconds: at least one second away).
            let at = std::time::SystemTime::now() + Duration::from_secs(2);
            Reply::status(503).header("Retry-After", &httpdate::fmt_http_date(at))
        } else {
            let _ = request;
            Reply::status(204)
        }
    });
    let (gateway, _dir) =
        with_consumers_file(&server, &entry(PUSHED, &endpoint.url, "rate_limit = 20")).await;
    js.publish("orders.1", "refused first").await;
    let refused = endpoint.wait_for(1, Duration::from_secs(10)).await[0].at;
    js.publish_many("orders.1", 30, "paced").await;
    let received = endpoint.wait_for(32, Duration::from_secs(15)).await;
    assert!(
        received[1].at.duration_since(refused) >= Duration::from_millis(900),
        "the next request came {:?} after a Retry-After date",
        received[1].at.duration_since(refused)
    );
    // At most 20 a second (and a burst of two): no second holds more than 22 requests.
    for (at, request) in received.iter().enumerate().skip(1) {
        let within = received[at..]
            .iter()
            .take_while(|later| later.at.duration_since(request.at) < Duration::from_secs(1))
            .count();
        assert!(
            within <= 22,
            "{within} requests within a second of request {at}"
        );
    }
    wait_all_settled(&gateway).await;
}
