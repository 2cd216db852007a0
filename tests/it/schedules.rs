//! Delayed, scheduled and recurring delivery against a real nats-server (2.14+): a delayed
//! message is leased no earlier than its time and never before; a cancelled schedule never
//! fires, even racing its own time; a cron in a zone and an `@every` fire; a stream not set
//! up for schedules is refused naming what to change; bad input is refused naming its field.

use std::time::Duration;

use serde_json::{Value, json};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use crate::support::{Js, STREAM, Setup, wait_until};

/// The subjects where the gateway keeps ORDERS' schedules (its default internal prefix).
const SCHEDULE_SUBJECTS: &str = "_RUSTSTREAM.schedule.ORDERS.>";

/// Set ORDERS up for schedules as docs/producers.md says: allowed, and the schedule
/// subjects captured.
async fn set_up_for_schedules(js: &Js) {
    let mut stream = js.js.get_stream(STREAM).await.expect("the stream");
    let mut config = stream.info().await.expect("stream info").config.clone();
    config.allow_message_schedules = true;
    config.subjects.push(SCHEDULE_SUBJECTS.to_owned());
    js.js.update_stream(config).await.expect("stream updated");
}

/// A gateway whose consumer leases the stream's own messages and not its schedules.
fn setup(name: &str) -> Setup {
    Setup::consumer(name).filter_subject("orders.>")
}

fn parse_time(value: &Value) -> OffsetDateTime {
    OffsetDateTime::parse(value.as_str().expect("a time"), &Rfc3339).expect("RFC 3339")
}

/// 1 000 delayed messages due over the next 10 s (one every 10 ms): none is leased before
/// its time; each is stored by the server's scheduler and leased at most 1 s after it
/// (p99), with `Ruststream-Scheduled-At`; the schedules themselves are not leased.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_messages_are_leased_from_their_time_on_and_never_before() {
    const COUNT: usize = 1_000;
    let (_server, js, gateway) = setup("delayed").start().await;
    set_up_for_schedules(&js).await;
    let messages: Vec<Value> = (0..COUNT)
        .map(|i| json!({ "subject": "orders.later", "data": format!("m{i}"), "delay": format!("{}ms", 200 + i * 10) }))
        .collect();
    let reply = gateway
        .post("/publish/batch", Some(&json!({ "messages": messages })))
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    let results = reply.body["results"].as_array().expect("results").clone();
    let mut due = std::collections::HashMap::new();
    for (i, result) in results.iter().enumerate() {
        assert_eq!(result["status"], 202, "message {i}: {result}");
        assert_eq!(result["subject"], "orders.later");
        due.insert(format!("m{i}"), parse_time(&result["deliver_at"]));
    }
    // Seconds late: stored by the scheduler after its time, and leased after its time.
    let mut stored_late = Vec::with_capacity(COUNT);
    let mut leased_late = Vec::with_capacity(COUNT);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !due.is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "all {COUNT} leased within 30 s; {} not",
            due.len()
        );
        let batch = gateway
            .fetch(json!({ "batch": 500, "wait_ms": 200, "encoding": "utf8" }))
            .await;
        let now = OffsetDateTime::now_utc();
        let mut ids = Vec::with_capacity(batch.len());
        for message in &batch {
            let at = due.remove(&message.data).unwrap_or_else(|| {
                panic!(
                    "leased once, and only a delayed message: {:?}",
                    message.data
                )
            });
            assert!(now >= at, "{} leased at {now}, due at {at}", message.data);
            let stored = parse_time(&json!(message.published_at));
            assert!(
                stored >= at,
                "{} stored at {stored}, due at {at}",
                message.data
            );
            stored_late.push((stored - at).as_seconds_f64());
            leased_late.push((now - at).as_seconds_f64());
            assert!(
                message.headers.get("Ruststream-Scheduled-At").is_some(),
                "{}: {:?}",
                message.data,
                message.headers
            );
            ids.push(message.id.clone());
        }
        if !ids.is_empty() {
            gateway
                .settle_many_ok(crate::support::Action::Ack, &json!({ "ids": ids }))
                .await;
        }
    }
    let p99 = |late: &mut Vec<f64>| {
        late.sort_by(f64::total_cmp);
        late[late.len() * 99 / 100]
    };
    let (stored_p99, leased_p99) = (p99(&mut stored_late), p99(&mut leased_late));
    eprintln!("late p99: stored {stored_p99:.3} s, leased {leased_p99:.3} s");
    assert!(
        stored_p99 <= 1.0,
        "stored at most 1 s late (p99): {stored_p99:.3} s"
    );
    assert!(
        leased_p99 <= 1.0,
        "leased at most 1 s late (p99): {leased_p99:.3} s"
    );
}

