//! The gateway's NATS connection lost: waiting long polls learn of it at once (503 with
//! `Retry-After`), so a client behind a load balancer can try a connected replica instead
//! of sleeping through its whole wait.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::support::{Scrape, Setup, wait_until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_polls_answer_503_with_retry_after_when_nats_goes_away() {
    let (mut server, _js, gateway) = Setup::consumer("outage-polls").start().await;
    const POLLS: usize = 20;
    let polls: Vec<_> = (0..POLLS)
        .map(|_| {
            let client = gateway.client().clone();
            tokio::spawn(async move {
                let reply = client
                    .fetch_reply(Some(&json!({ "batch": 1, "wait_ms": 25_000 })))
                    .await;
                (reply, Instant::now())
            })
        })
        .collect();
    wait_until(
        "every poll waits in the gateway",
        Duration::from_secs(10),
        || async {
            Scrape::of(&gateway)
                .await
                .get("ruststream_fetches_in_progress")
                == POLLS as f64
        },
    )
    .await;

    let killed = Instant::now();
    server.kill();
    for poll in polls {
        let (reply, answered) = poll.await.expect("poll task");
        reply.assert_problem(503);
        assert_eq!(
            reply.headers.get("retry-after").map(|v| v.as_bytes()),
            Some(&b"1"[..]),
            "Retry-After on the 503: {:?}",
            reply.headers
        );
        let after = answered.saturating_duration_since(killed);
        assert!(
            after < Duration::from_secs(5),
            "answered {after:?} after the connection was lost, not at the end of its 25 s wait"
        );
    }
}
