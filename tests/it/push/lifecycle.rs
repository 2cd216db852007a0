//! A push consumer's life around its pushes: a push table changed live, SIGTERM mid-push,
//! pause and resume (across a restart, and under an open pull), and a new consumer leader.

use std::time::Duration;

use serde_json::Value;
use tokio::time::Instant;

use crate::support::endpoint::{Endpoint, Reply};
use crate::support::nats::files_dir;
use crate::support::{STREAM, Setup, assert_stays, server_with_stream, wait_until};

use super::fixtures::{PUSHED, delivered, entry, payload, push_view};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_push_table_is_applied_live_and_a_broken_one_refused() {
    let (server, js) = server_with_stream().await;
    let before = Endpoint::start().await;
    let after = Endpoint::start().await;
    let dir = files_dir();
    let path = dir.path().join("consumers.toml");
    std::fs::write(&path, entry(PUSHED, &before.url, "")).expect("write");
    let gateway = Setup::defaults()
        .flag("--consumers-file", path.display().to_string())
        .process(&server.url())
        .await;
    js.publish("orders.1", "to the first").await;
    before.wait_for(1, Duration::from_secs(10)).await;
    // Not below the lease: refused with an ERROR naming file, consumer and key; the table in
    // force stays.
    std::fs::write(&path, entry(PUSHED, &after.url, "timeout = \"30s\"")).expect("write");
    wait_until("the reload is refused", Duration::from_secs(5), || async {
        gateway.log().lines().any(|line| {
            line.contains("ERROR")
                && line.contains("consumers.toml")
                && line.contains(&format!("consumer {STREAM}/{PUSHED}"))
                && line.contains("push.timeout")
        })
    })
    .await;
    js.publish("orders.1", "still to the first").await;
    before.wait_for(2, Duration::from_secs(10)).await;
    std::fs::write(&path, entry(PUSHED, &after.url, "")).expect("write");
    wait_until(
        "the new endpoint is in force",
        Duration::from_secs(5),
        || async { push_view(&gateway).await["push"]["url"] == after.url },
    )
    .await;
    js.publish("orders.1", "to the second").await;
    let received = after.wait_for(1, Duration::from_secs(10)).await;
    assert_eq!(payload(&received[0]), "to the second");
    assert_eq!(before.received().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_sigterm_a_push_in_flight_gets_the_grace_then_its_message_goes_back() {
    let (server, js) = server_with_stream().await;
    let hanging = Endpoint::start().await;
    hanging.answer(|_, _| Reply::status(204).after(Duration::from_secs(8)));
    let dir = files_dir();
    let path = dir.path().join("consumers.toml");
    std::fs::write(&path, entry(PUSHED, &hanging.url, "timeout = \"9s\"")).expect("write");
    let setup = Setup::defaults()
        .flag("--consumers-file", path.display().to_string())
        .shutdown_grace("1s");
    let mut gateway = setup.ready(&server.url()).await;
    js.publish("orders.1", "stuck").await;
    hanging.wait_for(1, Duration::from_secs(10)).await;
    let stopping = Instant::now();
    gateway.shutdown().await.expect("a clean stop");
    assert!(
        stopping.elapsed() < Duration::from_secs(5),
        "stopped after {:?}",
        stopping.elapsed()
    );
    // Nak'd at the end of the grace: pushed again at once, not after ack_wait (20 s).
    let answering = Endpoint::start().await;
    std::fs::write(&path, entry(PUSHED, &answering.url, "")).expect("write");
    let _gateway = setup.ready(&server.url()).await;
    let received = answering.wait_for(1, Duration::from_secs(5)).await;
    assert_eq!(payload(&received[0]), "stuck");
    assert_eq!(delivered(&received[0]), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_push_consumer_stays_paused_across_a_restart_until_resumed() {
    let (server, js) = server_with_stream().await;
    let endpoint = Endpoint::start().await;
    let dir = files_dir();
    let path = dir.path().join("consumers.toml");
    std::fs::write(&path, entry(PUSHED, &endpoint.url, "")).expect("write");
    let setup = Setup::defaults().flag("--consumers-file", path.display().to_string());
    let mut gateway = setup.ready(&server.url()).await;
    let named = format!("/streams/{STREAM}/consumers/{PUSHED}");

    // Bad input changes nothing.
    let past = gateway
        .post(
            &format!("{named}/push/pause"),
            Some(&serde_json::json!({"until": "2001-01-01T00:00:00Z"})),
        )
        .await;
    past.assert_invalid("until");
    gateway
        .post(
            &format!("/streams/{STREAM}/consumers/billing/push/pause"),
            None,
        )
        .await
        .assert_problem(404);

    let paused = gateway.post(&format!("{named}/push/pause"), None).await;
    assert_eq!(paused.status, 200, "{}", paused.text);
    assert_eq!(paused.body["paused"], true);
    js.publish("orders.1", "held").await;
    let fetch = gateway
        .post(
            &format!("{named}/fetch"),
            Some(&serde_json::json!({"wait_ms": 0})),
        )
        .await;
    assert_eq!(
        fetch.assert_problem(409)["type"],
        "urn:ruststream-nats:problem:consumer-paused"
    );
    wait_until(
        "the push says it is paused",
        Duration::from_secs(3),
        || async { push_view(&gateway).await["push"]["state"] == "paused" },
    )
    .await;

    // The pause is the server's: a restarted gateway finds it.
    gateway.shutdown().await.expect("a clean stop");
    let gateway = setup.ready(&server.url()).await;
    assert_stays(
        "nothing pushed while paused",
        Duration::from_secs(2),
        || async { endpoint.received().is_empty() },
    )
    .await;
    let resumed = gateway.post(&format!("{named}/push/resume"), None).await;
    assert_eq!(resumed.status, 200, "{}", resumed.text);
    assert_eq!(resumed.body["paused"], false);
    let received = endpoint.wait_for(1, Duration::from_secs(10)).await;
    assert_eq!(payload(&received[0]), "held");
}

/// An idle push worker's pull waits at the server for up to a minute, and nats-server never
/// serves a pull that was open while the consumer was paused, not even after the resume:
/// paused behind the worker's back (at the server, as `nats consumer pause` does) and resumed
/// through the gateway, the consumer pushes what waited at once, not a minute later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_consumer_paused_under_its_open_pull_pushes_at_once_when_resumed() {
    let (server, js) = server_with_stream().await;
    let endpoint = Endpoint::start().await;
    let dir = files_dir();
    let path = dir.path().join("consumers.toml");
    std::fs::write(&path, entry(PUSHED, &endpoint.url, "")).expect("write");
    let gateway = Setup::defaults()
        .flag("--consumers-file", path.display().to_string())
        .ready(&server.url())
        .await;
    wait_until(
        "the idle push worker's pull waits at the server",
        Duration::from_secs(10),
        || async { js.consumer_info(STREAM, PUSHED).await.num_waiting >= 1 },
    )
    .await;
    let paused: serde_json::Value = js
        .js
        .request(
            format!("CONSUMER.PAUSE.{STREAM}.{PUSHED}"),
            &serde_json::json!({"pause_until": "9999-12-31T00:00:00Z"}),
        )
        .await
        .expect("pause at the server");
    assert_eq!(paused["paused"], true, "{paused}");
    js.publish("orders.1", "held").await;
    assert_stays(
        "nothing pushed while paused",
        Duration::from_secs(1),
        || async { endpoint.received().is_empty() },
    )
    .await;
    let resumed = gateway
        .post(
            &format!("/streams/{STREAM}/consumers/{PUSHED}/push/resume"),
            None,
        )
        .await;
    assert_eq!(resumed.status, 200, "{}", resumed.text);
    let received = endpoint.wait_for(1, Duration::from_secs(10)).await;
    assert_eq!(payload(&received[0]), "held");
}

/// The consumer's leader, and how many pulls wait at it.
async fn leader_and_waiting(js: &async_nats::jetstream::Context) -> Option<(String, usize)> {
    let stream = js.get_stream(STREAM).await.ok()?;
    let info = stream.consumer_info(PUSHED).await.ok()?;
    let leader = info.cluster.as_ref()?.leader.clone()?;
    Some((leader, info.num_waiting))
}

/// An idle push consumer's pull waits at its consumer leader for up to a minute. When that
/// leader is killed outright (no status ends the pull), the leader elected next is asked
/// again at once: a message published then is pushed in seconds, not after that minute.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_push_consumer_pulls_again_from_a_new_consumer_leader() {
    use crate::support::cluster::Cluster;
    let mut cluster = Cluster::start(3, false).await;
    // Everyone talks to n1; the consumer's leader is made another node, then killed.
    let n1 = cluster.nodes[0].1.url();
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(n1.as_str())
        .await
        .expect("connect");
    let js = async_nats::jetstream::new(client);
    let deadline = Instant::now() + Duration::from_secs(30);
    while js
        .create_stream(async_nats::jetstream::stream::Config {
            name: STREAM.to_owned(),
            subjects: vec!["orders.>".to_owned()],
            num_replicas: 3,
            ..Default::default()
        })
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "the R3 stream was not made");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let endpoint = Endpoint::start().await;
    let dir = files_dir();
    let path = dir.path().join("consumers.toml");
    std::fs::write(&path, entry(PUSHED, &endpoint.url, "")).expect("write");
    let _gateway = Setup::defaults()
        .flag("--consumers-file", path.display().to_string())
        .ready(&n1)
        .await;
    // Moved off n1 if it is there; then one pull waits at it.
    let deadline = Instant::now() + Duration::from_secs(20);
    let leader = loop {
        match leader_and_waiting(&js).await {
            Some((at, _)) if at == "n1" => {
                // The JetStream context puts `$JS.API.` before the subject itself.
                let api = format!("CONSUMER.LEADER.STEPDOWN.{STREAM}.{PUSHED}");
                let _ = tokio::time::timeout(
                    Duration::from_secs(2),
                    js.request::<_, Value, Value>(api, &serde_json::json!({})),
                )
                .await;
            }
            Some((at, waiting)) if waiting > 0 => break at,
            _ => {}
        }
        assert!(
            Instant::now() < deadline,
            "no pull of the idle push consumer waits at a leader other than n1"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    cluster.node(&leader).kill();
    wait_until(
        "another consumer leader",
        Duration::from_secs(20),
        || async {
            leader_and_waiting(&js)
                .await
                .is_some_and(|(at, _)| at != leader)
        },
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let published = match js.publish("orders.1", "after the kill".into()).await {
            Ok(ack) => ack.await.is_ok(),
            Err(_) => false,
        };
        match published {
            true => break,
            false => {
                assert!(
                    Instant::now() < deadline,
                    "could not publish after the kill"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    let received = endpoint.wait_for(1, Duration::from_secs(15)).await;
    assert_eq!(payload(&received[0]), "after the kill");
    cluster.node(&leader).restart().await;
}
