//! Unit tests of `metrics` (kept apart so that the module itself stays short).

use super::*;

fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[test]
fn every_family_is_listed_from_the_start_and_other_results_on_first_use() {
    let process = ProcessMetrics::new();
    let billing = process.for_consumer("ORDERS", "billing");
    let text = process.render(false, SpanCounts::default());
    for name in [
        LEASES_IN_FLIGHT,
        LEASES_GRANTED,
        LEASES_SETTLED,
        LEASES_EXPIRED,
        LEASES_GIVEN_BACK,
        DELIVERIES_RECEIVED,
        REDELIVERIES,
        DELIVERIES_RELEASED,
        FETCH_WAIT,
        FETCH_LATENCY,
        FETCHES_EMPTY,
        FETCHES_IN_PROGRESS,
        NATS_CONNECTED,
        NATS_RECONNECTS,
        MAX_ACK_PENDING,
        ACK_WAIT,
        DELAYED_NAKS,
        BUILD_INFO,
        CONSUMERS,
    ] {
        assert!(
            text.contains(&format!("# TYPE {name} ")),
            "{name} missing:\n{text}"
        );
    }
    // What most consumers never see is listed once it happens.
    let rare = [
        SETTLED_AGAIN,
        FETCHES_REFUSED,
        ORDERING_HELD,
        ORDERING_BUSY_KEYS,
        ORDERING_KEYS_REJECTED,
    ];
    for name in rare {
        assert!(
            !text.contains(&format!("\n{name}{{")),
            "{name} listed before its first use:\n{text}"
        );
    }
    record_every_rare_series(&billing);
    let text = process.render(false, SpanCounts::default());
    for name in rare {
        assert!(
            text.contains(&format!("\n{name}{{")),
            "{name} missing after its first use:\n{text}"
        );
    }
    let series = |kind: &str, result: &str| {
        format!(
            r#"ruststream_leases_settled_total{{consumer="billing",kind="{kind}",result="{result}",stream="ORDERS"}}"#
        )
    };
    assert_eq!(value(&text, &series("in_progress", "ok")), Some(0.0));
    // A result other than ok appears on first use.
    assert_eq!(value(&text, &series("in_progress", "timeout")), None);
    billing.settled(SettleAction::InProgress, SettleOutcome::Timeout);
    let text = process.render(false, SpanCounts::default());
    assert_eq!(value(&text, &series("in_progress", "timeout")), Some(1.0));
    assert_eq!(value(&text, &series("in_progress", "ok")), Some(0.0));
}

/// Count once in each series made on first use.
fn record_every_rare_series(metrics: &Metrics) {
    metrics.settled_again(false, true);
    metrics.fetch_refused(FetchRefusal::AtCapacity);
    metrics.ordering(1, 1);
    metrics.ordering_key_rejected();
    metrics.dead_letter_missing();
    metrics.settle_forwarded(SettleOutcome::Ok);
    metrics.forwarded_settle_received(SettleOutcome::Ok);
}

/// The metrics page's table (docs/metrics.md, linked from the README) names every
/// metric, with its type.
#[test]
fn the_metrics_page_lists_every_metric() {
    let page = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/metrics.md"),
    )
    .expect("read docs/metrics.md");
    let process = ProcessMetrics::new();
    let billing = process.for_consumer("ORDERS", "billing");
    record_every_rare_series(&billing);
    let text = process.render(false, SpanCounts::default());
    let missing: Vec<&str> = text
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter(|declared| {
            let (name, kind) = declared.split_once(' ').unwrap_or((declared, ""));
            !page.contains(&format!("| `{name}` | {kind} |"))
        })
        .collect();
    assert!(
        missing.is_empty(),
        "docs/metrics.md's metrics table lacks rows `| `name` | type |` for: {missing:?}"
    );
}

#[test]
fn recordings_show_in_the_text() {
    let process = ProcessMetrics::new();
    let metrics = process.for_consumer("ORDERS", "billing");
    let shipping = process.for_consumer("ORDERS", "shipping");
    shipping.leases_granted(5);
    metrics.settled(SettleAction::Nak, SettleOutcome::Gone);
    metrics.settled(SettleAction::Nak, SettleOutcome::Gone);
    metrics.delivery_received(1);
    metrics.delivery_received(3);
    metrics.fetch_served(Duration::from_millis(3), 0);
    metrics.fetch_refused(FetchRefusal::AtCapacity);
    process.http_request(
        &Method::POST,
        "/messages/{id}/ack",
        StatusCode::GONE,
        Duration::from_millis(2),
    );
    metrics.leases_expired(2);
    metrics.take_in(Snapshot {
        leases_in_flight: 7,
        ack_wait: Duration::from_millis(1500),
        ..Snapshot::default()
    });
    let text = process.render(true, SpanCounts::default());
    let billing = r#"consumer="billing",stream="ORDERS""#;
    let expect = [
        (
            r#"ruststream_leases_settled_total{consumer="billing",kind="nak",result="gone",stream="ORDERS"}"#.to_owned(),
            2.0,
        ),
        (format!("ruststream_deliveries_received_total{{{billing}}}"), 2.0),
        (format!("ruststream_redeliveries_total{{{billing}}}"), 1.0),
        (format!("ruststream_fetches_empty_total{{{billing}}}"), 1.0),
        (format!("ruststream_fetch_latency_seconds_count{{{billing}}}"), 1.0),
        (
            format!(r#"ruststream_fetch_latency_seconds_bucket{{{billing},le="0.005"}}"#),
            1.0,
        ),
        (
            format!(r#"ruststream_fetch_latency_seconds_bucket{{{billing},le="0.0025"}}"#),
            0.0,
        ),
        (
            r#"ruststream_fetches_refused_total{consumer="billing",reason="at_capacity",stream="ORDERS"}"#.to_owned(),
            1.0,
        ),
        (
            r#"ruststream_http_requests_total{method="POST",route="/messages/{id}/ack",status="410"}"#.to_owned(),
            1.0,
        ),
        (format!("ruststream_leases_in_flight{{{billing}}}"), 7.0),
        (format!("ruststream_leases_expired_total{{{billing}}}"), 2.0),
        ("ruststream_nats_connected".to_owned(), 1.0),
        (format!("ruststream_ack_wait_seconds{{{billing}}}"), 1.5),
        (
            r#"ruststream_leases_granted_total{consumer="shipping",stream="ORDERS"}"#.to_owned(),
            5.0,
        ),
        (format!("ruststream_leases_granted_total{{{billing}}}"), 0.0),
    ];
    for (series, want) in expect {
        assert_eq!(value(&text, &series), Some(want), "{series} in:\n{text}");
    }
    shipping.forget();
    let text = process.render(true, SpanCounts::default());
    assert!(!text.contains(r#"consumer="shipping""#), "{text}");
    assert!(text.contains(r#"consumer="billing""#), "{text}");
}
