//! `GET /dead-letters`: over 5 000 dead letters (three made by terms through the gateway,
//! the rest written as the gateway writes them), pages followed by cursor newest and oldest
//! first, each filter, one by id with its original headers, bad input refused, and nothing
//! in the dead-letter stream changed by reading.

use std::collections::BTreeSet;
use std::time::Duration;

use async_nats::HeaderMap;
use ruststream_nats::dead_letter::headers;
use serde_json::Value;

use crate::support::{Client, Js, Setup, wait_until};

pub(crate) const DLQ: &str = "DLQ";
const WRITTEN: usize = 5_000;

pub(crate) async fn dlq_messages(js: &Js) -> u64 {
    let mut stream = js.js.get_stream(DLQ).await.expect("DLQ stream");
    stream.info().await.expect("DLQ info").state.messages
}

/// Every dead letter `query` lists, following `next` to the end; the number of pages too.
async fn all_pages(gateway: &Client, query: &str) -> (Vec<Value>, usize) {
    let mut letters = Vec::new();
    let mut pages = 0;
    let mut cursor: Option<String> = None;
    loop {
        let path = match &cursor {
            Some(cursor) => format!("/dead-letters?{query}&cursor={cursor}"),
            None => format!("/dead-letters?{query}"),
        };
        let reply = gateway.get(&path).await;
        assert_eq!(reply.status, 200, "{path}: {}", reply.text);
        pages += 1;
        letters.extend(
            reply.body["dead_letters"]
                .as_array()
                .expect("dead_letters")
                .iter()
                .cloned(),
        );
        match reply.body["next"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => return (letters, pages),
        }
        assert!(pages < 100, "the cursor never ends");
    }
}

fn sequences(letters: &[Value]) -> Vec<u64> {
    letters
        .iter()
        .map(|letter| letter["dead_letter_sequence"].as_u64().expect("sequence"))
        .collect()
}

