//! Log lines joined to requests and traces: every line written while a request is served
//! carries that request's `request_id` (whatever the level, so a warning can be found by the
//! id the client saw in `x-request-id`) and, when the request is traced, the `trace_id` and
//! `span_id` of its server span, as top-level fields of a JSON line or `key=value` pairs at
//! the end of a text line.
//!
//! May import: as the rest of `telemetry`.

use std::fmt;

use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// What the log lines of one request carry.
#[derive(Debug, Clone)]
pub(crate) struct RequestLog {
    pub(crate) request_id: axum::http::HeaderValue,
    /// The server span's trace, when traced.
    pub(crate) trace: Option<RequestTrace>,
}

/// A traced request's server span: its ids for the log lines, its context for the spans of
/// the messages it handles.
#[derive(Debug, Clone)]
pub(crate) struct RequestTrace {
    pub(crate) trace_id: String,
    pub(crate) span_id: String,
    pub(crate) context: opentelemetry::Context,
}

tokio::task_local! {
    static REQUEST: RequestLog;
}

/// The trace context of the request being served, when it is traced.
pub(crate) fn request_context() -> Option<opentelemetry::Context> {
    REQUEST
        .try_with(|log| log.trace.as_ref().map(|trace| trace.context.clone()))
        .ok()
        .flatten()
}

/// Serve a request (`serve`) with the log context `log`.
pub(crate) async fn within<F: Future>(log: RequestLog, serve: F) -> F::Output {
    REQUEST.scope(log, serve).await
}

/// An event format that adds the current request's ids to what `inner` writes.
#[derive(Debug)]
pub struct Joined<F> {
    inner: F,
    json: bool,
}

impl<F> Joined<F> {
    /// Around a JSON format (`json`) or a text one.
    pub fn new(inner: F, json: bool) -> Self {
        Self { inner, json }
    }
}

impl<S, N, F> FormatEvent<S, N> for Joined<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let Ok(log) = REQUEST.try_with(Clone::clone) else {
            return self.inner.format_event(ctx, writer, event);
        };
        // Formatted aside, then the ids put in: the inner format writes a whole line.
        let mut line = String::new();
        self.inner
            .format_event(ctx, Writer::new(&mut line), event)?;
        let request_id = String::from_utf8_lossy(log.request_id.as_bytes());
        let fields: Vec<(&str, &str)> = std::iter::once(("request_id", request_id.as_ref()))
            .chain(log.trace.iter().flat_map(|trace| {
                [
                    ("trace_id", trace.trace_id.as_str()),
                    ("span_id", trace.span_id.as_str()),
                ]
            }))
            .collect();
        writer.write_str(&join(&line, &fields, self.json))
    }
}

/// `line` with `fields` added: first in a JSON object, last (before the newline) in text.
fn join(line: &str, fields: &[(&str, &str)], json: bool) -> String {
    let mut joined = String::with_capacity(line.len() + 96);
    if json && let Some(rest) = line.strip_prefix('{') {
        joined.push('{');
        for (name, value) in fields {
            let value = serde_json::Value::from(*value);
            joined.push_str(&format!("\"{name}\":{value},"));
        }
        // An object with no field of its own would end up with a trailing comma.
        match rest.strip_prefix('}') {
            Some(after) => {
                joined.pop();
                joined.push('}');
                joined.push_str(after);
            }
            None => joined.push_str(rest),
        }
        return joined;
    }
    let (body, newline) = match line.strip_suffix('\n') {
        Some(body) => (body, "\n"),
        None => (line, ""),
    };
    joined.push_str(body);
    for (name, value) in fields {
        joined.push_str(&format!(" {name}={value}"));
    }
    joined.push_str(newline);
    joined
}

#[cfg(test)]
mod tests {
    use super::join;

    #[test]
    fn json_lines_get_the_ids_as_top_level_fields() {
        let line = "{\"level\":\"WARN\",\"fields\":{\"message\":\"x\"}}\n";
        let joined = join(line, &[("request_id", "a\"b"), ("trace_id", "t")], true);
        let value: serde_json::Value = serde_json::from_str(&joined).expect("still JSON");
        assert_eq!(value["request_id"], "a\"b");
        assert_eq!(value["trace_id"], "t");
        assert_eq!(value["level"], "WARN");
        assert!(joined.ends_with('\n'));
    }

    #[test]
    fn text_lines_get_the_ids_at_the_end() {
        let joined = join("2026 WARN x: y\n", &[("request_id", "r1")], false);
        assert_eq!(joined, "2026 WARN x: y request_id=r1\n");
    }
}
