//! `GET /console`: the operator's page — consumers, a consumer's recent activity, dead
//! letters, redrive and seek — as three static files compiled into the binary. The page is a
//! client of the documented API and nothing else: it loads nothing from elsewhere (its
//! Content-Security-Policy forbids it), and with authentication on it asks for a token and
//! sends it as any client would.
//!
//! May import: as the rest of `http`.

use axum::Router;
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE, HeaderName};
use axum::response::IntoResponse;
use axum::routing::get;

const PAGE: &str = include_str!("console/index.html");
const SCRIPT: &str = include_str!("console/console.js");
const STYLE: &str = include_str!("console/console.css");

/// Only this origin, for everything: the page works with what the binary serves.
const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

const CONTENT_SECURITY_POLICY: HeaderName = HeaderName::from_static("content-security-policy");

fn file(content_type: &'static str, body: &'static str) -> impl IntoResponse {
    (
        [
            (CONTENT_TYPE, content_type),
            (CACHE_CONTROL, "no-cache"),
            (CONTENT_SECURITY_POLICY, POLICY),
        ],
        body,
    )
}

/// The console page: the consumers, live; a consumer's activity, seek and push controls;
/// the dead letters with redrive. Static (it asks the API for everything it shows), so it
/// needs no token itself; the API calls it makes carry the one it asks for.
#[utoipa::path(
    get,
    path = "/console",
    operation_id = "getConsole",
    tag = "operations",
    responses(
        (status = 200, description = "The console's HTML page (its script and style at /console/console.js and /console/console.css)", content_type = "text/html"),
    )
)]
pub(crate) async fn page() -> impl IntoResponse {
    file("text/html; charset=utf-8", PAGE)
}

/// The page's script and style, beside it (not part of the API).
pub(crate) fn assets<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route(
            "/console/console.js",
            get(|| async { file("text/javascript; charset=utf-8", SCRIPT) }),
        )
        .route(
            "/console/console.css",
            get(|| async { file("text/css; charset=utf-8", STYLE) }),
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Everything the page loads names this origin's paths: no scheme, no host.
    #[test]
    fn the_page_loads_only_its_own_files() {
        for text in [PAGE, SCRIPT, STYLE] {
            for outside in ["http://", "https://", "//cdn", "@import"] {
                let hits: Vec<&str> = text
                    .lines()
                    .filter(|line| line.contains(outside) && !line.contains("www.w3.org/2000/svg"))
                    .collect();
                assert!(hits.is_empty(), "{outside}: {hits:?}");
            }
        }
        assert!(PAGE.contains(r#"src="/console/console.js""#));
        assert!(PAGE.contains(r#"href="/console/console.css""#));
    }
}
