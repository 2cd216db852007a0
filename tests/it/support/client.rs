//! The typed HTTP client every test talks to the gateway through, whatever started it (in
//! process, the binary as a child process, the ledger's runs): one method per endpoint over a
//! base URL, typed request and answer bodies, one [`Reply`] for any answer.

use std::time::Duration;

use reqwest::header::{AUTHORIZATION, CONTENT_TYPE, HeaderMap};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

/// The one reqwest builder of the suite: no proxies from the environment, a bound on every
/// request. Tests that need more (a bearer token, no redirects, a shorter timeout) add it.
pub fn http_builder() -> reqwest::ClientBuilder {
    install_crypto_provider();
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(60))
}

/// reqwest's TLS is built without a crypto provider of its own (the suite uses ring, as the
/// gateway does): install it once for the process before any client is built.
pub fn install_crypto_provider() {
    // Err only when one is installed already, which is as good.
    let _ = tokio_rustls::rustls::crypto::ring::default_provider().install_default();
}

/// [`http_builder`], built.
pub fn http_client() -> reqwest::Client {
    http_builder().build().expect("build reqwest client")
}

/// As [`http_client`], sending `Authorization: Bearer <token>` on every request.
pub fn http_client_with_token(token: &str) -> reqwest::Client {
    let mut headers = HeaderMap::new();
    headers.insert(
        AUTHORIZATION,
        format!("Bearer {token}").parse().expect("header value"),
    );
    http_builder()
        .default_headers(headers)
        .build()
        .expect("build reqwest client")
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
    /// Read a whole answer.
    pub async fn read(response: reqwest::Response) -> Self {
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let text = response.text().await.expect("read response body");
        let body = serde_json::from_str(&text).unwrap_or(Value::Null);
        Self {
            status,
            headers,
            text,
            body,
        }
    }

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

    /// Assert an RFC 9457 problem answer with exactly this status; returns the problem.
    #[track_caller]
    pub fn assert_problem(&self, status: u16) -> &Map<String, Value> {
        assert_eq!(
            self.status, status,
            "expected a {status} problem, got {} with body {}",
            self.status, self.text
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
        problem
    }

    /// Assert a 422 problem whose `field` is `field`.
    #[track_caller]
    pub fn assert_invalid(&self, field: &str) {
        let problem = self.assert_problem(422);
        assert_eq!(
            problem.get("field").and_then(Value::as_str),
            Some(field),
            "the 422 must name the field `{field}` in `.field`: {}",
            self.text
        );
    }

    /// Assert the 422 of a required field left out: `field` names it, as docs/api.md says.
    #[track_caller]
    pub fn assert_missing(&self, field: &str) {
        let problem = self.assert_problem(422);
        assert_eq!(
            problem.get("field").and_then(Value::as_str),
            Some(field),
            "`.field` names the missing field: {}",
            self.text
        );
        assert_eq!(
            self.detail(),
            format!("{field}: missing field `{field}`"),
            "a 422 for the missing field `{field}`: {}",
            self.text
        );
    }

    /// The problem's `detail` (empty when there is none).
    pub fn detail(&self) -> &str {
        self.body
            .get("detail")
            .and_then(Value::as_str)
            .unwrap_or("")
    }

    /// The `messages` of a 200 fetch answer.
    #[track_caller]
    pub fn messages(&self) -> Vec<Msg> {
        let messages = self
            .body
            .get("messages")
            .unwrap_or_else(|| panic!("fetch answer has no messages: {}", self.text));
        serde_json::from_value(messages.clone()).unwrap_or_else(|err| {
            panic!("messages do not match the contract ({err}): {}", self.text)
        })
    }
}

/// A leased message as `POST /fetch` returns it.
#[derive(Debug, Clone, Deserialize)]
pub struct Msg {
    pub id: String,
    pub subject: String,
    /// The subject's exact bytes, only when it is not UTF-8.
    #[serde(default)]
    pub subject_base64: Option<String>,
    pub data: String,
    pub encoding: String,
    pub headers: Map<String, Value>,
    /// The exact header block, only when it could not be parsed.
    #[serde(default)]
    pub headers_base64: Option<String>,
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

/// A `POST /fetch` body; unset fields are left out (the gateway's defaults apply).
#[derive(Debug, Clone, Default, Serialize)]
pub struct FetchRequest {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wait_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub encoding: Option<&'static str>,
}

impl FetchRequest {
    /// `{"batch": batch, "wait_ms": wait_ms}`.
    pub fn new(batch: u64, wait_ms: u64) -> Self {
        Self {
            batch: Some(batch),
            wait_ms: Some(wait_ms),
            ..Self::default()
        }
    }

    pub fn utf8(mut self) -> Self {
        self.encoding = Some("utf8");
        self
    }
}

/// What a client does with a lease: `POST /messages/{id}/{action}` (and the batch form
/// `POST /messages/{action}` for the first three).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Ack,
    Nak,
    Term,
    InProgress,
}

impl Action {
    /// Every action, settling and extending.
    pub const ALL: [Action; 4] = [Action::Ack, Action::Nak, Action::Term, Action::InProgress];
    /// The actions that end a lease (and have a batch form).
    pub const SETTLING: [Action; 3] = [Action::Ack, Action::Nak, Action::Term];

    /// The path segment.
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Ack => "ack",
            Action::Nak => "nak",
            Action::Term => "term",
            Action::InProgress => "in-progress",
        }
    }
}

