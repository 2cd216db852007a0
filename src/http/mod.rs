//! The HTTP layer: routes (one file per resource), the JSON body extractor, problem+json
//! errors and the middleware stack. Handlers are thin: parse, call the gateway, map.
//!
//! May import: `gateway` (the core), `domain` values it renders, `config`, `error`, `metrics`.
//! Never `dispatch`, `nats` or `state`: the handlers see only the core.

pub(crate) mod auth;
mod body;
pub(crate) mod client;
mod console;
mod consumers;
mod dead_letters;
mod docs;
pub(crate) mod dto;
mod events;
mod fetch;
mod jwt;
mod messages;
mod metrics;
mod ops;
mod principal;
pub(crate) mod problem;
mod publish;
mod publish_batch;
mod push;
mod redrive;
pub(crate) mod responses;
mod schedules;
mod scopes;
mod seek;
pub(crate) mod serve;
mod tickets;
pub(crate) mod tls;
mod tokens;
mod webhooks;
mod ws;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{MatchedPath, State};
use axum::http::{HeaderName, HeaderValue, Request, Response};
use axum::response::IntoResponse;
use tower_http::catch_panic::CatchPanicLayer;
use tracing::Instrument as _;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::error::Error;
use crate::gateway::Gateway;
use crate::http::auth::Auth;
use crate::metrics as metrics_names;
use crate::telemetry::{self, logs, logs::RequestLog};
use responses::ProblemResponses;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "ruststream-nats",
        description = "Lease NATS JetStream messages to HTTP clients: fetch a batch, then ack, nak, term or extend each lease.\n\nEvery error is an RFC 9457 `application/problem+json` object. Each operation lists the statuses it answers; besides those, a path not listed here answers 404, a listed path called with another method 405 (with `Allow`), a request URI over 8 KiB 414, a header section over 64 KiB 431, an HTTP/1.1 request without `Host` and a `GET /ws` without a WebSocket upgrade 400, all problem+json.",
        license(name = "MIT OR Apache-2.0", identifier = "MIT OR Apache-2.0")
    ),
    // Relative: the API is where the document was served from (Swagger UI, generated
    // clients given a base URL).
    servers((url = "/", description = "This gateway")),
    tags(
        (name = "leases", description = "Fetch messages and settle their leases"),
        (name = "messages", description = "Publish to the stream"),
        (name = "operations", description = "Health, readiness and consumer state"),
        (name = "push", description = "The requests a push consumer's endpoint receives (webhooks)"),
    ),
    modifiers(&ProblemResponses)
)]
struct ApiDoc;

/// Routes with their OpenAPI description; the spec is assembled from the same handlers
/// that serve, so the two cannot drift.
fn api() -> OpenApiRouter<Shared> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(fetch::fetch))
        .routes(routes!(fetch::fetch_named))
        .routes(routes!(events::events))
        .routes(routes!(events::events_named))
        .routes(routes!(ws::ws))
        .routes(routes!(ws::ws_named))
        .routes(routes!(tickets::create))
        .routes(routes!(messages::ack))
        .routes(routes!(messages::nak))
        .routes(routes!(messages::term))
        .routes(routes!(messages::in_progress))
        .routes(routes!(messages::ack_many))
        .routes(routes!(messages::nak_many))
        .routes(routes!(messages::term_many))
        .routes(routes!(publish::publish))
        .routes(routes!(publish_batch::publish_batch))
        .routes(routes!(schedules::create, schedules::list))
        .routes(routes!(schedules::one, schedules::cancel))
        .routes(routes!(ops::healthz))
        .routes(routes!(ops::readyz))
        .routes(routes!(consumers::consumer))
        .routes(routes!(consumers::consumers))
        .routes(routes!(consumers::named_consumer))
        .routes(routes!(consumers::history))
        .routes(routes!(push::pause))
        .routes(routes!(push::resume))
        .routes(routes!(seek::seek))
        .routes(routes!(dead_letters::list))
        .routes(routes!(dead_letters::one))
        .routes(routes!(redrive::redrive))
        .routes(routes!(redrive::task, redrive::cancel))
        .routes(routes!(console::page))
        .routes(routes!(metrics::metrics))
        .routes(routes!(ops::openapi_json))
}

