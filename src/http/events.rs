//! `GET /events`: leases as Server-Sent Events. One response stays open; each lease is one
//! `message` event (`id:` the lease id, `data:` one element of a fetch answer's `messages`),
//! at most `max_in_flight` of them live at once; settles go through the usual routes, at any
//! replica. A `: keep-alive` comment while nothing is sent, `event: shutdown` at the end.
//!
//! May import: as the rest of `http`.

use std::convert::Infallible;
use std::sync::Arc;

use axum::Extension;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderValue, Uri, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::Stream;

use utoipa::IntoParams;

use super::auth::Revocation;
use super::client::{Client, Connection};
use super::consumers::ConsumerPath;
use super::dto::{Encoding, MessageDto};
use super::responses::{FetchRefusals, Guarded, NamedFetchRefusals, QueryRefusals};
use crate::domain::delivery::Leased;
use crate::error::Error;
use crate::gateway::{Consumer, Gateway, LeaseStream, Step, Target};

/// Leases live at once on one stream, unless the client asks otherwise.
const DEFAULT_MAX_IN_FLIGHT: usize = 100;
/// The most a client may ask for.
const MAX_IN_FLIGHT: usize = 1000;
/// Why every stream ends when the gateway stops.
pub(super) const SHUTTING_DOWN: &str = "the gateway is stopping";
/// Events written together at most: the leases already leased for the stream go out in one
/// body chunk (an event per chunk cost a write and a client wake-up per message).
const EVENTS_PER_WRITE: usize = 64;

/// A stream's query parameters as the spec describes them; [`StreamQuery::parse`] reads them.
#[derive(IntoParams)]
#[into_params(parameter_in = Query)]
#[expect(
    dead_code,
    reason = "describes the query for the spec; the query is parsed by hand"
)]
pub(super) struct StreamParams {
    /// Most leases of this stream live at once (default 100).
    #[param(minimum = 1, maximum = 1000)]
    max_in_flight: Option<u32>,
    /// How `data` is encoded, as in a fetch (default base64).
    encoding: Option<Encoding>,
    /// A ticket from `POST /stream-tickets`, for a browser that cannot send
    /// `Authorization`: single use, within 30 s of its making.
    ticket: Option<String>,
}

/// What a stream asks for, from its query string.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct StreamQuery {
    pub(super) max_in_flight: usize,
    pub(super) encoding: Encoding,
    /// How leases are framed (`GET /ws` only; a stream of events has one per event).
    pub(super) frames: Frames,
}

/// How a WebSocket frames its leases.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub(super) enum Frames {
    /// `{"type": "message", …}`: one lease a frame.
    #[default]
    Single,
    /// `{"type": "messages", "messages": […]}`: the leases ready together share a frame, so
    /// a client parses one frame per batch, not one per message.
    Batch,
}

/// Which route a stream's query is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum StreamRoute {
    Events,
    WebSocket,
}

impl StreamQuery {
    /// `max_in_flight` (1 to 1000), `encoding` (`base64`, `utf8`) and, on a WebSocket,
    /// `frames` (`single`, `batch`); anything else is a 422 naming it, so a typo is not
    /// silently ignored.
    pub(super) fn parse(query: Option<&str>, route: StreamRoute) -> Result<Self, Error> {
        let mut parsed = Self {
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            encoding: Encoding::default(),
            frames: Frames::default(),
        };
        for pair in query
            .unwrap_or_default()
            .split('&')
            .filter(|p| !p.is_empty())
        {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            let value = percent_encoding::percent_decode_str(value).decode_utf8_lossy();
            match name {
                "max_in_flight" => {
                    parsed.max_in_flight = value
                        .parse::<usize>()
                        .ok()
                        .filter(|n| (1..=MAX_IN_FLIGHT).contains(n))
                        .ok_or_else(|| {
                            Error::invalid(
                                "max_in_flight",
                                format!(
                                    "max_in_flight: must be a whole number from 1 to {MAX_IN_FLIGHT}, got {value:?}"
                                ),
                            )
                        })?;
                }
                "encoding" => {
                    parsed.encoding = match value.as_ref() {
                        "base64" => Encoding::Base64,
                        "utf8" => Encoding::Utf8,
                        other => {
                            return Err(Error::invalid(
                                "encoding",
                                format!("encoding: must be base64 or utf8, got {other:?}"),
                            ));
                        }
                    };
                }
                "frames" if route == StreamRoute::WebSocket => {
                    parsed.frames = match value.as_ref() {
                        "single" => Frames::Single,
                        "batch" => Frames::Batch,
                        other => {
                            return Err(Error::invalid(
                                "frames",
                                format!("frames: must be single or batch, got {other:?}"),
                            ));
                        }
                    };
                }
                // Taken by authentication before the handler (see `POST /stream-tickets`).
                "ticket" => {}
                other => {
                    let shown: String = other.chars().take(64).collect();
                    let known = match route {
                        StreamRoute::Events => "max_in_flight, encoding, ticket",
                        StreamRoute::WebSocket => "max_in_flight, encoding, frames, ticket",
                    };
                    return Err(Error::invalid(
                        shown.as_str(),
                        format!("unknown query parameter {shown:?} (known: {known})"),
                    ));
                }
            }
        }
        Ok(parsed)
    }
}