/// 500 schedules cancelled while they race their own time never fire: every cancel answered
/// 204 leaves no message; every other schedule (cancel answered 404: it fired first, or 409
/// `schedule-firing`: too close to its time) was delivered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_schedule_never_fires() {
    const COUNT: usize = 500;
    let (_server, js, gateway) = setup("cancels").start().await;
    set_up_for_schedules(&js).await;
    // Due 2 ms apart from 0.3 s on, and cancelled latest first, about as fast: the cancels
    // of the last ones win, the first ones fire before their cancel comes, and some race.
    let messages: Vec<Value> = (0..COUNT)
        .map(|i| json!({ "subject": "orders.race", "data": format!("r{i}"), "delay": format!("{}ms", 300 + i * 2) }))
        .collect();
    let reply = gateway
        .post("/publish/batch", Some(&json!({ "messages": messages })))
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    let mut ids = Vec::new();
    for (i, result) in reply.body["results"]
        .as_array()
        .expect("results")
        .iter()
        .enumerate()
    {
        assert_eq!(result["status"], 202, "{result}");
        ids.push((
            format!("r{i}"),
            result["schedule"].as_str().expect("id").to_owned(),
        ));
    }
    let pending = gateway
        .get(&format!("/schedules/{}", ids[COUNT - 1].1))
        .await;
    assert_eq!(pending.status, 200, "{}", pending.text);
    assert_eq!(pending.body["kind"], "once");
    assert_eq!(pending.body["subject"], "orders.race");
    let (mut cancelled, mut firing) = (std::collections::HashSet::new(), 0);
    for (data, id) in ids.iter().rev() {
        let reply = gateway.delete(&format!("/schedules/{id}")).await;
        match reply.status {
            204 => {
                cancelled.insert(data.clone());
            }
            // Fired first, or too close to its time to be sure to stop: it fires.
            404 => {}
            409 => {
                assert_eq!(
                    reply.body["type"], "urn:ruststream-nats:problem:schedule-firing",
                    "{}",
                    reply.text
                );
                assert!(
                    reply.headers.get("retry-after").is_some(),
                    "{:?}",
                    reply.headers
                );
                firing += 1;
            }
            other => panic!("cancel {id}: {other} {}", reply.text),
        }
    }
    // Every schedule has fired or been cancelled once none is listed: what is there to lease
    // is all that will ever come.
    wait_until("no schedule left", Duration::from_secs(10), || async {
        let listed = gateway.get("/schedules?stream=ORDERS").await;
        listed.body["schedules"]
            .as_array()
            .is_some_and(Vec::is_empty)
    })
    .await;
    let mut delivered = Vec::new();
    loop {
        let batch = gateway
            .fetch(json!({ "batch": 100, "wait_ms": 1000, "encoding": "utf8" }))
            .await;
        if batch.is_empty() {
            break;
        }
        for message in batch {
            gateway.ack(&message.id).await;
            delivered.push(message.data);
        }
    }
    for data in &delivered {
        assert!(
            !cancelled.contains(data),
            "{data} was cancelled (204) and fired"
        );
    }
    eprintln!(
        "{} cancelled (204), {} delivered ({firing} of them refused as firing: 409)",
        cancelled.len(),
        delivered.len()
    );
    let delivered_once: std::collections::HashSet<&String> = delivered.iter().collect();
    assert_eq!(
        delivered_once.len(),
        delivered.len(),
        "none delivered twice"
    );
    assert_eq!(
        delivered.len() + cancelled.len(),
        COUNT,
        "each either delivered once or cancelled: {delivered:?}"
    );
}