/// The OpenAPI document, as served on `/openapi.json`.
pub fn openapi() -> utoipa::openapi::OpenApi {
    let mut spec = api().split_for_parts().1;
    optional_bodies_may_be_absent(&mut spec);
    declare_security(&mut spec);
    webhooks::declare(&mut spec);
    spec
}

/// utoipa renders an `Option<Body>` request body as "the body or JSON null"; describe it as
/// "may be absent" (`required` unset) with the body's own schema instead, as the gateway takes
/// it (an empty body means all defaults; `null` is refused like any non-object): generated
/// clients then leave it out when not given (openapi-python-client otherwise tries to
/// encode its "unset" marker as JSON).
fn optional_bodies_may_be_absent(spec: &mut utoipa::openapi::OpenApi) {
    use utoipa::openapi::{RefOr, schema::Schema};
    let null = serde_json::json!({ "type": "null" });
    let operations = spec.paths.paths.values_mut().flat_map(|item| {
        [
            &mut item.get,
            &mut item.put,
            &mut item.post,
            &mut item.delete,
            &mut item.patch,
        ]
        .into_iter()
        .flatten()
    });
    for operation in operations {
        let Some(RefOr::T(body)) = operation.request_body.as_mut() else {
            continue;
        };
        for content in body.content.values_mut() {
            let RefOr::T(content) = content else { continue };
            let Some(RefOr::T(Schema::OneOf(one_of))) = &content.schema else {
                continue;
            };
            let (nulls, others): (Vec<_>, Vec<_>) = one_of
                .items
                .iter()
                .partition(|item| serde_json::to_value(item).ok().as_ref() == Some(&null));
            if let ([_], [body_schema]) = (nulls.as_slice(), others.as_slice()) {
                content.schema = Some((*body_schema).clone());
            }
        }
    }
}

/// The bearer scheme, and on each operation the scope it needs — from the same
/// [`crate::http::auth::requirement`] the middleware enforces, so the two cannot disagree.
fn declare_security(spec: &mut utoipa::openapi::OpenApi) {
    use crate::http::scopes::{Requirement, requirement};
    use utoipa::openapi::security::{
        ApiKey, ApiKeyValue, HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme,
    };
    let components = spec.components.get_or_insert_with(Default::default);
    components.add_security_scheme(
        "bearer",
        SecurityScheme::Http(
            HttpBuilder::new()
                .scheme(HttpAuthScheme::Bearer)
                .description(Some(
                    "A token from --auth-tokens-file / --auth-tokens, or a JWT signed by a key of --auth-jwks-file / --auth-jwks-url (its scope claim naming the scopes); its scopes (fetch, settle, publish, admin) decide the endpoints it may call. Not required when the gateway runs without authentication.",
                ))
                .build(),
        ),
    );
    components.add_security_scheme(
        "ticket",
        SecurityScheme::ApiKey(ApiKey::Query(ApiKeyValue::with_description(
            "ticket",
            "A single-use ticket from POST /stream-tickets (valid 30 s), for a browser's EventSource or WebSocket, which cannot send Authorization.",
        ))),
    );
    for (path, item) in spec.paths.paths.iter_mut() {
        // An open route says so with an empty list (no requirement), rather than by omission.
        // Several requirements are alternatives: any one of the scopes suffices.
        let mut security = match requirement(path) {
            Requirement::Open => Vec::new(),
            Requirement::Scope(scope) => scope
                .granted_by()
                .iter()
                .map(|granting| SecurityRequirement::new("bearer", [granting.as_str()]))
                .collect(),
            Requirement::Authenticated => {
                vec![SecurityRequirement::new("bearer", Vec::<&str>::new())]
            }
        };
        if crate::http::auth::is_stream_path(path) {
            security.push(SecurityRequirement::new("ticket", Vec::<&str>::new()));
        }
        let operations = [
            &mut item.get,
            &mut item.post,
            &mut item.put,
            &mut item.delete,
            &mut item.patch,
        ];
        for operation in operations.into_iter().flatten() {
            operation.security = Some(security.clone());
        }
    }
}