/// Stream leases as Server-Sent Events.
///
/// Each lease is one event: `event: message`, `id:` the lease id, `data:` one JSON object,
/// exactly one element of a fetch answer's `messages`. At most `max_in_flight` leases of
/// this stream are live at once (written, not yet settled over any route at any replica,
/// expired or superseded); nothing more is sent until one ends. A `: keep-alive` comment
/// comes at least every 15 s while nothing else does; `event: shutdown` (data `{"reason"}`)
/// ends the stream at once when the gateway stops, the consumer is no longer served as it
/// was, or the token no longer allows the stream. A client that goes away keeps the leases already written until
/// their `lease_expires_at`; `Last-Event-ID` replays nothing.
#[utoipa::path(
    get,
    path = "/events",
    operation_id = "streamMessages",
    tag = "leases",
    params(
        StreamParams,
    ),
    responses(
        (status = 200, description = "An endless `text/event-stream`: `message` events (data: one leased message, as in a fetch answer), `: keep-alive` comments, and a final `shutdown` event (data: `{\"reason\": …}`)",
            content_type = "text/event-stream", body = String),
        Guarded, QueryRefusals, FetchRefusals,
    )
)]
pub(crate) async fn events(
    State(gateway): State<Arc<Gateway>>,
    connection: Option<Extension<Connection>>,
    revocation: Option<Extension<Revocation>>,
    uri: Uri,
) -> Result<Response, Error> {
    let query = StreamQuery::parse(uri.query(), StreamRoute::Events)?;
    let consumer = gateway.consumer(Target::Default).await?;
    open(consumer, connection, revocation, query)
}

/// The leases of the consumer the path names, as `GET /events` streams the default one's.
#[utoipa::path(
    get,
    path = "/streams/{stream}/consumers/{consumer}/events",
    operation_id = "streamNamedMessages",
    tag = "leases",
    params(
        ConsumerPath,
        StreamParams,
    ),
    responses(
        (status = 200, description = "The events of GET /events, for this consumer",
            content_type = "text/event-stream", body = String),
        Guarded, QueryRefusals, NamedFetchRefusals,
    )
)]
pub(crate) async fn events_named(
    State(gateway): State<Arc<Gateway>>,
    path: ConsumerPath,
    connection: Option<Extension<Connection>>,
    revocation: Option<Extension<Revocation>>,
    uri: Uri,
) -> Result<Response, Error> {
    let query = StreamQuery::parse(uri.query(), StreamRoute::Events)?;
    let consumer = gateway.consumer(Target::Named(&path.name())).await?;
    open(consumer, connection, revocation, query)
}

/// Stream `consumer`'s leases as Server-Sent Events.
fn open(
    consumer: Consumer,
    connection: Option<Extension<Connection>>,
    revocation: Option<Extension<Revocation>>,
    query: StreamQuery,
) -> Result<Response, Error> {
    // Refuse at once what would only make an endless stream of keep-alives.
    consumer.readiness()?;
    consumer.refuse_if_paused()?;
    let client = connection.map(|Extension(connection)| connection.client);
    let ends_when = revocation.and_then(|Extension(revocation)| revocation.take());
    let stream = events_of(
        LeaseStream::new(consumer, query.max_in_flight, ends_when),
        client,
        query.encoding,
    );
    Ok((
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/event-stream"),
            ),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
        ],
        Body::from_stream(stream),
    )
        .into_response())
}

