//! The gateway run in-process on a port-0 listener, with a typed HTTP client (one method per
//! endpoint) and a handle to trigger the graceful shutdown and collect `run`'s result.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use reqwest::header::{CONTENT_TYPE, HeaderMap};
use ruststream_nats::Config;
use serde::Deserialize;
use serde_json::{Map, Value, json};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// How long `wait_ready` waits for /readyz to answer 200.
pub const READY_DEADLINE: Duration = Duration::from_secs(20);

/// A running gateway owned by one test.
pub struct Gateway {
    addr: SocketAddr,
    pub stream: String,
    pub consumer: String,
    pub http: reqwest::Client,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<anyhow::Result<()>>>,
}

/// One HTTP answer: status, headers and the body as JSON (`Null` when empty or not JSON).
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: HeaderMap,
    pub text: String,
    pub body: Value,
}

impl Reply {
    /// The Retry-After header in whole seconds; panics when it is missing or not a number.
    #[track_caller]
    pub fn retry_after_secs(&self) -> u64 {
        self.headers
            .get("retry-after")
            .unwrap_or_else(|| panic!("{} without Retry-After: {:?}", self.status, self.headers))
            .to_str()
            .expect("ascii header")
            .parse::<u64>()
            .expect("Retry-After in whole seconds")
    }

    pub fn content_type(&self) -> &str {
        self.headers
            .get(CONTENT_TYPE)
            .and_then(|value| value.to_str().ok())
            .unwrap_or("")
    }

    /// Assert an RFC 9457 problem answer with this status whose text names `field`
    /// (pass "" to skip the naming check).
    #[track_caller]
    pub fn assert_problem(&self, statuses: &[u16], field: &str) {
        assert!(
            statuses.contains(&self.status),
            "expected status in {statuses:?}, got {} with body {}",
            self.status,
            self.text
        );
        assert!(
            self.content_type().starts_with("application/problem+json"),
            "a {} must be application/problem+json, got {:?} (body {})",
            self.status,
            self.content_type(),
            self.text
        );
        let problem = self.body.as_object().unwrap_or_else(|| {
            panic!("problem body is not a JSON object: {}", self.text);
        });
        assert_eq!(
            problem.get("status").and_then(Value::as_u64),
            Some(u64::from(self.status)),
            "problem.status must repeat the HTTP status: {}",
            self.text
        );
        assert!(
            problem.get("title").is_some_and(Value::is_string),
            "problem has no title: {}",
            self.text
        );
        if !field.is_empty() {
            assert!(
                self.text.contains(field),
                "a {} problem must name the field `{field}`: {}",
                self.status,
                self.text
            );
        }
    }
}

/// A leased message as `POST /fetch` returns it.
#[derive(Debug, Clone, Deserialize)]
pub struct Msg {
    pub id: String,
    pub subject: String,
    pub data: String,
    pub encoding: String,
    pub headers: Map<String, Value>,
    pub stream: String,
    pub consumer: String,
    pub stream_sequence: u64,
    pub consumer_sequence: u64,
    pub delivered: u64,
    pub pending: u64,
    pub published_at: String,
    pub lease_expires_at: String,
}

impl Msg {
    /// The payload, decoded according to `encoding`.
    pub fn payload(&self) -> Vec<u8> {
        match self.encoding.as_str() {
            "utf8" => self.data.clone().into_bytes(),
            "base64" => {
                use base64::Engine as _;
                base64::engine::general_purpose::STANDARD
                    .decode(&self.data)
                    .unwrap_or_else(|err| panic!("data {:?} is not base64: {err}", self.data))
            }
            other => panic!("unknown encoding {other:?}"),
        }
    }

    pub fn lease_expires(&self) -> time::OffsetDateTime {
        super::rfc3339(&self.lease_expires_at)
    }
}

/// The HTTP client every test uses: no proxies from the environment, no pooling limits.
pub fn http_client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("build reqwest client")
}

/// As [`http_client`], sending `Authorization: Bearer <token>` on every request.
pub fn http_client_with_token(token: &str) -> reqwest::Client {
    let mut headers = HeaderMap::new();
    headers.insert(
        reqwest::header::AUTHORIZATION,
        format!("Bearer {token}").parse().expect("header value"),
    );
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(60))
        .default_headers(headers)
        .build()
        .expect("build reqwest client")
}

