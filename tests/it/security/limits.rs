//! Connection-level limits, with raw sockets: a client dribbling its headers or its body is
//! cut off after the configured timeout, and connections past `--max-connections` wait.

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::Setup;

/// Slack on top of a configured timeout for a loaded 2-core machine.
const MARGIN: Duration = Duration::from_secs(3);

/// Read until the peer closes (EOF or reset) or `limit` passes; returns what was read and
/// whether it closed.
async fn read_until_closed(stream: &mut TcpStream, limit: Duration) -> (String, bool) {
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return (String::from_utf8_lossy(&seen).into(), true),
            Ok(Ok(n)) => seen.extend_from_slice(&buf[..n]),
            Err(_) => return (String::from_utf8_lossy(&seen).into(), false),
        }
    }
}

/// Write `chunks` one every 200 ms (ignoring errors once the server has closed).
fn dribble(mut writer: tokio::net::tcp::OwnedWriteHalf, chunks: Vec<String>) {
    tokio::spawn(async move {
        for chunk in chunks {
            if writer.write_all(chunk.as_bytes()).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
}

#[tokio::test]
async fn a_client_dribbling_headers_is_disconnected_after_the_header_timeout() {
    let (_server, _js, gateway) = Setup::consumer("slowloris")
        .flag("--header-read-timeout", "1s")
        .start()
        .await;
    let stream = TcpStream::connect(gateway.url("").trim_start_matches("http://"))
        .await
        .expect("connect");
    let (mut reader, writer) = stream.into_split();
    let started = Instant::now();
    // One header line every 200 ms for 20 s: each byte arrives well within any per-read
    // timeout, only the whole head is too slow.
    let mut chunks = vec!["POST /fetch HTTP/1.1\r\nHost: gateway\r\n".to_owned()];
    chunks.extend((0..100).map(|i| format!("X-Slow-{i}: still coming\r\n")));
    dribble(writer, chunks);
    let mut buf = [0u8; 1024];
    let closed = tokio::time::timeout(Duration::from_secs(1) + MARGIN, async {
        loop {
            match reader.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    let took = started.elapsed();
    assert!(closed.is_ok(), "still connected after {took:?}");
    assert!(
        took >= Duration::from_millis(900),
        "cut off before the timeout: {took:?}"
    );
}

#[tokio::test]
async fn an_idle_connection_is_closed_and_a_prompt_one_is_served() {
    let (_server, _js, gateway) = Setup::consumer("idle")
        .flag("--header-read-timeout", "1s")
        .start()
        .await;
    let address = gateway.url("").trim_start_matches("http://").to_owned();
    // A connection that never sends anything is closed too (no slot held forever).
    let mut idle = TcpStream::connect(&address).await.expect("connect");
    let (_, closed) = read_until_closed(&mut idle, Duration::from_secs(1) + MARGIN).await;
    assert!(closed, "an idle connection stayed open");
    // A prompt client is unaffected.
    let mut prompt = TcpStream::connect(&address).await.expect("connect");
    prompt
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\n\r\n")
        .await
        .expect("write");
    let (answer, _) = read_until_closed(&mut prompt, Duration::from_secs(5)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

#[tokio::test]
async fn a_client_dribbling_its_body_gets_408_and_is_disconnected() {
    let (_server, _js, gateway) = Setup::consumer("slowbody")
        .flag("--body-read-timeout", "1s")
        .start()
        .await;
    let stream = TcpStream::connect(gateway.url("").trim_start_matches("http://"))
        .await
        .expect("connect");
    let (mut reader, writer) = stream.into_split();
    let body = r#"{"batch": 1, "wait_ms": 0}"#;
    let mut chunks = vec![format!(
        "POST /fetch HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len() + 100
    )];
    // One byte every 200 ms: the whole body would take about 25 s.
    chunks.extend(
        body.chars()
            .chain(std::iter::repeat_n(' ', 100))
            .map(String::from),
    );
    let started = Instant::now();
    dribble(writer, chunks);
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    let closed = tokio::time::timeout(Duration::from_secs(1) + MARGIN, async {
        loop {
            match reader.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => seen.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    let took = started.elapsed();
    let answer = String::from_utf8_lossy(&seen);
    assert!(
        closed.is_ok(),
        "still connected after {took:?}; got {answer}"
    );
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("application/problem+json"), "{answer}");
    assert!(
        took >= Duration::from_millis(900),
        "cut off before the timeout: {took:?}"
    );
}

#[tokio::test]
async fn connections_past_the_cap_wait_until_one_closes() {
    let (_server, _js, mut gateway) = Setup::consumer("capped-conns")
        .flag("--max-connections", "2")
        .start()
        .await;
    // The readiness polls' pooled connection would hold a slot: close it.
    gateway.http = crate::support::client::http_client();
    let address = gateway.url("").trim_start_matches("http://").to_owned();
    let request = b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n";
    // Two keep-alive connections, each served once and left open.
    let mut open = Vec::new();
    for _ in 0..2 {
        let mut stream = TcpStream::connect(&address).await.expect("connect");
        stream.write_all(request).await.expect("write");
        let mut buf = [0u8; 1024];
        let n = stream.read(&mut buf).await.expect("answer");
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
        open.push(stream);
    }
    // The third connects (the kernel's backlog takes it) but is not served ...
    let mut third = TcpStream::connect(&address).await.expect("connect");
    third.write_all(request).await.expect("write");
    let mut buf = [0u8; 1024];
    let early = tokio::time::timeout(Duration::from_millis(700), third.read(&mut buf)).await;
    assert!(
        early.is_err(),
        "a third connection was served past --max-connections 2"
    );
    // ... until one of the two closes.
    drop(open.pop());
    let n = tokio::time::timeout(Duration::from_secs(5), third.read(&mut buf))
        .await
        .expect("served once a slot freed")
        .expect("read");
    assert!(
        buf[..n].starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&buf[..n])
    );
}

/// With `--admin-listen`, probes and scrapes have a listener and a connection budget of their
/// own: while slow clients hold every `--max-connections` slot of the main listener, the
/// admin listener still answers `/healthz`, `/readyz` and `/metrics` — and nothing else.
#[tokio::test]
async fn the_admin_listener_answers_probes_while_the_main_listener_is_full() {
    let admin_port = crate::support::nats::free_port();
    let (_server, _js, mut gateway) = Setup::consumer("admin-port")
        .flag("--max-connections", "2")
        .flag("--admin-listen", format!("127.0.0.1:{admin_port}"))
        .start()
        .await;
    gateway.http = crate::support::client::http_client();
    let address = gateway.url("").trim_start_matches("http://").to_owned();
    // Two clients that connect and send nothing take both slots (until the header timeout).
    let mut hogs = Vec::new();
    for _ in 0..2 {
        hogs.push(TcpStream::connect(&address).await.expect("connect"));
    }
    let mut starved = TcpStream::connect(&address).await.expect("connect");
    starved
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n")
        .await
        .expect("write");
    let mut buf = [0u8; 1024];
    assert!(
        tokio::time::timeout(Duration::from_millis(700), starved.read(&mut buf))
            .await
            .is_err(),
        "the main listener is full"
    );

    let admin = crate::support::Client::new(format!("http://127.0.0.1:{admin_port}"));
    for path in ["/healthz", "/readyz"] {
        let reply = admin.get(path).await;
        assert_eq!(
            reply.status, 200,
            "{path} on the admin listener: {}",
            reply.text
        );
        assert_eq!(reply.body, serde_json::json!({ "status": "ok" }));
    }
    let metrics = admin.get("/metrics").await;
    assert_eq!(metrics.status, 200, "{}", metrics.text);
    assert!(
        metrics.text.contains("ruststream_nats_connected 1"),
        "{}",
        metrics.text
    );
    admin.post("/fetch", None).await.assert_problem(404);
    admin.get("/consumer").await.assert_problem(404);
    drop(hogs);
}
