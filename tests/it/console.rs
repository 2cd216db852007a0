//! `GET /console`: the operator's page and its two files, each answered with the headers
//! that keep a browser from reading them as anything else or telling other sites where they
//! came from, under a policy that allows nothing inline.

use crate::support::Setup;
use crate::support::nats::free_port;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_console_answer_says_nosniff_no_referrer_and_allows_nothing_inline() {
    // Static files: served without NATS.
    let unreachable = format!("nats://127.0.0.1:{}", free_port());
    let mut gateway = Setup::consumer("console").starting(&unreachable).await;
    for (path, content_type) in [
        ("/console", "text/html"),
        ("/console/console.js", "text/javascript"),
        ("/console/console.css", "text/css"),
    ] {
        let reply = gateway.get(path).await;
        assert_eq!(reply.status, 200, "{path}: {}", reply.text);
        assert!(
            reply.content_type().starts_with(content_type),
            "{path}: {}",
            reply.content_type()
        );
        let header = |name: &str| {
            reply
                .headers
                .get(name)
                .and_then(|value| value.to_str().ok())
                .unwrap_or_default()
                .to_owned()
        };
        assert_eq!(header("x-content-type-options"), "nosniff", "{path}");
        assert_eq!(header("referrer-policy"), "no-referrer", "{path}");
        let policy = header("content-security-policy");
        assert!(policy.contains("style-src 'self'"), "{path}: {policy}");
        assert!(!policy.contains("unsafe-inline"), "{path}: {policy}");
    }
    gateway.shutdown().await.expect("shutdown without NATS");
}
