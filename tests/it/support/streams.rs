//! Open streams as a client reads them: Server-Sent Events event by event, and WebSocket
//! frames as JSON, with the close code the gateway ends with.

use std::time::Duration;

use futures::{SinkExt as _, StreamExt as _};
use serde_json::Value;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;

use super::Client;
use super::client::http_client;

/// One event of a `text/event-stream`: its `event:`, `id:` and `data:` fields, or a comment.
#[derive(Debug, Default, Clone)]
pub struct SseEvent {
    pub event: Option<String>,
    pub id: Option<String>,
    pub data: String,
    pub comment: Option<String>,
}

/// An open stream, read event by event.
pub struct EventStream {
    response: reqwest::Response,
    buffer: String,
}

impl EventStream {
    pub async fn open(gateway: &Client, query: &str) -> Self {
        Self::open_at(gateway, &format!("/events{query}")).await
    }

    /// The stream at `path` (with its query).
    pub async fn open_at(gateway: &Client, path: &str) -> Self {
        Self::open_with(gateway, path, None).await
    }

    /// The stream at `path`, presenting `token` as a bearer token if given.
    pub async fn open_with(gateway: &Client, path: &str, token: Option<&str>) -> Self {
        let mut request = http_client().get(gateway.url(path));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        let response = request.send().await.expect("GET the stream");
        assert_eq!(response.status(), 200);
        assert_eq!(
            response
                .headers()
                .get("content-type")
                .and_then(|v| v.to_str().ok()),
            Some("text/event-stream")
        );
        Self {
            response,
            buffer: String::new(),
        }
    }

    /// The next event (or comment) within `within`; `None` when none came or the stream
    /// ended.
    pub async fn next(&mut self, within: Duration) -> Option<SseEvent> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Some(end) = self.buffer.find("\n\n") {
                let block: String = self.buffer.drain(..end + 2).collect();
                let mut event = SseEvent::default();
                for line in block.lines() {
                    if let Some(comment) = line.strip_prefix(':') {
                        event.comment = Some(comment.trim().to_owned());
                    } else if let Some((field, value)) = line.split_once(':') {
                        let value = value.strip_prefix(' ').unwrap_or(value).to_owned();
                        match field {
                            "event" => event.event = Some(value),
                            "id" => event.id = Some(value),
                            "data" => event.data.push_str(&value),
                            _ => {}
                        }
                    }
                }
                return Some(event);
            }
            let chunk = tokio::time::timeout_at(deadline, self.response.chunk())
                .await
                .ok()?
                .expect("read the stream")?;
            self.buffer
                .push_str(std::str::from_utf8(&chunk).expect("UTF-8"));
        }
    }

    /// The next `message` event within `within`, skipping comments.
    pub async fn message(&mut self, within: Duration) -> Option<Value> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let event = self.next(left).await?;
            if event.event.as_deref() == Some("message") {
                let message: Value = serde_json::from_str(&event.data).expect("data is JSON");
                assert_eq!(
                    event.id.as_deref(),
                    message["id"].as_str(),
                    "id: is the lease id"
                );
                return Some(message);
            }
        }
    }
}

pub type Socket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

pub async fn open_socket(gateway: &Client, query: &str) -> Socket {
    open_socket_at(gateway, &format!("/ws{query}"), None).await
}

/// A WebSocket at `path` (with its query), presenting `token` as a bearer token if given.
pub async fn open_socket_at(gateway: &Client, path: &str, token: Option<&str>) -> Socket {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
    let url = format!("{}{path}", gateway.base().replacen("http://", "ws://", 1));
    let mut request = url.into_client_request().expect("a WebSocket request");
    if let Some(token) = token {
        request.headers_mut().insert(
            "authorization",
            format!("Bearer {token}").parse().expect("a header value"),
        );
    }
    let (socket, response) = tokio_tungstenite::connect_async(request)
        .await
        .expect("WebSocket handshake");
    assert_eq!(response.status(), 101);
    socket
}

/// The next text frame as JSON within `within` (pings and pongs skipped); `None` if none.
pub async fn frame(socket: &mut Socket, within: Duration) -> Option<Value> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let next = tokio::time::timeout_at(deadline, socket.next())
            .await
            .ok()??;
        match next.expect("a frame") {
            Message::Text(text) => return Some(serde_json::from_str(&text).expect("JSON")),
            Message::Close(close) => panic!("closed: {close:?}"),
            _ => {}
        }
    }
}

/// The next frame of `kind` within `within`, skipping others.
pub async fn frame_of(socket: &mut Socket, kind: &str, within: Duration) -> Option<Value> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let frame = frame(socket, left).await?;
        if frame["type"] == kind {
            return Some(frame);
        }
    }
}

pub async fn send(socket: &mut Socket, value: Value) {
    socket
        .send(Message::Text(value.to_string().into()))
        .await
        .expect("send");
}

/// The close code the gateway ends with, within `within`.
pub async fn closed_with(socket: &mut Socket, within: Duration) -> Option<CloseCode> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, socket.next())
            .await
            .ok()??
        {
            Ok(Message::Close(close)) => return close.map(|close| close.code),
            Ok(_) => {}
            Err(_) => return None,
        }
    }
}