/// Write `count` dead letters as the gateway writes them, from `consumer`, every third a
/// term for "malformed: <n>", the others exhausted deliveries.
pub(crate) async fn write_dead_letters(js: &Js, consumer: &str, count: usize) {
    let mut acks = Vec::with_capacity(count);
    for n in 0..count {
        let mut written = HeaderMap::new();
        if n % 3 == 0 {
            written.insert(headers::REASON, "terminated");
            written.insert(headers::TERM_REASON, format!("malformed: {n}").as_str());
        } else {
            written.insert(headers::REASON, "max_deliveries");
        }
        written.insert(headers::STREAM, "ORDERS");
        written.insert(headers::CONSUMER, consumer);
        written.insert(headers::SUBJECT, "orders.written");
        written.insert(headers::STREAM_SEQUENCE, (100_000 + n).to_string().as_str());
        written.insert(headers::DELIVERIES, "3");
        acks.push(
            js.js
                .publish_with_headers("DLQ.orders", written, format!("written {n}").into())
                .await
                .expect("publish a dead letter"),
        );
    }
    for ack in acks {
        ack.await.expect("the DLQ stored it");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_listed_filtered_paged_and_read_without_being_changed() {
    let (_server, js, gateway) = Setup::consumer("billing")
        .dead_letter_subject("DLQ.orders")
        .start()
        .await;
    js.create_stream(DLQ, &["DLQ.>"]).await;

    // Three real ones, through terms.
    let mut original = HeaderMap::new();
    original.insert("X-Trace", "trace-7");
    original.insert("Nats-Msg-Id", "order-7");
    js.publish_with_headers("orders.7", original, r#"{"order":7}"#)
        .await;
    js.publish("orders.8", "eight").await;
    js.publish("orders.9", "nine").await;
    let leased = gateway.fetch_n(3, 2000).await;
    assert_eq!(leased.len(), 3);
    for (message, reason) in leased
        .iter()
        .zip(["malformed", "malformed: no id", "garbage"])
    {
        assert_eq!(gateway.term(&message.id, Some(reason)).await, 204);
    }
    wait_until(
        "the three terms are dead-lettered",
        Duration::from_secs(10),
        || async { dlq_messages(&js).await == 3 },
    )
    .await;
    write_dead_letters(&js, "shipping", WRITTEN).await;
    let total = WRITTEN + 3;
    let stored = dlq_messages(&js).await;

    // Newest first (the default), 1 000 a page, to the end.
    let (newest, pages) = all_pages(&gateway, "limit=1000").await;
    assert_eq!((newest.len(), pages), (total, 6));
    let newest_sequences = sequences(&newest);
    assert!(
        newest_sequences.windows(2).all(|pair| pair[0] > pair[1]),
        "newest first, each once"
    );
    // Oldest first, in odd-sized pages: the same set, the other way round.
    let (oldest, _) = all_pages(&gateway, "order=oldest&limit=777").await;
    let mut reversed = sequences(&oldest);
    reversed.reverse();
    assert_eq!(reversed, newest_sequences);

    // The real ones read back as they were published, with the term's reason (stored in
    // the order their advisories were handled).
    let by_subject = |subject: &str| {
        oldest[..3]
            .iter()
            .find(|letter| letter["subject"] == subject)
            .unwrap_or_else(|| panic!("no dead letter of {subject}"))
    };
    let real = [by_subject("orders.7")];
    assert_eq!(real[0]["consumer"], "billing");
    assert_eq!(real[0]["reason"], "terminated");
    assert_eq!(real[0]["term_reason"], "malformed");
    assert_eq!(real[0]["subject"], "orders.7");
    assert_eq!(real[0]["stream"], "ORDERS");
    assert_eq!(real[0]["deliveries"], 1);
    assert_eq!(real[0]["headers"]["X-Trace"][0], "trace-7");
    assert_eq!(
        real[0]["headers"]["Nats-Msg-Id"][0], "order-7",
        "the original's own id, not the copy's"
    );
    assert!(
        real[0]["headers"]
            .as_object()
            .expect("headers")
            .keys()
            .all(|name| !name.starts_with("Ruststream-Dead-Letter")),
        "{}",
        real[0]["headers"]
    );
    assert_eq!(real[0]["encoding"], "base64");
    crate::support::rfc3339(real[0]["published_at"].as_str().expect("published_at"));
    let id = real[0]["id"].as_str().expect("id");
    let one = gateway
        .get(&format!("/dead-letters/{id}?encoding=utf8"))
        .await;
    assert_eq!(one.status, 200, "{}", one.text);
    assert_eq!(
        (&one.body["data"], &one.body["encoding"]),
        (&Value::from(r#"{"order":7}"#), &Value::from("utf8"))
    );

    // Filters, alone and together.
    let count = |query: &'static str| {
        let gateway = &gateway;
        async move { all_pages(gateway, query).await.0 }
    };
    let billing = count("consumer=billing&limit=1000").await;
    assert_eq!(billing.len(), 3);
    let malformed = count("consumer=billing&reason=terminated&term_reason=malformed*").await;
    let subjects = |letters: &[Value]| -> BTreeSet<String> {
        letters
            .iter()
            .map(|letter| letter["subject"].as_str().expect("subject").to_owned())
            .collect()
    };
    assert_eq!(
        subjects(&malformed),
        ["orders.7", "orders.8"].map(String::from).into(),
        "the prefix takes both, not garbage"
    );
    let exact = count("term_reason=malformed").await;
    assert_eq!(subjects(&exact), ["orders.7"].map(String::from).into());
    let exhausted = count("reason=max_deliveries&stream=ORDERS&limit=1000").await;
    assert_eq!(exhausted.len(), WRITTEN - WRITTEN.div_ceil(3));
    assert!(count("stream=OTHER").await.is_empty());
    let written_terms =
        count("consumer=shipping&term_reason=malformed*&order=oldest&limit=500").await;
    assert_eq!(written_terms.len(), WRITTEN.div_ceil(3));

    // A time window, from the listing's own times: since is inclusive, until exclusive.
    let times: Vec<time::OffsetDateTime> = oldest
        .iter()
        .map(|letter| crate::support::rfc3339(letter["dead_lettered_at"].as_str().expect("at")))
        .collect();
    let (since, until) = (times[1000], times[4000]);
    let expected = times
        .iter()
        .filter(|at| **at >= since && **at < until)
        .count();
    let format = |at: time::OffsetDateTime| {
        at.format(&time::format_description::well_known::Rfc3339)
            .expect("format")
    };
    for order in ["oldest", "newest"] {
        let query = format!(
            "order={order}&limit=1000&since={}&until={}",
            format(since),
            format(until)
        );
        let (window, _) = all_pages(&gateway, &query).await;
        assert_eq!(window.len(), expected, "{order} first");
        let distinct: BTreeSet<u64> = sequences(&window).into_iter().collect();
        assert_eq!(distinct.len(), expected);
    }

    // Bad input: a clear 422 (or 404), and nothing changes.
    for (query, field) in [
        ("limit=0", "limit"),
        ("limit=1001", "limit"),
        ("order=sideways", "order"),
        ("reason=bored", "reason"),
        ("since=yesterday", "since"),
        ("cursor=garbage", "cursor"),
        ("colour=red", "colour"),
    ] {
        gateway
            .get(&format!("/dead-letters?{query}"))
            .await
            .assert_invalid(field);
    }
    let first_page = gateway.get("/dead-letters?limit=1").await;
    let newest_cursor = first_page.body["next"].as_str().expect("next").to_owned();
    gateway
        .get(&format!(
            "/dead-letters?order=oldest&cursor={newest_cursor}"
        ))
        .await
        .assert_invalid("cursor");
    for missing in ["DLQ:999999", "ORDERS:1", "not-an-id"] {
        gateway
            .get(&format!("/dead-letters/{missing}"))
            .await
            .assert_problem(404);
    }
    assert_eq!(dlq_messages(&js).await, stored, "reading changed nothing");
}
