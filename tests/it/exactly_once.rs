//! Exactly once across the fleet: a message whose ack or term was answered 2xx is never
//! leased again by any gateway sharing the consumer — the one that confirmed it killed with
//! the server and restarted, other replicas after the server forgot, a consumer deleted and
//! made again — because the settle is answered only once its record is stored in the
//! gateway's settled records stream, which every gateway reads back. And when that record
//! cannot be stored, the settle is answered 503, never 2xx.
//!
//! The server runs at its default sync_interval: killed -9, it forgets acks it confirmed
//! (its consumer state is written behind), as NATS-FACTS says; each scenario checks from the
//! server's own count that it did forget some, so that the gateway's records were needed.

use std::collections::HashSet;
use std::time::Duration;

use serde_json::json;

use crate::support::{
    Action, Client, Js, STREAM, Scrape, Setup, assert_stays, shared_key, wait_for,
};

const MESSAGES: usize = 40;

/// `ruststream_redeliveries_settled_again_total` of both kinds from `source`.
fn settled_again(scrape: &Scrape, source: &str) -> f64 {
    ["ack", "term"]
        .iter()
        .map(|kind| {
            scrape.get_or_zero(&format!(
                "ruststream_redeliveries_settled_again_total{{kind=\"{kind}\",source=\"{source}\"}}"
            ))
        })
        .sum()
}

/// Publish, lease at `gateway`, ack three quarters (one batch) and term the rest (each
/// answered 204); the stream sequences settled.
async fn settle_a_burst(js: &Js, gateway: &Client) -> HashSet<u64> {
    js.publish_many("orders.1", MESSAGES, "m").await;
    let leased = gateway.fetch_n(MESSAGES as u64, 3000).await;
    assert_eq!(leased.len(), MESSAGES);
    let (terms, acks) = leased.split_at(MESSAGES / 4);
    let ack_ids: Vec<&str> = acks.iter().map(|m| m.id.as_str()).collect();
    let acked = gateway
        .settle_many_ok(Action::Ack, &json!({ "ids": ack_ids }))
        .await;
    assert!(acked.iter().all(|(_, status)| *status == 204), "{acked:?}");
    for message in terms {
        let reply = gateway
            .settle(&message.id, Action::Term, Some(&json!({ "reason": "bad" })))
            .await;
        assert_eq!(reply.status, 204, "{}", reply.text);
    }
    leased.iter().map(|m| m.stream_sequence).collect()
}

/// What the server counts as still to deliver or unacked on `consumer`.
async fn server_owes(js: &Js, consumer: &str) -> u64 {
    let info = js.consumer_info(STREAM, consumer).await;
    info.num_ack_pending as u64 + info.num_pending
}

/// Fetch at every gateway of `at` until the server owes nothing on `consumer`, asserting
/// that nothing is ever leased (a 503 while a gateway reads the consumer's state back after
/// the server's restart leases nothing either).
async fn drained_without_a_lease(js: &Js, consumer: &str, at: &[&Client]) {
    wait_for(
        "the server holds nothing pending",
        Duration::from_secs(30),
        || async {
            for gateway in at {
                let reply = gateway
                    .fetch_reply(Some(&json!({"batch": MESSAGES, "wait_ms": 300})))
                    .await;
                match reply.status {
                    200 => assert!(
                        reply.messages().is_empty(),
                        "a message answered 204 was leased again at {}: {}",
                        gateway.base(),
                        reply.text
                    ),
                    503 => {}
                    status => panic!("fetch at {}: {status} {}", gateway.base(), reply.text),
                }
            }
            (server_owes(js, consumer).await == 0).then_some(())
        },
    )
    .await;
    assert_stays(
        "nothing is leased again",
        Duration::from_secs(2),
        || async {
            for gateway in at {
                if !gateway.fetch_n(10, 200).await.is_empty() {
                    return false;
                }
            }
            true
        },
    )
    .await;
}

/// (a) One nats-server at its default sync and one gateway, killed -9 together right after a
/// burst of confirmed acks and terms, then both started again: the server has forgotten some
/// of those settles and delivers the messages again; the new gateway process — no lease key
/// file, so nothing of its predecessor's but the records — settles each again, and leases
/// none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_and_its_gateway_killed_together_lease_nothing_answered_before() {
    let consumer = "once-together";
    let (mut server, js) = crate::support::server_with_stream().await;
    let setup = Setup::consumer(consumer).ack_wait("2s");
    let mut gateway = setup.process(&server.url()).await;
    let mut forgotten = 0;
    for _ in 0..5 {
        settle_a_burst(&js, &gateway).await;
        server.kill();
        gateway.kill9();
        server.restart().await;
        forgotten = server_owes(&js, consumer).await;
        gateway.restart().await;
        if forgotten > 0 {
            break;
        }
    }
    assert!(
        forgotten > 0,
        "no kill inside the server's write-behind window in 5 tries"
    );
    drained_without_a_lease(&js, consumer, &[&gateway]).await;
    let scrape = Scrape::of(&gateway).await;
    assert_eq!(
        settled_again(&scrape, "fleet"),
        forgotten as f64,
        "each forgotten settle was settled again from the records, once"
    );
}

