//! An OTLP trace receiver for the tracing tests: `POST /v1/traces` bodies (OTLP/HTTP) or
//! `TraceService/Export` calls (OTLP/gRPC) decoded with the official protobuf definitions
//! (`opentelemetry-proto`), every span kept for the test to look at. Started on a free port
//! by the test, stopped when dropped.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use prost::Message as _;

use super::wait_for;

/// One span as received, ids in lowercase hex as W3C `traceparent` writes them.
#[derive(Debug, Clone)]
pub struct Span {
    pub name: String,
    pub kind: SpanKind,
    pub trace_id: String,
    pub span_id: String,
    /// Empty for a root span.
    pub parent_span_id: String,
    pub attributes: HashMap<String, String>,
    /// The attributes whose values are integers, as sent.
    pub integers: HashMap<String, i64>,
    /// (trace id, span id) of each link.
    pub links: Vec<(String, String)>,
    /// The resource's `service.name`.
    pub service: String,
    /// The span failed (status code ERROR).
    pub failed: bool,
}

impl Span {
    /// An attribute's value as text (numbers in decimal), or a panic naming the span.
    pub fn attr(&self, key: &str) -> &str {
        self.attributes
            .get(key)
            .unwrap_or_else(|| panic!("span {:?} has no attribute {key}: {self:#?}", self.name))
    }

    /// This span's `traceparent` (sampled).
    pub fn traceparent(&self) -> String {
        format!("00-{}-{}-01", self.trace_id, self.span_id)
    }
}

/// The receiver: its address and what it has received.
pub struct Receiver {
    pub endpoint: String,
    spans: Arc<Mutex<Vec<Span>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Receiver {
    /// Listen on a free port of 127.0.0.1.
    pub async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the OTLP receiver");
        let address = listener.local_addr().expect("receiver address");
        let spans: Arc<Mutex<Vec<Span>>> = Arc::default();
        let kept = spans.clone();
        let app = axum::Router::new().route(
            "/v1/traces",
            post(move |body: Bytes| {
                let kept = kept.clone();
                async move {
                    let request = ExportTraceServiceRequest::decode(body)
                        .expect("the gateway sends valid OTLP protobuf");
                    kept.lock().expect("spans").extend(flatten(request));
                    ExportTraceServiceResponse::default().encode_to_vec()
                }
            }),
        );
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self {
            endpoint: format!("http://{address}"),
            spans,
            task,
        }
    }

    /// An OTLP/gRPC receiver, on a free port of 127.0.0.1.
    pub async fn start_grpc() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the OTLP/gRPC receiver");
        let address = listener.local_addr().expect("receiver address");
        let spans: Arc<Mutex<Vec<Span>>> = Arc::default();
        let service = TraceServiceServer::new(Collector(spans.clone()));
        let task = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                .await;
        });
        Self {
            endpoint: format!("http://{address}"),
            spans,
            task,
        }
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Span> {
        self.spans.lock().expect("spans").clone()
    }

    /// Wait (up to 10 s) until a span matches `wanted`; the first that does.
    pub async fn span(&self, what: &str, wanted: impl Fn(&Span) -> bool) -> Span {
        let wanted = &wanted;
        wait_for(what, Duration::from_secs(10), || async move {
            self.spans().into_iter().find(|span| wanted(span))
        })
        .await
    }

    /// Wait until `count` spans match `wanted`; them.
    pub async fn spans_matching(
        &self,
        what: &str,
        count: usize,
        wanted: impl Fn(&Span) -> bool,
    ) -> Vec<Span> {
        let wanted = &wanted;
        wait_for(what, Duration::from_secs(10), || async move {
            let found: Vec<Span> = self
                .spans()
                .into_iter()
                .filter(|span| wanted(span))
                .collect();
            (found.len() >= count).then_some(found)
        })
        .await
    }
}

/// The gRPC collector service: keeps what it is sent.
struct Collector(Arc<Mutex<Vec<Span>>>);

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.0
            .lock()
            .expect("spans")
            .extend(flatten(request.into_inner()));
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

fn flatten(request: ExportTraceServiceRequest) -> Vec<Span> {
    let mut spans = Vec::new();
    for resource_spans in request.resource_spans {
        let service = resource_spans
            .resource
            .map(|resource| attributes(&resource.attributes))
            .and_then(|attributes| attributes.get("service.name").cloned())
            .unwrap_or_default();
        for scope in resource_spans.scope_spans {
            for span in scope.spans {
                spans.push(Span {
                    kind: SpanKind::try_from(span.kind).unwrap_or(SpanKind::Unspecified),
                    name: span.name,
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent_span_id: hex(&span.parent_span_id),
                    attributes: attributes(&span.attributes),
                    integers: integers(&span.attributes),
                    links: span
                        .links
                        .iter()
                        .map(|link| (hex(&link.trace_id), hex(&link.span_id)))
                        .collect(),
                    service: service.clone(),
                    // STATUS_CODE_ERROR
                    failed: span.status.is_some_and(|status| status.code == 2),
                });
            }
        }
    }
    spans
}

fn attributes(list: &[KeyValue]) -> HashMap<String, String> {
    list.iter()
        .filter_map(|kv| {
            let value = match kv.value.as_ref()?.value.as_ref()? {
                AnyValue::StringValue(text) => text.clone(),
                AnyValue::IntValue(n) => n.to_string(),
                AnyValue::BoolValue(b) => b.to_string(),
                AnyValue::DoubleValue(d) => d.to_string(),
                other => format!("{other:?}"),
            };
            Some((kv.key.clone(), value))
        })
        .collect()
}

fn integers(list: &[KeyValue]) -> HashMap<String, i64> {
    list.iter()
        .filter_map(|kv| match kv.value.as_ref()?.value.as_ref()? {
            AnyValue::IntValue(n) => Some((kv.key.clone(), *n)),
            _ => None,
        })
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}
