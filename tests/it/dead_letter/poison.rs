//! Messages dead-lettered for what happened to them: `--max-deliver` naks exhausted, a term
//! with its reason, a letter whose message is gone, and a NATS restart in between.

use std::time::Duration;

use async_nats::HeaderMap;
use futures::StreamExt as _;
use ruststream_nats::dead_letter::headers;

use crate::support::{Js, Scrape, Setup, assert_stays, wait_for};

use super::inspect::{DLQ, delivery, dlq_count, header};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_nakked_max_deliver_times_is_dead_lettered_exactly_once() {
    let (_server, js, gateway) = Setup::consumer("poison")
        .max_deliver(3)
        .dead_letter_subject("DLQ.orders")
        .start()
        .await;
    js.create_stream(DLQ, &["DLQ.>"]).await;
    let mut original = HeaderMap::new();
    original.insert("X-Trace", "trace-1");
    original.insert("Nats-Msg-Id", "order-1");
    let sequence = js
        .publish_with_headers("orders.poison", original, "cannot be processed")
        .await;

    for attempt in 1..=3 {
        let message = delivery(&gateway, sequence, attempt).await;
        assert_eq!(gateway.nak(&message.id, None).await, 204);
    }
    // The server gives up on the next pull and only emits an advisory; the gateway copies
    // the message. Keep fetching meanwhile: the message must never come a fourth time.
    wait_for(
        "the message is in the dead-letter stream",
        Duration::from_secs(10),
        || async {
            let fetched = gateway.fetch_n(10, 200).await;
            assert!(
                fetched.is_empty(),
                "delivered beyond max_deliver: {fetched:?}"
            );
            (dlq_count(&js).await == 1).then_some(())
        },
    )
    .await;

    let dlq = js.js.get_stream(DLQ).await.expect("DLQ stream");
    let letter = dlq.get_raw_message(1).await.expect("the dead letter");
    assert_eq!(letter.subject.as_str(), "DLQ.orders");
    assert_eq!(letter.payload.as_ref(), b"cannot be processed");
    assert_eq!(
        header(&letter, "X-Trace"),
        "trace-1",
        "original headers are kept"
    );
    assert_eq!(header(&letter, headers::REASON), "max_deliveries");
    assert_eq!(header(&letter, headers::SUBJECT), "orders.poison");
    assert_eq!(header(&letter, headers::STREAM), "ORDERS");
    assert_eq!(
        header(&letter, headers::STREAM_SEQUENCE),
        sequence.to_string()
    );
    assert_eq!(header(&letter, headers::CONSUMER), "poison");
    assert_eq!(header(&letter, headers::DELIVERIES), "3");
    assert!(letter.headers.get(headers::TERM_REASON).is_none());
    assert_eq!(
        header(&letter, &format!("{}Msg-Id", headers::ORIGINAL_PREFIX)),
        "order-1",
        "the original's Nats-Msg-Id is carried, not reused"
    );
    crate::support::rfc3339(header(&letter, headers::PUBLISHED_AT));
    let metrics = Scrape::of(&gateway).await;
    assert_eq!(
        metrics.of_consumer(
            "ruststream_dead_lettered_total",
            "",
            &gateway.stream,
            &gateway.consumer
        ),
        1.0,
        "counted in /metrics, labelled with the consumer:\n{}",
        metrics.text
    );

    // The advisory seen again (a second replica, a retry): the gateway republishes, and the
    // dead-letter stream drops the copy by its Nats-Msg-Id.
    let mut republished = js.client.subscribe("DLQ.orders").await.expect("subscribe");
    js.client.flush().await.expect("flush");
    let advisory = serde_json::json!({
        "type": "io.nats.jetstream.advisory.v1.max_deliver",
        "stream": "ORDERS",
        "consumer": "poison",
        "stream_seq": sequence,
        "deliveries": 3,
    });
    js.client
        .publish(
            "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.ORDERS.poison",
            advisory.to_string().into(),
        )
        .await
        .expect("replay the advisory");
    let again = tokio::time::timeout(Duration::from_secs(10), republished.next())
        .await
        .expect("the gateway republished on the replayed advisory")
        .expect("subscription open");
    assert_eq!(again.payload.as_ref(), b"cannot be processed");
    assert_stays(
        "the dead-letter stream holds one copy",
        Duration::from_millis(500),
        || async { dlq_count(&js).await == 1 },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_message_is_dead_lettered_with_its_reason() {
    let (_server, js, gateway) = Setup::consumer("terminator")
        .dead_letter_subject("DLQ.orders")
        .start()
        .await;
    js.create_stream(DLQ, &["DLQ.>"]).await;
    let first = js.publish("orders.bad", "unparsable").await;
    let second = js.publish("orders.bad", "unwanted").await;
    let messages = gateway.fetch_n(2, 1000).await;
    assert_eq!(messages.len(), 2);
    assert_eq!(
        gateway
            .term(&messages[0].id, Some("invalid order: no lines"))
            .await,
        204
    );
    assert_eq!(gateway.term(&messages[1].id, None).await, 204);

    wait_for(
        "both terminated messages are in the dead-letter stream",
        Duration::from_secs(10),
        || async { (dlq_count(&js).await == 2).then_some(()) },
    )
    .await;
    let dlq = js.js.get_stream(DLQ).await.expect("DLQ stream");
    let mut letters = Vec::new();
    for dlq_sequence in 1..=2 {
        letters.push(
            dlq.get_raw_message(dlq_sequence)
                .await
                .expect("a dead letter"),
        );
    }
    letters.sort_by_key(|letter| {
        header(letter, headers::STREAM_SEQUENCE)
            .parse::<u64>()
            .unwrap_or(0)
    });
    assert_eq!(
        header(&letters[0], headers::STREAM_SEQUENCE),
        first.to_string()
    );
    assert_eq!(letters[0].payload.as_ref(), b"unparsable");
    assert_eq!(header(&letters[0], headers::REASON), "terminated");
    assert_eq!(
        header(&letters[0], headers::TERM_REASON),
        "invalid order: no lines"
    );
    assert_eq!(header(&letters[0], headers::DELIVERIES), "1");
    assert_eq!(
        header(&letters[1], headers::STREAM_SEQUENCE),
        second.to_string()
    );
    assert_eq!(header(&letters[1], headers::REASON), "terminated");
    assert!(
        letters[1].headers.get(headers::TERM_REASON).is_none(),
        "no reason given, none invented: {:?}",
        letters[1].headers
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_whose_message_is_gone_is_skipped_and_the_gateway_keeps_working() {
    let (_server, js, gateway) = Setup::consumer("vanished")
        .dead_letter_subject("DLQ.orders")
        .start()
        .await;
    js.create_stream(DLQ, &["DLQ.>"]).await;
    let sequence = js.publish("orders.gone", "purged").await;
    let message = gateway.fetch_n(1, 1000).await.remove(0);
    // The message leaves the stream (a purge, limits) before the advisory is handled.
    js.js
        .get_stream("ORDERS")
        .await
        .expect("stream")
        .delete_message(sequence)
        .await
        .expect("delete the message");
    assert_eq!(gateway.term(&message.id, Some("gone")).await, 204);
    let later = js.publish("orders.gone", "still served").await;
    let next = gateway.fetch_n(1, 2000).await;
    assert_eq!(next.len(), 1);
    assert_eq!(next[0].stream_sequence, later);
    assert_eq!(gateway.term(&next[0].id, Some("poison")).await, 204);
    wait_for(
        "the later message is dead-lettered",
        Duration::from_secs(10),
        || async { (dlq_count(&js).await == 1).then_some(()) },
    )
    .await;
    let dlq = js.js.get_stream(DLQ).await.expect("DLQ stream");
    let letter = dlq.get_raw_message(1).await.expect("a dead letter");
    assert_eq!(header(&letter, headers::STREAM_SEQUENCE), later.to_string());
    let metrics = Scrape::of(&gateway).await;
    assert_eq!(
        // Two advisories named the vanished message: the server's own MSG_TERMINATED
        // ("Unacknowledged message was deleted") and the client's term.
        metrics.get(r#"ruststream_dead_letters_skipped_total{reason="missing"}"#),
        2.0,
        "the vanished message is counted:\n{}",
        metrics.text
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_lettering_survives_a_nats_restart() {
    let (mut server, js, gateway) = Setup::consumer("reconnecting")
        .dead_letter_subject("DLQ.orders")
        .start()
        .await;
    js.create_stream(DLQ, &["DLQ.>"]).await;
    server.restart().await;
    let js = Js::connect(&server.url()).await;
    js.publish("orders.after", "termed after the restart").await;
    // Fetches answer 503 until the gateway has reconnected. A lease issued while it was
    // still rebinding may be voided by that rebind (a server killed -9 can come back having
    // lost its consumer state: a new lease epoch, 410); the message then comes again.
    wait_for(
        "a delivery after the restart, termed",
        Duration::from_secs(15),
        || async {
            let reply = gateway
                .fetch_reply(Some(&serde_json::json!({ "batch": 1, "wait_ms": 500 })))
                .await;
            if reply.status != 200 {
                return None;
            }
            let message = reply.messages().into_iter().next()?;
            match gateway.term(&message.id, Some("after restart")).await {
                204 => Some(()),
                410 => None,
                other => panic!("term after the restart answered {other}"),
            }
        },
    )
    .await;
    wait_for(
        "the message is dead-lettered through the renewed subscription",
        Duration::from_secs(10),
        || async { (dlq_count(&js).await == 1).then_some(()) },
    )
    .await;
}