/// (b) Three replicas, non-sticky: the acks are confirmed at replica A; the server is killed
/// -9 and comes back having forgotten some; the redeliveries are fetched at B and C only,
/// which never confirmed them: neither leases one, both settle them again from A's records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_that_never_confirmed_an_ack_still_never_lease_it_again() {
    let consumer = "once-replicas";
    let (mut server, js) = crate::support::server_with_stream().await;
    let key = shared_key();
    let setup = Setup::consumer(consumer)
        .ack_wait("2s")
        .lease_key_file(key.path());
    let a = setup.ready(&server.url()).await;
    let b = setup.ready(&server.url()).await;
    let c = setup.ready(&server.url()).await;
    let mut forgotten = 0;
    for _ in 0..5 {
        settle_a_burst(&js, &a).await;
        server.kill();
        server.restart().await;
        forgotten = server_owes(&js, consumer).await;
        if forgotten > 0 {
            break;
        }
    }
    assert!(
        forgotten > 0,
        "no kill inside the server's write-behind window in 5 tries"
    );
    drained_without_a_lease(&js, consumer, &[&b, &c]).await;
    let from_fleet = settled_again(&Scrape::of(&b).await, "fleet")
        + settled_again(&Scrape::of(&c).await, "fleet");
    assert_eq!(
        from_fleet, forgotten as f64,
        "B and C settled again, from A's records, each message the server forgot"
    );
}

/// (d) A consumer deleted and made again under its name delivers from the start: a new
/// gateway process (the one that settled is gone) leases only what was never acked or
/// terminated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_made_again_leases_only_what_never_ended() {
    let consumer = "once-recreated";
    let (server, js) = crate::support::server_with_stream().await;
    let setup = Setup::consumer(consumer);
    let mut first = setup.process(&server.url()).await;
    let settled = settle_a_burst(&js, &first).await;
    let open: Vec<u64> = js.publish_many("orders.1", 3, "later").await;
    first.kill9();
    js.delete_consumer(STREAM, consumer).await;
    let second = setup.process(&server.url()).await;
    let mut seen = HashSet::new();
    let deadline =
        crate::support::Deadline::after("the three never settled", Duration::from_secs(20));
    while seen.len() < open.len() {
        for message in second.fetch_n(MESSAGES as u64, 500).await {
            assert!(
                !settled.contains(&message.stream_sequence),
                "a message answered 204 before was leased again: {message:?}"
            );
            seen.insert(message.stream_sequence);
            assert_eq!(second.ack(&message.id).await, 204);
        }
        deadline.tick_seeing(format_args!("{seen:?}")).await;
    }
    assert_eq!(seen, open.into_iter().collect::<HashSet<u64>>());
    drained_without_a_lease(&js, consumer, &[&second]).await;
    assert_eq!(
        settled_again(&Scrape::of(&second).await, "fleet"),
        MESSAGES as f64
    );
}

/// (f) When the record cannot be stored (here its stream is full and refuses more), the
/// settle is answered 503 with Retry-After — never 2xx — though the server has the ack; the
/// same id retried once the record can be stored is answered 204 and leaves the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settle_whose_record_cannot_be_stored_is_answered_503_then_204_on_retry() {
    let consumer = "once-unrecorded";
    let (_server, js, gateway) = Setup::consumer(consumer).start().await;
    js.publish_many("orders.1", 3, "m").await;
    let leased = gateway.fetch_n(3, 2000).await;
    assert_eq!(leased.len(), 3);
    assert_eq!(gateway.ack(&leased[0].id).await, 204);
    let records = records_stream(&js).await;
    let full = records.cached_info().config.clone();
    let refusing = async_nats::jetstream::stream::Config {
        max_messages: 1,
        discard: async_nats::jetstream::stream::DiscardPolicy::New,
        ..full.clone()
    };
    js.js
        .update_stream(&refusing)
        .await
        .expect("fill the records stream");

    let single = gateway.settle(&leased[1].id, Action::Ack, None).await;
    single.assert_problem(503);
    assert!(single.retry_after_secs() >= 1, "Retry-After on a 503");
    let batch = gateway
        .settle_many_ok(Action::Term, &json!({ "ids": [leased[2].id] }))
        .await;
    assert_eq!(batch[0].1, 503, "{batch:?}");
    assert_eq!(records_held(&js).await, 1, "no record of either");

    js.js.update_stream(&full).await.expect("room again");
    assert_eq!(gateway.ack(&leased[1].id).await, 204, "the retry");
    let reply = gateway
        .settle_many_ok(Action::Term, &json!({ "ids": [leased[2].id] }))
        .await;
    assert_eq!(reply[0].1, 204, "{reply:?}");
    assert_eq!(records_held(&js).await, 3, "a record of each retry");
    assert_eq!(server_owes(&js, consumer).await, 0);
}

