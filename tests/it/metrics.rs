//! `GET /metrics`: the Prometheus figures move as the gateway works. Each test scrapes, does
//! known things (fetch, ack, nak, term, extend, expiry, empty fetch, 429, a NATS restart),
//! scrapes again and checks the exact differences.

use std::time::Duration;

use serde_json::json;

use crate::support::{Msg, Scrape, Setup, sleep_past, wait_for};

fn settled(kind: &str, result: &str) -> String {
    format!(r#"ruststream_leases_settled_total{{kind="{kind}",result="{result}"}}"#)
}

fn http(method: &str, route: &str, status: u16) -> String {
    format!(
        r#"ruststream_http_requests_total{{method="{method}",route="{route}",status="{status}"}}"#
    )
}

/// Check `after - before` for each series, reporting every mismatch at once.
#[track_caller]
fn assert_deltas(before: &Scrape, after: &Scrape, expected: &[(String, f64)]) {
    let wrong: Vec<String> = expected
        .iter()
        .filter_map(|(series, want)| {
            let got = after.get_or_zero(series) - before.get_or_zero(series);
            ((got - want).abs() > 1e-9).then(|| format!("{series}: expected +{want}, got +{got}"))
        })
        .collect();
    assert!(
        wrong.is_empty(),
        "metric deltas differ:\n  {}\nlast scrape:\n{}",
        wrong.join("\n  "),
        after.text
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_move_with_fetches_settles_expiry_and_refusals() {
    let (_server, js, gateway) = Setup::consumer("metered")
        .max_ack_pending(3)
        .ack_wait("3s")
        .start()
        .await;
    let start = Scrape::of(&gateway).await;
    assert_eq!(start.get("ruststream_max_ack_pending"), 3.0);
    assert_eq!(start.get("ruststream_ack_wait_seconds"), 3.0);
    assert_eq!(start.get("ruststream_nats_connected"), 1.0);
    assert_eq!(start.get("ruststream_leases_in_flight"), 0.0);
    assert_eq!(start.get("ruststream_delayed_naks"), 0.0);
    assert_eq!(
        start.get(r#"ruststream_build_info{version="0.1.0"}"#),
        1.0,
        "build info carries the crate version"
    );
    // What most consumers never see costs an idle one no series (a thousand consumers'
    // would cost megabytes): those appear on first use.
    for family in [
        "ruststream_fetches_refused_total",
        "ruststream_dead_letters_skipped_total",
        "ruststream_redeliveries_settled_again_total",
        "ruststream_settles_forwarded_total",
        "ruststream_forwarded_settles_received_total",
        "ruststream_ordering_held",
        "ruststream_ordering_busy_keys",
        "ruststream_ordering_keys_rejected_total",
    ] {
        assert!(
            !start
                .text
                .lines()
                .any(|line| line.starts_with(&format!("{family}{{"))),
            "{family} listed before its first use:\n{}",
            start.text
        );
    }

    // An empty fetch, then three leases: max_ack_pending is full, the next fetch is a 429.
    assert!(gateway.fetch_n(1, 0).await.is_empty());
    js.publish_many("orders.1", 4, "m").await;
    let mut fetches_ok = 1.0;
    let mut empty = 1.0;
    let first = gateway.fetch_n(3, 2000).await;
    fetches_ok += 1.0;
    assert_eq!(first.len(), 3, "three messages at once");
    let held = Scrape::of(&gateway).await;
    assert_eq!(held.get("ruststream_leases_in_flight"), 3.0);
    gateway.fetch_refused_at_capacity().await;

    // Settles: ok, a repeat, a conflict, nak, term, an extension of a settled lease, a forgery.
    let [m0, m1, m2] = [&first[0], &first[1], &first[2]];
    assert_eq!(gateway.ack(&m0.id).await, 204);
    assert_eq!(
        gateway.ack(&m0.id).await,
        204,
        "a repeated ack answers the same"
    );
    assert_eq!(gateway.nak(&m0.id, None).await, 409);
    assert_eq!(gateway.nak(&m1.id, None).await, 204);
    assert_eq!(gateway.term(&m2.id, Some("bad")).await, 204);
    assert_eq!(gateway.in_progress(&m2.id).await.status, 409);
    let forged = format!("{}A", &m0.id[..m0.id.len() - 1]);
    let forged = if forged == m0.id {
        format!("{}B", &m0.id[..m0.id.len() - 1])
    } else {
        forged
    };
    assert_eq!(gateway.ack(&forged).await, 404);

    // The nak'd message comes back (delivered 2) with the fourth one.
    let mut second: Vec<Msg> = Vec::new();
    while second.len() < 2 {
        let got = gateway.fetch_n(3, 2000).await;
        fetches_ok += 1.0;
        if got.is_empty() {
            empty += 1.0;
        }
        second.extend(got);
        assert!(
            fetches_ok < 10.0,
            "the nak'd and the fourth message come: {second:?}"
        );
    }
    assert_eq!(second.len(), 2, "{second:?}");
    assert_eq!(
        second.iter().filter(|m| m.delivered == 2).count(),
        1,
        "one redelivery: {second:?}"
    );
    let extended = gateway.in_progress(&second[0].id).await;
    assert_eq!(extended.status, 200, "{}", extended.text);
    let extended_to = crate::support::rfc3339(
        extended.body["lease_expires_at"]
            .as_str()
            .expect("lease_expires_at"),
    );

    // Both leases run out: the scrape sees them expire; a late ack is 410.
    sleep_past(
        extended_to.max(second[1].lease_expires()),
        Duration::from_millis(100),
    )
    .await;
    let expired = Scrape::of(&gateway).await;
    assert_eq!(expired.get("ruststream_leases_in_flight"), 0.0);
    assert_deltas(
        &start,
        &expired,
        &[("ruststream_leases_expired_total".into(), 2.0)],
    );
    assert_eq!(gateway.ack(&second[1].id).await, 410);

    // Redelivered again (delivered 3 and 2): one nak'd with a delay holds a slot.
    let mut third: Vec<Msg> = Vec::new();
    while third.len() < 2 {
        let got = gateway.fetch_n(3, 2000).await;
        fetches_ok += 1.0;
        if got.is_empty() {
            empty += 1.0;
        }
        third.extend(got);
        assert!(
            fetches_ok < 20.0,
            "both expired messages come back: {third:?}"
        );
    }
    assert_eq!(gateway.nak(&third[0].id, Some(60_000)).await, 204);
    assert_eq!(gateway.ack(&third[1].id).await, 204);

    let end = Scrape::of(&gateway).await;
    assert_eq!(end.get("ruststream_leases_in_flight"), 0.0);
    assert_eq!(end.get("ruststream_delayed_naks"), 1.0);
    assert_eq!(end.get("ruststream_nats_connected"), 1.0);
    let granted = (first.len() + second.len() + third.len()) as f64;
    assert_deltas(
        &start,
        &end,
        &[
            ("ruststream_leases_granted_total".into(), granted),
            ("ruststream_deliveries_received_total".into(), granted),
            ("ruststream_redeliveries_total".into(), 3.0),
            ("ruststream_leases_expired_total".into(), 2.0),
            ("ruststream_leases_withdrawn_total".into(), 0.0),
            ("ruststream_fetches_empty_total".into(), empty),
            ("ruststream_fetch_wait_seconds_count".into(), fetches_ok),
            ("ruststream_fetch_latency_seconds_count".into(), fetches_ok),
            (
                r#"ruststream_fetches_refused_total{reason="at_capacity"}"#.into(),
                1.0,
            ),
            (
                r#"ruststream_fetches_refused_total{reason="unavailable"}"#.into(),
                0.0,
            ),
            (settled("ack", "ok"), 2.0),
            (settled("ack", "repeated"), 1.0),
            (settled("ack", "unknown"), 1.0),
            (settled("ack", "gone"), 1.0),
            (settled("nak", "already_settled"), 1.0),
            (settled("nak", "ok"), 2.0),
            (settled("term", "ok"), 1.0),
            (settled("in_progress", "already_settled"), 1.0),
            (settled("in_progress", "ok"), 1.0),
            (settled("ack", "timeout"), 0.0),
            (settled("term", "gone"), 0.0),
            (http("POST", "/fetch", 200), fetches_ok),
            (http("POST", "/fetch", 429), 1.0),
            (http("POST", "/messages/{id}/ack", 204), 3.0),
            (http("POST", "/messages/{id}/ack", 404), 1.0),
            (http("POST", "/messages/{id}/ack", 410), 1.0),
            (http("POST", "/messages/{id}/nak", 204), 2.0),
            (http("POST", "/messages/{id}/nak", 409), 1.0),
            (http("POST", "/messages/{id}/term", 204), 1.0),
            (http("POST", "/messages/{id}/in-progress", 200), 1.0),
            (http("POST", "/messages/{id}/in-progress", 409), 1.0),
            // The scrapes in between (the first scrape itself is counted after it answered).
            (http("GET", "/metrics", 200), 3.0),
            (
                r#"ruststream_http_request_duration_seconds_count{method="POST",route="/fetch"}"#
                    .into(),
                fetches_ok + 1.0,
            ),
        ],
    );
    // Routes are templates: no lease id ever becomes a label.
    for message in first.iter().chain(&second).chain(&third) {
        assert!(
            !end.text.contains(&message.id),
            "a lease id leaked into the metrics"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unmatched_paths_count_under_one_route_label() {
    let (_server, _js, gateway) = Setup::consumer("unmatched").start().await;
    let before = Scrape::of(&gateway).await;
    for probe in ["/nope", "/wp-admin/x.php", "/messages"] {
        assert_eq!(gateway.get(probe).await.status, 404, "{probe}");
    }
    assert_eq!(gateway.get("/healthz").await.status, 200);
    let after = Scrape::of(&gateway).await;
    assert_deltas(
        &before,
        &after,
        &[
            (http("GET", "unmatched", 404), 3.0),
            (http("GET", "/healthz", 200), 1.0),
        ],
    );
    assert!(
        !after.text.contains("wp-admin"),
        "raw paths are never labels"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_restart_shows_in_connection_state_and_reconnects() {
    let (mut server, _js, mut gateway) = Setup::consumer("reconnecting").start().await;
    let before = Scrape::of(&gateway).await;
    assert_eq!(before.get("ruststream_nats_connected"), 1.0);
    assert_eq!(before.get("ruststream_nats_reconnects_total"), 0.0);

    server.kill();
    gateway.wait_unready().await;
    let down = Scrape::of(&gateway).await;
    assert_eq!(
        down.get("ruststream_nats_connected"),
        0.0,
        "/metrics answers while NATS is down, and says so"
    );
    let refused = gateway.fetch_reply(Some(&json!({ "wait_ms": 0 }))).await;
    refused.assert_problem(503);

    server.restart().await;
    gateway.wait_ready().await;
    let after = wait_for(
        "the reconnect is counted",
        Duration::from_secs(10),
        || async {
            let scrape = Scrape::of(&gateway).await;
            (scrape.get("ruststream_nats_reconnects_total") >= 1.0).then_some(scrape)
        },
    )
    .await;
    assert_eq!(after.get("ruststream_nats_connected"), 1.0);
    assert_deltas(
        &before,
        &after,
        &[
            ("ruststream_nats_reconnects_total".into(), 1.0),
            (
                r#"ruststream_fetches_refused_total{reason="unavailable"}"#.into(),
                1.0,
            ),
        ],
    );
}
