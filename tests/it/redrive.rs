//! `POST /dead-letters/redrive`, `GET`/`DELETE /dead-letters/redrive/{task}`: a filtered
//! subset sent back (dry run first) while more dead letters arrive; bad input refused
//! changing nothing (a `to_subject` in the gateway's plumbing among it); a task outliving a
//! gateway killed -9 mid-way, run by one of two replicas, each message published once and
//! removed only after that; a cancel mid-way; an id named three times taken once, and a
//! dead letter gone before its removal counted as removed; two identical redrives at once
//! (a double click): one made, the other refused 409 naming it, each message stored once.

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::stream;
use ruststream_nats::dead_letter::headers;
use serde_json::{Value, json};

use crate::dead_letters_read::{DLQ, dlq_messages, write_dead_letters};
use crate::support::{Client, Js, Setup, assert_stays, server_with_stream, wait_for};

/// What the redrive of `body` answered (status asserted).
async fn start(gateway: &Client, body: &Value) -> Value {
    let reply = gateway.post("/dead-letters/redrive", Some(body)).await;
    assert_eq!(reply.status, 202, "{body}: {}", reply.text);
    reply.body
}

async fn task(gateway: &Client, task: &str) -> Value {
    let reply = gateway.get(&format!("/dead-letters/redrive/{task}")).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    reply.body
}

/// The task once it is in `state`.
async fn task_in(gateway: &Client, id: &str, state: &str, within: Duration) -> Value {
    wait_for(&format!("redrive task {id} {state}"), within, || async {
        let now = task(gateway, id).await;
        (now["state"] == state).then_some(now)
    })
    .await
}