/// The settled records stream of `ORDERS`.
async fn records_stream(js: &Js) -> async_nats::jetstream::stream::Stream {
    let names: Vec<String> = futures::TryStreamExt::try_collect(js.js.stream_names())
        .await
        .expect("stream names");
    let name = names
        .into_iter()
        .find(|name| name.starts_with("RUSTSTREAM_SETTLED_ORDERS_"))
        .expect("the settled records stream of ORDERS");
    js.js.get_stream(name).await.expect("the records stream")
}

async fn records_state(js: &Js) -> async_nats::jetstream::stream::State {
    let mut stream = records_stream(js).await;
    stream
        .info()
        .await
        .expect("records stream info")
        .state
        .clone()
}

/// How many records the stream holds now.
async fn records_held(js: &Js) -> u64 {
    records_state(js).await.messages
}

/// (c) Every gateway killed -9 with the server, and a new one started in their place: it
/// settles again what the server forgot, from the records both wrote, and leases none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_gateway_after_every_one_was_killed_leases_nothing_answered_before() {
    let consumer = "once-all-killed";
    let (mut server, js) = crate::support::server_with_stream().await;
    let key = shared_key();
    let setup = Setup::consumer(consumer)
        .ack_wait("2s")
        .lease_key_file(key.path());
    let mut forgotten = 0;
    for _ in 0..5 {
        let mut a = setup.process(&server.url()).await;
        let mut b = setup.process(&server.url()).await;
        settle_a_burst(&js, &a).await;
        settle_a_burst(&js, &b).await;
        server.kill();
        a.kill9();
        b.kill9();
        server.restart().await;
        forgotten = server_owes(&js, consumer).await;
        if forgotten > 0 {
            break;
        }
    }
    assert!(
        forgotten > 0,
        "no kill inside the server's write-behind window in 5 tries"
    );
    let fresh = setup.process(&server.url()).await;
    drained_without_a_lease(&js, consumer, &[&fresh]).await;
    assert_eq!(
        settled_again(&Scrape::of(&fresh).await, "fleet"),
        forgotten as f64,
        "the new gateway settled again, from the others' records, each message forgotten"
    );
}

/// With a lease key, a record nobody sealed is not believed: published under the prefix by
/// anyone allowed to, it would otherwise have messages acked that nobody processed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsealed_record_settles_nothing() {
    let consumer = "once-forged";
    let (server, js) = crate::support::server_with_stream().await;
    let key = shared_key();
    let gateway = Setup::consumer(consumer)
        .lease_key_file(key.path())
        .ready(&server.url())
        .await;
    let sequences = js.publish_many("orders.1", 3, "m").await;
    let stream = js.js.get_stream(STREAM).await.expect("stream");
    let mut settled = Vec::new();
    for sequence in &sequences {
        let message = stream.get_raw_message(*sequence).await.expect("message");
        settled.push(json!({
            "seq": sequence,
            "published_ns": message.time.unix_timestamp_nanos(),
            "final": "ack",
        }));
    }
    let forged = json!({ "consumer": consumer, "settled": settled });
    js.publish_with_headers(
        &format!("_RUSTSTREAM.settled.{STREAM}.{consumer}"),
        async_nats::HeaderMap::new(),
        forged.to_string(),
    )
    .await;
    let mut leased = HashSet::new();
    let deadline = crate::support::Deadline::after("the three leased", Duration::from_secs(10));
    while leased.len() < sequences.len() {
        for message in gateway.fetch_n(3, 500).await {
            leased.insert(message.stream_sequence);
        }
        deadline.tick_seeing(format_args!("{leased:?}")).await;
    }
    assert_eq!(settled_again(&Scrape::of(&gateway).await, "fleet"), 0.0);
}

