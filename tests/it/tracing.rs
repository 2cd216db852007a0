//! OpenTelemetry traces, as an OTLP/HTTP collector receives them (a real receiver decoding
//! the protobuf, [`crate::support::otlp`]): a message followed from `POST /publish` (its
//! `traceparent` written into the NATS headers) through the fetch that leased it (a link to
//! it) to each settle (children of the request, linked to the message); log lines joined to
//! the trace; a settle forwarded between replicas continuing the forwarding replica's trace;
//! and a collector that is down costing requests nothing but dropped, counted spans.

use std::time::Duration;

use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use serde_json::{Value, json};

use crate::support::nats::free_port;
use crate::support::otlp::{Receiver, Span};
use crate::support::{Action, FetchRequest, GatewayProcess, Msg, Scrape, Setup, wait_for};

/// A gateway binary exporting to `endpoint`, in batches every 100 ms.
fn traced(consumer: &str, endpoint: &str) -> Setup {
    Setup::consumer(consumer)
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
}

/// A message's `traceparent` header as fetched.
fn traceparent(message: &Msg) -> String {
    match &message.headers["traceparent"] {
        Value::Array(values) => values[0].as_str().unwrap_or_default().to_owned(),
        other => other.as_str().unwrap_or_default().to_owned(),
    }
}

/// (trace id, span id) of a `traceparent`.
fn ids(traceparent: &str) -> (String, String) {
    let parts: Vec<&str> = traceparent.split('-').collect();
    assert_eq!(parts.len(), 4, "a W3C traceparent: {traceparent:?}");
    (parts[1].to_owned(), parts[2].to_owned())
}

/// POST /publish of `data` to `orders.traced`, with these request headers and NATS headers.
async fn publish(
    gateway: &GatewayProcess,
    data: &str,
    request_headers: &[(&str, &str)],
    nats_headers: Value,
) {
    let mut request = gateway.http.post(gateway.url("/publish")).json(&json!({
        "subject": "orders.traced",
        "data": data,
        "headers": nats_headers,
    }));
    for (name, value) in request_headers {
        request = request.header(*name, *value);
    }
    let reply = request.send().await.expect("POST /publish");
    assert_eq!(reply.status(), 201, "{:?}", reply.text().await);
}

