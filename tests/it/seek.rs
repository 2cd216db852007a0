//! `POST /streams/{stream}/consumers/{consumer}/seek`: a consumer moved to a sequence, a
//! time, its stream's beginning and end (dry runs first), the acked messages it re-delivers
//! leased again, its live leases void (410) here and at another replica, and bad input
//! refused with nothing changed.

use std::time::Duration;

use serde_json::{Value, json};

use crate::support::{STREAM, Setup, shared_key, wait_until};

fn seek_path(consumer: &str) -> String {
    format!("/streams/{STREAM}/consumers/{consumer}/seek")
}

/// The stream sequences of everything a fetch leases now, acked.
async fn fetch_all_and_ack(gateway: &crate::support::Client, expected: usize) -> Vec<u64> {
    let mut sequences = Vec::new();
    let deadline = crate::support::Deadline::after(
        format!("{expected} messages are leased"),
        Duration::from_secs(10),
    );
    while sequences.len() < expected {
        for message in gateway.fetch_n(100, 300).await {
            assert_eq!(gateway.ack(&message.id).await, 204);
            sequences.push(message.stream_sequence);
        }
        deadline.tick_seeing(format_args!("{sequences:?}")).await;
    }
    sequences.sort_unstable();
    sequences
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_moves_to_a_sequence_a_time_its_beginning_and_its_end() {
    let consumer = "rewound";
    let (_server, js, gateway) = Setup::consumer(consumer).start().await;
    js.publish_many("orders.1", 10, "m").await;
    let leased = gateway.fetch_n(10, 2000).await;
    assert_eq!(leased.len(), 10);
    let sixth_published_at = leased[5].published_at.clone();
    for message in &leased {
        assert_eq!(gateway.ack(&message.id).await, 204);
    }
    let path = seek_path(consumer);
    let seek = |body: Value| {
        let gateway = &gateway;
        let path = path.clone();
        async move {
            let reply = gateway.post(&path, Some(&body)).await;
            assert_eq!(reply.status, 200, "{body}: {}", reply.text);
            reply.body
        }
    };

    // A dry run says where and what, and moves nothing.
    let dry = seek(json!({"sequence": 3, "dry_run": true})).await;
    assert_eq!(
        (
            &dry["sequence"],
            &dry["redelivers"],
            &dry["skips"],
            &dry["dry_run"]
        ),
        (&json!(3), &json!(8), &json!(0), &json!(true))
    );
    assert!(gateway.fetch_n(10, 300).await.is_empty(), "nothing moved");

    // Back to 3: what was acked here is leased again, as the move means.
    let moved = seek(json!({"sequence": 3})).await;
    assert_eq!(
        (&moved["sequence"], &moved["dry_run"]),
        (&json!(3), &json!(false))
    );
    assert_eq!(
        fetch_all_and_ack(&gateway, 8).await,
        (3..=10).collect::<Vec<_>>()
    );

    // To a time: the first message stored at or after it.
    let at = seek(json!({"time": sixth_published_at, "dry_run": true})).await;
    assert_eq!((&at["sequence"], &at["redelivers"]), (&json!(6), &json!(5)));
    seek(json!({"time": sixth_published_at})).await;
    assert_eq!(
        fetch_all_and_ack(&gateway, 5).await,
        (6..=10).collect::<Vec<_>>()
    );

    let beginning = seek(json!({"position": "beginning", "dry_run": true})).await;
    assert_eq!(
        (&beginning["sequence"], &beginning["redelivers"]),
        (&json!(1), &json!(10))
    );

    // To the end: what waits is skipped, what comes next is delivered.
    js.publish_many("orders.1", 3, "skipped").await;
    let end = seek(json!({"position": "end", "dry_run": true})).await;
    assert_eq!((&end["sequence"], &end["skips"]), (&json!(14), &json!(3)));
    seek(json!({"position": "end"})).await;
    js.publish("orders.1", "after the end").await;
    assert_eq!(fetch_all_and_ack(&gateway, 1).await, vec![14]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seek_voids_live_leases_here_and_at_another_replica_and_bad_input_changes_nothing() {
    let consumer = "rewound-fleet";
    let key = shared_key();
    let setup = Setup::consumer(consumer).lease_key_file(key.path());
    let (server, js, here) = setup.start().await;
    let there = setup.ready(&server.url()).await;
    js.publish_many("orders.1", 4, "m").await;
    let held_here = here.fetch_n(2, 2000).await;
    let held_there = there.fetch_n(2, 2000).await;
    assert_eq!((held_here.len(), held_there.len()), (2, 2));
    let path = seek_path(consumer);

    for bad in [
        json!({}),
        json!({"sequence": 2, "position": "end"}),
        json!({"sequence": 0}),
        json!({"position": "middle"}),
        json!({"time": "yesterday"}),
        json!({"sequence": 1, "rewind": true}),
    ] {
        let reply = here.post(&path, Some(&bad)).await;
        assert_eq!(reply.status, 422, "{bad}: {}", reply.text);
    }
    here.post(
        &format!("/streams/{STREAM}/consumers/nobody/seek"),
        Some(&json!({"sequence": 1})),
    )
    .await
    .assert_problem(404);
    assert_eq!(
        here.leases_in_flight().await,
        2,
        "bad input changed nothing"
    );

    let moved = here
        .post(&path, Some(&json!({"position": "beginning"})))
        .await;
    assert_eq!(moved.status, 200, "{}", moved.text);
    assert_eq!(here.ack(&held_here[0].id).await, 410, "void at once here");
    wait_until(
        "the other replica sees the move",
        Duration::from_secs(3),
        || async {
            // Having seen it, that replica binds the consumer again: meanwhile its view is
            // 503 with Retry-After, never anything else.
            let view = there.get("/consumer").await;
            assert!(
                matches!(view.status, 200 | 503),
                "GET /consumer: {}",
                view.text
            );
            view.status == 200 && view.body["leases_in_flight"] == 0
        },
    )
    .await;
    assert_eq!(there.ack(&held_there[0].id).await, 410, "void there too");
    // Everything comes again, once, to whoever fetches.
    let mut again = fetch_all_and_ack(&here, 4).await;
    again.dedup();
    assert_eq!(again, vec![1, 2, 3, 4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seek_past_the_end_is_refused_naming_the_last_sequence_and_to_the_end_is_allowed() {
    let consumer = "past-the-end";
    let (_server, js, gateway) = Setup::consumer(consumer).start().await;
    js.publish_many("orders.1", 10, "m").await;
    let path = seek_path(consumer);

    for beyond in [
        json!(12),
        json!(99_999),
        json!(9_223_372_036_854_775_807_u64),
        json!(9_223_372_036_854_775_808_u64),
        json!(u64::MAX),
    ] {
        for dry_run in [true, false] {
            let reply = gateway
                .post(
                    &path,
                    Some(&json!({"sequence": beyond, "dry_run": dry_run})),
                )
                .await;
            reply.assert_invalid("sequence");
            let detail = reply.body["detail"].as_str().unwrap_or_default();
            if beyond
                .as_u64()
                .is_some_and(|beyond| beyond <= i64::MAX as u64)
            {
                assert!(detail.contains("last sequence is 10"), "{beyond}: {detail}");
            }
        }
    }
    // Nothing moved: every message is still delivered, and later ones too.
    js.publish("orders.1", "published later").await;
    assert_eq!(
        fetch_all_and_ack(&gateway, 11).await,
        (1..=11).collect::<Vec<_>>()
    );

    // To the end (the last sequence + 1): allowed, and its dry run says what it skips.
    js.publish_many("orders.1", 3, "skipped").await;
    let end = gateway
        .post(&path, Some(&json!({"sequence": 15, "dry_run": true})))
        .await;
    assert_eq!(end.status, 200, "{}", end.text);
    assert_eq!(
        (
            &end.body["sequence"],
            &end.body["skips"],
            &end.body["redelivers"]
        ),
        (&json!(15), &json!(3), &json!(0))
    );
    let moved = gateway.post(&path, Some(&json!({"sequence": 15}))).await;
    assert_eq!(moved.status, 200, "{}", moved.text);
    js.publish("orders.1", "after the end").await;
    assert_eq!(fetch_all_and_ack(&gateway, 1).await, vec![15]);
}

/// A floor record of another writer's (everything up to `last`, published by
/// `published_by`, ended), seen under the seek `mark`.
async fn store_floor_record(
    js: &crate::support::Js,
    consumer: &str,
    last: u64,
    published_by: i128,
    mark: &str,
) {
    let record = json!({
        "consumer": consumer,
        "settled": [],
        "floor": {"seq": last, "published_by_ns": published_by, "mark": mark},
    });
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Ruststream-Writer", "00000000000000ff");
    js.publish_with_headers(
        &format!("_RUSTSTREAM.settled.{STREAM}.{consumer}"),
        headers,
        record.to_string(),
    )
    .await;
}

/// A replica's compactor reads the consumer's ack floor, another replica moves the consumer
/// back (forgetting every record), then the first writes its floor record: a floor of the
/// consumer before the move, which would settle the whole replay unseen. Written here by
/// hand after the move, with the mark the consumer had before it; a gateway started then
/// reads every record before it leases, and must not believe that one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_floor_record_written_across_a_seek_by_another_replica_is_not_believed() {
    let consumer = "floor-across-seek";
    let (server, js) = crate::support::server_with_stream().await;
    let setup = Setup::consumer(consumer);
    let mut gateway = setup.process(&server.url()).await;
    let sequences = js.publish_many("orders.1", 10, "m").await;
    assert_eq!(fetch_all_and_ack(&gateway, 10).await, sequences);
    let last = *sequences.last().expect("ten sequences");
    let published_by = js
        .js
        .get_stream(STREAM)
        .await
        .expect("stream")
        .get_raw_message(last)
        .await
        .expect("the last message")
        .time
        .unix_timestamp_nanos();
    let reply = gateway
        .post(
            &seek_path(consumer),
            Some(&json!({"position": "beginning"})),
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    gateway.kill9();
    store_floor_record(&js, consumer, last, published_by, "").await;
    gateway.restart().await;
    assert_eq!(fetch_all_and_ack(&gateway, 10).await, sequences);
    // The move is marked done (a floor is written under that mark again), and a floor record
    // written under it is believed: after another move back, one said of all ten settles
    // the replay of all ten again.
    let mark = |info: async_nats::jetstream::consumer::Info| {
        info.config
            .metadata
            .get("ruststream_seek")
            .cloned()
            .unwrap_or_default()
    };
    let reply = gateway
        .post(
            &seek_path(consumer),
            Some(&json!({"position": "beginning"})),
        )
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    let now = mark(js.consumer_info(STREAM, consumer).await);
    assert!(
        !now.is_empty() && !now.ends_with("~moving"),
        "the mark left: {now:?}"
    );
    gateway.kill9();
    store_floor_record(&js, consumer, last, published_by, &now).await;
    gateway.restart().await;
    // Pulled for fetches that get none of them: each is settled again as the floor says.
    let deadline = crate::support::Deadline::after(
        "the replay settled again under the floor",
        Duration::from_secs(10),
    );
    loop {
        let leased = gateway.fetch_n(10, 300).await;
        assert!(leased.is_empty(), "leased under the floor: {leased:?}");
        let again = crate::support::Scrape::of(&gateway).await.get_or_zero(
            r#"ruststream_redeliveries_settled_again_total{kind="ack",source="fleet"}"#,
        );
        if again >= 10.0 {
            break;
        }
        deadline
            .tick_seeing(format_args!("{again} settled again"))
            .await;
    }
}