/// The body chunks of `leases`' events, until the gateway stops or the client goes.
fn events_of(
    leases: LeaseStream,
    client: Option<Client>,
    encoding: Encoding,
) -> impl Stream<Item = Result<Bytes, Infallible>> + Send {
    futures::stream::unfold(Some((leases, client)), move |state| async move {
        let (mut leases, client) = state?;
        let mut chunk = Vec::new();
        match leases.next(client.as_ref()).await {
            Step::Lease(leased) => {
                write_message(&mut chunk, *leased, encoding);
                for _ in 1..EVENTS_PER_WRITE {
                    let Some(ready) = leases.next_ready() else {
                        break;
                    };
                    write_message(&mut chunk, *ready, encoding);
                }
            }
            Step::Quiet => chunk.extend_from_slice(b": keep-alive\n\n"),
            Step::ShuttingDown => return Some((Ok(shutdown_event(SHUTTING_DOWN)), None)),
            Step::Ended(reason) => return Some((Ok(shutdown_event(&reason)), None)),
            Step::Gone => return None,
        }
        Some((Ok(Bytes::from(chunk)), Some((leases, client))))
    })
}

/// The last event of a stream: `shutdown`, its data `{"reason": …}`.
fn shutdown_event(reason: &str) -> Bytes {
    let data = serde_json::json!({ "reason": reason });
    Bytes::from(format!("event: shutdown\ndata: {data}\n\n"))
}

/// Append `leased`'s `message` event. Lease ids are URL-safe tokens and serde_json escapes
/// every line break, so neither field can break the event's lines.
fn write_message(chunk: &mut Vec<u8>, leased: Leased, encoding: Encoding) {
    let start = chunk.len();
    chunk.extend_from_slice(b"event: message\nid: ");
    chunk.extend_from_slice(leased.id.as_bytes());
    chunk.extend_from_slice(b"\ndata: ");
    if serde_json::to_writer(&mut *chunk, &MessageDto::new(leased, encoding)).is_err() {
        // Strings and maps only: cannot fail, and never ends the stream.
        chunk.truncate(start);
        chunk.extend_from_slice(b": unencodable message\n\n");
        return;
    }
    chunk.extend_from_slice(b"\n\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_query_takes_max_in_flight_and_encoding_and_names_anything_else() {
        assert_eq!(
            StreamQuery::parse(None, StreamRoute::Events).expect("defaults"),
            StreamQuery {
                max_in_flight: 100,
                encoding: Encoding::Base64,
                frames: Frames::Single,
            }
        );
        assert_eq!(
            StreamQuery::parse(
                Some("max_in_flight=1000&encoding=utf8"),
                StreamRoute::Events
            )
            .expect("valid"),
            StreamQuery {
                max_in_flight: 1000,
                encoding: Encoding::Utf8,
                frames: Frames::Single,
            }
        );
        for (query, route, field) in [
            ("max_in_flight=0", StreamRoute::Events, "max_in_flight"),
            (
                "max_in_flight=1001",
                StreamRoute::WebSocket,
                "max_in_flight",
            ),
            ("max_in_flight=ten", StreamRoute::Events, "max_in_flight"),
            ("encoding=hex", StreamRoute::Events, "encoding"),
            ("batch=5", StreamRoute::Events, "batch"),
            // Frames are a WebSocket's: an event stream has one lease per event.
            ("frames=batch", StreamRoute::Events, "frames"),
            ("frames=many", StreamRoute::WebSocket, "frames"),
        ] {
            match StreamQuery::parse(Some(query), route) {
                Err(Error::Invalid {
                    field: Some(named), ..
                }) => assert_eq!(named, field, "{query}"),
                other => panic!("{query}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_websocket_query_takes_its_framing() {
        for (query, frames) in [
            ("", Frames::Single),
            ("frames=single", Frames::Single),
            ("max_in_flight=5&frames=batch", Frames::Batch),
        ] {
            let parsed = StreamQuery::parse(Some(query), StreamRoute::WebSocket).expect(query);
            assert_eq!(parsed.frames, frames, "{query}");
        }
    }
}
