//! 2 000 concurrent long polls (four times the server's 512 waiting pulls per consumer) are all
//! answered 200, and the messages published meanwhile go to exactly one fetch each.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::{Value, json};

use crate::support::client::http_client;
use crate::support::{STREAM, Setup, wait_until};

const POLLS: usize = 2000;
const MESSAGES: usize = 50;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_thousand_concurrent_long_polls_are_all_served() {
    let (_server, js, gateway) = Setup::consumer("crowd").ack_wait("60s").start().await;
    let http = http_client();
    let url = gateway.url("/fetch");

    let mut polls = Vec::with_capacity(POLLS);
    for _ in 0..POLLS {
        let http = http.clone();
        let url = url.clone();
        polls.push(tokio::spawn(async move {
            let response = http
                .post(url)
                .json(&json!({ "batch": 1, "wait_ms": 4000 }))
                .send()
                .await
                .map_err(|err| format!("request failed: {err}"))?;
            let status = response.status().as_u16();
            let body: Value = response
                .json()
                .await
                .map_err(|err| format!("body failed: {err}"))?;
            Ok::<_, String>((status, body))
        }));
    }
    // Publish once the polls wait: the gateway has a good part of its pulls open for them.
    wait_until(
        "the polls wait at the server",
        Duration::from_secs(10),
        || async { js.consumer_info(STREAM, "crowd").await.num_waiting >= 128 },
    )
    .await;
    let published = js.publish_many("orders.1", MESSAGES, "crowd").await;

    let mut handed_out: HashMap<u64, usize> = HashMap::new();
    let mut failures = Vec::new();
    for poll in polls {
        match poll.await.expect("poll task") {
            Ok((200, body)) => {
                for message in body["messages"].as_array().expect("messages") {
                    let sequence = message["stream_sequence"].as_u64().expect("sequence");
                    *handed_out.entry(sequence).or_default() += 1;
                }
            }
            Ok((status, body)) => failures.push(format!("{status}: {body}")),
            Err(err) => failures.push(err),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {POLLS} polls failed, e.g. {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );

    // Anything the polls missed must still come to the next fetches, never be lost. Under
    // load a delivery can reach the gateway after its poll ended; it is then held or nak'd
    // and redelivered, so keep fetching (with a deadline) rather than trusting one fetch.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while handed_out.len() < published.len() && tokio::time::Instant::now() < deadline {
        for message in gateway.fetch_n(100, 1000).await {
            *handed_out.entry(message.stream_sequence).or_default() += 1;
        }
    }
    let twice: Vec<_> = handed_out.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        twice.is_empty(),
        "messages handed out more than once: {twice:?}"
    );
    let mut sequences: Vec<u64> = handed_out.into_keys().collect();
    sequences.sort_unstable();
    assert_eq!(
        sequences, published,
        "every message handed out exactly once"
    );
}
