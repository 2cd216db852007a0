//! What replicas tell each other cannot be forged by a NATS user who may publish (or only
//! listen) under the internal prefix: forged heartbeats, keyed answers, forwarded settles and
//! forwarded answers are dropped and counted; a passive subscriber does not keep a dead
//! owner's leases "valid".

use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use futures::{StreamExt as _, TryStreamExt as _};
use serde_json::{Value, json};

use crate::support::{Js, STREAM, Scrape, Setup, shared_key, wait_for, wait_until};

const PREFIX: &str = "_RUSTSTREAM";

fn rejected(scrape: &Scrape, kind: &str) -> f64 {
    scrape.get(&format!(
        r#"ruststream_internal_messages_rejected_total{{kind="{kind}"}}"#
    ))
}

async fn replicas_listed(gateway: &crate::support::Client) -> usize {
    gateway.consumer_view().await["replicas"]
        .as_array()
        .map_or(0, Vec::len)
}

/// The stream the fleet's replicas share.
async fn fleet_stream(js: &Js) -> async_nats::jetstream::stream::Stream {
    js.js
        .get_stream("RUSTSTREAM_FLEET")
        .await
        .expect("the fleet stream")
}

/// A consumer's own shared stream, as releases before the fleet stream made it.
async fn earlier_release_stream(js: &Js, name: &str, subjects: &[String]) {
    js.js
        .create_stream(async_nats::jetstream::stream::Config {
            name: name.to_owned(),
            subjects: subjects.to_vec(),
            max_messages_per_subject: 1,
            allow_message_ttl: true,
            allow_direct: true,
            ..Default::default()
        })
        .await
        .expect("the earlier release's stream");
}

