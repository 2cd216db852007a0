//! Terms dead-lettered exactly once across faults: the gateway killed right after its 204s,
//! a work-queue stream deleting the message, advisories published while no gateway ran.

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{consumer, stream};
use futures::StreamExt as _;
use ruststream_nats::dead_letter::headers;

use crate::support::{
    Js, NatsServer, STREAM, Scrape, Setup, assert_stays, fetch_count, wait_until,
};

use super::inspect::{DLQ, dead_letters, dlq_count, header, stream_count};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terms_answered_204_are_dead_lettered_exactly_once_although_the_gateway_is_killed_right_after()
 {
    let (server, js) = crate::support::server_with_stream().await;
    js.create_stream(DLQ, &["DLQ.>"]).await;
    let sequences = js.publish_many("orders.crash", 10, "termed").await;
    let mut gateway = Setup::consumer("crash")
        .dead_letter_subject("DLQ.orders")
        .process(&server.url())
        .await;
    let messages = fetch_count(&gateway, 10, Duration::from_secs(10)).await;
    let terms = messages.iter().map(|message| {
        let reason = format!("bad {}", message.stream_sequence);
        let gateway = &gateway;
        async move { gateway.term(&message.id, Some(&reason)).await }
    });
    let statuses = futures::future::join_all(terms).await;
    assert_eq!(statuses, vec![204; 10], "every term confirmed");
    gateway.kill9();

    gateway.restart().await;
    // Advisories the killed gateway held unacked come back after the advisory consumer's
    // ack_wait (10 s).
    let deadline = crate::support::Deadline::after(
        "all 10 termed messages are in the dead-letter stream",
        Duration::from_secs(30),
    );
    loop {
        let stored = dlq_count(&js).await;
        if stored >= 10 {
            break;
        }
        deadline
            .tick_seeing(format_args!("{stored} of 10 dead-lettered"))
            .await;
    }
    assert_stays(
        "the dead-letter stream holds each once",
        Duration::from_secs(1),
        || async { dlq_count(&js).await == 10 },
    )
    .await;
    let letters = dead_letters(&js).await;
    assert_eq!(
        letters.keys().copied().collect::<Vec<_>>(),
        sequences,
        "every termed message"
    );
    for (sequence, letter) in &letters {
        assert_eq!(header(letter, headers::REASON), "terminated");
        assert_eq!(
            header(letter, headers::TERM_REASON),
            format!("bad {sequence}")
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_term_on_a_work_queue_stream_copies_the_message_before_the_stream_deletes_it() {
    let server = NatsServer::start().await;
    let js = Js::connect(&server.url()).await;
    js.js
        .create_stream(stream::Config {
            name: STREAM.to_owned(),
            subjects: vec!["orders.>".to_owned()],
            retention: stream::RetentionPolicy::WorkQueue,
            ..Default::default()
        })
        .await
        .expect("create the work-queue stream");
    let gateway = Setup::consumer("worker")
        .dead_letter_subject("DLQ.orders")
        .ready(&server.url())
        .await;
    let mut original = HeaderMap::new();
    original.insert("X-Trace", "trace-wq");
    let sequence = js
        .publish_with_headers("orders.wq", original, "one worker only")
        .await;
    let message = gateway.fetch_n(1, 2000).await.remove(0);

    // No stream captures the dead-letter subject yet: the copy fails, so no term is sent
    // (it would delete the message with nothing kept) and the lease stays.
    assert_eq!(gateway.term(&message.id, Some("no such order")).await, 503);
    assert_eq!(
        stream_count(&js, STREAM).await,
        Some(1),
        "still in the stream"
    );

    js.create_stream(DLQ, &["DLQ.>"]).await;
    assert_eq!(gateway.term(&message.id, Some("no such order")).await, 204);
    wait_until(
        "the work-queue stream deleted the termed message",
        Duration::from_secs(5),
        || async { stream_count(&js, STREAM).await == Some(0) },
    )
    .await;
    assert_eq!(dlq_count(&js).await, 1, "copied before the term");
    // The advisory's copy finds the message gone and says why; nothing is counted missing.
    assert_stays("one copy only", Duration::from_secs(1), || async {
        dlq_count(&js).await == 1
    })
    .await;
    let letters = dead_letters(&js).await;
    let letter = &letters[&sequence];
    assert_eq!(letter.payload.as_ref(), b"one worker only");
    assert_eq!(header(letter, "X-Trace"), "trace-wq");
    assert_eq!(header(letter, headers::REASON), "terminated");
    assert_eq!(header(letter, headers::TERM_REASON), "no such order");
    assert_eq!(header(letter, headers::DELIVERIES), "1");
    assert_eq!(header(letter, headers::CONSUMER), "worker");
    let metrics = Scrape::of(&gateway).await;
    assert!(
        metrics.get("ruststream_dead_lettered_total") == 1.0
            && metrics.get_or_zero(r#"ruststream_dead_letters_skipped_total{reason="missing"}"#)
                == 0.0,
        "one copy counted, none missing:\n{}",
        metrics.text
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisories_published_while_no_gateway_runs_are_dead_lettered_after_the_restart() {
    let (server, js) = crate::support::server_with_stream().await;
    js.create_stream(DLQ, &["DLQ.>"]).await;
    let termed = js.publish("orders.offline", "termed offline").await;
    let exhausted = js.publish("orders.offline", "nakked offline").await;
    let mut gateway = Setup::consumer("offline")
        .max_deliver(2)
        .dead_letter_subject("DLQ.orders")
        .process(&server.url())
        .await;
    gateway.kill9();

    // Another client of the same consumer settles while no gateway runs: a term with a
    // reason, and naks until max_deliver is exhausted.
    let consumer: consumer::PullConsumer = js
        .js
        .get_stream(STREAM)
        .await
        .expect("stream")
        .get_consumer("offline")
        .await
        .expect("the gateway's consumer");
    let advisories = "RUSTSTREAM_ADVISORIES_ORDERS_";
    let mut naks = 0;
    let deadline = crate::support::Deadline::after(
        "both advisories are in the advisory stream",
        Duration::from_secs(15),
    );
    while stream_count(&js, advisories).await != Some(2) {
        let mut batch = consumer
            .fetch()
            .max_messages(10)
            .messages()
            .await
            .expect("fetch");
        while let Some(message) = batch.next().await {
            let message = message.expect("a delivery");
            let reply = message.reply.clone().expect("a reply subject");
            let sequence = message.info().expect("delivery info").stream_sequence;
            let command = if sequence == termed {
                "+TERM offline term"
            } else {
                naks += 1;
                "-NAK"
            };
            js.client
                .request(reply, command.into())
                .await
                .expect("the server confirms the settle");
        }
        deadline
            .tick_seeing(format_args!(
                "{:?} advisories, {naks} naks",
                stream_count(&js, advisories).await
            ))
            .await;
    }
    assert_eq!(naks, 2, "delivered max_deliver times");
    assert_eq!(dlq_count(&js).await, 0, "nobody copied them yet");

    gateway.restart().await;
    wait_until(
        "both messages are in the dead-letter stream",
        Duration::from_secs(15),
        || async { dlq_count(&js).await == 2 },
    )
    .await;
    let letters = dead_letters(&js).await;
    assert_eq!(header(&letters[&termed], headers::REASON), "terminated");
    assert_eq!(
        header(&letters[&termed], headers::TERM_REASON),
        "offline term"
    );
    assert_eq!(
        header(&letters[&exhausted], headers::REASON),
        "max_deliveries"
    );
    assert_eq!(header(&letters[&exhausted], headers::DELIVERIES), "2");
}
