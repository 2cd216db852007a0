//! `GET /docs`: Swagger UI, its files compiled into the binary (utoipa-swagger-ui, vendored),
//! reading `/openapi.json`. Served here rather than through the crate's router so that
//! `/docs` itself answers 200 (curl without `-L` sees the page) and a missing file is our
//! problem+json 404.
//!
//! May import: as the rest of `http`.

use std::sync::{Arc, LazyLock};

use axum::Router;
use axum::extract::Path;
use axum::http::header::{CONTENT_ENCODING, CONTENT_TYPE};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use utoipa_swagger_ui::{Config, SwaggerFile};

use crate::error::Error;

/// Where the page lives; its assets are relative to it.
const DOCS_PATH: &str = "/docs";

/// The UI reads our spec, and the online validator (which would send the spec to a third
/// party) is off, so the page works without a network.
static CONFIG: LazyLock<Arc<Config<'static>>> =
    LazyLock::new(|| Arc::new(Config::from("/openapi.json").validator_url("none")));

/// `/docs`, `/docs/` and `/docs/<file>`.
pub(crate) fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route(DOCS_PATH, get(index))
        .route(&format!("{DOCS_PATH}/"), get(index))
        .route(&format!("{DOCS_PATH}/{{*file}}"), get(file))
}

async fn index() -> Response {
    serve("index.html")
}

async fn file(Path(file): Path<String>) -> Response {
    serve(&file)
}

fn serve(file: &str) -> Response {
    match utoipa_swagger_ui::serve(file, CONFIG.clone()) {
        Ok(Some(found)) if file == "index.html" && !found.gzpipped => with_base(found),
        Ok(Some(found)) => respond(found.content_type, found.gzpipped, found.bytes.into_owned()),
        Ok(None) | Err(_) => {
            Error::NotFound(format!("no file {file:?} in the Swagger UI bundle")).into_response()
        }
    }
}

/// The page refers to its assets as `./swagger-ui.css`; served at `/docs` (no slash) a
/// browser would look for them at the root, so the page names its base.
fn with_base(index: SwaggerFile<'_>) -> Response {
    let html = String::from_utf8_lossy(&index.bytes);
    let html = html.replacen(
        "<head>",
        &format!("<head>\n    <base href=\"{DOCS_PATH}/\">"),
        1,
    );
    respond(index.content_type, false, html.into_bytes())
}

fn respond(content_type: String, gzipped: bool, bytes: Vec<u8>) -> Response {
    let mut response = ([(CONTENT_TYPE, content_type)], bytes).into_response();
    if gzipped {
        response.headers_mut().insert(
            CONTENT_ENCODING,
            axum::http::HeaderValue::from_static("gzip"),
        );
    }
    response
}