/// `@every 1s` fires about every second; a cron with seconds in a zone fires on its
/// seconds; both are listed with their next time, and a cancel stops them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recurring_schedules_fire_until_cancelled() {
    let (_server, js, gateway) = setup("recurring").start().await;
    set_up_for_schedules(&js).await;
    let every = gateway
        .post(
            "/schedules",
            Some(&json!({ "subject": "orders.tick", "data": "tick", "cron": "@every 1s" })),
        )
        .await;
    assert_eq!(every.status, 201, "{}", every.text);
    assert!(every.body["next"].is_string(), "{}", every.text);
    // Every even second of this hour and the next in Kolkata (UTC+5:30): read in UTC, the
    // hours would never match and it would not fire at all.
    let kolkata = OffsetDateTime::now_utc()
        .to_offset(time::UtcOffset::from_hms(5, 30, 0).expect("an offset"));
    let hours = format!("{},{}", kolkata.hour(), (kolkata.hour() + 1) % 24);
    let cron = gateway
        .post(
            "/schedules",
            Some(&json!({ "subject": "orders.tock", "data": "tock", "cron": format!("*/2 * {hours} * * *"), "time_zone": "Asia/Kolkata" })),
        )
        .await;
    assert_eq!(cron.status, 201, "{}", cron.text);
    let listed = gateway.get("/schedules?subject=orders.tock").await;
    assert_eq!(listed.status, 200, "{}", listed.text);
    let listed = listed.body["schedules"]
        .as_array()
        .expect("schedules")
        .clone();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["kind"], "recurring");
    assert_eq!(listed[0]["time_zone"], "Asia/Kolkata");

    let mut ticks = 0;
    let mut tock_seconds = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while ticks < 3 || tock_seconds.len() < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "3 ticks and 2 tocks within 20 s"
        );
        for message in gateway
            .fetch(json!({ "batch": 10, "wait_ms": 1000, "encoding": "utf8" }))
            .await
        {
            match message.data.as_str() {
                "tick" => ticks += 1,
                "tock" => tock_seconds.push(parse_time(&json!(message.published_at)).second()),
                other => panic!("only the schedules' messages: {other}"),
            }
            gateway.ack(&message.id).await;
        }
    }
    assert!(
        tock_seconds.iter().all(|second| second % 2 == 0),
        "stored on even seconds: {tock_seconds:?}"
    );
    for id in [&every.body["schedule"], &cron.body["schedule"]] {
        let id = id.as_str().expect("id");
        let reply = gateway.delete(&format!("/schedules/{id}")).await;
        assert_eq!(reply.status, 204, "{}", reply.text);
        assert_eq!(gateway.get(&format!("/schedules/{id}")).await.status, 404);
    }
}

/// A delayed message with a msg id published again (a client's retry after a lost answer):
/// the stream keeps one schedule, both answers name it, and it is delivered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_delayed_message_is_one_schedule() {
    let (_server, js, gateway) = setup("retried").start().await;
    set_up_for_schedules(&js).await;
    let body = json!({ "subject": "orders.retry", "data": "charge once", "msg_id": "charge-41", "delay": "1s" });
    let first = gateway.post("/publish", Some(&body)).await;
    assert_eq!(first.status, 202, "{}", first.text);
    let again = gateway.post("/publish", Some(&body)).await;
    assert_eq!(again.status, 202, "{}", again.text);
    let id = first.body["schedule"].as_str().expect("a schedule id");
    assert_eq!(
        again.body["schedule"], id,
        "the retry names the schedule stored"
    );
    let pending = gateway.get(&format!("/schedules/{id}")).await;
    assert_eq!(pending.status, 200, "{}", pending.text);
    let listed = gateway.get("/schedules?subject=orders.retry").await;
    assert_eq!(
        listed.body["schedules"].as_array().map(Vec::len),
        Some(1),
        "{}",
        listed.text
    );
    let mut delivered = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while delivered.is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "delivered within 10 s"
        );
        for message in gateway
            .fetch(json!({ "batch": 10, "wait_ms": 500, "encoding": "utf8" }))
            .await
        {
            gateway.ack(&message.id).await;
            delivered.push(message.data);
        }
    }
    // Nothing else is due: a second delivery would come with the first.
    let more = gateway
        .fetch(json!({ "batch": 10, "wait_ms": 1500, "encoding": "utf8" }))
        .await;
    assert_eq!(delivered, ["charge once"]);
    assert!(more.is_empty(), "delivered once: {more:?}");
}

