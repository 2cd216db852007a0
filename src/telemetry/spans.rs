//! The spans the gateway makes, named and attributed after the OpenTelemetry semantic
//! conventions for HTTP servers and for messaging (`send`, `receive`, `settle`), and the W3C
//! Trace Context carried in and out: from HTTP request headers, into the NATS headers of a
//! published message, from a fetched message's headers (its link), and across a settle
//! forwarded to another replica. Each helper returns a disabled span at once when tracing is
//! off.
//!
//! May import: as the rest of `telemetry`.

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator as _};
use opentelemetry::trace::{
    Link, Span as _, SpanBuilder, SpanContext, SpanKind, Status, TraceContextExt as _, Tracer as _,
};
use opentelemetry::{KeyValue, Value};
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
    // Signed: the OpenTelemetry bridge exports an unsigned field as a string, and the
    // semantic conventions (and every trace query) want an integer.
    span.record("http.response.status_code", i64::from(status.as_u16()));
    if status.is_server_error() {
        span.record("otel.status_code", "error");
    }
}

/// The trace context of a request's server span, for its log lines and its message spans;
/// `None` when it is not part of a trace.
pub(crate) fn request_trace(span: &Span) -> Option<super::logs::RequestTrace> {
    if span.is_disabled() {
        return None;
    }
    let context = span.context();
    let span_context = context.span().span_context().clone();
    span_context.is_valid().then(|| super::logs::RequestTrace {
        trace_id: span_context.trace_id().to_string(),
        span_id: span_context.span_id().to_string(),
        context,
    })
}

/// A span of one message (`send`, `receive`, `settle`), made with the OpenTelemetry API
/// itself rather than as a `tracing` span: these are made per message, and the registry, the
/// field visitors and the string conversions of the bridge cost as much again as the span.
/// Ends when dropped. Does nothing when tracing is off.
pub(crate) struct MessageSpan(Option<opentelemetry_sdk::trace::Span>);

impl MessageSpan {
    pub(crate) fn none() -> Self {
        Self(None)
    }

    fn set(&mut self, key: &'static str, value: impl Into<Value>) {
        if let Some(span) = &mut self.0 {
            span.set_attribute(KeyValue::new(key, value));
        }
    }

    fn fail(&mut self) {
        if let Some(span) = &mut self.0 {
            span.set_status(Status::error(""));
        }
    }

    fn span_context(&self) -> Option<SpanContext> {
        self.0.as_ref().map(|span| span.span_context().clone())
    }
}

/// Start a message span, child of the current request (or of a forwarded settle's context).
fn start(name: String, kind: SpanKind, attributes: Vec<KeyValue>, links: Vec<Link>) -> MessageSpan {
    let Some(tracer) = super::tracer() else {
        return MessageSpan::none();
    };
    let parent = parent_context();
    let builder = SpanBuilder::from_name(name)
        .with_kind(kind)
        .with_attributes(attributes)
        .with_links(links);
    MessageSpan(Some(tracer.build_with_context(builder, &parent)))
}

/// The parent of a message span: a forwarded settle's context, else the request's server span
/// (kept by the request's log context), else the current `tracing` span's.
fn parent_context() -> opentelemetry::Context {
    FORWARDED_FROM
        .try_with(Clone::clone)
        .ok()
        .or_else(super::logs::request_context)
        .unwrap_or_else(|| Span::current().context())
}

/// `messaging.system`, on every message span.
fn system() -> KeyValue {
    KeyValue::new("messaging.system", "nats")
}

/// A `send {subject}` span (kind PRODUCER) for `POST /publish`; `headers` are the message's
/// NATS headers, which get the span's `traceparent` (and `tracestate`) unless the publisher
/// already set one, kept as it is then.
pub(crate) fn send_span(subject: &str, headers: &mut async_nats::HeaderMap) -> MessageSpan {
    if !on() {
        return MessageSpan::none();
    }
    let mut attributes = vec![
        system(),
        KeyValue::new("messaging.operation.type", "send"),
        KeyValue::new("messaging.operation.name", "publish"),
        KeyValue::new("messaging.destination.name", subject.to_owned()),
    ];
    if let Some(id) = header(headers, MESSAGE_ID) {
        attributes.push(KeyValue::new("messaging.message.id", id.to_owned()));
    }
    let span = start(
        format!("send {subject}"),
        SpanKind::Producer,
        attributes,
        Vec::new(),
    );
    if header(headers, TRACEPARENT).is_none()
        && let Some(context) = span.span_context()
    {
        let context = opentelemetry::Context::new().with_remote_span_context(context);
        TraceContextPropagator::new().inject_context(&context, &mut NatsHeadersMut(headers));
    }
    span
}