/// Store, as a plain NATS user can, a heartbeat on `subject` claiming to be replica
/// `instance` busy on `consumer`, with `seal` as its seal header if given.
async fn store_heartbeat(
    js: &Js,
    subject: String,
    consumer: &str,
    instance: &str,
    seal: Option<&str>,
) {
    let record = json!({
        "instance_id": instance,
        "started_at": "2026-01-01T00:00:00Z",
        "leases_in_flight": 0,
        "lease_key_fingerprint": "0000000000000000",
        "listen": "127.0.0.1:1",
        "consumers": [{ "stream": STREAM, "consumer": consumer, "leases_in_flight": 0 }],
    });
    let mut headers = HeaderMap::new();
    headers.insert("Nats-TTL", "60s");
    if let Some(seal) = seal {
        headers.insert("Ruststream-Seal", seal);
    }
    js.js
        .publish_with_headers(
            subject,
            headers,
            serde_json::to_vec(&record).expect("json").into(),
        )
        .await
        .expect("publish")
        .await
        .expect("stored");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_heartbeats_are_dropped_counted_and_logged_once() {
    let (server, js) = crate::support::server_with_stream().await;
    let key = shared_key();
    let setup = Setup::consumer("forged-beats").lease_key_file(key.path());
    let mut first = setup.process(&server.url()).await;
    let before = Scrape::of(&first).await;
    // 50 made-up replicas, one of them copying a genuine seal header onto other content.
    let genuine = wait_for("the first's heartbeat", Duration::from_secs(5), || {
        let js = &js;
        async move {
            let stream = fleet_stream(js).await;
            let subject = format!("{PREFIX}.fleet.replica.*");
            let subjects: Vec<(String, usize)> = stream
                .info_with_subjects(subject)
                .await
                .ok()?
                .try_collect()
                .await
                .ok()?;
            let (subject, _) = subjects.into_iter().next()?;
            stream.direct_get_last_for_subject(subject).await.ok()
        }
    })
    .await;
    let genuine_seal = genuine
        .headers
        .get("Ruststream-Seal")
        .expect("a genuine heartbeat is sealed")
        .as_str()
        .to_owned();
    for n in 0..50u64 {
        let instance = format!("{:016x}", 0xdead_0000 + n);
        let seal = (n == 0).then_some(genuine_seal.as_str());
        let subject = format!("{PREFIX}.fleet.replica.{instance}");
        store_heartbeat(&js, subject, "forged-beats", &instance, seal).await;
    }
    wait_until(
        "the forgeries are counted",
        Duration::from_secs(5),
        || async { rejected(&Scrape::of(&first).await, "heartbeat") >= 50.0 },
    )
    .await;
    let after = Scrape::of(&first).await;
    assert_eq!(after.get("ruststream_replicas"), 1.0);
    assert_eq!(replicas_listed(&first).await, 1);
    assert_eq!(rejected(&before, "heartbeat"), 0.0);
    let log = first.log();
    let logged = log
        .lines()
        .filter(|line| {
            line.contains("ERROR")
                && line.contains("heartbeat")
                && line.contains("dropped a message under the internal prefix")
        })
        .count();
    assert_eq!(logged, 1, "logged once, not per forgery:\n{log}");

    // Alone with the made-up replicas, a gateway with other settings is not refused.
    assert!(first.terminate(Duration::from_secs(15)).await.success());
    let second = Setup::consumer("forged-beats")
        .lease_key_file(key.path())
        .ack_wait("45s")
        .process(&server.url())
        .await;
    assert_eq!(second.readyz().await, 200, "{}", second.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_keyed_answer_is_not_replayed() {
    let (server, js) = crate::support::server_with_stream().await;
    let key = shared_key();
    let setup = Setup::consumer("forged-answer").lease_key_file(key.path());
    let a = setup.ready(&server.url()).await;
    let b = setup.ready(&server.url()).await;
    wait_until("B sees A", Duration::from_secs(10), || async {
        replicas_listed(&b).await == 2
    })
    .await;
    js.publish_many("orders.1", 4, "m").await;
    let request = json!({ "batch": 1, "wait_ms": 1000 });
    let first = a.fetch_keyed("run-1", &request).await;
    assert_eq!(first.status, 200, "{}", first.text);
    let genuine_id = first.messages()[0].id.clone();

    // Rewrite the stored answer: the genuine headers (seal included), forged content.
    let stream = fleet_stream(&js).await;
    let subjects: Vec<(String, usize)> = stream
        .info_with_subjects(format!("{PREFIX}.fleet.idempotency.*"))
        .await
        .expect("subjects")
        .try_collect()
        .await
        .expect("subjects");
    let (subject, _) = subjects.into_iter().next().expect("the stored answer");
    let stored = stream
        .direct_get_last_for_subject(&subject)
        .await
        .expect("stored answer");
    let mut forged: Value = serde_json::from_slice(&stored.payload).expect("json");
    forged["messages"][0]["subject"] = json!("orders.forged");
    forged["messages"][0]["data"] = json!("Zm9yZ2Vk");
    js.js
        .publish_with_headers(
            subject,
            stored.headers.clone(),
            serde_json::to_vec(&forged).expect("json").into(),
        )
        .await
        .expect("publish")
        .await
        .expect("stored");

    let retried = b.fetch_keyed("run-1", &request).await;
    assert_eq!(retried.status, 200, "{}", retried.text);
    assert!(
        retried.headers.get("idempotent-replayed").is_none(),
        "{}",
        retried.text
    );
    assert!(!retried.text.contains("orders.forged"), "{}", retried.text);
    assert!(
        retried
            .messages()
            .iter()
            .all(|message| message.id != genuine_id)
    );
    assert_eq!(rejected(&Scrape::of(&b).await, "keyed_answer"), 1.0);
}

/// An owner (a child process, so it can be paused and killed) and another replica in
/// process on `consumer`, seeing each other, and two leases the owner issued.
struct OwnerAndOther {
    _server: crate::support::NatsServer,
    js: Js,
    owner: crate::support::GatewayProcess,
    other: crate::support::Gateway,
    leased: Vec<crate::support::Msg>,
    _key: tempfile::NamedTempFile,
}

async fn owner_and_other(consumer: &str, settle_timeout: &str, ack_wait: &str) -> OwnerAndOther {
    let (server, js) = crate::support::server_with_stream().await;
    let key = shared_key();
    let setup = Setup::consumer(consumer)
        .lease_key_file(key.path())
        .settle_timeout(settle_timeout)
        .ack_wait(ack_wait);
    let owner = setup.process(&server.url()).await;
    let other = setup.ready(&server.url()).await;
    wait_until(
        "the other sees the owner",
        Duration::from_secs(10),
        || async { replicas_listed(&other).await == 2 },
    )
    .await;
    js.publish_many("orders.1", 2, "m").await;
    let leased = owner.fetch_n(2, 1000).await;
    assert_eq!(leased.len(), 2);
    OwnerAndOther {
        _server: server,
        js,
        owner,
        other,
        leased,
        _key: key,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_forwarded_settles_and_answers_change_nothing() {
    let mut pair = owner_and_other("forged-forward", "1s", "30s").await;
    let (js, other, leased) = (&pair.js, &pair.other, pair.leased.clone());
    let owner_id = pair.owner.consumer_view().await["instance_id"]
        .as_str()
        .expect("instance id")
        .to_owned();
    let settle_subject = format!("{PREFIX}.{STREAM}.forged-forward.settle.{owner_id}");

    // A plain client asks the owner to ack a genuine lease id: no answer, nothing acked.
    let forged = json!({ "kind": "ack", "ids": [leased[0].id] });
    let asked = tokio::time::timeout(
        Duration::from_secs(2),
        js.client
            .request(settle_subject.clone(), forged.to_string().into()),
    )
    .await;
    assert!(
        !matches!(asked, Ok(Ok(_))),
        "the owner answered a forged settle"
    );
    assert_eq!(
        js.consumer_info(STREAM, "forged-forward")
            .await
            .num_ack_pending,
        2
    );

    // The owner stalls and a plain client answers "ok" for it: the settle is not 204.
    let mut answers = js
        .client
        .subscribe(settle_subject)
        .await
        .expect("subscribe");
    let client = js.client.clone();
    let forger = tokio::spawn(async move {
        while let Some(request) = answers.next().await {
            if let Some(reply) = request.reply {
                let _ = client
                    .publish(reply, r#"{"results":[{"result":"ok"}]}"#.into())
                    .await;
            }
        }
    });
    js.client.flush().await.expect("flush");
    pair.owner.pause();
    let reply = other
        .settle(&leased[1].id, crate::support::Action::Ack, None)
        .await;
    assert_ne!(
        reply.status, 204,
        "a forged answer was believed: {}",
        reply.text
    );
    assert_eq!(reply.status, 503, "{}", reply.text);
    assert_eq!(
        js.consumer_info(STREAM, "forged-forward")
            .await
            .num_ack_pending,
        2,
        "nothing was acked"
    );
    forger.abort();
    // The genuine forward waits for the owner, which acks once it runs again.
    pair.owner.resume();
    let owner_scrape = Scrape::of(&pair.owner).await;
    assert!(rejected(&owner_scrape, "forwarded_settle") >= 1.0);
    assert!(rejected(&Scrape::of(other).await, "forwarded_answer") >= 1.0);
    // The real ones still work.
    assert_eq!(other.ack(&leased[0].id).await, 204);
    assert_eq!(other.ack(&leased[1].id).await, 204);
}

/// Behind a monitoring tap (a listener that answers nothing) a forwarded settle always
/// reaches someone, so nothing tells a dead owner from a live one whose heartbeats are not
/// stored and that may have applied the ack: its settles are 504, never 410 — not even once
/// its leases would have expired (a live owner still leasing would have newer ones).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_owner_behind_a_tap_is_504_never_410() {
    let mut pair = owner_and_other("tapped", "2s", "3s").await;
    let (js, other, leased) = (&pair.js, &pair.other, pair.leased.clone());
    let _tap = js
        .client
        .subscribe(format!("{PREFIX}.>"))
        .await
        .expect("subscribe");
    js.client.flush().await.expect("flush");

    pair.owner.kill9();
    let reply = other
        .settle(&leased[0].id, crate::support::Action::Ack, None)
        .await;
    assert_eq!(reply.status, 504, "{}", reply.text);
    // Past every lease the owner issued (ack_wait 3 s) and past its heartbeat's TTL (4 s).
    let past = Instant::now() + Duration::from_secs(8);
    while Instant::now() < past {
        assert_eq!(other.ack(&leased[1].id).await, 504);
    }
}

/// During a rolling upgrade, replicas of a release before seals send unsealed messages:
/// believed only with `--accept-unsigned-replicas`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsealed_heartbeats_count_only_with_accept_unsigned_replicas() {
    let (server, js) = crate::support::server_with_stream().await;
    // The consumer's own shared stream, as a release before the fleet stream made it.
    earlier_release_stream(
        &js,
        &format!("RUSTSTREAM_SHARED_{STREAM}_upgrade"),
        &[
            format!("{PREFIX}.{STREAM}.upgrade.replica.*"),
            format!("{PREFIX}.{STREAM}.upgrade.idempotency.*"),
        ],
    )
    .await;
    let key = shared_key();
    let strict = Setup::consumer("upgrade")
        .lease_key_file(key.path())
        .ready(&server.url())
        .await;
    let lenient = Setup::consumer("upgrade")
        .lease_key_file(key.path())
        .switch("--accept-unsigned-replicas")
        .ready(&server.url())
        .await;
    wait_until("both see each other", Duration::from_secs(10), || async {
        replicas_listed(&strict).await == 2 && replicas_listed(&lenient).await == 2
    })
    .await;
    // An old replica's heartbeat, where old replicas beat: the same record, no seal.
    let subject = format!("{PREFIX}.{STREAM}.upgrade.replica.00000000000000a1");
    store_heartbeat(&js, subject, "upgrade", "00000000000000a1", None).await;
    wait_until(
        "the lenient one counts it",
        Duration::from_secs(5),
        || async { replicas_listed(&lenient).await == 3 },
    )
    .await;
    wait_until(
        "the strict one rejects it",
        Duration::from_secs(5),
        || async { rejected(&Scrape::of(&strict).await, "heartbeat") >= 1.0 },
    )
    .await;
    assert_eq!(replicas_listed(&strict).await, 2);
}

/// `X_Y`/`c` and `X`/`Y_c` ran together into one per-consumer shared stream name in early
/// releases: the stream of that name is read only by the pair whose subjects it holds, and
/// never rewritten; the replicas of both meet in the one fleet stream, which grows with
/// neither consumer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_earlier_releases_shared_stream_is_read_only_by_its_own_pair() {
    let server = crate::support::NatsServer::start().await;
    let js = crate::support::Js::connect(&server.url()).await;
    js.create_stream("X_Y", &["xy.>"]).await;
    js.create_stream("X", &["x.>"]).await;
    // What an early release made for X/Y_c, under the name X_Y/c runs into too.
    earlier_release_stream(
        &js,
        "RUSTSTREAM_SHARED_X_Y_c",
        &[format!("{PREFIX}.X.Y_c.replica.*")],
    )
    .await;
    let key = shared_key();
    let first = Setup::consumer("c")
        .stream("X_Y")
        .lease_key_file(key.path())
        .ready(&server.url())
        .await;
    let second = Setup::consumer("Y_c")
        .stream("X")
        .lease_key_file(key.path())
        .ready(&server.url())
        .await;
    for gateway in [&first, &second] {
        wait_until("each sees itself", Duration::from_secs(5), || async {
            replicas_listed(gateway).await == 1
        })
        .await;
    }
    let legacy = js
        .js
        .get_stream("RUSTSTREAM_SHARED_X_Y_c")
        .await
        .expect("the old stream");
    // X/Y_c beats there too (for replicas of that release); X_Y/c does not.
    let beating: Vec<(String, usize)> = legacy
        .info_with_subjects(format!("{PREFIX}.>"))
        .await
        .expect("subjects")
        .try_collect()
        .await
        .expect("subjects");
    assert_eq!(beating.len(), 1, "{beating:?}");
    assert!(
        beating[0]
            .0
            .starts_with(&format!("{PREFIX}.X.Y_c.replica.")),
        "{beating:?}"
    );
    assert_eq!(
        legacy.cached_info().config.subjects,
        vec![format!("{PREFIX}.X.Y_c.replica.*")],
        "not rewritten"
    );
    let names: Vec<String> = js.js.stream_names().try_collect().await.expect("names");
    // The settled records streams are per consumed stream (X and X_Y), not per pair.
    let made: Vec<&String> = names
        .iter()
        .filter(|name| name.starts_with("RUSTSTREAM_") && !name.starts_with("RUSTSTREAM_SETTLED_"))
        .collect();
    assert_eq!(made.len(), 2, "only the fleet stream was made: {made:?}");
    assert!(
        names.iter().any(|name| name == "RUSTSTREAM_FLEET"),
        "{names:?}"
    );
    // Both processes beat once in the fleet stream.
    let fleet = fleet_stream(&js).await;
    let beats: Vec<(String, usize)> = fleet
        .info_with_subjects(format!("{PREFIX}.fleet.replica.*"))
        .await
        .expect("subjects")
        .try_collect()
        .await
        .expect("subjects");
    assert_eq!(beats.len(), 2, "{beats:?}");
}
