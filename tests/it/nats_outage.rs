//! The gateway's NATS connection lost: waiting long polls learn of it at once (503 with
//! `Retry-After`), so a client behind a load balancer can try a connected replica instead
//! of sleeping through its whole wait; a settle waiting for its confirmation is answered
//! (504) when the connection drops, not at the end of `--settle-timeout`.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::support::{Action, Scrape, Setup, assert_stays, wait_until};

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settle_waiting_for_its_confirmation_is_answered_when_the_connection_drops() {
    // A long --settle-timeout: the answer must come from the dropped connection, not from it.
    let (mut server, js, gateway) = Setup::consumer("outage-settle")
        .settle_timeout("60s")
        .start()
        .await;
    js.publish("orders.1", "x").await;
    let message = gateway.fetch_n(1, 1000).await.remove(0);

    // A hung server: the ack goes out and waits for its confirmation.
    server.pause();
    let ack = {
        let client = gateway.client().clone();
        let id = message.id.clone();
        tokio::spawn(async move {
            let reply = client.settle(&id, Action::Ack, None).await;
            (reply, Instant::now())
        })
    };
    assert_stays(
        "the ack waits for the hung server's confirmation",
        Duration::from_secs(1),
        || {
            let waiting = !ack.is_finished();
            async move { waiting }
        },
    )
    .await;

    // The connection drops: the confirmation can no longer come, and a client holding more
    // leases of its fetch hears so at once rather than after 60 s.
    let dropped = Instant::now();
    server.kill();
    let (reply, answered) = ack.await.expect("ack task");
    reply.assert_problem(504);
    let after = answered.saturating_duration_since(dropped);
    assert!(
        after < Duration::from_secs(10),
        "answered {after:?} after the connection dropped, not when it dropped"
    );
}
