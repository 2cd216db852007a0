//! Start-up: creating or binding the consumer with the flags' settings, refusing immutable
//! differences and a missing stream, and waiting out an unreachable NATS (/healthz vs /readyz).

use std::time::Duration;

use async_nats::jetstream::consumer::{self, AckPolicy, DeliverPolicy};
use futures::StreamExt;
use serde_json::{Value, json};

use crate::support::nats::{create_stream, publish};
use crate::support::{Action, Js, NatsServer, STREAM, Setup, wait_until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_durable_consumer_is_created_with_explicit_settings_only() {
    let (server, js) = crate::support::server_with_stream().await;
    // Watch the JetStream API requests the gateway sends to create its consumer.
    let mut api = js
        .client
        .subscribe("$JS.API.CONSUMER.>")
        .await
        .expect("subscribe to the JetStream API");
    js.client.flush().await.expect("flush");

    let gateway = Setup::consumer("created")
        .ack_wait("7s")
        .max_ack_pending(33)
        .ready(&server.url())
        .await;

    let info = js.consumer_info(STREAM, "created").await;
    assert_eq!(info.config.durable_name.as_deref(), Some("created"));
    assert_eq!(info.config.ack_policy, AckPolicy::Explicit);
    assert_eq!(info.config.ack_wait, Duration::from_secs(7));
    assert_eq!(info.config.max_ack_pending, 33);
    assert_eq!(info.config.deliver_policy, DeliverPolicy::All);
    // Fields the gateway leaves out keep the server's defaults.
    assert_eq!(
        info.config.max_waiting, 512,
        "max_waiting is the server default"
    );
    assert_eq!(
        info.config.max_deliver, -1,
        "max_deliver is not sent by default"
    );

    // Ready means bound: the create request has been sent by now.
    let create = loop {
        let message = tokio::time::timeout(Duration::from_secs(5), api.next())
            .await
            .expect("the consumer create request was seen")
            .expect("API subscription open");
        if message.subject.contains(".CREATE.") {
            break serde_json::from_slice::<Value>(&message.payload)
                .expect("create request is JSON");
        }
    };
    let sent = create["config"]
        .as_object()
        .unwrap_or_else(|| panic!("create request without config: {create}"));
    assert_eq!(
        sent.get("ack_wait"),
        Some(&json!(7_000_000_000u64)),
        "{create}"
    );
    assert_eq!(sent.get("max_ack_pending"), Some(&json!(33)), "{create}");
    assert_eq!(sent.get("deliver_policy"), Some(&json!("all")), "{create}");
    assert_eq!(sent.get("ack_policy"), Some(&json!("explicit")), "{create}");
    for left_out in [
        "max_waiting",
        "max_deliver",
        "max_batch",
        "max_expires",
        "max_bytes",
        "backoff",
        "inactive_threshold",
        "headers_only",
        "filter_subject",
    ] {
        assert!(
            !sent.contains_key(left_out),
            "`{left_out}` must be left to the server's default: {create}"
        );
    }
    drop(gateway);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filter_subject_and_max_deliver_are_sent_when_given() {
    let (_server, js, gateway) = Setup::consumer("filtered")
        .filter_subject("orders.eu.>")
        .max_deliver(3)
        .start()
        .await;
    let info = js.consumer_info(STREAM, "filtered").await;
    assert_eq!(info.config.filter_subject, "orders.eu.>");
    assert_eq!(info.config.max_deliver, 3);

    js.publish("orders.us.1", "us").await;
    let eu = js.publish("orders.eu.1", "eu").await;
    let messages = gateway.fetch_n(10, 1000).await;
    assert_eq!(messages.len(), 1, "{messages:?}");
    assert_eq!(messages[0].subject, "orders.eu.1");
    assert_eq!(messages[0].stream_sequence, eu);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliver_policy_new_skips_messages_published_before() {
    let (server, js) = crate::support::server_with_stream().await;
    js.publish_many("orders.old", 3, "old").await;
    let gateway = Setup::consumer("only-new")
        .deliver_policy("new")
        .ready(&server.url())
        .await;
    let info = js.consumer_info(STREAM, "only-new").await;
    assert_eq!(info.config.deliver_policy, DeliverPolicy::New);

    assert!(gateway.fetch_n(10, 300).await.is_empty());
    let fresh = js.publish("orders.new", "new").await;
    let messages = gateway.fetch_n(10, 3000).await;
    assert_eq!(messages.len(), 1, "{messages:?}");
    assert_eq!(messages[0].stream_sequence, fresh);
    assert_eq!(messages[0].payload(), b"new");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn existing_consumer_is_bound_and_its_mutable_fields_updated() {
    let (server, js) = crate::support::server_with_stream().await;
    js.publish_many("orders.eu.1", 3, "m").await;
    js.create_consumer(
        STREAM,
        consumer::pull::Config {
            durable_name: Some("existing".into()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(30),
            max_ack_pending: 1000,
            deliver_policy: DeliverPolicy::ByStartSequence { start_sequence: 2 },
            ..Default::default()
        },
    )
    .await;

    let gateway = Setup::consumer("existing")
        .deliver_policy("by-start-sequence=2")
        .ack_wait("3s")
        .max_ack_pending(17)
        .max_deliver(4)
        .filter_subject("orders.eu.>")
        .ready(&server.url())
        .await;

    let info = js.consumer_info(STREAM, "existing").await;
    assert_eq!(info.config.ack_wait, Duration::from_secs(3));
    assert_eq!(info.config.max_ack_pending, 17);
    assert_eq!(info.config.max_deliver, 4);
    assert_eq!(info.config.filter_subject, "orders.eu.>");
    assert_eq!(
        info.config.deliver_policy,
        DeliverPolicy::ByStartSequence { start_sequence: 2 }
    );

    // Bound, not recreated: it starts at sequence 2 as the existing consumer does.
    let messages = gateway.fetch_n(10, 1000).await;
    let sequences: Vec<u64> = messages.iter().map(|m| m.stream_sequence).collect();
    assert_eq!(sequences, vec![2, 3]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn differing_deliver_policy_refuses_to_start_naming_the_field() {
    let (server, js) = crate::support::server_with_stream().await;
    js.create_consumer(
        STREAM,
        consumer::pull::Config {
            durable_name: Some("strict".into()),
            ack_policy: AckPolicy::Explicit,
            deliver_policy: DeliverPolicy::New,
            ..Default::default()
        },
    )
    .await;

    let mut gateway = Setup::consumer("strict")
        .deliver_policy("all")
        .starting(&server.url())
        .await;
    let error = gateway
        .exit_result()
        .await
        .expect_err("run() must refuse a consumer whose deliver policy differs");
    let message = format!("{error:#}");
    assert!(
        message.contains("deliver_policy")
            || message.contains("deliver policy")
            || message.contains("deliver-policy"),
        "the error must name the deliver policy: {message}"
    );
    assert!(!message.contains('\n'), "a one-line error: {message:?}");
    // The consumer was left as it was.
    let info = js.consumer_info(STREAM, "strict").await;
    assert_eq!(info.config.deliver_policy, DeliverPolicy::New);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_stream_is_an_error_naming_the_stream_and_the_url() {
    let server = NatsServer::start().await;
    let mut gateway = Setup::consumer("nostream")
        .stream("NOSUCHSTREAM")
        .starting(&server.url())
        .await;
    let error = gateway
        .exit_result()
        .await
        .expect_err("run() must fail when the stream does not exist");
    let message = format!("{error:#}");
    assert!(
        message.contains("NOSUCHSTREAM"),
        "names the stream: {message}"
    );
    let host_port = format!("127.0.0.1:{}", server.port());
    assert!(
        message.contains(&host_port),
        "names the NATS URL: {message}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_nats_is_healthy_but_not_ready_until_it_comes_up() {
    // A store that already holds the stream, with its server down.
    let mut server = NatsServer::start().await;
    create_stream(&server.url(), STREAM, &["orders.>"]).await;
    server.kill();

    let gateway = Setup::consumer("patient").starting(&server.url()).await;
    wait_until("/healthz answers 200", Duration::from_secs(5), || async {
        gateway.healthz().await == 200
    })
    .await;
    assert_eq!(gateway.readyz().await, 503, "not ready without NATS");
    let reply = gateway.get("/readyz").await;
    reply.assert_problem(503);
    // Anyone may ask /readyz: its answer names neither the NATS server nor the consumer.
    let port = server
        .url()
        .rsplit(':')
        .next()
        .unwrap_or_default()
        .to_owned();
    for private in [port.as_str(), "127.0.0.1", "patient", STREAM] {
        assert!(!reply.text.contains(private), "{private} in {}", reply.text);
    }
    // Fetching without NATS is refused, not hung.
    let fetch = gateway.fetch_reply(Some(&json!({ "wait_ms": 0 }))).await;
    fetch.assert_problem(503);

    server.restart().await;
    wait_until(
        "/readyz answers 200 once NATS is up",
        Duration::from_secs(20),
        || async { gateway.readyz().await == 200 },
    )
    .await;
    assert_eq!(gateway.healthz().await, 200);
    let sequence = publish(&server.url(), "orders.1", "after the outage").await;
    let messages = gateway.fetch_n(1, 3000).await;
    assert_eq!(messages.len(), 1);
    assert_eq!(messages[0].stream_sequence, sequence);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_outage_answers_503_and_recovers() {
    let (mut server, js, mut gateway) = Setup::consumer("outage").start().await;
    js.publish("orders.1", "before").await;
    let held = gateway.fetch_n(1, 1000).await;
    assert_eq!(held.len(), 1);

    server.kill();
    gateway.wait_unready().await;
    assert_eq!(gateway.healthz().await, 200);
    gateway
        .fetch_reply(Some(&json!({ "wait_ms": 1000 })))
        .await
        .assert_problem(503);
    gateway
        .settle(&held[0].id, Action::Ack, None)
        .await
        .assert_problem(503);
    let results = gateway
        .settle_many_ok(Action::Ack, &json!({ "ids": [held[0].id] }))
        .await;
    assert_eq!(results, vec![(held[0].id.clone(), 503)]);

    server.restart().await;
    gateway.wait_ready().await;
    let js = Js::connect(&server.url()).await;
    let sequence = js.publish("orders.2", "after").await;
    let messages = gateway.fetch_n(10, 3000).await;
    assert!(
        messages.iter().any(|m| m.stream_sequence == sequence),
        "a message published after the outage is fetched: {messages:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_gateway_continues_where_the_durable_consumer_stands() {
    let (server, js, mut first) = Setup::consumer("durable").start().await;
    js.publish_many("orders.1", 3, "m").await;
    let messages = first.fetch_n(2, 1000).await;
    assert_eq!(messages.len(), 2);
    for message in &messages {
        assert_eq!(first.ack(&message.id).await, 204);
    }
    first.shutdown().await.expect("clean shutdown");

    let second = Setup::consumer("durable").ready(&server.url()).await;
    let messages = second.fetch_n(10, 1000).await;
    let sequences: Vec<u64> = messages.iter().map(|m| m.stream_sequence).collect();
    assert_eq!(sequences, vec![3], "only the unacked message is left");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ephemeral_consumer_has_no_durable_name_and_goes_away_after_the_gateway() {
    let (_server, js, mut gateway) = Setup::defaults().ephemeral().start().await;
    let stream = js.js.get_stream(STREAM).await.expect("stream");
    let names: Vec<String> = stream
        .consumer_names()
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .map(|name| name.expect("consumer name"))
        .collect();
    assert_eq!(names.len(), 1, "one consumer: {names:?}");
    let info = stream.consumer_info(&names[0]).await.expect("info");
    assert_eq!(info.config.durable_name, None, "ephemeral: no durable name");

    js.publish("orders.1", "eph").await;
    let messages = gateway.fetch_n(1, 2000).await;
    assert_eq!(messages.len(), 1);
    assert_eq!(messages[0].consumer, names[0]);
    assert_eq!(gateway.ack(&messages[0].id).await, 204);
    gateway.shutdown().await.expect("clean shutdown");

    wait_until(
        "the server removed the ephemeral consumer",
        Duration::from_secs(20),
        || {
            let stream = stream.clone();
            async move { stream.consumer_names().collect::<Vec<_>>().await.is_empty() }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn last_and_last_per_subject_policies_start_where_they_say() {
    let (server, js) = crate::support::server_with_stream().await;
    js.publish("orders.a", "a1").await;
    let a2 = js.publish("orders.a", "a2").await;
    let b1 = js.publish("orders.b", "b1").await;

    let last = Setup::consumer("last")
        .deliver_policy("last")
        .ready(&server.url())
        .await;
    let sequences: Vec<u64> = last
        .fetch_n(10, 500)
        .await
        .iter()
        .map(|m| m.stream_sequence)
        .collect();
    assert_eq!(sequences, vec![b1]);

    let per_subject = Setup::consumer("per-subject")
        .deliver_policy("last-per-subject")
        // nats-server requires a filter for last-per-subject.
        .filter_subject("orders.>")
        .ready(&server.url())
        .await;
    let mut sequences: Vec<u64> = per_subject
        .fetch_n(10, 500)
        .await
        .iter()
        .map(|m| m.stream_sequence)
        .collect();
    sequences.sort_unstable();
    assert_eq!(sequences, vec![a2, b1]);
    let info = js.consumer_info(STREAM, "per-subject").await;
    assert_eq!(info.config.deliver_policy, DeliverPolicy::LastPerSubject);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_start_time_policy_applies_and_survives_a_restart() {
    let (server, js) = crate::support::server_with_stream().await;
    js.publish_many("orders.before", 2, "before").await;
    // A start time strictly between the two groups, with sub-second precision.
    let start = time::OffsetDateTime::now_utc() + time::Duration::milliseconds(5);
    let start_text = start
        .format(&time::format_description::well_known::Rfc3339)
        .expect("format start time");
    wait_until(
        "the clock passed the start time",
        Duration::from_secs(2),
        || async { time::OffsetDateTime::now_utc() > start + time::Duration::milliseconds(5) },
    )
    .await;
    let after = js.publish_many("orders.after", 2, "after").await;

    let policy = format!("by-start-time={start_text}");
    let setup = Setup::consumer("since").deliver_policy(&policy);
    let mut first = setup.ready(&server.url()).await;
    let messages = first.fetch_n(10, 500).await;
    let sequences: Vec<u64> = messages.iter().map(|m| m.stream_sequence).collect();
    assert_eq!(sequences, after);
    for message in &messages {
        assert_eq!(first.ack(&message.id).await, 204);
    }
    first.shutdown().await.expect("clean shutdown");

    // The same flag on the next boot is the same policy, not a change of an immutable field.
    let second = setup.ready(&server.url()).await;
    assert!(second.fetch_n(10, 300).await.is_empty());
}

/// Values NATS would refuse (or that make every lease born expired) stop the start at once,
/// exiting non-zero with a message naming the flag and the value, instead of retrying forever.
#[test]
fn bad_names_subjects_and_ack_waits_refuse_to_start_naming_the_value() {
    for (flag, value, reason) in [
        ("--ack-wait", "1ms", "at least 1s"),
        ("--ack-wait", "0s", "at least 1s"),
        ("--stream", "bad name.x", "must not contain"),
        ("--consumer", "billing.v2", "must not contain"),
        ("--consumer", "", "must not be empty"),
        ("--filter-subject", "orders..created", "empty tokens"),
        ("--filter-subject", "orders.>.x", "last token"),
        ("--stream-subjects", "bad subject", "whitespace"),
        ("--ack-wait", "99999999999999999s", "at most"),
        ("--nats-url", "", "names no NATS server"),
        ("--nats-url", ",", "names no NATS server"),
    ] {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_ruststream-nats"))
            .args([flag, value])
            .env("NATS_URL", "nats://127.0.0.1:1")
            .output()
            .expect("run the gateway binary");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(
            output.status.code(),
            Some(2),
            "{flag} {value:?} must refuse to start: {stderr}"
        );
        let first = stderr.lines().next().unwrap_or_default();
        assert!(
            first.contains(flag) && first.contains(value) && stderr.contains(reason),
            "{flag} {value:?}: the error names the flag, the value and why: {stderr}"
        );
    }
}
