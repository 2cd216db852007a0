//! Poison messages: a message that exhausted `--max-deliver`, or that a client terminated, is
//! republished with its headers and delivery metadata to `--dead-letter-subject` — stored
//! exactly once in the dead-letter stream even when the advisory is seen twice, when the
//! gateway is killed right after the terms, or when no gateway runs as the advisory is
//! published; a term on a work-queue stream, which deletes the message, copies it first.

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{consumer, stream};
use futures::StreamExt as _;
use ruststream_nats::dead_letter::headers;

use crate::support::{
    Gateway, Js, Msg, NatsServer, STREAM, Scrape, Setup, assert_stays, fetch_count, wait_for,
    wait_until,
};

const DLQ: &str = "DLQ";

async fn dlq_count(js: &Js) -> u64 {
    let mut stream = js.js.get_stream(DLQ).await.expect("DLQ stream");
    stream.info().await.expect("DLQ info").state.messages
}

/// Fetch until the message with `stream_sequence` is delivered for the `delivered`th time.
async fn delivery(gateway: &Gateway, stream_sequence: u64, delivered: u64) -> Msg {
    wait_for(
        &format!("delivery {delivered} of stream sequence {stream_sequence}"),
        Duration::from_secs(10),
        || async move {
            gateway
                .fetch_n(10, 250)
                .await
                .into_iter()
                .find(|m| m.stream_sequence == stream_sequence && m.delivered == delivered)
        },
    )
    .await
}

fn header<'a>(message: &'a async_nats::jetstream::message::StreamMessage, name: &str) -> &'a str {
    message
        .headers
        .get(name)
        .unwrap_or_else(|| panic!("dead letter has no {name} header: {:?}", message.headers))
        .as_str()
}

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

/// Every dead letter in the DLQ stream, by the stream sequence of its original.
async fn dead_letters(js: &Js) -> BTreeMap<u64, async_nats::jetstream::message::StreamMessage> {
    let dlq = js.js.get_stream(DLQ).await.expect("DLQ stream");
    let mut letters = BTreeMap::new();
    for dlq_sequence in 1..=dlq_count(js).await {
        let letter = dlq
            .get_raw_message(dlq_sequence)
            .await
            .expect("a dead letter");
        let original: u64 = header(&letter, headers::STREAM_SEQUENCE)
            .parse()
            .expect("a stream sequence");
        assert!(
            letters.insert(original, letter).is_none(),
            "stream sequence {original} dead-lettered twice"
        );
    }
    letters
}

async fn stream_count(js: &Js, name: &str) -> Option<u64> {
    let mut stream = js
        .js
        .get_stream(gateway_stream(js, name).await?)
        .await
        .ok()?;
    Some(stream.info().await.ok()?.state.messages)
}

/// The stream the gateway made whose name starts with `prefix` (its names end in a hash of
/// the stream and consumer names).
async fn gateway_stream(js: &Js, prefix: &str) -> Option<String> {
    use futures::TryStreamExt as _;
    let names: Vec<String> = js.js.stream_names().try_collect().await.ok()?;
    names.into_iter().find(|name| name.starts_with(prefix))
}

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

/// The names of the consumers on stream `name`.
async fn consumer_names(js: &Js, name: &str) -> Vec<String> {
    use futures::TryStreamExt as _;
    let stream = js.js.get_stream(name).await.expect("stream");
    let mut names: Vec<String> = stream.consumer_names().try_collect().await.expect("names");
    names.sort();
    names
}

/// The gateway's advisory streams.
async fn advisory_streams(js: &Js) -> Vec<String> {
    use futures::TryStreamExt as _;
    let names: Vec<String> = js.js.stream_names().try_collect().await.expect("names");
    names
        .into_iter()
        .filter(|name| name.starts_with("RUSTSTREAM_ADVISORIES_"))
        .collect()
}

/// Two dead-lettering consumers of one stream (the default one and one of the consumers
/// file): one advisory stream for the stream, one durable per consumer, and each
/// consumer's terms copied to its own subject, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_of_one_stream_share_one_advisory_stream() {
    let (server, js) = crate::support::server_with_stream().await;
    js.create_stream(DLQ, &["DLQ.>"]).await;
    let dir = crate::support::nats::files_dir();
    let file = dir.path().join("consumers.toml");
    std::fs::write(
        &file,
        "[[consumer]]\nstream = \"ORDERS\"\nname = \"shipping\"\ndead_letter_subject = \"DLQ.shipping\"\n",
    )
    .expect("write the consumers file");
    let gateway = Setup::consumer("billing")
        .dead_letter_subject("DLQ.billing")
        .flag("--consumers-file", file.display().to_string())
        .ready(&server.url())
        .await;
    let first = js.publish("orders.1", "bad for billing").await;
    let second = js.publish("orders.1", "bad for shipping").await;
    let billing = gateway.fetch_n(2, 1000).await;
    let shipping = gateway
        .post(
            &format!("/streams/{STREAM}/consumers/shipping/fetch"),
            Some(&serde_json::json!({ "batch": 2, "wait_ms": 1000 })),
        )
        .await
        .messages();
    let by_sequence = |leased: &[Msg], sequence: u64| {
        leased
            .iter()
            .find(|m| m.stream_sequence == sequence)
            .map(|m| m.id.clone())
            .expect("leased")
    };
    assert_eq!(gateway.term(&by_sequence(&billing, first), None).await, 204);
    assert_eq!(
        gateway.term(&by_sequence(&shipping, second), None).await,
        204
    );
    wait_until("both terms are copied", Duration::from_secs(10), || async {
        dlq_count(&js).await == 2
    })
    .await;
    let letters = dead_letters(&js).await;
    assert_eq!(header(&letters[&first], headers::CONSUMER), "billing");
    assert_eq!(letters[&first].subject.as_str(), "DLQ.billing");
    assert_eq!(header(&letters[&second], headers::CONSUMER), "shipping");
    assert_eq!(letters[&second].subject.as_str(), "DLQ.shipping");
    let streams = advisory_streams(&js).await;
    assert_eq!(streams.len(), 1, "{streams:?}");
    assert!(
        streams[0].starts_with("RUSTSTREAM_ADVISORIES_ORDERS_"),
        "{streams:?}"
    );
    assert_eq!(
        consumer_names(&js, &streams[0]).await,
        [
            "ruststream-dead-letters_billing",
            "ruststream-dead-letters_shipping"
        ]
    );
}

/// The advisory stream an earlier release made for one consumer is used as long as it
/// exists; nothing else is made next to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_earlier_releases_advisory_stream_is_used_while_it_exists() {
    let (server, js) = crate::support::server_with_stream().await;
    js.create_stream(DLQ, &["DLQ.>"]).await;
    let legacy = "RUSTSTREAM_ADVISORIES_ORDERS_billing";
    js.create_stream(
        legacy,
        &[
            "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.ORDERS.billing",
            "$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.ORDERS.billing",
        ],
    )
    .await;
    let gateway = Setup::consumer("billing")
        .dead_letter_subject("DLQ.billing")
        .ready(&server.url())
        .await;
    js.publish("orders.1", "bad").await;
    let leased = gateway.fetch_n(1, 1000).await;
    assert_eq!(gateway.term(&leased[0].id, None).await, 204);
    wait_until("the term is copied", Duration::from_secs(10), || async {
        dlq_count(&js).await == 1
    })
    .await;
    assert_eq!(stream_count(&js, legacy).await, Some(1));
    assert_eq!(advisory_streams(&js).await, [legacy]);
    assert_eq!(
        consumer_names(&js, legacy).await,
        ["ruststream-dead-letters"]
    );
}