/// A settle's record goes out alongside it; when the settle then goes unconfirmed (here the
/// gateway's NATS user may not ack at all, so the ack times out), the answer is non-2xx and
/// a later record voids the first: another gateway hands the message out again when it
/// comes back, as the non-2xx answer said it may.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ack_answered_non_2xx_is_not_taken_as_ended_by_the_fleet() {
    let consumer = "once-void";
    let server = crate::support::NatsServer::with_config(
        r#"authorization { users = [
            { user: admin, password: "pw-admin" }
            { user: gw, password: "pw-gw",
              permissions: { publish: { allow: ">", deny: "$JS.ACK.>" }, subscribe: ">" } }
        ] }"#,
    )
    .await;
    let client =
        async_nats::ConnectOptions::with_user_and_password("admin".into(), "pw-admin".into())
            .connect(server.url())
            .await
            .expect("connect as admin");
    let js = Js {
        js: async_nats::jetstream::new(client.clone()),
        client,
    };
    js.create_stream(STREAM, &["orders.>"]).await;
    let setup = Setup::consumer(consumer).ack_wait("2s");
    let mut unable = setup
        .clone()
        .settle_timeout("1s")
        .flag("--nats-user", "gw")
        .flag("--nats-password", "pw-gw")
        .process(&server.url())
        .await;
    let sequence = js.publish("orders.1", "m").await;
    let leased = unable.fetch_n(1, 2000).await;
    assert_eq!(leased.len(), 1);
    assert_eq!(
        unable.ack(&leased[0].id).await,
        504,
        "an ack the server never confirmed, within the settle timeout"
    );
    wait_for(
        "the record and its void stored",
        Duration::from_secs(10),
        || async { (records_held(&js).await >= 2).then_some(()) },
    )
    .await;
    unable.kill9();

    let able = setup
        .flag("--nats-user", "admin")
        .flag("--nats-password", "pw-admin")
        .process(&server.url())
        .await;
    let again = able.fetch_n(1, 5000).await;
    assert_eq!(again.len(), 1, "the message handed out again");
    assert_eq!(again[0].stream_sequence, sequence);
    assert_eq!(able.ack(&again[0].id).await, 204);
    assert_eq!(settled_again(&Scrape::of(&able).await, "fleet"), 0.0);
}

/// (g) The records stay bounded by what is pending, not by traffic: a second after the
/// consumer's ack floor moved (in the server's files by then), a floor record replaces the
/// records under it, and a newer floor record the older one — at the server's default sync
/// (not known to the gateway) and at `sync_interval: always`. A consumer made again after
/// that, delivering everything from the start, still leases none of it. (An hour of traffic
/// is simulated in the compactor's own tests.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_under_the_ack_floor_give_way_to_a_floor_record() {
    const ROUNDS: usize = 2;
    const PER_ROUND: usize = 1_000;
    let consumer = "once-bounded";
    for sync_always in [false, true] {
        let (server, _monitor) = crate::support::NatsServer::with_monitoring(sync_always).await;
        let js = Js::connect(&server.url()).await;
        js.create_stream(STREAM, &["orders.>"]).await;
        let setup = Setup::consumer(consumer);
        let mut first = setup.process(&server.url()).await;
        js.publish_many("orders.1", ROUNDS * PER_ROUND, "m").await;
        for round in 1..=ROUNDS {
            let mut drained = 0;
            while drained < PER_ROUND {
                let leased = first.fetch_n(50, 2000).await;
                let ids: Vec<&str> = leased.iter().map(|m| m.id.as_str()).collect();
                let acked = first
                    .settle_many_ok(Action::Ack, &json!({ "ids": ids }))
                    .await;
                assert!(acked.iter().all(|(_, status)| *status == 204), "{acked:?}");
                drained += leased.len();
            }
            wait_for(
                &format!(
                    "sync always {sync_always}, round {round}: the records under the floor dropped"
                ),
                Duration::from_secs(30),
                || async {
                    let held = records_held(&js).await;
                    (held <= 1).then_some(held)
                },
            )
            .await;
        }
        // A batch ack's settles share a record (or a few, when the writer takes some of
        // them while the rest are still being queued), never one each.
        // Every record ever stored, dropped or not.
        let written = records_state(&js).await.last_sequence;
        let drained = (ROUNDS * PER_ROUND) as u64;
        assert!(
            (drained / 50..drained / 10).contains(&written),
            "about a record per batch ack of 50, and a floor record a round: {written}"
        );

        first.kill9();
        js.delete_consumer(STREAM, consumer).await;
        let second = setup.process(&server.url()).await;
        drained_without_a_lease(&js, consumer, &[&second]).await;
        assert_eq!(
            settled_again(&Scrape::of(&second).await, "fleet"),
            drained as f64,
            "sync always {sync_always}: each message settled again under the floor record"
        );
    }
}