/// The server span of the request `span` is a child of.
async fn server_parent(receiver: &Receiver, span: &Span) -> Span {
    let parent = span.parent_span_id.clone();
    receiver
        .span(
            &format!("the server span of {:?}", span.name),
            |candidate| candidate.span_id == parent && candidate.kind == SpanKind::Server,
        )
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_is_traced_from_publish_through_fetch_to_each_settle() {
    let receiver = Receiver::start().await;
    let (server, _js) = crate::support::server_with_stream().await;
    let gateway = traced("traced", &receiver.endpoint)
        .flag("--log-format", "json")
        .rust_log("info,ruststream_nats=debug")
        .process(&server.url())
        .await;

    // Published inside the caller's trace: the server span continues it, the send span is
    // the server span's child, and the message carries the send span's context.
    let caller = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331");
    let incoming = format!("00-{}-{}-01", caller.0, caller.1);
    publish(&gateway, "one", &[("traceparent", &incoming)], json!({})).await;
    for data in ["two", "three", "four", "five"] {
        publish(&gateway, data, &[], json!({})).await;
    }
    // A message that carries its own context keeps it as it is.
    let own = "00-11111111111111111111111111111111-2222222222222222-01";
    publish(&gateway, "six", &[], json!({ "traceparent": own })).await;

    let send = receiver
        .span("the send span of the first message", |span| {
            span.name == "send orders.traced" && span.trace_id == caller.0
        })
        .await;
    assert_eq!(send.kind, SpanKind::Producer);
    assert_eq!(send.service, "ruststream-nats", "the default service.name");
    for (key, value) in [
        ("messaging.system", "nats"),
        ("messaging.operation.type", "send"),
        ("messaging.destination.name", "orders.traced"),
        ("messaging.nats.stream", "ORDERS"),
        ("messaging.nats.stream_sequence", "1"),
    ] {
        assert_eq!(send.attr(key), value, "{key} of {send:#?}");
    }
    let publish_span = server_parent(&receiver, &send).await;
    assert_eq!(publish_span.name, "POST /publish");
    assert_eq!(
        publish_span.parent_span_id, caller.1,
        "child of the caller's span"
    );
    assert_eq!(publish_span.attr("http.request.method"), "POST");
    assert_eq!(publish_span.attr("http.route"), "/publish");
    // An integer, as the semantic conventions and every trace query want it.
    assert_eq!(
        publish_span.integers.get("http.response.status_code"),
        Some(&201),
        "{publish_span:#?}"
    );

    let messages = gateway.fetch_with(&FetchRequest::new(6, 2000).utf8()).await;
    assert_eq!(messages.len(), 6);
    let by_data = |data: &str| {
        messages
            .iter()
            .find(|message| message.data == data)
            .unwrap_or_else(|| panic!("no message {data:?} in {messages:?}"))
    };
    assert_eq!(traceparent(by_data("one")), send.traceparent());
    assert_eq!(
        traceparent(by_data("six")),
        own,
        "kept as the publisher wrote it"
    );
    let two = ids(&traceparent(by_data("two")));
    assert_ne!(
        two.0, caller.0,
        "a publish without a traceparent starts a trace"
    );

    let receive = receiver
        .span("the fetch's receive span", |span| {
            span.name == "receive ORDERS"
        })
        .await;
    assert_eq!(receive.kind, SpanKind::Consumer);
    assert_eq!(receive.attr("messaging.batch.message_count"), "6");
    assert_eq!(receive.attr("messaging.consumer.group.name"), "traced");
    assert_eq!(receive.attr("messaging.operation.type"), "receive");
    for message in &messages {
        assert!(
            receive.links.contains(&ids(&traceparent(message))),
            "a link to {:?}'s context: {receive:#?}",
            message.data
        );
    }
    assert_eq!(server_parent(&receiver, &receive).await.name, "POST /fetch");

    // One settle span per id: child of its request's span, linked to the message.
    assert_eq!(gateway.ack(&by_data("one").id).await, 204);
    assert_eq!(gateway.nak(&by_data("two").id, None).await, 204);
    assert_eq!(gateway.term(&by_data("three").id, None).await, 204);
    let batch = json!({ "ids": [by_data("four").id, by_data("five").id] });
    let results = gateway.settle_many_ok(Action::Ack, &batch).await;
    assert!(
        results.iter().all(|(_, status)| *status == 204),
        "{results:?}"
    );
    assert_eq!(gateway.in_progress(&by_data("six").id).await.status, 200);
    assert_eq!(gateway.nak(&by_data("one").id, None).await, 409);

    let settles = receiver
        .spans_matching("seven settle spans", 7, |span| {
            span.attributes
                .get("messaging.operation.type")
                .map(String::as_str)
                == Some("settle")
        })
        .await;
    let settle_of = |data: &str, operation: &str| -> Span {
        let message = by_data(data);
        settles
            .iter()
            .find(|span| {
                span.attr("messaging.operation.name") == operation
                    && span.attr("messaging.nats.stream_sequence")
                        == message.stream_sequence.to_string()
            })
            .unwrap_or_else(|| panic!("no {operation} span of {data:?}: {settles:#?}"))
            .clone()
    };
    for (data, operation, outcome) in [
        ("one", "ack", "ok"),
        ("two", "nak", "ok"),
        ("three", "term", "ok"),
        ("four", "ack", "ok"),
        ("five", "ack", "ok"),
        ("six", "in_progress", "ok"),
        ("one", "nak", "already_settled"),
    ] {
        let span = settle_of(data, operation);
        assert_eq!(span.name, format!("{operation} orders.traced"));
        assert_eq!(span.kind, SpanKind::Client);
        assert!(
            !span.failed,
            "a 409 is the client's error, not the span's: {span:#?}"
        );
        assert_eq!(span.attr("ruststream.settle.outcome"), outcome, "{span:#?}");
        assert_eq!(span.attr("messaging.system"), "nats");
        assert_eq!(span.attr("messaging.consumer.group.name"), "traced");
        assert_eq!(span.attr("messaging.nats.delivered"), "1");
        assert!(
            span.links.contains(&ids(&traceparent(by_data(data)))),
            "linked to the message: {span:#?}"
        );
        let request = server_parent(&receiver, &span).await;
        assert_eq!(request.trace_id, span.trace_id);
        assert!(request.name.starts_with("POST /messages/"), "{request:#?}");
    }
    let (four, five) = (settle_of("four", "ack"), settle_of("five", "ack"));
    assert_eq!(
        four.parent_span_id, five.parent_span_id,
        "one batch, one request"
    );
    assert_eq!(
        server_parent(&receiver, &four).await.attr("http.route"),
        "/messages/ack"
    );

    // The log line of the first ack carries its request's ids and trace.
    let ack = settle_of("one", "ack");
    let request = server_parent(&receiver, &ack).await;
    let log = gateway.log();
    let line: Value = log
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .find(|line| {
            line["fields"]["message"] == "lease settle"
                && line["fields"]["lease_id"] == by_data("one").id.as_str()
                && line["fields"]["kind"] == "ack"
        })
        .unwrap_or_else(|| panic!("no settle line for the ack in {log}"));
    assert_eq!(line["trace_id"], request.trace_id.as_str(), "{line}");
    assert_eq!(line["span_id"], request.span_id.as_str(), "{line}");
    assert!(
        line["request_id"].as_str().is_some_and(|id| !id.is_empty()),
        "{line}"
    );

    // A batch written to an open event stream is a receive span of the stream's request.
    publish(&gateway, "seven", &[], json!({})).await;
    let mut events = gateway
        .http
        .get(gateway.url("/events?encoding=utf8"))
        .send()
        .await
        .expect("GET /events");
    let mut seen = String::new();
    while !seen.contains("event: message") {
        let chunk = tokio::time::timeout(Duration::from_secs(10), events.chunk())
            .await
            .expect("an event within 10 s")
            .expect("read the stream")
            .expect("the stream stays open");
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    let streamed = receiver
        .span("the stream's receive span", |span| {
            span.name == "receive ORDERS" && span.span_id != receive.span_id
        })
        .await;
    // "seven", and "two" again (nak'd without a delay, so redelivered at once).
    let count: u64 = streamed
        .attr("messaging.batch.message_count")
        .parse()
        .expect("a count");
    assert!((1..=2).contains(&count), "{streamed:#?}");
    // The stream's own span ends (and is exported) when the stream does.
    drop(events);
    let opened = server_parent(&receiver, &streamed).await;
    assert_eq!(opened.attr("http.route"), "/events");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_settle_continues_the_forwarding_replicas_trace() {
    let receiver = Receiver::start().await;
    let (server, js) = crate::support::server_with_stream().await;
    let mut key = tempfile::NamedTempFile::new().expect("temp key file");
    std::io::Write::write_all(
        &mut key,
        b"traced replicas share this lease key: 0123456789",
    )
    .expect("write key");
    let setup = traced("traced-replicas", &receiver.endpoint).lease_key_file(key.path());
    let owner = setup
        .clone()
        .env("OTEL_SERVICE_NAME", "replica-a")
        .process(&server.url())
        .await;
    let other = setup
        .env("OTEL_SERVICE_NAME", "replica-b")
        .process(&server.url())
        .await;
    for gateway in [&owner, &other] {
        wait_for(
            "both replicas see each other",
            Duration::from_secs(10),
            || async move {
                let view = gateway.consumer_view().await;
                (view["replicas"].as_array().map_or(0, Vec::len) == 2).then_some(())
            },
        )
        .await;
    }
    js.publish("orders.forwarded", "m").await;
    let leased = owner.fetch_n(1, 2000).await;
    assert_eq!(leased.len(), 1);
    assert_eq!(other.ack(&leased[0].id).await, 204);

    let settle = receiver
        .span("the owner's ack span", |span| {
            span.service == "replica-a" && span.name == "ack orders.forwarded"
        })
        .await;
    assert_eq!(settle.attr("ruststream.settle.outcome"), "ok");
    let request = server_parent(&receiver, &settle).await;
    assert_eq!(
        request.service, "replica-b",
        "the forwarding replica's request"
    );
    assert_eq!(request.attr("http.route"), "/messages/{id}/ack");
    assert_eq!(request.trace_id, settle.trace_id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_is_down_costs_requests_only_dropped_spans() {
    let (server, js) = crate::support::server_with_stream().await;
    let nobody = format!("http://127.0.0.1:{}", free_port());
    let gateway = traced("untraced", &nobody)
        .env("OTEL_EXPORTER_OTLP_TIMEOUT", "500")
        .process(&server.url())
        .await;
    for round in 0..5 {
        js.publish("orders.lost", format!("m{round}")).await;
        let leased = gateway.fetch_n(1, 2000).await;
        assert_eq!(leased.len(), 1);
        assert_eq!(gateway.ack(&leased[0].id).await, 204);
    }
    let dropped = wait_for(
        "spans counted as dropped",
        Duration::from_secs(10),
        || async {
            let dropped = Scrape::of(&gateway)
                .await
                .exact("ruststream_trace_spans_dropped_total");
            (dropped >= 10.0).then_some(dropped)
        },
    )
    .await;
    assert!(dropped >= 10.0);
    let warnings = gateway.log().matches("trace spans dropped").count();
    assert_eq!(
        warnings,
        1,
        "one warning a minute at most: {}",
        gateway.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_go_out_over_grpc_when_the_protocol_says_so() {
    let receiver = Receiver::start_grpc().await;
    let (server, _js) = crate::support::server_with_stream().await;
    let gateway = traced("traced-grpc", &receiver.endpoint)
        .env("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        .env("OTEL_SERVICE_NAME", "gateway-over-grpc")
        .process(&server.url())
        .await;
    publish(&gateway, "over grpc", &[], json!({})).await;
    let send = receiver
        .span("the send span, over gRPC", |span| {
            span.name == "send orders.traced"
        })
        .await;
    assert_eq!(send.kind, SpanKind::Producer);
    assert_eq!(send.service, "gateway-over-grpc");
    assert_eq!(server_parent(&receiver, &send).await.name, "POST /publish");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_attempt_is_a_client_span_linked_to_the_message_and_named_in_its_request() {
    let receiver = Receiver::start().await;
    let endpoint = crate::support::endpoint::Endpoint::start().await;
    let (server, _js) = crate::support::server_with_stream().await;
    let dir = crate::support::nats::files_dir();
    let file = dir.path().join("consumers.toml");
    std::fs::write(
        &file,
        format!(
            "[[consumer]]\nstream = \"ORDERS\"\nname = \"hooks\"\n\n[consumer.push]\nurl = \"{}\"\n",
            endpoint.url
        ),
    )
    .expect("consumers file");
    let gateway = traced("traced", &receiver.endpoint)
        .flag("--consumers-file", file.display().to_string())
        .process(&server.url())
        .await;
    publish(&gateway, "pushed", &[], json!({})).await;
    let send = receiver
        .span("the send span", |span| span.name == "send orders.traced")
        .await;
    let request = &endpoint.wait_for(1, Duration::from_secs(10)).await[0];
    let incoming = request.header("traceparent").expect("a traceparent");
    let (trace, span_id) = ids(&incoming);
    let push = receiver
        .span("the push span", |span| span.span_id == span_id)
        .await;
    assert_eq!(push.name, "POST");
    assert_eq!(push.kind, SpanKind::Client);
    assert_eq!(push.trace_id, trace);
    assert_eq!(push.attr("url.full"), endpoint.url);
    assert_eq!(push.integers.get("http.response.status_code"), Some(&204));
    assert_eq!(push.attr("messaging.consumer.group.name"), "hooks");
    assert_eq!(
        push.links,
        vec![(send.trace_id.clone(), send.span_id.clone())],
        "linked to the span that sent the message"
    );
}