/// A stream not set up for schedules, a consumer that would lease them, and bad input are
/// refused naming what to change; nothing is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schedules_are_refused_where_they_cannot_be_kept() {
    let (_server, js, gateway) = setup("refusals").start().await;
    let delayed = json!({ "subject": "orders.1", "data": "x", "delay": "1h" });
    let refused = gateway.post("/publish", Some(&delayed)).await;
    refused.assert_problem(409);
    assert_eq!(
        refused.body["setting"], "allow_msg_schedules",
        "{}",
        refused.text
    );

    let mut stream = js.js.get_stream(STREAM).await.expect("the stream");
    let mut config = stream.info().await.expect("stream info").config.clone();
    config.allow_message_schedules = true;
    js.js.update_stream(config).await.expect("stream updated");
    let refused = gateway.post("/publish", Some(&delayed)).await;
    refused.assert_problem(409);
    assert_eq!(refused.body["setting"], "subjects", "{}", refused.text);
    assert!(
        refused.detail().contains(SCHEDULE_SUBJECTS),
        "{}",
        refused.text
    );

    set_up_for_schedules(&js).await;
    js.js
        .get_stream(STREAM)
        .await
        .expect("the stream")
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            durable_name: Some("everything".into()),
            ..Default::default()
        })
        .await
        .expect("a consumer of the whole stream");
    let refused = gateway.post("/publish", Some(&delayed)).await;
    refused.assert_problem(409);
    assert!(
        refused.detail().contains("everything"),
        "names the consumer: {}",
        refused.text
    );
    js.js
        .get_stream(STREAM)
        .await
        .expect("the stream")
        .delete_consumer("everything")
        .await
        .expect("deleted");

    for (body, field) in [
        (json!({ "subject": "orders.1", "delay": "soon" }), "delay"),
        (
            json!({ "subject": "orders.1", "deliver_at": "tomorrow" }),
            "deliver_at",
        ),
        (
            json!({ "subject": "orders.1", "delay": "1s", "deliver_at": "2030-01-01T00:00:00Z" }),
            "delay",
        ),
        (json!({ "subject": "orders.1", "delay": "400d" }), "delay"),
        (
            json!({ "subject": "orders.1", "deliver_at": "2099-01-01T00:00:00Z" }),
            "deliver_at",
        ),
    ] {
        gateway
            .post("/publish", Some(&body))
            .await
            .assert_invalid(field);
    }
    for (body, field) in [
        (
            json!({ "subject": "orders.1", "cron": "0 9 * * *" }),
            "cron",
        ),
        (
            json!({ "subject": "orders.1", "cron": "@every 100ms" }),
            "cron",
        ),
        (
            json!({ "subject": "orders.1", "cron": "0 0 9 * * *", "time_zone": "Europe/Atlantis" }),
            "time_zone",
        ),
        (
            json!({ "subject": "invoices.1", "cron": "@hourly" }),
            "subject",
        ),
    ] {
        gateway
            .post("/schedules", Some(&body))
            .await
            .assert_invalid(field);
    }
    assert_eq!(
        gateway
            .get("/schedules/ORDERS.0123456789abcdef")
            .await
            .status,
        404
    );
    assert_eq!(gateway.delete("/schedules/nonsense").await.status, 404);
    let listed = gateway.get("/schedules").await;
    assert_eq!(
        listed.body["schedules"],
        json!([]),
        "nothing stored: {}",
        listed.text
    );
    let past = gateway
        .post("/publish", Some(&json!({ "subject": "orders.past", "data": "now", "deliver_at": "2020-01-01T00:00:00Z" })))
        .await;
    assert_eq!(past.status, 202, "{}", past.text);
    let leased = gateway
        .fetch(json!({ "batch": 1, "wait_ms": 5000, "encoding": "utf8" }))
        .await;
    assert_eq!(leased.len(), 1, "a time past is delivered at once");
    assert_eq!(leased[0].data, "now");
}

/// Schedules due while the server is down, with the gateway gone too, fire once each after
/// both are back: none lost, none fired twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schedules_due_while_everything_was_down_fire_once_after_recovery() {
    let setup = setup("restarts");
    let (mut server, js, gateway) = setup.start().await;
    set_up_for_schedules(&js).await;
    let messages: Vec<Value> = (0..20)
        .map(|i| json!({ "subject": "orders.due", "data": format!("d{i}"), "delay": format!("{}ms", 1500 + i * 50) }))
        .collect();
    let reply = gateway
        .post("/publish/batch", Some(&json!({ "messages": messages })))
        .await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    let last_due = reply.body["results"]
        .as_array()
        .expect("results")
        .iter()
        .map(|result| parse_time(&result["deliver_at"]))
        .max()
        .expect("20 schedules");
    drop(gateway);
    server.stop_gracefully().await;
    // What is under test is a schedule that came due while nothing ran: wait for the clock.
    let down_for = (last_due - OffsetDateTime::now_utc()).max(time::Duration::ZERO)
        + time::Duration::milliseconds(500);
    tokio::time::sleep(down_for.try_into().unwrap_or_default()).await;
    server.restart().await;
    let gateway = setup.ready(&server.url()).await;

    let mut delivered = std::collections::HashMap::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while delivered.len() < 20 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "all 20 fired within 20 s of the restart: {delivered:?}"
        );
        for message in gateway
            .fetch(json!({ "batch": 20, "wait_ms": 1000, "encoding": "utf8" }))
            .await
        {
            *delivered.entry(message.data.clone()).or_insert(0) += 1;
            gateway.ack(&message.id).await;
        }
    }
    let more = gateway
        .fetch(json!({ "batch": 20, "wait_ms": 2000, "encoding": "utf8" }))
        .await;
    assert!(
        more.is_empty(),
        "none fired twice: {:?}",
        more.iter().map(|m| &m.data).collect::<Vec<_>>()
    );
    assert!(delivered.values().all(|count| *count == 1), "{delivered:?}");
    let listed = gateway.get("/schedules?stream=ORDERS").await;
    assert_eq!(listed.body["schedules"], json!([]), "{}", listed.text);
}