/// The complete application; `auth` guards every route but health, readiness and the docs.
pub(crate) fn router(gateway: Gateway, auth: Auth) -> Router {
    with_layers(
        api()
            .split_for_parts()
            .0
            .merge(docs::routes())
            .merge(console::assets()),
        gateway,
        auth,
    )
}

/// The admin listener's application: the probes and the metrics only, behind the same
/// middleware (`/metrics` keeps its `admin` scope when tokens are configured).
pub(crate) fn admin_router(gateway: Gateway, auth: Auth) -> Router {
    let routes = axum::Router::new()
        .route("/healthz", axum::routing::get(ops::healthz))
        .route("/readyz", axum::routing::get(ops::readyz))
        .route("/metrics", axum::routing::get(metrics::metrics));
    with_layers(routes, gateway, auth)
}

/// The router's state: the gateway behind one `Arc`, so that handing it to a handler costs
/// one reference count, not one per field of [`Gateway`].
type Shared = Arc<Gateway>;

/// The middleware stack every listener shares: one middleware, [`edge`] (oversized heads,
/// request ids, the debug access log, authentication and the metrics in
/// [`metrics::guard`], problem instances), around the panic catcher. Each layer costs every
/// request a boxed future (an idle long poll holds it for its whole wait) and a clone of the
/// service below it, so there is one.
fn with_layers(routes: Router<Shared>, gateway: Gateway, auth: Auth) -> Router {
    let cors = cors_layer(&gateway.config().cors_allow_origins);
    let gateway = Arc::new(gateway);
    // Behind one `Arc`: the middleware clones its state for every request.
    let edge_state = Arc::new(Edge {
        ids: SequentialRequestId::new(),
        guard: metrics::Guard {
            gateway: gateway.clone(),
            auth,
        },
    });
    let app = routes
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(gateway)
        // Inside the metrics: a handler that panicked is counted (500) under its route.
        .layer(CatchPanicLayer::custom(problem::panic_response))
        .layer(axum::middleware::from_fn_with_state(edge_state, edge));
    // Outermost, and only when asked for: a preflight carries no token, so it is answered
    // before authentication; every other answer gets its Access-Control-* headers.
    match cors {
        Some(cors) => app.layer(cors),
        None => app,
    }
}

/// `--cors-allow-origin`: browser pages of these origins may call the API and open its
/// streams, with a bearer token (no cookies: credentials are never allowed).
fn cors_layer(origins: &[String]) -> Option<tower_http::cors::CorsLayer> {
    use axum::http::{HeaderName, HeaderValue, Method, header};
    use tower_http::cors::{AllowOrigin, CorsLayer};
    if origins.is_empty() {
        return None;
    }
    let origins: Vec<HeaderValue> = origins
        .iter()
        .filter_map(|origin| HeaderValue::from_str(origin).ok())
        .collect();
    Some(
        CorsLayer::new()
            .allow_origin(AllowOrigin::list(origins))
            .allow_methods([Method::GET, Method::POST, Method::DELETE])
            .allow_headers([
                header::AUTHORIZATION,
                header::CONTENT_TYPE,
                HeaderName::from_static("idempotency-key"),
                HeaderName::from_static("last-event-id"),
                HeaderName::from_static("traceparent"),
                HeaderName::from_static("tracestate"),
                X_REQUEST_ID,
            ])
            .expose_headers([
                header::RETRY_AFTER,
                header::WWW_AUTHENTICATE,
                HeaderName::from_static("idempotent-replayed"),
                X_REQUEST_ID,
            ])
            .max_age(std::time::Duration::from_secs(600)),
    )
}

/// What [`edge`] needs.
struct Edge {
    ids: SequentialRequestId,
    guard: metrics::Guard,
}