/// The messages the redrives published to ORDERS: by the dead-letter sequence they were
/// sent back from, each with its headers and payload (a sequence sent twice shows twice).
async fn redriven(js: &Js) -> BTreeMap<u64, Vec<(BTreeMap<String, Vec<String>>, String)>> {
    let mut stream = js.js.get_stream("ORDERS").await.expect("ORDERS");
    let last = stream.info().await.expect("info").state.last_sequence;
    let mut found: BTreeMap<u64, Vec<_>> = BTreeMap::new();
    for sequence in 1..=last {
        let Ok(message) = stream.get_raw_message(sequence).await else {
            continue;
        };
        let mut headers = BTreeMap::<String, Vec<String>>::new();
        for (name, values) in message.headers.iter() {
            headers
                .entry(name.to_string())
                .or_default()
                .extend(values.iter().map(ToString::to_string));
        }
        let Some(from) = headers
            .get("Ruststream-Redriven-From")
            .and_then(|from| from.last())
            .and_then(|from| from.parse().ok())
        else {
            continue;
        };
        let payload = String::from_utf8_lossy(&message.payload).into_owned();
        found.entry(from).or_default().push((headers, payload));
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filtered_redrive_sends_back_what_it_matched_once_and_leaves_the_rest() {
    let (_server, js, gateway) = Setup::consumer("billing")
        .dead_letter_subject("DLQ.orders")
        .start()
        .await;
    js.create_stream(DLQ, &["DLQ.>"]).await;
    // Dead-letter sequences 1..=600 of shipping (every third, from 1, terminated with
    // "malformed: n"), then 601..=630 of billing.
    write_dead_letters(&js, "shipping", 600).await;
    write_dead_letters(&js, "billing", 30).await;

    // Bad input is refused, naming the field, and changes nothing.
    for (body, field) in [
        (json!({"ids": ["DLQ:1"], "consumer": "shipping"}), "ids"),
        (json!({"ids": []}), "ids"),
        (json!({"ids": ["DLQ"]}), "ids"),
        (json!({"rate": 0}), "rate"),
        (json!({"rate": 10_001}), "rate"),
        (json!({"to_subject": "orders.*"}), "to_subject"),
        // The gateway's own plumbing: what its replicas exchange, and reply inboxes.
        (
            json!({"to_subject": "_RUSTSTREAM.fleet.replica.x"}),
            "to_subject",
        ),
        (json!({"to_subject": "_RUSTSTREAM"}), "to_subject"),
        (json!({"to_subject": "_INBOX.abc"}), "to_subject"),
        (
            json!({"to_subject": "_INBOX.abc", "dry_run": true}),
            "to_subject",
        ),
        (json!({"reason": "bored"}), "reason"),
        (json!({"since": "yesterday"}), "since"),
    ] {
        let reply = gateway.post("/dead-letters/redrive", Some(&body)).await;
        assert_eq!(reply.status, 422, "{body}: {}", reply.text);
        assert_eq!(reply.body["field"], field, "{body}: {}", reply.text);
    }
    let unknown = gateway
        .post("/dead-letters/redrive", Some(&json!({"colour": "red"})))
        .await;
    assert_eq!(unknown.status, 422, "{}", unknown.text);
    // A careless POST without a body sends nothing back (`{}` takes every dead letter).
    let bodiless = gateway.post("/dead-letters/redrive", None).await;
    assert_eq!(bodiless.status, 422, "{}", bodiless.text);
    for missing in ["0123456789abcdef", "not%20a%20task"] {
        let path = format!("/dead-letters/redrive/{missing}");
        assert_eq!(gateway.get(&path).await.status, 404, "GET {path}");
        assert_eq!(gateway.delete(&path).await.status, 404, "DELETE {path}");
    }
    assert_eq!(dlq_messages(&js).await, 630);

    // The dry run counts and shows the first ten, oldest first, and sends nothing.
    let filter =
        json!({"consumer": "shipping", "reason": "terminated", "term_reason": "malformed*"});
    let mut dry = filter.clone();
    dry["dry_run"] = json!(true);
    let reply = gateway.post("/dead-letters/redrive", Some(&dry)).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    assert_eq!(reply.body["matched"], 200);
    let shown: Vec<u64> = reply.body["dead_letters"]
        .as_array()
        .expect("dead_letters")
        .iter()
        .map(|letter| letter["dead_letter_sequence"].as_u64().expect("sequence"))
        .collect();
    assert_eq!(shown, (0..10).map(|n| 1 + 3 * n).collect::<Vec<u64>>());
    assert_eq!(dlq_messages(&js).await, 630);
    assert!(redriven(&js).await.is_empty());

    // The redrive, while more dead letters arrive: it takes those there when it was made.
    let mut run = filter.clone();
    run["rate"] = json!(10_000);
    let started = start(&gateway, &run).await;
    assert_eq!(started["matched"], 200, "{started}");
    let id = started["task"].as_str().expect("task").to_owned();
    write_dead_letters(&js, "shipping", 30).await;
    let done = task_in(&gateway, &id, "done", Duration::from_secs(30)).await;
    for (field, value) in [
        ("task", json!(id)),
        ("matched", json!(200)),
        ("published", json!(200)),
        ("removed", json!(200)),
        ("failed", json!(0)),
        ("last_error", Value::Null),
        ("rate", json!(10_000)),
    ] {
        assert_eq!(done[field], value, "{field}: {done}");
    }
    assert!(done["started_at"].is_string() && done["finished_at"].is_string());
    assert_eq!(dlq_messages(&js).await, 630 - 200 + 30);

    // Each sent back once, to its own subject, with its payload and own headers, its
    // history and the task; the dead-letter headers are not among them.
    let sent = redriven(&js).await;
    let expected: Vec<u64> = (0..200).map(|n| 1 + 3 * n).collect();
    assert_eq!(sent.keys().copied().collect::<Vec<_>>(), expected);
    for (from, copies) in &sent {
        assert_eq!(copies.len(), 1, "dead letter {from} published {copies:?}");
        let (headers, payload) = &copies[0];
        assert_eq!(*payload, format!("written {}", from - 1));
        assert_eq!(
            headers["Ruststream-Redrive-Task"],
            std::slice::from_ref(&id)
        );
        assert!(
            headers
                .keys()
                .all(|name| !name.starts_with("Ruststream-Dead-Letter")),
            "{headers:?}"
        );
    }
    // What is left of the filter: only what came later.
    let left = gateway
        .get("/dead-letters?consumer=shipping&reason=terminated&limit=1000&order=oldest")
        .await;
    let left: Vec<u64> = left.body["dead_letters"]
        .as_array()
        .expect("dead_letters")
        .iter()
        .map(|letter| letter["dead_letter_sequence"].as_u64().expect("sequence"))
        .collect();
    assert_eq!(left, (0..10).map(|n| 631 + 3 * n).collect::<Vec<u64>>());

    // By ids, to another subject: one of billing's, and one that is gone (not matched).
    let by_ids = start(
        &gateway,
        &json!({"ids": ["DLQ:601", "DLQ:1"], "to_subject": "orders.again"}),
    )
    .await;
    assert_eq!(by_ids["matched"], 1, "{by_ids}");
    let id = by_ids["task"].as_str().expect("task");
    let done = task_in(&gateway, id, "done", Duration::from_secs(10)).await;
    assert_eq!(
        (done["published"].clone(), done["removed"].clone()),
        (json!(1), json!(1))
    );
    assert_eq!(gateway.get("/dead-letters/DLQ:601").await.status, 404);
    // A task that ended is answered as it is by a cancel.
    let again = gateway.delete(&format!("/dead-letters/redrive/{id}")).await;
    assert_eq!(
        (again.status, again.body["state"].clone()),
        (200, json!("done"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redrive_outlives_a_killed_gateway_at_one_replica_and_a_cancel_stops_it_whole() {
    const SHIPPING: u64 = 1000;
    const BILLING: u64 = 400;
    let (server, js) = server_with_stream().await;
    js.create_stream(DLQ, &["DLQ.>"]).await;
    write_dead_letters(&js, "shipping", SHIPPING as usize).await;
    write_dead_letters(&js, "billing", BILLING as usize).await;
    let setup = Setup::consumer("billing").dead_letter_subject("DLQ.orders");

    // Killed -9 a few chunks in.
    let mut first = setup.process(&server.url()).await;
    let started = start(&first, &json!({"consumer": "shipping", "rate": 250})).await;
    assert_eq!(started["matched"], SHIPPING);
    let id = started["task"].as_str().expect("task").to_owned();
    wait_for(
        "a few chunks published",
        Duration::from_secs(20),
        || async { (task(&first, &id).await["published"].as_u64() >= Some(200)).then_some(()) },
    )
    .await;
    first.kill9();

    // Restarted, beside another replica: the task goes on at one of them.
    let second = setup.process(&server.url()).await;
    let third = setup.process(&server.url()).await;
    let done = task_in(&second, &id, "done", Duration::from_secs(60)).await;
    for field in ["published", "removed"] {
        assert_eq!(done[field], SHIPPING, "{field}: {done}");
    }
    assert_eq!(done["failed"], 0, "{done}");
    let runners = [&second, &third]
        .iter()
        .filter(|replica| replica.log().contains("running the redrive task here"))
        .count();
    assert_eq!(runners, 1, "one replica runs the task");
    // Each published once (stored once: a chunk published again after the kill is
    // deduplicated), and every dead letter gone was published first.
    let sent = redriven(&js).await;
    assert_eq!(sent.len() as u64, SHIPPING);
    assert!(sent.values().all(|copies| copies.len() == 1));
    assert_eq!(dlq_messages(&js).await, BILLING);

    // A cancel mid-way (asked at a replica that does not run it): the chunk in hand is
    // finished (published and removed), nothing after it starts, what was done stays done.
    let started = start(&third, &json!({"consumer": "billing", "rate": 100})).await;
    let id = started["task"].as_str().expect("task").to_owned();
    wait_for(
        "billing's redrive under way",
        Duration::from_secs(20),
        || async { (task(&second, &id).await["published"].as_u64() > Some(0)).then_some(()) },
    )
    .await;
    // The answer comes once the holder stopped: its counts are final.
    let cancelled = second.delete(&format!("/dead-letters/redrive/{id}")).await;
    assert_eq!(cancelled.status, 200, "{}", cancelled.text);
    let settled = cancelled.body;
    assert_eq!(settled["state"], "cancelled", "{settled}");
    assert_eq!(settled["published"], settled["removed"], "{settled}");
    let removed = settled["removed"].as_u64().expect("removed");
    assert!(
        removed > 0 && removed < BILLING,
        "cancelled mid-way: {settled}"
    );
    assert_eq!(dlq_messages(&js).await, BILLING - removed);
    assert_stays(
        "nothing more redriven after the cancel",
        Duration::from_secs(1),
        || async { dlq_messages(&js).await == BILLING - removed },
    )
    .await;
    assert_eq!(task(&third, &id).await, settled);
    assert_eq!(redriven(&js).await.len() as u64, SHIPPING + removed);
}

/// One dead letter of billing's, as the gateway writes them, stored on `subject`.
async fn write_dead_letter(js: &Js, subject: &str, n: u64) {
    let mut written = HeaderMap::new();
    written.insert(headers::REASON, "max_deliveries");
    written.insert(headers::STREAM, "ORDERS");
    written.insert(headers::CONSUMER, "billing");
    written.insert(headers::SUBJECT, "orders.written");
    written.insert(headers::STREAM_SEQUENCE, n.to_string().as_str());
    written.insert(headers::DELIVERIES, "3");
    js.js
        .publish_with_headers(subject.to_owned(), written, format!("written {n}").into())
        .await
        .expect("publish a dead letter")
        .await
        .expect("the DLQ stored it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_id_named_again_is_taken_once_and_a_dead_letter_gone_counts_as_removed() {
    let (_server, js, gateway) = Setup::consumer("billing")
        .dead_letter_subject("DLQ.orders")
        .start()
        .await;
    // At most one message a subject: a publish to a dead letter's subject removes it.
    js.js
        .create_stream(stream::Config {
            name: DLQ.to_owned(),
            subjects: vec!["DLQ.>".to_owned()],
            max_messages_per_subject: 1,
            ..Default::default()
        })
        .await
        .expect("DLQ stream");
    for (n, subject) in ["DLQ.a", "DLQ.b", "DLQ.c", "DLQ.d"].into_iter().enumerate() {
        write_dead_letter(&js, subject, n as u64 + 1).await;
    }

    // Named three times: one dead letter, matched, published and removed once.
    let started = start(&gateway, &json!({"ids": ["DLQ:2", "DLQ:2", "DLQ:2"]})).await;
    assert_eq!(started["matched"], 1, "{started}");
    let id = started["task"].as_str().expect("task").to_owned();
    let done = task_in(&gateway, &id, "done", Duration::from_secs(15)).await;
    for (field, value) in [
        ("matched", 1),
        ("published", 1),
        ("removed", 1),
        ("failed", 0),
    ] {
        assert_eq!(done[field], value, "{field}: {done}");
    }
    assert_eq!(done["last_error"], Value::Null, "{done}");
    let sent = redriven(&js).await;
    assert_eq!(sent.keys().copied().collect::<Vec<_>>(), [2]);
    assert_eq!(sent[&2].len(), 1, "{sent:?}");
    assert_eq!(gateway.get("/dead-letters/DLQ:2").await.status, 404);

    // Sent back onto its own subject in the dead-letter stream, which drops it there: when
    // its removal comes, it is gone already, and that is a removal done, not a failure.
    let started = start(&gateway, &json!({"ids": ["DLQ:3"], "to_subject": "DLQ.c"})).await;
    let id = started["task"].as_str().expect("task").to_owned();
    let done = task_in(&gateway, &id, "done", Duration::from_secs(15)).await;
    for (field, value) in [
        ("matched", 1),
        ("published", 1),
        ("removed", 1),
        ("failed", 0),
    ] {
        assert_eq!(done[field], value, "{field}: {done}");
    }
    assert_eq!(done["last_error"], Value::Null, "{done}");
    assert_eq!(gateway.get("/dead-letters/DLQ:3").await.status, 404);
    assert_eq!(gateway.get("/dead-letters/DLQ:4").await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_redrives_at_once_make_one_task_and_no_dead_letter_is_stored_twice() {
    let (_server, js, gateway) = Setup::consumer("billing")
        .dead_letter_subject("DLQ.orders")
        .start()
        .await;
    js.create_stream(DLQ, &["DLQ.>"]).await;
    // Shipping's are dead-letter sequences 1..=600, billing's 601..=630.
    write_dead_letters(&js, "shipping", 600).await;
    write_dead_letters(&js, "billing", 30).await;

    // A double click: the same redrive twice at once. One task is made, the other refused.
    let shipping = json!({"consumer": "shipping", "rate": 100});
    let (one, other) = tokio::join!(
        gateway.post("/dead-letters/redrive", Some(&shipping)),
        gateway.post("/dead-letters/redrive", Some(&shipping)),
    );
    let (made, refused) = if one.status == 202 {
        (one, other)
    } else {
        (other, one)
    };
    assert_eq!(made.status, 202, "{}", made.text);
    let running = made.body["task"].as_str().expect("task").to_owned();
    let problem = refused.assert_problem(409);
    assert_eq!(
        problem["type"], "urn:ruststream-nats:problem:redrive-overlaps",
        "{}",
        refused.text
    );
    assert_eq!(problem["task"], running.as_str(), "{}", refused.text);
    assert!(refused.detail().contains(&running), "{}", refused.text);

    // While it runs: ids it takes are refused too; a filter apart from it is not.
    let reply = gateway
        .post("/dead-letters/redrive", Some(&json!({"ids": ["DLQ:600"]})))
        .await;
    assert_eq!(reply.assert_problem(409)["task"], running.as_str());
    let billing = start(&gateway, &json!({"consumer": "billing", "rate": 10_000})).await;
    let billing = billing["task"].as_str().expect("task").to_owned();
    assert_eq!(task(&gateway, &running).await["state"], "running");

    // Once it ended (cancelled here), the same redrive is made and takes the rest.
    let cancelled = gateway
        .delete(&format!("/dead-letters/redrive/{running}"))
        .await;
    assert_eq!(cancelled.body["state"], "cancelled", "{}", cancelled.text);
    let rest = start(&gateway, &json!({"consumer": "shipping", "rate": 10_000})).await;
    let removed = cancelled.body["removed"].as_u64().expect("removed");
    assert_eq!(rest["matched"], 600 - removed, "{rest}");
    let rest = rest["task"].as_str().expect("task").to_owned();
    task_in(&gateway, &rest, "done", Duration::from_secs(30)).await;
    task_in(&gateway, &billing, "done", Duration::from_secs(30)).await;

    // Every dead letter stored once, under its own dedup id, and none left.
    let sent = redriven(&js).await;
    assert_eq!(sent.len(), 630);
    for (from, copies) in &sent {
        assert_eq!(
            copies.len(),
            1,
            "dead letter {from} stored {}",
            copies.len()
        );
        assert_eq!(
            copies[0].0["Nats-Msg-Id"],
            [format!("ruststream-redrive:{DLQ}:{from}")]
        );
    }
    assert_eq!(dlq_messages(&js).await, 0);
}
