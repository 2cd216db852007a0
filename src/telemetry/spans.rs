//! The spans the gateway makes, named and attributed after the OpenTelemetry semantic
//! conventions for HTTP servers and for messaging (`send`, `receive`, `settle`), and the W3C
//! Trace Context carried in and out: from HTTP request headers, into the NATS headers of a
//! published message, from a fetched message's headers (its link), and across a settle
//! forwarded to another replica. Each helper returns a disabled span at once when tracing is
//! off.
//!
//! May import: as the rest of `telemetry`.

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator as _};
use opentelemetry::trace::{SpanContext, TraceContextExt as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing::Span;
use tracing::field::Empty;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

use super::on;
use crate::domain::delivery::{Leased, MessageNote};
use crate::domain::lease_id::LeaseCoordinates;

/// The target of the HTTP server span: the log lines of a request show its fields.
pub(crate) const SERVER: &str = "ruststream_nats::otel::server";
/// The target of the per-message spans, which log lines leave out (they would repeat the
/// message's attributes on every line).
pub(crate) const MESSAGING: &str = "ruststream_nats::otel::messaging";

/// The W3C `traceparent` header (and NATS header) name.
pub(crate) const TRACEPARENT: &str = "traceparent";
/// The NATS header naming a message for the stream's deduplication.
const MESSAGE_ID: &str = "Nats-Msg-Id";

/// The server span of one HTTP request, child of the request's `traceparent` when it has
/// one. Named `{method} {route}`, as the HTTP conventions say (the method alone when no route
/// matched). Also carries the fields the access log records ([`super::super`]'s callers).
pub(crate) fn server_span(
    method: &axum::http::Method,
    route: Option<&str>,
    request_id: &str,
    headers: &axum::http::HeaderMap,
) -> Span {
    let name = match route {
        Some(route) => format!("{method} {route}"),
        None => method.to_string(),
    };
    let span = tracing::info_span!(
        target: SERVER,
        "request",
        otel.name = name,
        otel.kind = "server",
        otel.status_code = Empty,
        http.request.method = method.as_str(),
        http.route = route,
        http.response.status_code = Empty,
        request_id,
        subject = Empty,
        path = Empty,
        status = Empty,
        latency_us = Empty,
    );
    let parent = TraceContextPropagator::new().extract(&HttpHeaders(headers));
    let _ = span.set_parent(parent);
    span
}

/// The answer's status on the server span; a 5xx marks it failed.
pub(crate) fn answered(span: &Span, status: axum::http::StatusCode) {
    span.record("http.response.status_code", status.as_u16());
    if status.is_server_error() {
        span.record("otel.status_code", "error");
    }
}

/// The trace and span ids of `span` (hex), when it is part of a trace.
pub(crate) fn ids(span: &Span) -> Option<(String, String)> {
    let context = span.context();
    let span_context = context.span().span_context().clone();
    span_context.is_valid().then(|| {
        (
            span_context.trace_id().to_string(),
            span_context.span_id().to_string(),
        )
    })
}

/// A `send {subject}` span (kind PRODUCER) for `POST /publish`; `headers` are the message's
/// NATS headers, which get the span's `traceparent` (and `tracestate`) unless the publisher
/// already set one, kept as it is then.
pub(crate) fn send_span(subject: &str, headers: &mut async_nats::HeaderMap) -> Span {
    if !on() {
        return Span::none();
    }
    let message_id = header(headers, MESSAGE_ID).map(str::to_owned);
    let span = tracing::info_span!(
        target: MESSAGING,
        "send",
        otel.name = format!("send {subject}"),
        otel.kind = "producer",
        otel.status_code = Empty,
        messaging.system = "nats",
        messaging.operation.type = "send",
        messaging.operation.name = "publish",
        messaging.destination.name = subject,
        messaging.message.id = message_id,
        messaging.nats.stream = Empty,
        messaging.nats.stream_sequence = Empty,
        error.type = Empty,
    );
    if header(headers, TRACEPARENT).is_none() {
        inject_nats(&span, headers);
    }
    span
}

/// What the stream said of a published message, on its `send` span: where it stored it, or
/// the HTTP status of the refusal (its `error.type`).
pub(crate) fn sent(span: &Span, result: Result<(&str, u64), u16>) {
    match result {
        Ok((stream, sequence)) => {
            span.record("messaging.nats.stream", stream);
            span.record("messaging.nats.stream_sequence", sequence);
        }
        Err(status) => {
            span.record("otel.status_code", "error");
            span.record("error.type", status.to_string());
        }
    }
}

/// A `receive {stream}` span (kind CONSUMER) for one fetch, or one batch written to an open
/// event stream; [`received`] adds its messages.
pub(crate) fn receive_span(stream: &str, consumer: &str) -> Span {
    if !on() {
        return Span::none();
    }
    tracing::info_span!(
        target: MESSAGING,
        "receive",
        otel.name = format!("receive {stream}"),
        otel.kind = "consumer",
        messaging.system = "nats",
        messaging.operation.type = "receive",
        messaging.operation.name = "fetch",
        messaging.consumer.group.name = consumer,
        messaging.nats.stream = stream,
        messaging.destination.name = Empty,
        messaging.batch.message_count = Empty,
    )
}

/// The messages a receive span handed out: their count, a link to each one's own trace
/// context (its `traceparent` header), and the subject when they all share one.
pub(crate) fn received(span: &Span, leased: &[Leased]) {
    if span.is_disabled() {
        return;
    }
    span.record("messaging.batch.message_count", leased.len() as u64);
    if let Some(first) = leased.first()
        && leased
            .iter()
            .all(|one| one.delivery.subject == first.delivery.subject)
    {
        span.record(
            "messaging.destination.name",
            first.delivery.subject.as_str(),
        );
    }
    for one in leased {
        if let Some(context) = message_context(one.delivery.headers.as_ref()) {
            let key = one.delivery.coordinates.key;
            span.add_link_with_attributes(
                context,
                vec![
                    opentelemetry::KeyValue::new(
                        "messaging.destination.name",
                        one.delivery.subject.to_string(),
                    ),
                    opentelemetry::KeyValue::new(
                        "messaging.nats.stream_sequence",
                        i64::try_from(key.stream_sequence).unwrap_or(i64::MAX),
                    ),
                    opentelemetry::KeyValue::new(
                        "messaging.nats.delivered",
                        i64::try_from(key.delivered).unwrap_or(i64::MAX),
                    ),
                ],
            );
        }
    }
}

/// What a settle span will need of a delivery, kept with its lease; `None` when tracing is
/// off (the lease table then keeps nothing more).
pub(crate) fn note_of(
    subject: &async_nats::Subject,
    headers: Option<&async_nats::HeaderMap>,
) -> Option<std::sync::Arc<MessageNote>> {
    if !on() {
        return None;
    }
    Some(std::sync::Arc::new(MessageNote {
        subject: subject.clone(),
        message_id: headers.and_then(|headers| header(headers, MESSAGE_ID).map(str::to_owned)),
        context: message_context(headers),
    }))
}

tokio::task_local! {
    /// The trace context a forwarded settle came with: the settle spans made while the
    /// owner serves it are its children.
    static FORWARDED_FROM: opentelemetry::Context;
}

/// Serve a forwarded settle (`serve`) with the trace context of its NATS request's headers.
pub(crate) async fn forwarded_from<F: Future>(
    headers: Option<&async_nats::HeaderMap>,
    serve: F,
) -> F::Output {
    if !on() {
        return serve.await;
    }
    let context = match headers {
        Some(headers) => TraceContextPropagator::new().extract(&NatsHeaders(headers)),
        None => opentelemetry::Context::new(),
    };
    FORWARDED_FROM.scope(context, serve).await
}

/// The current span's trace context in a forwarded settle's NATS headers, for the owner's
/// settle spans to be its children.
pub(crate) fn inject_forward(headers: &mut async_nats::HeaderMap) {
    if on() {
        inject_nats(&Span::current(), headers);
    }
}

/// A settle span for one lease id: named `{operation} {subject}` (the stream's name when the
/// id names no lease known here), kind CLIENT, child of the current span (the HTTP request's)
/// or of a forwarded settle's context, linked to the message's own trace context.
pub(crate) fn settle_span(
    operation: &str,
    stream: &str,
    consumer: &str,
    lease: Option<&LeaseCoordinates>,
    note: Option<&MessageNote>,
) -> Span {
    if !on() {
        return Span::none();
    }
    let destination = note.map_or(stream, |note| note.subject.as_str());
    let span = tracing::info_span!(
        target: MESSAGING,
        "settle",
        otel.name = format!("{operation} {destination}"),
        otel.kind = "client",
        otel.status_code = Empty,
        messaging.system = "nats",
        messaging.operation.type = "settle",
        messaging.operation.name = operation,
        messaging.destination.name = destination,
        messaging.consumer.group.name = consumer,
        messaging.nats.stream = stream,
        messaging.message.id = note.and_then(|note| note.message_id.as_deref()),
        messaging.nats.stream_sequence = lease.map(|lease| lease.key.stream_sequence),
        messaging.nats.delivered = lease.map(|lease| lease.key.delivered),
        ruststream.settle.outcome = Empty,
    );
    if let Ok(parent) = FORWARDED_FROM.try_with(Clone::clone) {
        let _ = span.set_parent(parent);
    }
    if let Some(context) = note.and_then(|note| note.context.clone()) {
        span.add_link(context);
    }
    span
}

/// How the settle ended (the `result` label of the metrics: `ok`, `already_settled`, `gone`,
/// …); `failed` marks the span an error (the server did not confirm it).
pub(crate) fn settled(span: &Span, outcome: &'static str, failed: bool) {
    span.record("ruststream.settle.outcome", outcome);
    if failed {
        span.record("otel.status_code", "error");
    }
}

/// The trace context in a message's `traceparent` (and `tracestate`) header, when valid.
fn message_context(headers: Option<&async_nats::HeaderMap>) -> Option<SpanContext> {
    let headers = headers?;
    header(headers, TRACEPARENT)?;
    let context = TraceContextPropagator::new().extract(&NatsHeaders(headers));
    let span_context = context.span().span_context().clone();
    span_context.is_valid().then_some(span_context)
}

fn inject_nats(span: &Span, headers: &mut async_nats::HeaderMap) {
    TraceContextPropagator::new().inject_context(&span.context(), &mut NatsHeadersMut(headers));
}

/// A NATS header by name, the case of the name aside (the first value).
fn header<'h>(headers: &'h async_nats::HeaderMap, name: &str) -> Option<&'h str> {
    headers
        .iter()
        .find(|(key, _)| AsRef::<str>::as_ref(key).eq_ignore_ascii_case(name))
        .and_then(|(_, values)| values.first())
        .map(async_nats::HeaderValue::as_str)
}

struct HttpHeaders<'h>(&'h axum::http::HeaderMap);

impl Extractor for HttpHeaders<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|value| value.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(axum::http::HeaderName::as_str).collect()
    }
}

struct NatsHeaders<'h>(&'h async_nats::HeaderMap);

impl Extractor for NatsHeaders<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        header(self.0, key)
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .iter()
            .map(|(key, _)| AsRef::<str>::as_ref(key))
            .collect()
    }
}

struct NatsHeadersMut<'h>(&'h mut async_nats::HeaderMap);

impl Injector for NatsHeadersMut<'_> {
    fn set(&mut self, key: &str, value: String) {
        // The propagator writes an empty `tracestate` when there is none: no header then.
        if !value.is_empty() {
            self.0.insert(key, value.as_str());
        }
    }
}
