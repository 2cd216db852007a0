//! `GET /docs`: Swagger UI served from the binary (no network, not even NATS), reading
//! `/openapi.json`; and the `instance` of a problem answer.

use reqwest::redirect::Policy;

use crate::support::Setup;
use crate::support::nats::free_port;

/// A client that shows redirects instead of following them.
fn no_redirects() -> reqwest::Client {
    crate::support::client::http_builder()
        .redirect(Policy::none())
        .build()
        .expect("build reqwest client")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docs_serve_swagger_ui_and_its_assets_from_the_binary() {
    let unreachable = format!("nats://127.0.0.1:{}", free_port());
    let mut gateway = Setup::consumer("docs").starting(&unreachable).await;

    // `/docs` itself is the page (curl without -L sees it); it names /docs/ as the base its
    // relative asset paths resolve against. `/docs/` serves the same page.
    let page = no_redirects()
        .get(gateway.url("/docs"))
        .send()
        .await
        .expect("GET /docs");
    assert_eq!(page.status(), 200, "GET /docs answers the page itself");
    let html = page.text().await.expect("page body");
    assert!(html.contains(r#"<base href="/docs/">"#), "{html}");
    assert!(html.contains("swagger-ui.css"), "{html}");

    let page = gateway.get("/docs/").await;
    assert_eq!(page.status, 200, "{}", page.text);
    assert!(page.content_type().starts_with("text/html"), "{page:?}");
    assert!(page.text.contains("swagger-ui"), "{}", page.text);

    // The page loads these; each must come from the binary, and the initializer must point
    // Swagger UI at our spec with the online validator off.
    for (asset, content_type, marker) in [
        ("/docs/swagger-ui.css", "text/css", ".swagger-ui"),
        (
            "/docs/swagger-ui-bundle.js",
            "text/javascript",
            "SwaggerUIBundle",
        ),
        (
            "/docs/swagger-ui-standalone-preset.js",
            "text/javascript",
            "SwaggerUIStandalonePreset",
        ),
        (
            "/docs/swagger-initializer.js",
            "text/javascript",
            "/openapi.json",
        ),
    ] {
        let reply = gateway.get(asset).await;
        assert_eq!(reply.status, 200, "{asset}: {}", reply.text);
        assert!(
            reply.content_type().starts_with(content_type),
            "{asset}: {:?}",
            reply.content_type()
        );
        assert!(reply.text.contains(marker), "{asset} lacks {marker:?}");
    }
    let initializer = gateway.get("/docs/swagger-initializer.js").await;
    assert!(
        initializer.text.contains(r#""validatorUrl": "none""#),
        "the online validator is off: {}",
        initializer.text
    );
    let missing = gateway.get("/docs/no-such-file.js").await;
    missing.assert_problem(404);
    let spec = gateway.openapi().await;
    assert_eq!(spec.status, 200);

    gateway.shutdown().await.expect("shutdown without NATS");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_problem_names_the_request_path_as_its_instance() {
    let unreachable = format!("nats://127.0.0.1:{}", free_port());
    let mut gateway = Setup::consumer("instance").starting(&unreachable).await;

    let reply = gateway.post("/messages/not-a-lease/ack", None).await;
    reply.assert_problem(404);
    assert_eq!(
        reply.body["instance"], "/messages/not-a-lease/ack",
        "{}",
        reply.text
    );
    let reply = gateway.get("/no/such/route").await;
    reply.assert_problem(404);
    assert_eq!(reply.body["instance"], "/no/such/route", "{}", reply.text);

    gateway.shutdown().await.expect("shutdown without NATS");
}