const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The middleware: oversized heads answer 414/431 at once; the request gets its
/// `x-request-id` (the client's when usable, else one made up), which the answer repeats;
/// at debug the request is a span closed by one `request finished` event; the guard
/// authenticates and counts it; a problem answer names the request path as its `instance`.
async fn edge(
    State(edge): State<Arc<Edge>>,
    mut request: Request<axum::body::Body>,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let request_id = match usable_request_id(request.headers_mut()) {
        Some(id) => id,
        None => {
            let id = edge.ids.make();
            request.headers_mut().insert(X_REQUEST_ID, id.clone());
            id
        }
    };
    if let Some(refusal) = refused_head(&request) {
        // A URI too long is not echoed: the problem names the request by its id instead.
        let instance = match refusal {
            Error::UriTooLong { .. } => {
                format!(
                    "urn:ruststream:request:{}",
                    request_id.to_str().unwrap_or("-")
                )
            }
            _ => request.uri().path().to_owned(),
        };
        let mut response = problem::name_instance(refusal.into_response(), &instance);
        response.headers_mut().insert(X_REQUEST_ID, request_id);
        return response;
    }
    // The path, copied: a clone of the URI would share the bytes of the connection's read
    // buffer, and keep all 8 KB of it for as long as a long poll waits. Needed only for a
    // problem answer.
    let path: Box<str> = request.uri().path().into();
    let span = request_span(&request);
    let log = RequestLog {
        request_id: request_id.clone(),
        trace: telemetry::spans::request_trace(&span),
    };
    let response = if span.is_disabled() {
        logs::within(log, metrics::guard(&edge.guard, request, next)).await
    } else {
        // The closing line inside the log context too: it carries the request's ids. Boxed:
        // unboxed, this traced variant's state would sit beside the plain one's in every
        // request's future — a kilobyte more held by each idle long poll, traced or not.
        Box::pin(logs::within(log, async {
            let started = Instant::now();
            let response = metrics::guard(&edge.guard, request, next)
                .instrument(span.clone())
                .await;
            finish_request_span(&response, started.elapsed(), &span);
            response
        }))
        .await
    };
    let mut response = problem::name_instance(response, &path);
    response
        .headers_mut()
        .entry(X_REQUEST_ID)
        .or_insert(request_id);
    response
}

/// Longest request URI the gateway takes: a lease id path is under 200 bytes.
const MAX_URI_BYTES: usize = 8 * 1024;
/// Largest header section (names and values) the gateway takes.
const MAX_HEAD_BYTES: usize = 64 * 1024;

/// Request heads refused before routing, as problem+json: oversized ones 414 or 431, well
/// below the limits at which hyper itself answers them with an empty body (64 KiB URIs, a
/// ~400 KiB head, more than [`serve::MAX_HEADERS`] headers); an HTTP/1.1 request without
/// `Host` 400 (RFC 9112 §3.2).
fn refused_head<B>(request: &Request<B>) -> Option<Error> {
    if request.version() == axum::http::Version::HTTP_11
        && !request.headers().contains_key(axum::http::header::HOST)
    {
        return Some(Error::BadRequest {
            detail: "an HTTP/1.1 request must carry a Host header (RFC 9112, section 3.2)".into(),
        });
    }
    let uri_bytes = request
        .uri()
        .path_and_query()
        .map_or(0, |target| target.as_str().len());
    if uri_bytes > MAX_URI_BYTES {
        return Some(Error::UriTooLong {
            limit: MAX_URI_BYTES,
        });
    }
    let head_bytes: usize = request
        .headers()
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len() + 4)
        .sum();
    if head_bytes > MAX_HEAD_BYTES {
        return Some(Error::HeadersTooLarge {
            limit: MAX_HEAD_BYTES,
        });
    }
    None
}

/// Longest `x-request-id` taken from a client; longer (or not visible ASCII) is replaced by
/// one of ours, since it is echoed in the answer and written to every log line.
const MAX_REQUEST_ID: usize = 128;

