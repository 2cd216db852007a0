//! The process's `tracing` subscriber: log lines on stderr (text or JSON, each joined to its
//! request and trace), and the gateway's own spans to the OTLP exporter when one runs.
//!
//! May import: `config` (the log format), the rest of `telemetry`.

use tracing_subscriber::Layer as _;
use tracing_subscriber::filter::{EnvFilter, FilterExt as _, LevelFilter, filter_fn};
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

use super::logs::Joined;
use super::{MESSAGING_TARGET, SPANS_TARGET, Tracer};
use crate::config::LogFormat;

/// Logs to stderr (text or JSON, each line joined to its request and trace), and spans to an
/// OTLP collector when one is configured.
pub(crate) fn install(format: LogFormat, tracer: Option<Tracer>) {
    // async-nats reports every failed reconnect attempt at info ("IO error"); the gateway
    // says what matters about the connection itself, at warn.
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,async_nats=warn"));
    // The per-message spans are exported, never logged: their attributes on every line of a
    // request would only repeat themselves.
    // The hints keep the level the filter names as the global maximum: without one, `log`
    // records (tungstenite writes several per WebSocket frame) would all reach the
    // subscriber to be refused there, and every disabled `tracing` callsite be asked again.
    let logged = filter.and(
        filter_fn(|metadata| !metadata.target().starts_with(MESSAGING_TARGET))
            .with_max_level_hint(LevelFilter::TRACE),
    );
    let json = format == LogFormat::Json;
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        // Colour codes only for a person at a terminal, never in a log file or a pipe.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let logs = if json {
        logs.json()
            .map_event_format(|inner| Joined::new(inner, true))
            .with_filter(logged)
            .boxed()
    } else {
        logs.map_event_format(|inner| Joined::new(inner, false))
            .with_filter(logged)
            .boxed()
    };
    // Only the gateway's own spans (none of its libraries'), and the warnings and errors
    // written inside them, which become span events.
    let spans = tracer.map(|tracer| {
        tracing_opentelemetry::layer()
            .with_tracer(tracer)
            .with_location(false)
            .with_threads(false)
            .with_target(false)
            .with_level(false)
            .with_filter(
                filter_fn(|metadata| {
                    metadata.target().starts_with(SPANS_TARGET)
                        || (metadata.is_event() && *metadata.level() <= tracing::Level::WARN)
                })
                .with_max_level_hint(LevelFilter::INFO),
            )
    });
    tracing_subscriber::registry().with(logs).with(spans).init();
}
