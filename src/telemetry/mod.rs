//! OpenTelemetry traces: off unless an OTLP endpoint is configured; then the spans the
//! gateway makes (an HTTP server span per request, `send`, `receive` and `settle` spans for
//! the messages, see [`spans`]) go out in batches over OTLP, `http/protobuf` or `grpc`.
//! Nothing here ever blocks a request: a span that ends joins a bounded queue, a full queue
//! or a failed export drops spans, which are counted ([`spans_dropped`]) and reported in one
//! warning a minute at most.
//!
//! With tracing off every span helper returns at once, after one relaxed atomic load, and
//! the lease table keeps nothing extra.
//!
//! May import: `domain` (the delivery values) and [`crate::tls_client`]. Usable from every
//! room above `domain`.

pub mod logs;
pub(crate) mod spans;
mod subscriber;

pub(crate) use subscriber::install;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, SdkTracerProvider, SpanData, SpanExporter, SpanProcessor,
};

pub use opentelemetry_sdk::trace::Tracer;

/// The `tracing` target of the per-message spans (`send`, `receive`, `settle`): exported, but
/// left out of log lines.
pub const MESSAGING_TARGET: &str = spans::MESSAGING;
/// The prefix of the `tracing` targets of every span the gateway exports.
pub const SPANS_TARGET: &str = "ruststream_nats::otel";

/// Whether spans are made and exported: set once, at start, by [`start`].
static ON: AtomicBool = AtomicBool::new(false);
/// Spans dropped since start: the queue was full, or their export failed.
static DROPPED: AtomicU64 = AtomicU64::new(0);
/// Spans the collector accepted since start.
static EXPORTED: AtomicU64 = AtomicU64::new(0);

/// The tracer of the per-message spans ([`spans::MessageSpan`]), set with [`ON`].
static TRACER: std::sync::OnceLock<Tracer> = std::sync::OnceLock::new();

fn tracer() -> Option<&'static Tracer> {
    TRACER.get()
}

/// Whether tracing is on (an OTLP endpoint is configured).
pub(crate) fn on() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Spans dropped since the process started (`ruststream_trace_spans_dropped_total`).
pub(crate) fn spans_dropped() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

/// Spans exported since the process started (`ruststream_trace_spans_exported_total`).
pub(crate) fn spans_exported() -> u64 {
    EXPORTED.load(Ordering::Relaxed)
}

/// The service name when neither `OTEL_SERVICE_NAME` nor `OTEL_RESOURCE_ATTRIBUTES` gives one.
const SERVICE_NAME: &str = "ruststream-nats";
/// The spans waiting for export at most (`OTEL_BSP_MAX_QUEUE_SIZE` overrides it).
const MAX_QUEUE: usize = 2048;
/// An export's time limit when `OTEL_EXPORTER_OTLP_TIMEOUT` sets none (the specification's).
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);
/// At most one warning about dropped spans per this long.
const WARN_EVERY: Duration = Duration::from_secs(60);
/// How long the last spans may take to leave at shutdown.
const FLUSH_AT_STOP: Duration = Duration::from_secs(2);

/// How spans reach the collector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    HttpProtobuf,
    Grpc,
}

/// The running exporter; [`Telemetry::stop`] flushes what is left.
#[derive(Debug)]
pub struct Telemetry {
    provider: SdkTracerProvider,
}

impl Telemetry {
    /// Send the spans still queued (for at most 2 s: a collector that is down must not hold
    /// the stop up) and stop exporting. Call it while the runtime still runs.
    pub fn stop(self) {
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let provider = self.provider;
        std::thread::spawn(move || {
            let _ = provider.shutdown_with_timeout(FLUSH_AT_STOP);
            let _ = done_tx.send(());
        });
        let _ = done_rx.recv_timeout(FLUSH_AT_STOP + Duration::from_millis(500));
    }
}

/// A non-empty environment variable.
fn env(name: &str) -> Option<String> {
    std::env::var(name)
        .ok()
        .filter(|value| !value.trim().is_empty())
}