impl Gateway {
    /// Parse `--nats-url <url> <extra…>` like the binary does and start `run` on a port-0
    /// listener. Does not wait for readiness.
    pub async fn start(nats_url: &str, extra_flags: &[&str]) -> Self {
        let mut args = vec!["ruststream-nats", "--nats-url", nats_url];
        args.extend_from_slice(extra_flags);
        let config = Config::try_parse_from(args.clone())
            .unwrap_or_else(|err| panic!("flags {args:?} do not parse: {err}"));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the gateway listener");
        let addr = listener.local_addr().expect("listener addr");
        let stream = config.stream.clone();
        let consumer = config.consumer.clone();
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(ruststream_nats::run(config, listener, async move {
            let _ = rx.await;
        }));
        Self {
            addr,
            stream,
            consumer,
            http: http_client(),
            shutdown: Some(tx),
            task: Some(task),
        }
    }

    /// `start` and wait until /readyz answers 200.
    pub async fn ready(nats_url: &str, extra_flags: &[&str]) -> Self {
        let mut gateway = Self::start(nats_url, extra_flags).await;
        gateway.wait_ready().await;
        gateway
    }

    pub fn base(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base())
    }

    /// Poll /readyz until it answers 200; panics (with run's error, if it ended) otherwise.
    pub async fn wait_ready(&mut self) {
        let deadline = tokio::time::Instant::now() + READY_DEADLINE;
        loop {
            if self.readyz().await == 200 {
                return;
            }
            if self.task.as_ref().is_some_and(JoinHandle::is_finished) {
                let result = self.join(Duration::from_secs(1)).await;
                panic!("run() ended before the gateway became ready: {result:?}");
            }
            if tokio::time::Instant::now() >= deadline {
                panic!("/readyz did not answer 200 within {READY_DEADLINE:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Poll /readyz until it answers 503 (NATS went away).
    pub async fn wait_unready(&self) {
        crate::support::wait_until(
            "/readyz answers 503 while NATS is down",
            Duration::from_secs(10),
            || async { self.readyz().await == 503 },
        )
        .await;
    }

    /// Resolve the shutdown future given to `run` (SIGTERM in the binary); does not wait.
    pub fn trigger_shutdown(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }

    /// Trigger the shutdown and wait until new fetches are refused (503): the drain began.
    pub async fn begin_shutdown(&mut self) {
        self.trigger_shutdown();
        crate::support::wait_until(
            "the shutdown has begun (new fetches are refused)",
            Duration::from_secs(5),
            || async {
                self.fetch_reply(Some(&serde_json::json!({ "wait_ms": 0 })))
                    .await
                    .status
                    == 503
            },
        )
        .await;
    }

    /// Wait (bounded) for `run` to return on its own or after `trigger_shutdown`.
    pub async fn join(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let task = self.task.take().expect("run() was already joined");
        match tokio::time::timeout(timeout, task).await {
            Ok(Ok(result)) => result,
            Ok(Err(join_error)) => panic!("run() panicked: {join_error}"),
            Err(_) => panic!("run() did not return within {timeout:?}"),
        }
    }

    /// Trigger the graceful shutdown and return `run`'s result.
    pub async fn shutdown(&mut self) -> anyhow::Result<()> {
        self.trigger_shutdown();
        self.join(Duration::from_secs(30)).await
    }

    /// Wait until `run` has ended on its own (start-up errors) and return its result.
    pub async fn exit_result(&mut self) -> anyhow::Result<()> {
        self.join(Duration::from_secs(20)).await
    }

    // ---- raw requests ---------------------------------------------------------------------

    pub async fn reply(response: reqwest::Response) -> Reply {
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let text = response.text().await.expect("read response body");
        let body = serde_json::from_str(&text).unwrap_or(Value::Null);
        Reply {
            status,
            headers,
            text,
            body,
        }
    }

    pub async fn get(&self, path: &str) -> Reply {
        let response = self
            .http
            .get(self.url(path))
            .send()
            .await
            .unwrap_or_else(|err| panic!("GET {path}: {err}"));
        Self::reply(response).await
    }

    /// POST a JSON body (`None`: no body at all).
    pub async fn post(&self, path: &str, body: Option<&Value>) -> Reply {
        let mut request = self.http.post(self.url(path));
        if let Some(body) = body {
            request = request.json(body);
        }
        let response = request
            .send()
            .await
            .unwrap_or_else(|err| panic!("POST {path}: {err}"));
        Self::reply(response).await
    }

    /// POST raw bytes with `Content-Type: application/json`.
    pub async fn post_bytes(&self, path: &str, bytes: Vec<u8>) -> Reply {
        let response = self
            .http
            .post(self.url(path))
            .header(CONTENT_TYPE, "application/json")
            .body(bytes)
            .send()
            .await
            .unwrap_or_else(|err| panic!("POST {path}: {err}"));
        Self::reply(response).await
    }

    // ---- one method per endpoint ----------------------------------------------------------

    pub async fn healthz(&self) -> u16 {
        self.get("/healthz").await.status
    }

    /// /readyz status, or 0 when the request itself failed.
    pub async fn readyz(&self) -> u16 {
        match self.http.get(self.url("/readyz")).send().await {
            Ok(response) => response.status().as_u16(),
            Err(_) => 0,
        }
    }

    pub async fn consumer_view(&self) -> Value {
        let reply = self.get("/consumer").await;
        assert_eq!(reply.status, 200, "GET /consumer: {}", reply.text);
        reply.body
    }

    /// `leases_in_flight` from GET /consumer.
    pub async fn leases_in_flight(&self) -> u64 {
        let view = self.consumer_view().await;
        view.get("leases_in_flight")
            .and_then(Value::as_u64)
            .unwrap_or_else(|| panic!("GET /consumer has no leases_in_flight: {view}"))
    }

    pub async fn openapi(&self) -> Reply {
        self.get("/openapi.json").await
    }

    /// POST /fetch with this body (`None`: no body), any status.
    /// A long-poll fetch that must be refused with 429 at once (not after its wait);
    /// returns the Retry-After seconds.
    pub async fn fetch_refused_at_capacity(&self) -> u64 {
        let started = std::time::Instant::now();
        let reply = self
            .fetch_reply(Some(&serde_json::json!({ "batch": 1, "wait_ms": 10_000 })))
            .await;
        let took = started.elapsed();
        reply.assert_problem(&[429], "");
        assert!(
            took < Duration::from_secs(3),
            "429 at once, not after wait_ms: {took:?}"
        );
        reply.retry_after_secs()
    }

    pub async fn fetch_reply(&self, body: Option<&Value>) -> Reply {
        self.post("/fetch", body).await
    }

    /// POST /fetch expecting 200; returns the messages.
    pub async fn fetch(&self, body: Value) -> Vec<Msg> {
        let reply = self.fetch_reply(Some(&body)).await;
        assert_eq!(reply.status, 200, "POST /fetch {body}: {}", reply.text);
        parse_messages(&reply)
    }

    /// POST /fetch `{"batch": batch, "wait_ms": wait_ms}` expecting 200.
    pub async fn fetch_n(&self, batch: u64, wait_ms: u64) -> Vec<Msg> {
        self.fetch(json!({ "batch": batch, "wait_ms": wait_ms }))
            .await
    }

    /// POST /messages/{id}/{action} (`ack`, `nak`, `term`, `in-progress`).
    pub async fn settle(&self, id: &str, action: &str, body: Option<&Value>) -> Reply {
        self.post(&format!("/messages/{id}/{action}"), body).await
    }

    pub async fn ack(&self, id: &str) -> u16 {
        self.settle(id, "ack", None).await.status
    }

    pub async fn nak(&self, id: &str, delay_ms: Option<u64>) -> u16 {
        let body = delay_ms.map(|delay_ms| json!({ "delay_ms": delay_ms }));
        self.settle(id, "nak", body.as_ref()).await.status
    }

    pub async fn term(&self, id: &str, reason: Option<&str>) -> u16 {
        let body = reason.map(|reason| json!({ "reason": reason }));
        self.settle(id, "term", body.as_ref()).await.status
    }

    pub async fn in_progress(&self, id: &str) -> Reply {
        self.settle(id, "in-progress", None).await
    }

    /// POST /messages/{action} (batch settle) with this body.
    pub async fn settle_many(&self, action: &str, body: &Value) -> Reply {
        self.post(&format!("/messages/{action}"), Some(body)).await
    }

    /// Batch settle expecting 200; returns `(id, status)` per result, in answer order.
    pub async fn settle_many_ok(&self, action: &str, body: &Value) -> Vec<(String, u16)> {
        let reply = self.settle_many(action, body).await;
        assert_eq!(reply.status, 200, "POST /messages/{action}: {}", reply.text);
        let results = reply.body["results"]
            .as_array()
            .unwrap_or_else(|| panic!("no results array: {}", reply.text));
        results
            .iter()
            .map(|result| {
                assert!(
                    result.get("detail").is_some(),
                    "every result carries detail: {result}"
                );
                let id = result["id"].as_str().expect("result id").to_string();
                let status = result["status"].as_u64().expect("result status");
                (id, u16::try_from(status).expect("status fits u16"))
            })
            .collect()
    }
}

/// The `messages` of a 200 fetch answer.
pub fn parse_messages(reply: &Reply) -> Vec<Msg> {
    let messages = reply
        .body
        .get("messages")
        .unwrap_or_else(|| panic!("fetch answer has no messages: {}", reply.text));
    serde_json::from_value(messages.clone())
        .unwrap_or_else(|err| panic!("messages do not match the contract ({err}): {}", reply.text))
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}