/// The client's `x-request-id` when there is exactly one and it is 1 to 128 visible ASCII
/// characters. An unusable one is dropped from the request (the caller puts one of ours in
/// its place).
fn usable_request_id(headers: &mut axum::http::HeaderMap) -> Option<HeaderValue> {
    let usable = |value: &HeaderValue| {
        let bytes = value.as_bytes();
        !bytes.is_empty()
            && bytes.len() <= MAX_REQUEST_ID
            && bytes.iter().all(|byte| byte.is_ascii_graphic())
    };
    let mut values = headers.get_all(X_REQUEST_ID).iter();
    let (first, second) = (values.next(), values.next());
    match (first, second) {
        (None, _) => None,
        // A copy: a clone would keep the connection's read buffer (8 KB) for as long as
        // the request lasts, a long poll's whole wait.
        (Some(value), None) if usable(value) => HeaderValue::from_bytes(value.as_bytes()).ok(),
        _ => {
            headers.remove(X_REQUEST_ID);
            None
        }
    }
}

/// One span per request: method, route (the matched template, as in the metrics), request id;
/// status and latency are recorded when the answer leaves. Headers are never recorded (they
/// may carry credentials), nor the query string; the raw path only when no route matched.
///
/// At debug, as is the line that closes it: a line per request at the default level cost
/// more CPU than the request itself under load, and the metrics already count every request
/// by route and status. Off, the span costs nothing but this level check.
fn request_span<B>(request: &Request<B>) -> tracing::Span {
    let traced = telemetry::on();
    if !traced && !tracing::enabled!(tracing::Level::DEBUG) {
        return tracing::Span::none();
    }
    let request_id = request
        .headers()
        .get(X_REQUEST_ID)
        .and_then(|id| id.to_str().ok())
        .unwrap_or_default();
    let route = request.extensions().get::<MatchedPath>();
    if traced {
        // The traced request's server span (at info, exported) is its log span too.
        let span = telemetry::spans::server_span(
            request.method(),
            route.map(MatchedPath::as_str),
            request_id,
            request.headers(),
        );
        if route.is_none() {
            span.record("path", request.uri().path());
        }
        return span;
    }
    let span = tracing::debug_span!(
        "request",
        method = %request.method(),
        route = route.map_or(metrics_names::UNMATCHED_ROUTE, MatchedPath::as_str),
        request_id,
        // A JWT's `sub`, recorded by the authentication middleware.
        subject = tracing::field::Empty,
        path = tracing::field::Empty,
        status = tracing::field::Empty,
        latency_us = tracing::field::Empty,
    );
    if route.is_none() {
        span.record("path", request.uri().path());
    }
    span
}

/// The access log (at debug): status and latency go into the request's span, and one event
/// in that span shows the whole of it.
fn finish_request_span<B>(response: &Response<B>, latency: Duration, span: &tracing::Span) {
    span.record("status", response.status().as_u16());
    telemetry::spans::answered(span, response.status());
    span.record(
        "latency_us",
        u64::try_from(latency.as_micros()).unwrap_or(u64::MAX),
    );
    tracing::debug!(parent: span, "request finished");
}

/// Request ids for requests that bring none: a per-process random prefix and a counter.
/// A UUID per request would cost a `getrandom` system call on every request.
struct SequentialRequestId {
    prefix: String,
    next: std::sync::atomic::AtomicU64,
}

impl SequentialRequestId {
    fn new() -> Self {
        Self {
            prefix: format!("{:08x}", rand::random::<u32>()),
            next: std::sync::atomic::AtomicU64::new(0),
        }
    }

    fn make(&self) -> HeaderValue {
        use std::io::Write as _;
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // Written into a small buffer: hex and decimal digits are always a valid value.
        let mut id = Vec::with_capacity(self.prefix.len() + 21);
        let _ = write!(id, "{}-{n}", self.prefix);
        HeaderValue::from_maybe_shared(bytes::Bytes::from(id))
            .unwrap_or_else(|_| HeaderValue::from_static("-"))
    }
}

async fn not_found() -> impl IntoResponse {
    Error::NotFound("no such endpoint; see /openapi.json".into())
}

async fn method_not_allowed() -> impl IntoResponse {
    Error::MethodNotAllowed("this endpoint does not take that method; see /openapi.json".into())
}

#[cfg(test)]
mod tests;
