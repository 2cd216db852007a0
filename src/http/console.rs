//! `GET /console`: the operator's page — consumers, a consumer's recent activity, dead
//! letters, redrive and seek — as three static files compiled into the binary. The page is a
//! client of the documented API and nothing else: it loads nothing from elsewhere (its
//! Content-Security-Policy forbids it), and with authentication on it asks for a token and
//! sends it as any client would.
//!
//! May import: as the rest of `http`.

use axum::Router;
use axum::http::header::{
    CACHE_CONTROL, CONTENT_SECURITY_POLICY, CONTENT_TYPE, REFERRER_POLICY, X_CONTENT_TYPE_OPTIONS,
};
use axum::response::IntoResponse;
use axum::routing::get;

const PAGE: &str = include_str!("console/index.html");
const SCRIPT: &str = include_str!("console/console.js");
const STYLE: &str = include_str!("console/console.css");

/// Only this origin, for everything: the page works with what the binary serves. No inline
/// style either (no `style` attributes: the page styles through classes of its stylesheet).
const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// Each of the console's answers: its type, never sniffed as another (`nosniff`); the
/// policy; and no `Referer` naming the console's URL to anything it links to.
fn file(content_type: &'static str, body: &'static str) -> impl IntoResponse {
    (
        [
            (CONTENT_TYPE, content_type),
            (CACHE_CONTROL, "no-cache"),
            (CONTENT_SECURITY_POLICY, POLICY),
            (X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (REFERRER_POLICY, "no-referrer"),
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

    /// `style-src 'self'` refuses inline style: a `style` attribute the script sets (or the
    /// page carries) is dropped with a CSP error, so the page has none and styles through
    /// its stylesheet's classes — the chart legend's swatches included.
    #[test]
    fn the_page_sets_no_inline_style_and_the_stylesheet_colours_each_swatch() {
        assert!(!PAGE.contains("style="), "a style attribute in the page");
        assert!(!PAGE.contains("<style"), "a style element in the page");
        for (number, line) in SCRIPT.lines().enumerate() {
            assert!(
                !line.contains("style:")
                    && !line.contains("\"style\"")
                    && !line.contains("cssText"),
                "console.js:{}: an inline style: {line}",
                number + 1
            );
        }
        let series: Vec<&str> = SCRIPT
            .split("const SERIES = [")
            .nth(1)
            .and_then(|rest| rest.split("];").next())
            .expect("the chart's series")
            .lines()
            .filter_map(|line| line.trim().strip_prefix("[\""))
            .filter_map(|line| line.split('"').next())
            .collect();
        assert_eq!(series.len(), 4, "{series:?}");
        for key in series {
            assert!(
                STYLE.contains(&format!(".legend .swatch-{key} {{ background: #")),
                "no swatch colour for {key} in console.css"
            );
        }
    }
}
