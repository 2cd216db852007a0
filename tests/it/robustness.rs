//! Bad input never yields a 500: odd bodies on every endpoint, unknown routes and wrong
//! methods (405 with `Allow`) and lease ids that are not UTF-8 all answer RFC 9457
//! problem+json with a 4xx status.

use serde_json::json;

use crate::support::{Action, Setup};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_bodies_on_every_endpoint_are_4xx_problems() {
    let (_server, js, gateway) = Setup::consumer("odd").start().await;
    // Enough messages that an accepted fetch answers at once.
    js.publish_many("orders.1", 10, "x").await;
    let held = gateway.fetch_n(1, 1000).await.remove(0);

    let deep = format!("{}{}", "[".repeat(5000), "]".repeat(5000));
    let bodies: Vec<Vec<u8>> = vec![
        b"null".to_vec(),
        b"[]".to_vec(),
        b"\"text\"".to_vec(),
        b"42".to_vec(),
        b"{\"batch\": null, \"wait_ms\": 0}".to_vec(),
        b"{\"batch\": 1e400}".to_vec(),
        b"{\"batch\": 18446744073709551616}".to_vec(),
        b"{\"wait_ms\": 99999999999999999999}".to_vec(),
        b"{\"ids\": [null]}".to_vec(),
        b"{\"ids\": [1, 2]}".to_vec(),
        b"{\"delay_ms\": 1.5}".to_vec(),
        b"{\"reason\": [\"x\"]}".to_vec(),
        b"{\"a\": 1} trailing".to_vec(),
        b"\xff\xfe\xfd".to_vec(),
        deep.into_bytes(),
    ];
    // (path, whether its body is optional)
    let paths = [
        ("/fetch".to_string(), true),
        ("/publish".to_string(), false),
        ("/messages/ack".to_string(), false),
        ("/messages/nak".to_string(), false),
        ("/messages/term".to_string(), false),
        (format!("/messages/{}/nak", held.id), true),
        (format!("/messages/{}/term", held.id), true),
    ];
    for (path, optional) in &paths {
        for body in &bodies {
            let reply = gateway.post_bytes(path, body.clone()).await;
            if reply.status == 200 || reply.status == 204 {
                // `null` may fairly mean "no body" where the body is optional, and a `null`
                // field its default; nothing else may pass.
                let fair =
                    body == b"null" || (path == "/fetch" && body.starts_with(b"{\"batch\": null"));
                assert!(
                    *optional && fair,
                    "POST {path} accepted {:?}: {}",
                    String::from_utf8_lossy(body),
                    reply.text
                );
                continue;
            }
            assert!(
                (400..500).contains(&reply.status),
                "POST {path} with {:?} answered {}: {}",
                String::from_utf8_lossy(&body[..body.len().min(60)]),
                reply.status,
                reply.text
            );
            reply.assert_problem(reply.status);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_routes_and_wrong_methods_are_problems() {
    let (_server, _js, gateway) = Setup::consumer("routes").start().await;
    gateway.get("/nope").await.assert_problem(404);
    gateway
        .post("/messages", Some(&json!({})))
        .await
        .assert_problem(404);
    // A 405 says which methods the endpoint takes (`Allow`, RFC 9110).
    for (reply, allowed) in [
        (gateway.get("/fetch").await, "POST"),
        (gateway.get("/messages/ack").await, "POST"),
        (gateway.post("/healthz", None).await, "GET"),
    ] {
        reply.assert_problem(405);
        let allow = reply
            .headers
            .get("allow")
            .and_then(|value| value.to_str().ok())
            .unwrap_or_else(|| panic!("a 405 without Allow: {:?}", reply.headers));
        let methods: Vec<&str> = allow.split(',').map(str::trim).collect();
        assert!(
            methods.contains(&allowed),
            "Allow {allow:?} must list {allowed}"
        );
        assert!(
            !methods.contains(&if allowed == "GET" { "POST" } else { "GET" }),
            "Allow {allow:?} must not list the method just refused"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_id_that_is_not_utf8_is_a_404_problem() {
    let (_server, _js, gateway) = Setup::consumer("rv-utf8").start().await;
    for action in Action::ALL {
        let reply = gateway.post(&format!("/messages/%FF/{action}"), None).await;
        reply.assert_problem(404);
    }
}

/// Oversized request heads are refused as problem+json (414 for the URI, 431 for the
/// headers) without echoing them; what hyper refuses before the gateway sees a request (a
/// malformed request line or header) is a bare 400 that closes the connection, as
/// docs/security.md lists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_and_malformed_request_heads_are_refused() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (_server, _js, gateway) = Setup::consumer("heads").start().await;
    let address = gateway.url("").trim_start_matches("http://").to_owned();
    let exchange = |raw: Vec<u8>| {
        let address = address.clone();
        async move {
            let mut stream = tokio::net::TcpStream::connect(&address)
                .await
                .expect("connect");
            stream.write_all(&raw).await.expect("write");
            let mut answer = Vec::new();
            tokio::time::timeout(
                std::time::Duration::from_secs(10),
                stream.read_to_end(&mut answer),
            )
            .await
            .expect("answered and closed")
            .expect("read");
            String::from_utf8_lossy(&answer).into_owned()
        }
    };
    let long_path = format!("/messages/{}/ack", "a".repeat(9000));
    let answer = exchange(
        format!("POST {long_path} HTTP/1.1\r\nHost: g\r\nConnection: close\r\n\r\n").into_bytes(),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 414"), "{answer:.300}");
    assert!(answer.contains("application/problem+json"), "{answer:.300}");
    assert!(
        answer.contains("urn:ruststream-nats:problem:uri-too-long"),
        "{answer:.300}"
    );
    assert!(!answer.contains(&"a".repeat(100)), "the URI is not echoed");
    assert!(
        answer.contains(r#""instance":"urn:ruststream:request:"#),
        "the problem names the request by its id: {answer:.600}"
    );

    let big_header = format!(
        "GET /healthz HTTP/1.1\r\nHost: g\r\nConnection: close\r\nX-Big: {}\r\n\r\n",
        "b".repeat(70 * 1024)
    );
    let answer = exchange(big_header.into_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer:.300}");
    assert!(
        answer.contains("urn:ruststream-nats:problem:headers-too-large"),
        "{answer:.300}"
    );

    // 150 header lines (a proxy chain, tracing): served, not hyper's bare 431 past 100.
    let many: String = (0..150).map(|n| format!("X-Hop-{n}: v\r\n")).collect();
    let answer = exchange(
        format!("GET /healthz HTTP/1.1\r\nHost: g\r\nConnection: close\r\n{many}\r\n").into_bytes(),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer:.300}");

    // HTTP/1.1 without Host (RFC 9112 §3.2): 400, problem+json; HTTP/1.0 needs none.
    let answer = exchange(b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n".to_vec()).await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer:.300}");
    assert!(answer.contains("application/problem+json"), "{answer:.300}");
    assert!(answer.contains("Host"), "{answer:.300}");
    let answer = exchange(b"GET /healthz HTTP/1.0\r\n\r\n".to_vec()).await;
    assert!(answer.starts_with("HTTP/1.0 200"), "{answer:.300}");

    for malformed in [
        b"GARBAGE\r\n\r\n".to_vec(),
        b"GET /healthz HTTP/1.1\r\nHost: g\r\nNo Colon Here\r\n\r\n".to_vec(),
    ] {
        let answer = exchange(malformed).await;
        assert!(answer.starts_with("HTTP/1.1 400"), "{answer:.300}");
    }
}