/// What the stream said of a published message, on its `send` span: where it stored it, or
/// the HTTP status of the refusal (its `error.type`).
pub(crate) fn sent(span: &mut MessageSpan, result: Result<(&str, u64), u16>) {
    match result {
        Ok((stream, sequence)) => {
            span.set("messaging.nats.stream", stream.to_owned());
            span.set("messaging.nats.stream_sequence", int(sequence));
        }
        Err(status) => {
            span.fail();
            span.set("error.type", status.to_string());
        }
    }
}

/// A `receive {stream}` span (kind CONSUMER) for one fetch, or one batch written to an open
/// event stream; [`received`] adds its messages.
pub(crate) fn receive_span(stream: &str, consumer: &str) -> MessageSpan {
    if !on() {
        return MessageSpan::none();
    }
    start(
        format!("receive {stream}"),
        SpanKind::Consumer,
        vec![
            system(),
            KeyValue::new("messaging.operation.type", "receive"),
            KeyValue::new("messaging.operation.name", "fetch"),
            KeyValue::new("messaging.consumer.group.name", consumer.to_owned()),
            KeyValue::new("messaging.nats.stream", stream.to_owned()),
        ],
        Vec::new(),
    )
}

/// The messages a receive span handed out: their count, a link to each one's own trace
/// context (its `traceparent` header), and the subject when they all share one.
pub(crate) fn received(span: &mut MessageSpan, leased: &[Leased]) {
    let Some(inner) = &mut span.0 else {
        return;
    };
    inner.set_attribute(KeyValue::new(
        "messaging.batch.message_count",
        int(leased.len() as u64),
    ));
    if let Some(first) = leased.first()
        && leased
            .iter()
            .all(|one| one.delivery.subject == first.delivery.subject)
    {
        inner.set_attribute(KeyValue::new(
            "messaging.destination.name",
            first.delivery.subject.to_string(),
        ));
    }
    for one in leased {
        if let Some(context) = message_context(one.delivery.headers.as_ref()) {
            let key = one.delivery.coordinates.key;
            inner.add_link(
                context,
                vec![
                    KeyValue::new(
                        "messaging.destination.name",
                        one.delivery.subject.to_string(),
                    ),
                    KeyValue::new("messaging.nats.stream_sequence", int(key.stream_sequence)),
                    KeyValue::new("messaging.nats.delivered", int(key.delivered)),
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

/// The current request's trace context in a forwarded settle's NATS headers, for the
/// owner's settle spans to be its children.
pub(crate) fn inject_forward(headers: &mut async_nats::HeaderMap) {
    if on() {
        TraceContextPropagator::new()
            .inject_context(&parent_context(), &mut NatsHeadersMut(headers));
    }
}

/// A settle span for one lease id: named `{operation} {subject}` (the stream's name when the
/// id names no lease known here), kind CLIENT, child of the current request's span or of a
/// forwarded settle's context, linked to the message's own trace context.
pub(crate) fn settle_span(
    operation: &'static str,
    stream: &str,
    consumer: &str,
    lease: Option<&LeaseCoordinates>,
    note: Option<&MessageNote>,
) -> MessageSpan {
    if !on() {
        return MessageSpan::none();
    }
    let destination = note.map_or(stream, |note| note.subject.as_str());
    let mut attributes = Vec::with_capacity(10);
    attributes.extend([
        system(),
        KeyValue::new("messaging.operation.type", "settle"),
        KeyValue::new("messaging.operation.name", operation),
        KeyValue::new("messaging.destination.name", destination.to_owned()),
        KeyValue::new("messaging.consumer.group.name", consumer.to_owned()),
        KeyValue::new("messaging.nats.stream", stream.to_owned()),
    ]);
    if let Some(id) = note.and_then(|note| note.message_id.clone()) {
        attributes.push(KeyValue::new("messaging.message.id", id));
    }
    if let Some(lease) = lease {
        attributes.push(KeyValue::new(
            "messaging.nats.stream_sequence",
            int(lease.key.stream_sequence),
        ));
        attributes.push(KeyValue::new(
            "messaging.nats.delivered",
            int(lease.key.delivered),
        ));
    }
    let links = note
        .and_then(|note| note.context.clone())
        .map(|context| vec![Link::with_context(context)])
        .unwrap_or_default();
    start(
        format!("{operation} {destination}"),
        SpanKind::Client,
        attributes,
        links,
    )
}

/// How the settle ended (the `result` label of the metrics: `ok`, `already_settled`, `gone`,
/// …); `failed` marks the span an error (the server did not confirm it).
pub(crate) fn settled(span: &mut MessageSpan, outcome: &'static str, failed: bool) {
    span.set("ruststream.settle.outcome", outcome);
    if failed {
        span.fail();
    }
}

/// A count or sequence as an OTLP integer (signed 64-bit).
fn int(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// The trace context in a message's `traceparent` (and `tracestate`) header, when valid.
fn message_context(headers: Option<&async_nats::HeaderMap>) -> Option<SpanContext> {
    let headers = headers?;
    header(headers, TRACEPARENT)?;
    let context = TraceContextPropagator::new().extract(&NatsHeaders(headers));
    let span_context = context.span().span_context().clone();
    span_context.is_valid().then_some(span_context)
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

/// A push attempt's span: `POST`, kind CLIENT, linked to the span that sent the message (its
/// first message's, for a batch); its context goes into the request's `traceparent`.
/// `endpoint` is the URL as it may be shown (no user, password or query).
pub(crate) fn push_span(
    endpoint: &str,
    leased: &Leased,
    request_headers: &mut reqwest::header::HeaderMap,
) -> MessageSpan {
    if !on() {
        return MessageSpan::none();
    }
    let delivery = &leased.delivery;
    let attributes = vec![
        KeyValue::new("http.request.method", "POST"),
        KeyValue::new("url.full", endpoint.to_owned()),
        system(),
        KeyValue::new("messaging.operation.type", "process"),
        KeyValue::new("messaging.destination.name", delivery.subject.to_string()),
        KeyValue::new("messaging.consumer.group.name", delivery.consumer.clone()),
        KeyValue::new("messaging.nats.stream", delivery.stream.clone()),
        KeyValue::new(
            "messaging.nats.stream_sequence",
            int(delivery.coordinates.key.stream_sequence),
        ),
        KeyValue::new(
            "messaging.nats.delivered",
            int(delivery.coordinates.key.delivered),
        ),
    ];
    let links = message_context(delivery.headers.as_ref())
        .map(|context| vec![Link::with_context(context)])
        .unwrap_or_default();
    let span = start("POST".to_owned(), SpanKind::Client, attributes, links);
    if let Some(context) = span.span_context() {
        let context = opentelemetry::Context::new().with_remote_span_context(context);
        TraceContextPropagator::new()
            .inject_context(&context, &mut HttpHeadersMut(request_headers));
    }
    span
}

/// How a push attempt ended: the status it was answered with, or none (a failure).
pub(crate) fn pushed(span: &mut MessageSpan, status: Option<u16>) {
    match status {
        Some(status) => {
            span.set("http.response.status_code", i64::from(status));
            if status >= 500 {
                span.fail();
            }
        }
        None => span.fail(),
    }
}

struct HttpHeadersMut<'h>(&'h mut reqwest::header::HeaderMap);

impl Injector for HttpHeadersMut<'_> {
    fn set(&mut self, key: &str, value: String) {
        if value.is_empty() {
            return;
        }
        if let (Ok(name), Ok(value)) = (
            reqwest::header::HeaderName::from_bytes(key.as_bytes()),
            reqwest::header::HeaderValue::from_str(&value),
        ) {
            self.0.insert(name, value);
        }
    }
}
