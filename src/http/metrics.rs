//! `GET /metrics` (the Prometheus text format) and the guard the edge middleware runs every
//! request through: authentication ([`super::auth::admit`]), then a count of every HTTP
//! request by method, matched route template and status.
//!
//! May import: as the rest of `http`.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::http::header::CONTENT_TYPE;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::auth::Auth;
use super::responses::Guarded;
use crate::gateway::Gateway;
use crate::metrics::{CONTENT_TYPE as METRICS_CONTENT_TYPE, UNMATCHED_ROUTE};

/// Metrics in the Prometheus text exposition format (0.0.4).
///
/// Leases in flight, granted, settled (by kind and result) and expired; redeliveries; fetch
/// wait and latency histograms; empty and refused fetches; the NATS connection; the
/// consumer's limits; HTTP requests by route and status. See docs/metrics.md for the list.
#[utoipa::path(
    get,
    path = "/metrics",
    operation_id = "getMetrics",
    tag = "operations",
    responses(
        (status = 200, description = "Prometheus text exposition format 0.0.4", body = String,
            content_type = "text/plain",
            example = "# TYPE ruststream_leases_in_flight gauge\nruststream_leases_in_flight 3\n"),
        Guarded,
    )
)]
pub(crate) async fn metrics(State(gateway): State<Arc<Gateway>>) -> impl IntoResponse {
    (
        [(CONTENT_TYPE, METRICS_CONTENT_TYPE)],
        gateway.render_metrics(),
    )
}

/// Authenticate, then serve, and count the request under its route template
/// (`/messages/{id}/ack`), never its raw path: one series per lease id would grow without
/// bound. Refusals (401/403) are counted under their route too. Run by the one middleware
/// ([`super::edge`]): each layer costs every request a boxed future and a clone of the service
/// below it.
pub(crate) async fn guard(guard: &Guard, mut request: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = request.method().clone();
    let route = request.extensions().get::<MatchedPath>().cloned();
    let response = match super::auth::admit(&guard.auth, &guard.gateway, &mut request).await {
        Ok(()) => next.run(request).await,
        Err(refused) => refused.into_response(),
    };
    guard.gateway.metrics().http_request(
        &method,
        route.as_ref().map_or(UNMATCHED_ROUTE, MatchedPath::as_str),
        response.status(),
        started.elapsed(),
    );
    response
}

/// What [`guard`] needs: the metrics and the token sources.
pub(crate) struct Guard {
    pub(crate) gateway: Arc<Gateway>,
    pub(crate) auth: Auth,
}
