//! Several replicas on one consumer, no sticky sessions: any replica settles any lease as the
//! replica that issued it would (forwarded to it over NATS), an owner killed, stalled or
//! being rolled, capacity and max_waiting shared by all, Idempotency-Key across replicas, a
//! replica with another lease key named (and not believed), and the consumer's settings
//! protected.

use std::io::Write as _;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::support::{
    Action, Gateway, GatewayProcess, Js, NatsServer, STREAM, Scrape, Setup, shared_key, wait_for,
    wait_until,
};

/// A nats-server with the stream and three in-process replicas of `setup` (given the shared
/// key), each ready and seeing the other two.
async fn three(setup: Setup) -> (NatsServer, Js, [Gateway; 3], tempfile::NamedTempFile) {
    let (server, js) = crate::support::server_with_stream().await;
    let key = shared_key();
    let setup = setup.lease_key_file(key.path());
    let a = setup.ready(&server.url()).await;
    let b = setup.ready(&server.url()).await;
    let c = setup.ready(&server.url()).await;
    for gateway in [&a, &b, &c] {
        wait_replicas(gateway, 3).await;
    }
    (server, js, [a, b, c], key)
}

/// Wait until `gateway`'s `GET /consumer` lists `count` live replicas.
async fn wait_replicas(gateway: &crate::support::Client, count: usize) -> Value {
    wait_for(
        &format!("{} lists {count} replicas", gateway.base()),
        Duration::from_secs(10),
        || async move {
            let view = gateway.consumer_view().await;
            let listed = view["replicas"].as_array().map_or(0, Vec::len);
            (listed == count).then_some(view)
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_replica_settles_any_lease_as_its_owner_would() {
    let (_server, js, [a, b, c], _key) = three(Setup::consumer("spread").ack_wait("30s")).await;
    js.publish_many("orders.1", 6, "m").await;
    let at_a = a.fetch_n(3, 1000).await;
    let at_b = b.fetch_n(3, 1000).await;
    assert_eq!((at_a.len(), at_b.len()), (3, 3));
    let before = Scrape::of(&b).await;

    // An ack at another replica: 204 once the server has it, the same again anywhere.
    assert_eq!(b.ack(&at_a[0].id).await, 204);
    assert_eq!(
        js.consumer_info(STREAM, "spread").await.num_ack_pending,
        5,
        "the forwarded ack was confirmed by the server before the 204"
    );
    assert_eq!(c.ack(&at_a[0].id).await, 204, "the same settle repeated");
    assert_eq!(c.nak(&at_a[0].id, None).await, 409, "another outcome");
    // A nak at B, an ack at C: 409; the nak repeated at C: 204.
    assert_eq!(b.nak(&at_a[1].id, None).await, 204);
    assert_eq!(c.ack(&at_a[1].id).await, 409);
    assert_eq!(c.nak(&at_a[1].id, None).await, 204);
    // In-progress at another replica answers the owner's new expiry.
    let extended = c.in_progress(&at_a[2].id).await;
    assert_eq!(extended.status, 200, "{}", extended.text);
    let extended_to = crate::support::rfc3339(
        extended.body["lease_expires_at"]
            .as_str()
            .expect("lease_expires_at"),
    );
    assert!(extended_to > at_a[2].lease_expires());
    // A tampered id: 404 at the replica it reached, not forwarded.
    let mut forged = at_a[2].id.clone().into_bytes();
    forged[20] = if forged[20] == b'A' { b'B' } else { b'A' };
    let forged = String::from_utf8(forged).expect("ascii");
    assert_eq!(b.ack(&forged).await, 404);

    // A batch with ids of three replicas (and one forged): each answered in request order.
    let ids = vec![
        at_b[0].id.clone(),
        at_a[2].id.clone(),
        forged.clone(),
        at_b[1].id.clone(),
        at_a[0].id.clone(),
    ];
    let results = c.settle_many_ok(Action::Ack, &json!({ "ids": ids })).await;
    let statuses: Vec<(String, u16)> = ids.iter().cloned().zip([204, 204, 404, 204, 204]).collect();
    assert_eq!(results, statuses);
    assert_eq!(
        js.consumer_info(STREAM, "spread").await.num_ack_pending,
        2,
        "left: the nak'd message redelivered (or pending) and at_b[2]"
    );

    let after = Scrape::of(&b).await;
    assert_eq!(
        after.get(r#"ruststream_settles_forwarded_total{result="ok"}"#)
            - before.get_or_zero(r#"ruststream_settles_forwarded_total{result="ok"}"#),
        2.0,
        "B forwarded the ack and the nak"
    );
    let received = Scrape::of(&a).await;
    assert!(received.get(r#"ruststream_forwarded_settles_received_total{result="ok"}"#) >= 5.0);
    assert_eq!(received.get("ruststream_replicas"), 3.0);

    // GET /consumer lists the three, each once, with this one marked.
    let view = c.consumer_view().await;
    let replicas = view["replicas"].as_array().expect("replicas");
    assert_eq!(replicas.len(), 3, "{view}");
    let this: Vec<&Value> = replicas
        .iter()
        .filter(|r| r["this_replica"] == true)
        .collect();
    assert_eq!(this.len(), 1);
    assert_eq!(this[0]["instance_id"], view["instance_id"]);
    assert!(replicas.iter().all(|r| r["lease_key_matches"] == true));
    // B still holds at_b[2]: its next heartbeat says so.
    wait_for(
        "B's lease shows in the list",
        Duration::from_secs(5),
        || {
            let c = &c;
            async move {
                let view = c.consumer_view().await;
                let held: u64 = view["replicas"]
                    .as_array()?
                    .iter()
                    .filter_map(|r| r["leases_in_flight"].as_u64())
                    .sum();
                (held == 1).then_some(())
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_superseded_lease_is_refused_at_every_replica_and_nothing_stale_reaches_the_server() {
    let (_server, js, [a, b, c], _key) = three(Setup::consumer("stale").ack_wait("2s")).await;
    let sequence = js.publish("orders.1", "once").await;
    let first = a.fetch_n(1, 1000).await.remove(0);
    // A's lease expires; the server redelivers the message, here to B.
    let again = wait_for(
        "the message is redelivered at B",
        Duration::from_secs(10),
        || {
            let b = &b;
            async move {
                b.fetch_n(1, 500)
                    .await
                    .into_iter()
                    .find(|m| m.stream_sequence == sequence && m.delivered == 2)
            }
        },
    )
    .await;
    assert_eq!(
        c.ack(&first.id).await,
        410,
        "A's expired lease, settled at C"
    );
    assert_eq!(b.ack(&first.id).await, 410);
    assert_eq!(
        js.consumer_info(STREAM, "stale").await.num_ack_pending,
        1,
        "the stale ack did not settle B's delivery"
    );
    assert_eq!(a.ack(&again.id).await, 204, "B's lease, settled at A");
    assert_eq!(js.consumer_info(STREAM, "stale").await.num_ack_pending, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_killed_answers_410_a_stalled_one_504_and_a_rolled_one_keeps_settling() {
    let (server, js) = crate::support::server_with_stream().await;
    let key = shared_key();
    let setup = Setup::consumer("owners")
        .lease_key_file(key.path())
        .settle_timeout("1s")
        .shutdown_grace("20s");
    let mut owner = setup.process(&server.url()).await;
    let other = setup.ready(&server.url()).await;
    wait_replicas(&other, 2).await;
    js.publish_many("orders.1", 4, "m").await;
    let leased = owner.fetch_n(4, 1000).await;
    assert_eq!(leased.len(), 4);

    // Stalled: 504 after the settle timeout, the lease stays valid, a retry succeeds.
    owner.pause();
    let started = Instant::now();
    let reply = other.settle(&leased[0].id, Action::Ack, None).await;
    assert_eq!(reply.status, 504, "{}", reply.text);
    assert!(started.elapsed() >= Duration::from_secs(1));
    owner.resume();
    assert_eq!(other.ack(&leased[0].id).await, 204);

    // Being rolled (SIGTERM): through its grace it still settles its leases.
    owner.sigterm();
    wait_until(
        "the owner is shutting down",
        Duration::from_secs(5),
        || async { owner.readyz().await == 503 },
    )
    .await;
    assert_eq!(other.ack(&leased[1].id).await, 204);
    assert_eq!(other.nak(&leased[2].id, None).await, 204);
    assert_eq!(other.ack(&leased[3].id).await, 204);
    let exited = owner.wait_exit(Duration::from_secs(10)).await;
    assert!(exited.success(), "{}", owner.log());

    // Killed: a settle of its leases answers 410 within 3 s.
    let mut owner = setup.process(&server.url()).await;
    let lease = wait_for(
        "the nak'd message is leased again",
        Duration::from_secs(10),
        || {
            let owner = &owner;
            async move { owner.fetch_n(1, 500).await.pop() }
        },
    )
    .await;
    owner.kill9();
    let started = Instant::now();
    assert_eq!(other.ack(&lease.id).await, 410);
    assert!(started.elapsed() < Duration::from_secs(3));
}

/// A killed owner's lease past its `lease_expires_at` is refused 410 at once at another
/// replica: its id says when it ended, so the owner is not asked again for 2 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_owners_expired_lease_is_refused_410_at_once_at_another_replica() {
    let (server, js) = crate::support::server_with_stream().await;
    let key = shared_key();
    let setup = Setup::consumer("expired")
        .lease_key_file(key.path())
        .ack_wait("3s");
    let mut owner = setup.process(&server.url()).await;
    let other = setup.ready(&server.url()).await;
    wait_replicas(&other, 2).await;
    js.publish_many("orders.1", 2, "m").await;
    let leased = owner.fetch_n(2, 1000).await;
    owner.kill9();
    let expires = leased[0].lease_expires().max(leased[1].lease_expires());
    wait_until(
        "the leases are past their lease_expires_at",
        Duration::from_secs(10),
        || async { time::OffsetDateTime::now_utc() > expires },
    )
    .await;
    for (lease, action) in leased.iter().zip([Action::Ack, Action::Nak]) {
        let started = Instant::now();
        let reply = other.settle(&lease.id, action, None).await;
        assert_eq!(reply.status, 410, "{}", reply.text);
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "answered after {:?}: the owner was asked again as if the lease could be live",
            started.elapsed()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_is_the_consumers_not_the_replicas() {
    let (_server, js, [a, b, c], _key) =
        three(Setup::consumer("shared-cap").max_ack_pending(4)).await;
    js.publish_many("orders.1", 6, "m").await;
    let at_a = a.fetch_n(2, 1000).await;
    let at_b = b.fetch_n(2, 1000).await;
    assert_eq!((at_a.len(), at_b.len()), (2, 2));

    // C holds nothing, yet the consumer is full: 429 within 2 s, not an empty 200.
    let started = Instant::now();
    let reply = wait_for("C refuses with 429", Duration::from_secs(5), || {
        let c = &c;
        async move {
            let reply = c
                .fetch_reply(Some(&json!({ "batch": 1, "wait_ms": 10000 })))
                .await;
            (reply.status != 200 || !reply.messages().is_empty()).then_some(reply)
        }
    })
    .await;
    reply.assert_problem(429);
    assert!(reply.retry_after_secs() >= 1);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );

    // Settles anywhere free slots: C leases again.
    assert_eq!(c.ack(&at_a[0].id).await, 204);
    assert_eq!(c.ack(&at_b[0].id).await, 204);
    let leased = wait_for("C leases again", Duration::from_secs(5), || {
        let c = &c;
        async move {
            let reply = c
                .fetch_reply(Some(&json!({ "batch": 2, "wait_ms": 1000 })))
                .await;
            (reply.status == 200 && !reply.messages().is_empty()).then(|| reply.messages())
        }
    })
    .await;
    assert!(!leased.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotency_key_retried_at_another_replica_gets_the_first_answer() {
    let (_server, js, [a, b, c], _key) = three(Setup::consumer("keyed")).await;
    js.publish_many("orders.1", 5, "m").await;
    let request = json!({ "batch": 2, "wait_ms": 1000 });
    let first = a.fetch_keyed("order-run-7", &request).await;
    assert_eq!(first.status, 200, "{}", first.text);
    let first_ids: Vec<String> = first.messages().into_iter().map(|m| m.id).collect();
    assert_eq!(first_ids.len(), 2);

    let retried = b.fetch_keyed("order-run-7", &request).await;
    assert_eq!(retried.status, 200, "{}", retried.text);
    assert_eq!(
        retried
            .headers
            .get("idempotent-replayed")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..])
    );
    let retried_ids: Vec<String> = retried.messages().into_iter().map(|m| m.id).collect();
    assert_eq!(retried_ids, first_ids, "the same leases, not new ones");
    assert_eq!(retried.body["messages"], first.body["messages"]);

    let other = c
        .fetch_keyed("order-run-7", &json!({ "batch": 3, "wait_ms": 1000 }))
        .await;
    other.assert_invalid("Idempotency-Key");
    assert_eq!(
        js.consumer_info(STREAM, "keyed").await.num_ack_pending,
        2,
        "no replica leased anything more"
    );

    // Once every lease of the first answer ended, the key is free at every replica.
    for id in &first_ids {
        assert_eq!(c.ack(id).await, 204);
    }
    let fresh = b.fetch_keyed("order-run-7", &request).await;
    assert_eq!(fresh.status, 200, "{}", fresh.text);
    assert!(fresh.headers.get("idempotent-replayed").is_none());
    let fresh_ids: Vec<String> = fresh.messages().into_iter().map(|m| m.id).collect();
    assert_eq!(fresh_ids.len(), 2);
    assert!(fresh_ids.iter().all(|id| !first_ids.contains(id)));
    let again = c.fetch_keyed("order-run-7", &request).await;
    assert_eq!(
        again
            .messages()
            .into_iter()
            .map(|m| m.id)
            .collect::<Vec<_>>(),
        fresh_ids,
        "the new answer is the one replayed now"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_with_another_lease_key_is_named_in_the_log_and_not_believed() {
    let (server, _js) = crate::support::server_with_stream().await;
    let key = shared_key();
    let first = Setup::consumer("two-keys")
        .lease_key_file(key.path())
        .ready(&server.url())
        .await;
    let mut other_key = tempfile::NamedTempFile::new().expect("temp");
    write!(other_key, "another lease key altogether: 0123456789!").expect("write");
    let second = Setup::consumer("two-keys")
        .lease_key_file(other_key.path())
        .process(&server.url())
        .await;
    let first_id = first.consumer_view().await["instance_id"]
        .as_str()
        .expect("instance id")
        .to_owned();
    wait_until(
        "the second names the first in an error",
        Duration::from_secs(5),
        || {
            let log = second.log();
            let first_id = first_id.clone();
            async move {
                log.lines().any(|line| {
                    line.contains("ERROR")
                        && line.contains(&first_id)
                        && line.contains("--lease-key-file")
                })
            }
        },
    )
    .await;
    // Its heartbeat cannot be told from a forgery: neither counts the other.
    for gateway in [&*first, &*second] {
        let view = gateway.consumer_view().await;
        assert_eq!(view["replicas"].as_array().map(Vec::len), Some(1), "{view}");
    }
    wait_until(
        "the first counts the second's heartbeats as rejected",
        Duration::from_secs(5),
        || async {
            Scrape::of(&first)
                .await
                .get(r#"ruststream_internal_messages_rejected_total{kind="heartbeat"}"#)
                >= 1.0
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_may_not_change_the_settings_of_a_consumer_others_use() {
    let (server, js) = crate::support::server_with_stream().await;
    let key = shared_key();
    let running = Setup::consumer("guarded")
        .lease_key_file(key.path())
        .ack_wait("30s")
        .ready(&server.url())
        .await;
    let running_id = running.consumer_view().await["instance_id"]
        .as_str()
        .expect("instance id")
        .to_owned();
    js.publish("orders.1", "held").await;
    let held = running.fetch_n(1, 1000).await.remove(0);

    for (flag, value, field, values) in [
        ("--ack-wait", "2s", "ack_wait", "from 30s to 2s"),
        (
            "--max-ack-pending",
            "7",
            "max_ack_pending",
            "from 1024 to 7",
        ),
        ("--filter-subject", "orders.eu.>", "filter", "orders.eu.>"),
        ("--max-deliver", "3", "max_deliver", "from -1 to 3"),
    ] {
        let mut refused = GatewayProcess::spawn(
            &Setup::consumer("guarded")
                .lease_key_file(key.path())
                .flag(flag, value),
            &server.url(),
        );
        let status = refused.wait_exit(Duration::from_secs(20)).await;
        let log = refused.log();
        assert!(!status.success(), "{flag} {value}: {log}");
        assert!(
            log.contains(field) && log.contains(values) && log.contains(&running_id),
            "{flag} {value}: the refusal names the field, both values and the replica: {log}"
        );
    }
    let info = js.consumer_info(STREAM, "guarded").await;
    assert_eq!(info.config.ack_wait, Duration::from_secs(30));
    assert_eq!(info.config.max_ack_pending, 1024);
    assert_eq!(info.config.filter_subject, "");
    assert_eq!(running.ack(&held.id).await, 204);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_made_outside_the_gateways_is_followed_within_seconds() {
    let (_server, js, gateway) = Setup::consumer("edited").ack_wait("30s").start().await;
    js.publish_many("orders.1", 2, "m").await;
    let held = gateway.fetch_n(1, 1000).await.remove(0);

    // `nats consumer edit`: ack_wait down to 3 s.
    let stream = js.js.get_stream(STREAM).await.expect("stream");
    let mut config: async_nats::jetstream::consumer::pull::Config =
        async_nats::jetstream::consumer::FromConsumer::try_from_consumer_config(
            js.consumer_info(STREAM, "edited").await.config,
        )
        .expect("a pull consumer");
    config.ack_wait = Duration::from_secs(3);
    stream
        .update_consumer(config)
        .await
        .expect("edit the consumer");
    let edited = Instant::now();

    wait_until(
        "the gateway follows the new ack_wait",
        Duration::from_secs(5),
        || {
            let gateway = &gateway;
            async move { Scrape::of(gateway).await.get("ruststream_ack_wait_seconds") == 3.0 }
        },
    )
    .await;
    // New leases follow it…
    let fresh = gateway.fetch_n(1, 1000).await.remove(0);
    let lifetime =
        crate::support::rfc3339(&fresh.lease_expires_at) - time::OffsetDateTime::now_utc();
    assert!(lifetime <= time::Duration::seconds(3), "{lifetime}");
    // …and the old one ends no later than the server now redelivers it.
    wait_until("the old lease has ended", Duration::from_secs(5), || {
        let gateway = &gateway;
        async move { gateway.leases_in_flight().await < 2 }
    })
    .await;
    assert!(
        edited.elapsed() < Duration::from_secs(4),
        "{:?}",
        edited.elapsed()
    );
    assert_eq!(gateway.ack(&held.id).await, 410);
    assert_eq!(gateway.ack(&fresh.id).await, 204);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_share_max_waiting_among_2100_long_polls() {
    const POLLS_PER_REPLICA: usize = 700;
    const WAIT_MS: u64 = 5000;
    const MESSAGES: usize = 100;
    let (_server, js, replicas, _key) = three(Setup::consumer("crowd")).await;
    assert_eq!(
        js.consumer_info(STREAM, "crowd").await.config.max_waiting,
        512,
        "the server's default"
    );
    let mut polls = tokio::task::JoinSet::new();
    for gateway in &replicas {
        for _ in 0..POLLS_PER_REPLICA {
            let client = gateway.client().clone();
            polls.spawn(async move {
                let sent = Instant::now();
                let reply = client
                    .fetch_reply(Some(&json!({ "batch": 1, "wait_ms": WAIT_MS })))
                    .await;
                (reply, sent.elapsed())
            });
        }
    }
    // Published while every poll waits.
    wait_until("the polls are all waiting", Duration::from_secs(30), || {
        let replicas = &replicas;
        async move {
            let mut waiting = 0.0;
            for gateway in replicas {
                waiting += Scrape::of(gateway)
                    .await
                    .get("ruststream_fetches_in_progress");
            }
            waiting >= (3 * POLLS_PER_REPLICA) as f64
        }
    })
    .await;
    // Together the replicas keep at most half the consumer's max_waiting open: the server
    // never turns a pull away ("Exceeded MaxWaiting") and other clients keep room.
    // Pulls are slices of a second: between two a sample may see none, never more than 256.
    let seen = std::sync::Mutex::new(Vec::new());
    wait_until(
        "pull requests waiting at the server",
        Duration::from_secs(5),
        || {
            let (js, seen) = (&js, &seen);
            async move {
                let waiting = js.consumer_info(STREAM, "crowd").await.num_waiting;
                seen.lock().expect("samples").push(waiting);
                waiting > 0
            }
        },
    )
    .await;
    let seen = seen.into_inner().expect("samples");
    assert!(
        seen.iter().all(|waiting| *waiting <= 256),
        "pull requests waiting at the server, never more than 256: {seen:?}"
    );
    js.publish_many("orders.1", MESSAGES, "m").await;

    let mut leased = std::collections::HashMap::new();
    let mut answers = 0;
    while let Some(joined) = polls.join_next().await {
        let (reply, took) = joined.expect("a poll task");
        answers += 1;
        assert_eq!(reply.status, 200, "{}", reply.text);
        let messages = reply.messages();
        if messages.is_empty() {
            assert!(
                took >= Duration::from_millis(WAIT_MS),
                "an empty answer before its wait_ms: {took:?}"
            );
        }
        for message in messages {
            *leased.entry(message.stream_sequence).or_insert(0) += 1;
        }
    }
    assert_eq!(answers, 3 * POLLS_PER_REPLICA);
    assert_eq!(leased.len(), MESSAGES, "every message leased");
    assert!(
        leased.values().all(|count| *count == 1),
        "each message leased exactly once: {leased:?}"
    );
}