/// Start exporting when an endpoint is configured: `--otlp-endpoint` (`flag`), else
/// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, else `OTEL_EXPORTER_OTLP_ENDPOINT`; `None` (tracing
/// off) when none is, or when `OTEL_SDK_DISABLED=true`. Must run inside the tokio runtime,
/// which carries the exports. The tracer goes to the `tracing` subscriber's OpenTelemetry
/// layer.
pub fn start(flag: Option<&str>) -> anyhow::Result<Option<(Telemetry, Tracer)>> {
    if env("OTEL_SDK_DISABLED").is_some_and(|value| value.eq_ignore_ascii_case("true")) {
        return Ok(None);
    }
    let configured = flag.is_some()
        || env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_some()
        || env("OTEL_EXPORTER_OTLP_ENDPOINT").is_some();
    if !configured {
        return Ok(None);
    }
    let protocol = protocol()?;
    let timeout = export_timeout()?;
    let exporter = Counted::new(build_exporter(protocol, flag, timeout)?);
    let queued = exporter.queued.clone();
    let max_queue = env("OTEL_BSP_MAX_QUEUE_SIZE")
        .and_then(|value| value.parse().ok())
        .filter(|size| *size > 0)
        .unwrap_or(MAX_QUEUE);
    let batches =
        opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor::builder(
            exporter,
            opentelemetry_sdk::runtime::Tokio,
        )
        .with_batch_config(
            BatchConfigBuilder::default()
                .with_max_queue_size(max_queue)
                .build(),
        )
        .build();
    let processor = Bounded {
        inner: batches,
        queued,
        limit: max_queue,
    };
    let provider = SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_resource(resource())
        .build();
    let tracer = provider.tracer(SERVICE_NAME);
    let _ = TRACER.set(tracer.clone());
    ON.store(true, Ordering::Relaxed);
    Ok(Some((Telemetry { provider }, tracer)))
}