impl std::fmt::Display for Action {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One entry of a batch settle's `results`.
#[derive(Debug, Clone, Deserialize)]
pub struct BatchResult {
    pub id: String,
    pub status: u16,
    /// Why a result is not a 2xx; `null` for a 2xx.
    #[allow(dead_code)] // asserted present by `batch_results`; read in failure messages
    pub detail: Option<String>,
}

/// The gateway's HTTP API at one base URL.
#[derive(Clone)]
pub struct Client {
    base: String,
    pub http: reqwest::Client,
}

impl Client {
    /// A client of the gateway at `base` (`http://host:port`), with [`http_client`].
    pub fn new(base: impl Into<String>) -> Self {
        Self::with_http(base, http_client())
    }

    /// A client of the gateway at `base` sending its requests through `http`.
    pub fn with_http(base: impl Into<String>, http: reqwest::Client) -> Self {
        Self {
            base: base.into(),
            http,
        }
    }

    pub fn base(&self) -> String {
        self.base.clone()
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    // ---- raw requests ---------------------------------------------------------------------

    pub async fn get(&self, path: &str) -> Reply {
        let response = self
            .http
            .get(self.url(path))
            .send()
            .await
            .unwrap_or_else(|err| panic!("GET {path}: {err}"));
        Reply::read(response).await
    }

    pub async fn delete(&self, path: &str) -> Reply {
        let response = self
            .http
            .delete(self.url(path))
            .send()
            .await
            .unwrap_or_else(|err| panic!("DELETE {path}: {err}"));
        Reply::read(response).await
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
        Reply::read(response).await
    }

    /// POST a JSON body (`None`: none) and return the answer, or the transport error (a
    /// connection closed or refused, a timeout) — for callers that expect those.
    pub async fn try_post(
        &self,
        path: &str,
        body: Option<&Value>,
        timeout: Option<Duration>,
    ) -> Result<Reply, reqwest::Error> {
        let mut request = self.http.post(self.url(path));
        if let Some(body) = body {
            request = request.json(body);
        }
        if let Some(timeout) = timeout {
            request = request.timeout(timeout);
        }
        let response = request.send().await?;
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let text = response.text().await?;
        let body = serde_json::from_str(&text).unwrap_or(Value::Null);
        Ok(Reply {
            status,
            headers,
            text,
            body,
        })
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
        Reply::read(response).await
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

    /// A long-poll fetch that must be refused with 429 at once (not after its wait);
    /// returns the Retry-After seconds.
    pub async fn fetch_refused_at_capacity(&self) -> u64 {
        let started = std::time::Instant::now();
        let reply = self
            .fetch_reply(Some(&json!({ "batch": 1, "wait_ms": 10_000 })))
            .await;
        let took = started.elapsed();
        reply.assert_problem(429);
        assert!(
            took < Duration::from_secs(3),
            "429 at once, not after wait_ms: {took:?}"
        );
        reply.retry_after_secs()
    }

    /// POST /fetch with this body (`None`: no body), any status.
    pub async fn fetch_reply(&self, body: Option<&Value>) -> Reply {
        self.post("/fetch", body).await
    }

    /// POST /fetch expecting 200; returns the messages.
    pub async fn fetch(&self, body: Value) -> Vec<Msg> {
        let reply = self.fetch_reply(Some(&body)).await;
        assert_eq!(reply.status, 200, "POST /fetch {body}: {}", reply.text);
        reply.messages()
    }

    /// POST /fetch with a typed body expecting 200; returns the messages.
    pub async fn fetch_with(&self, request: &FetchRequest) -> Vec<Msg> {
        self.fetch(serde_json::to_value(request).expect("a fetch body serializes"))
            .await
    }

    /// POST /fetch `{"batch": batch, "wait_ms": wait_ms}` expecting 200.
    pub async fn fetch_n(&self, batch: u64, wait_ms: u64) -> Vec<Msg> {
        self.fetch_with(&FetchRequest::new(batch, wait_ms)).await
    }

    /// POST /fetch with this body and an `Idempotency-Key`, any status.
    pub async fn fetch_keyed(&self, key: &str, body: &Value) -> Reply {
        let request = self
            .http
            .post(self.url("/fetch"))
            .header("Idempotency-Key", key)
            .json(body);
        Reply::read(request.send().await.expect("POST /fetch")).await
    }

    /// POST /fetch with a typed body, any status or a transport error (see `try_post`).
    pub async fn try_fetch(
        &self,
        request: &FetchRequest,
        timeout: Option<Duration>,
    ) -> Result<Reply, reqwest::Error> {
        let body = serde_json::to_value(request).expect("a fetch body serializes");
        self.try_post("/fetch", Some(&body), timeout).await
    }

    /// POST /messages/{id}/{action}, any status or a transport error (see `try_post`).
    pub async fn try_settle(
        &self,
        id: &str,
        action: Action,
        body: Option<&Value>,
        timeout: Option<Duration>,
    ) -> Result<Reply, reqwest::Error> {
        self.try_post(&format!("/messages/{id}/{action}"), body, timeout)
            .await
    }

    /// POST /messages/{id}/{action} with this body, any status.
    pub async fn settle(&self, id: &str, action: Action, body: Option<&Value>) -> Reply {
        self.post(&format!("/messages/{id}/{action}"), body).await
    }

    pub async fn ack(&self, id: &str) -> u16 {
        self.settle(id, Action::Ack, None).await.status
    }

    pub async fn nak(&self, id: &str, delay_ms: Option<u64>) -> u16 {
        let body = delay_ms.map(|delay_ms| json!({ "delay_ms": delay_ms }));
        self.settle(id, Action::Nak, body.as_ref()).await.status
    }

    pub async fn term(&self, id: &str, reason: Option<&str>) -> u16 {
        let body = reason.map(|reason| json!({ "reason": reason }));
        self.settle(id, Action::Term, body.as_ref()).await.status
    }

    pub async fn in_progress(&self, id: &str) -> Reply {
        self.settle(id, Action::InProgress, None).await
    }

    /// POST /messages/{action} (batch settle) with this body.
    pub async fn settle_many(&self, action: Action, body: &Value) -> Reply {
        self.post(&format!("/messages/{action}"), Some(body)).await
    }

    /// Batch settle of `ids` expecting 200 and every id answered 204; `what` names the step
    /// in a failure.
    pub async fn settle_many_all_204(&self, action: Action, ids: &Value, what: &str) {
        let results = self
            .settle_many_ok(action, &serde_json::json!({ "ids": ids }))
            .await;
        assert!(
            results.iter().all(|(_, status)| *status == 204),
            "{what}: POST /messages/{action}: {results:?}"
        );
    }

    /// Batch settle expecting 200; returns `(id, status)` per result, in answer order.
    pub async fn settle_many_ok(&self, action: Action, body: &Value) -> Vec<(String, u16)> {
        let reply = self.settle_many(action, body).await;
        assert_eq!(reply.status, 200, "POST /messages/{action}: {}", reply.text);
        batch_results(&reply)
            .into_iter()
            .map(|result| (result.id, result.status))
            .collect()
    }
}

/// The `results` of a 200 batch-settle answer (each with its detail).
#[track_caller]
pub fn batch_results(reply: &Reply) -> Vec<BatchResult> {
    let results = reply
        .body
        .get("results")
        .and_then(Value::as_array)
        .unwrap_or_else(|| panic!("no results array: {}", reply.text));
    for result in results {
        assert!(
            result.get("detail").is_some(),
            "every result carries detail: {result}"
        );
    }
    serde_json::from_value(Value::Array(results.clone()))
        .unwrap_or_else(|err| panic!("results do not match the contract ({err}): {}", reply.text))
}