/// `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`, else `OTEL_EXPORTER_OTLP_PROTOCOL`: `http/protobuf`
/// (the default) or `grpc`.
fn protocol() -> anyhow::Result<Protocol> {
    let named = env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        .map(|value| ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", value))
        .or_else(|| {
            env("OTEL_EXPORTER_OTLP_PROTOCOL").map(|value| ("OTEL_EXPORTER_OTLP_PROTOCOL", value))
        });
    match named {
        None => Ok(Protocol::HttpProtobuf),
        Some((_, value)) if value.trim() == "http/protobuf" => Ok(Protocol::HttpProtobuf),
        Some((_, value)) if value.trim() == "grpc" => Ok(Protocol::Grpc),
        Some((name, value)) => {
            bail!("{name}={value:?}: the gateway exports traces over \"http/protobuf\" or \"grpc\"")
        }
    }
}

/// `OTEL_EXPORTER_OTLP_TRACES_TIMEOUT`, else `OTEL_EXPORTER_OTLP_TIMEOUT` (milliseconds),
/// else 10 s.
fn export_timeout() -> anyhow::Result<Duration> {
    for name in [
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
        "OTEL_EXPORTER_OTLP_TIMEOUT",
    ] {
        if let Some(value) = env(name) {
            let millis: u64 = value
                .trim()
                .parse()
                .with_context(|| format!("{name}={value:?}: not a number of milliseconds"))?;
            return Ok(Duration::from_millis(millis));
        }
    }
    Ok(EXPORT_TIMEOUT)
}

/// The OTLP exporter. The endpoint of `--otlp-endpoint` is a base, as
/// `OTEL_EXPORTER_OTLP_ENDPOINT` is (`/v1/traces` appended for http/protobuf); without it
/// the exporter reads the variables itself, as do the headers
/// (`OTEL_EXPORTER_OTLP_HEADERS`).
fn build_exporter(
    protocol: Protocol,
    flag: Option<&str>,
    timeout: Duration,
) -> anyhow::Result<opentelemetry_otlp::SpanExporter> {
    let exporter = match protocol {
        Protocol::HttpProtobuf => {
            // https verified against the system's roots (with none, only http works).
            let (tls, _roots) = crate::tls_client::config().map_err(anyhow::Error::msg)?;
            let client = reqwest::Client::builder()
                .timeout(timeout)
                .tls_backend_preconfigured(tls)
                .build()
                .context("building the OTLP/HTTP client")?;
            let mut builder = opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_http_client(client)
                .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                .with_timeout(timeout);
            if let Some(base) = flag {
                builder =
                    builder.with_endpoint(format!("{}/v1/traces", base.trim_end_matches('/')));
            }
            builder.build()
        }
        Protocol::Grpc => {
            let mut builder = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_timeout(timeout);
            if let Some(endpoint) = flag {
                builder = builder.with_endpoint(endpoint);
            }
            builder.build()
        }
    };
    exporter.context("configuring the OTLP exporter")
}

/// The resource: what the standard variables say (`OTEL_SERVICE_NAME`,
/// `OTEL_RESOURCE_ATTRIBUTES`), `service.name` `ruststream-nats` when they name none, and the
/// version.
fn resource() -> Resource {
    let named = env("OTEL_SERVICE_NAME").is_some()
        || env("OTEL_RESOURCE_ATTRIBUTES").is_some_and(|attributes| {
            attributes
                .split(',')
                .any(|pair| pair.trim_start().starts_with("service.name="))
        });
    let builder = Resource::builder().with_attribute(opentelemetry::KeyValue::new(
        "service.version",
        env!("CARGO_PKG_VERSION"),
    ));
    if named {
        builder.build()
    } else {
        builder.with_service_name(SERVICE_NAME).build()
    }
}

/// Count `spans` dropped, and say so, at most once a minute.
fn dropped(spans: usize, why: &dyn std::fmt::Display) {
    DROPPED.fetch_add(spans as u64, Ordering::Relaxed);
    static LAST_WARNING: Mutex<Option<Instant>> = Mutex::new(None);
    let Ok(mut last) = LAST_WARNING.lock() else {
        return;
    };
    if last.is_some_and(|at| at.elapsed() < WARN_EVERY) {
        return;
    }
    *last = Some(Instant::now());
    tracing::warn!(
        dropped_total = DROPPED.load(Ordering::Relaxed),
        "trace spans dropped: {why} (ruststream_trace_spans_dropped_total counts them; next warning in a minute at the earliest)"
    );
}

/// The exporter, counting what it sends and what fails. `queued` counts spans handed to the
/// batch processor and not yet given to an export.
#[derive(Debug)]
struct Counted<E> {
    inner: E,
    queued: Arc<AtomicUsize>,
}

impl<E> Counted<E> {
    fn new(inner: E) -> Self {
        Self {
            inner,
            queued: Arc::default(),
        }
    }
}

impl<E: SpanExporter> SpanExporter for Counted<E> {
    fn export(&self, batch: Vec<SpanData>) -> impl Future<Output = OTelSdkResult> + Send {
        let spans = batch.len();
        self.queued.fetch_sub(spans, Ordering::Relaxed);
        let exported = self.inner.export(batch);
        async move {
            let result = exported.await;
            match &result {
                Ok(()) => {
                    EXPORTED.fetch_add(spans as u64, Ordering::Relaxed);
                }
                Err(err) => dropped(spans, &format_args!("the export failed: {err}")),
            }
            result
        }
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// The batch processor behind a bound the gateway counts itself: the processor drops spans
/// silently when its queue is full, this drops (and counts) them first.
#[derive(Debug)]
struct Bounded<P> {
    inner: P,
    queued: Arc<AtomicUsize>,
    limit: usize,
}

impl<P: SpanProcessor> SpanProcessor for Bounded<P> {
    fn on_start(&self, span: &mut opentelemetry_sdk::trace::Span, cx: &opentelemetry::Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        if !span.span_context.is_sampled() {
            return;
        }
        if self.queued.fetch_add(1, Ordering::Relaxed) >= self.limit {
            self.queued.fetch_sub(1, Ordering::Relaxed);
            dropped(
                1,
                &"the export queue is full (the collector is slow or unreachable)",
            );
            return;
        }
        self.inner.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}
