//! `GET /ws`: leases over a WebSocket, settled in band. The gateway sends one text frame per
//! lease (`{"type": "message", …}`; with `frames=batch` one per batch of the leases ready
//! together, `{"type": "messages", …}`) within the stream's credit, as `GET /events` does; the
//! client sends settle operations (`{"op": "ack", "ids": […]}`) and gets one `settled`
//! frame per operation once the server confirmed it, each id's status what the HTTP settle
//! would answer. The session's task reads and writes the socket; the leases are pulled by a
//! task of their own, so a frame from the client never interrupts a pull waiting at the
//! server.
//!
//! May import: as the rest of `http`.

use std::sync::Arc;
use std::time::Duration;

use axum::Extension;
use axum::extract::State;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade, close_code};
use axum::http::Uri;
use axum::response::{IntoResponse, Response};
use futures::{SinkExt as _, StreamExt as _};
use serde_json::json;
use tokio::sync::{Semaphore, mpsc};
use tokio::time::Instant;

use super::auth::{Principal, Revocation};
use super::consumers::ConsumerPath;
use super::dto::MessageDto;
use super::events::{Frames, SHUTTING_DOWN, StreamParams, StreamQuery, StreamRoute};
use super::messages::Settler;
use super::responses::{FetchRefusals, Guarded, NamedFetchRefusals, QueryRefusals};
use tracing::Instrument as _;

use crate::domain::delivery::Leased;
use crate::error::Error;
use crate::gateway::{
    AnswersOwed, Consumer, EndsWhen, Gateway, LeaseStream, STREAM_SLICE, Step, Target,
};
use operations::{Outgoing, start_queued, take_operation, text};

mod operations;

/// The gateway pings this often.
const PING_EVERY: Duration = Duration::from_secs(15);
/// A client heard from (any frame, a pong included) less recently than this is gone.
const SILENT_AT_MOST: Duration = Duration::from_secs(45);
/// Frames waiting to be written: leases are bounded by the credit anyway, answers by the
/// client's own operations.
const OUTGOING: usize = 256;

/// A WebSocket's framing of its leases, for the spec; [`StreamQuery::parse`] reads it.
#[derive(utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[expect(
    dead_code,
    reason = "describes the query for the spec; the query is parsed by hand"
)]
struct FramesParam {
    /// `single` (default): one lease a frame, `{"type": "message", …}`. `batch`: the leases
    /// ready together (up to 100) share one frame, `{"type": "messages", "messages": […]}`,
    /// each element what a `message` frame holds without its `type`.
    #[param(inline)]
    frames: Option<Frames>,
}

/// Stream leases over a WebSocket and settle them in band.
///
/// After the upgrade (RFC 6455; text frames, one JSON object each) the gateway sends
/// `{"type": "message", …every field of a fetched message…}` for each lease, at most
/// `max_in_flight` live at once (with `frames=batch`, the leases ready together in one
/// `{"type": "messages", "messages": […]}` frame); `{"type": "settled", "op", "ref"?, "results": [{"id",
/// "status", "detail"?, "lease_expires_at"?}]}` for each operation the client sends
/// (`{"op": "ack"|"nak"|"term"|"in_progress", "ids": [1..=1000], "delay_ms"?, "reason"?,
/// "ref"?}`), once the server confirmed, each status what the HTTP settle would answer;
/// `{"type": "error", "status", "title", "detail", "field"?}` for a frame it cannot take;
/// `{"type": "shutdown", "reason"}` before closing with 1001. Invalid UTF-8 closes with
/// 1007, a protocol violation with 1002, a binary frame with 1003, a
/// frame over `--max-body-bytes` with 1009; a ping every 15 s, and a client silent for 45 s
/// is closed.
#[utoipa::path(
    get,
    path = "/ws",
    operation_id = "streamMessagesWebSocket",
    tag = "leases",
    params(
        StreamParams,
        FramesParam,
    ),
    responses(
        (status = 101, description = "Switching to the WebSocket protocol; the frames are described in the operation's text and in openapi/asyncapi.yaml"),
        Guarded, QueryRefusals, FetchRefusals,
    )
)]
pub(crate) async fn ws(
    State(gateway): State<Arc<Gateway>>,
    principal: Option<Extension<Principal>>,
    revocation: Option<Extension<Revocation>>,
    uri: Uri,
    upgrade: Result<WebSocketUpgrade, UpgradeRejection>,
) -> Result<Response, Error> {
    let query = StreamQuery::parse(uri.query(), StreamRoute::WebSocket)?;
    let upgrade = upgrade.map_err(not_an_upgrade)?;
    let consumer = gateway.consumer(Target::Default).await?;
    open(gateway, consumer, (principal, revocation), query, upgrade)
}

/// The leases of the consumer the path names, with in-band settles, as `GET /ws` for the
/// default consumer.
#[utoipa::path(
    get,
    path = "/streams/{stream}/consumers/{consumer}/ws",
    operation_id = "streamNamedMessagesWebSocket",
    tag = "leases",
    params(
        ConsumerPath,
        StreamParams,
        FramesParam,
    ),
    responses(
        (status = 101, description = "Switching to the WebSocket protocol; the frames are those of GET /ws"),
        Guarded, QueryRefusals, NamedFetchRefusals,
    )
)]
pub(crate) async fn ws_named(
    State(gateway): State<Arc<Gateway>>,
    path: ConsumerPath,
    principal: Option<Extension<Principal>>,
    revocation: Option<Extension<Revocation>>,
    uri: Uri,
    upgrade: Result<WebSocketUpgrade, UpgradeRejection>,
) -> Result<Response, Error> {
    let query = StreamQuery::parse(uri.query(), StreamRoute::WebSocket)?;
    let upgrade = upgrade.map_err(not_an_upgrade)?;
    let consumer = gateway.consumer(Target::Named(&path.name())).await?;
    open(gateway, consumer, (principal, revocation), query, upgrade)
}

type UpgradeRejection = axum::extract::ws::rejection::WebSocketUpgradeRejection;

fn not_an_upgrade(rejection: UpgradeRejection) -> Error {
    Error::BadRequest {
        detail: format!("this route takes a WebSocket upgrade (RFC 6455): {rejection}"),
    }
}

/// Upgrade to a session streaming `consumer`'s leases.
fn open(
    gateway: Arc<Gateway>,
    consumer: Consumer,
    (principal, revocation): (Option<Extension<Principal>>, Option<Extension<Revocation>>),
    query: StreamQuery,
    upgrade: WebSocketUpgrade,
) -> Result<Response, Error> {
    consumer.readiness()?;
    consumer.refuse_if_paused()?;
    let settler = Arc::new(Settler::of(principal.map(|Extension(principal)| principal)));
    let ends_when = revocation.and_then(|Extension(revocation)| revocation.take());
    let max_frame = gateway.config().max_body_bytes as usize;
    // Frames up to twice the limit are read, so that one just over it is closed with 1009
    // (larger ones end the connection in the WebSocket library itself).
    let read_limit = max_frame.saturating_mul(2);
    // The connection lives on in a task of its own: its batches and settles stay in the trace
    // of the request that opened it.
    let origin = tracing::Span::current();
    Ok(upgrade
        .max_message_size(read_limit)
        .max_frame_size(read_limit)
        .on_upgrade(move |socket| {
            let sessions = gateway.websockets().clone();
            let session = session(
                gateway,
                socket,
                Session {
                    consumer,
                    query,
                    settler,
                    max_frame,
                    ends_when,
                },
            )
            .instrument(origin);
            sessions.track_future(session)
        })
        .into_response())
}

/// What one connection was opened with.
struct Session {
    /// The consumer whose leases flow out (settles go wherever their ids say).
    consumer: Consumer,
    query: StreamQuery,
    /// The token has the `settle` scope (or auth is off).
    settler: Arc<Settler>,
    max_frame: usize,
    /// Ends the stream when its token no longer allows it.
    ends_when: Option<EndsWhen>,
}

/// Most frames written out together before one flush.
const FRAMES_PER_WRITE: usize = 64;
/// How long the close frame to a silent client may take to go out.
const FAREWELL_AT_MOST: Duration = Duration::from_secs(1);

/// How one write to the client went.
enum Written {
    Flushed,
    /// A close frame went out: the session ends.
    Closed,
    /// The client is gone, or nothing is left to write.
    Failed,
}

/// Serve one WebSocket until either side ends it.
async fn session(gateway: Arc<Gateway>, socket: WebSocket, mut session: Session) {
    let (mut sink, mut source) = socket.split();
    let (outgoing, mut to_write) = mpsc::channel::<Outgoing>(OUTGOING);
    let encoding = session.query.encoding;
    let frames = session.query.frames;
    // Lease frames taken and not yet flushed to the client; with what the stream has leased
    // and not yet handed over (it leases no more than the room left here), at most a
    // slice: a client that stops reading strands no more than that.
    let unflushed = Arc::new(Semaphore::new(STREAM_SLICE));
    // The in-band operations under way: their answers (the settle that ended the grace's
    // too) go out before the goodbye.
    let operations = tokio_util::task::TaskTracker::new();
    let answers_owed = Arc::new(AnswersOwed::default());
    let (queue, queued) = mpsc::unbounded_channel();
    // In the session's span, as each operation's settle was when it ran in a task of its own.
    tokio::spawn(
        start_queued(
            gateway.clone(),
            session.settler.clone(),
            queued,
            outgoing.clone(),
            answers_owed.clone(),
        )
        .instrument(tracing::Span::current()),
    );
    let leases = tokio::spawn(send_leases(
        LeaseStream::new(
            session.consumer.clone(),
            session.query.max_in_flight,
            session.ends_when.take(),
        )
        .answering(answers_owed.clone()),
        (gateway.clone(), operations.clone()),
        outgoing.clone(),
        unflushed.clone(),
    ));
    let mut ping = tokio::time::interval_at(Instant::now() + PING_EVERY, PING_EVERY);
    let mut heard = Instant::now();
    // Why the session ended, for its last log line.
    let ended: &str = loop {
        tokio::select! {
            next = to_write.recv() => {
                // Every frame ready goes out in one write: a flush per frame cost a system
                // call (and a wake-up of the client) per message.
                let write = async {
                    let mut next = next;
                    let mut closing = false;
                    let mut fed = 0;
                    let mut leases_fed = 0;
                    // Leases framed together (`frames=batch`), written before whatever
                    // frame follows them: the order of leases and answers is kept.
                    let mut batch = Vec::new();
                    while let Some(outgoing) = next.take() {
                        let frame = match outgoing {
                            Outgoing::Lease(leased) => {
                                leases_fed += 1;
                                match frames {
                                    Frames::Single => Some(lease_frame(*leased, encoding)),
                                    Frames::Batch => {
                                        batch.push(MessageDto::new(*leased, encoding));
                                        None
                                    }
                                }
                            }
                            Outgoing::Frame(frame) => Some(frame),
                        };
                        if let Some(frame) = frame {
                            if !batch.is_empty() {
                                if sink.feed(batch_frame(&batch)).await.is_err() {
                                    return Written::Failed;
                                }
                                batch.clear();
                                fed += 1;
                            }
                            closing = matches!(frame, Message::Close(_));
                            if sink.feed(frame).await.is_err() {
                                return Written::Failed;
                            }
                            fed += 1;
                        }
                        if closing || fed >= FRAMES_PER_WRITE {
                            break;
                        }
                        next = to_write.try_recv().ok();
                    }
                    if !batch.is_empty() {
                        if sink.feed(batch_frame(&batch)).await.is_err() {
                            return Written::Failed;
                        }
                        fed += 1;
                    }
                    if fed == 0 {
                        // The channel closed: every sender is gone.
                        return Written::Failed;
                    }
                    if sink.flush().await.is_err() {
                        return Written::Failed;
                    }
                    unflushed.add_permits(leases_fed);
                    if closing { Written::Closed } else { Written::Flushed }
                };
                // A client that reads nothing blocks the write: it is closed at the silence
                // limit all the same (no close frame can reach it), and what it was never
                // sent goes back.
                match tokio::time::timeout_at(heard + SILENT_AT_MOST, write).await {
                    Ok(Written::Flushed) => {}
                    Ok(Written::Closed) => break "closed by the gateway",
                    Ok(Written::Failed) => break "a write failed",
                    Err(_) => break "a write outlasted the silence limit",
                }
            }
            incoming = source.next() => {
                heard = Instant::now();
                match incoming {
                    Some(Ok(Message::Text(text))) => {
                        if text.len() > session.max_frame {
                            let _ = sink.send(close(close_code::SIZE, "frame over --max-body-bytes")).await;
                            break "a frame over --max-body-bytes";
                        }
                        take_operation(
                            text.as_str(),
                            (&queue, &outgoing, &operations, &answers_owed),
                        );
                    }
                    Some(Ok(Message::Binary(_))) => {
                        let _ = sink.send(close(close_code::UNSUPPORTED, "text frames only")).await;
                        break "a binary frame";
                    }
                    Some(Ok(Message::Close(_))) => break "closed by the client",
                    None => break "the connection ended",
                    // RFC 6455: a violation ends the connection with the code that names it.
                    Some(Err(err)) => {
                        if let Some((code, reason)) = violation(err) {
                            let farewell = sink.send(close(code, reason));
                            let _ = tokio::time::timeout(FAREWELL_AT_MOST, farewell).await;
                        }
                        break "a protocol violation or a read error";
                    }
                    // Pings are answered by the WebSocket library; a pong only says it is there.
                    Some(Ok(_)) => {}
                }
            }
            _ = ping.tick() => {
                if heard.elapsed() > SILENT_AT_MOST {
                    let farewell = sink.send(close(close_code::AWAY, "no frame from the client for 45 s"));
                    let _ = tokio::time::timeout(FAREWELL_AT_MOST, farewell).await;
                    break "the client was silent for 45 s";
                }
                let ping = sink.send(Message::Ping(Vec::new().into()));
                match tokio::time::timeout_at(heard + SILENT_AT_MOST, ping).await {
                    Ok(Ok(())) => {}
                    Ok(Err(_)) | Err(_) => break "a ping could not be sent",
                }
            }
        }
    };
    // Gone: what the lease task holds unwritten, and the leases still waiting here to be
    // written, go back; written leases stay valid. The task is stopped before the queue is
    // emptied: an abort takes effect at its next await, and a task in the middle of a step on
    // another thread still sends the lease it just took (into a slot reserved before the
    // close), which a queue emptied earlier would strand until it expired.
    leases.abort();
    let _ = leases.await;
    to_write.close();
    let mut unwritten = Vec::new();
    while let Ok(waiting) = to_write.try_recv() {
        if let Outgoing::Lease(leased) = waiting {
            unwritten.push(*leased);
        }
    }
    tracing::debug!(
        ended,
        given_back = unwritten.len(),
        "WebSocket session ended"
    );
    if !unwritten.is_empty() {
        session.consumer.give_back_unwritten(unwritten).await;
    }
}

/// A lease's frame: `"type": "message"` and every field of a fetched message, serialized
/// straight to text (no JSON tree per message).
#[derive(serde::Serialize)]
struct LeaseFrame {
    #[serde(rename = "type")]
    kind: &'static str,
    #[serde(flatten)]
    message: MessageDto,
}

fn lease_frame(leased: Leased, encoding: super::dto::Encoding) -> Message {
    let frame = LeaseFrame {
        kind: "message",
        message: MessageDto::new(leased, encoding),
    };
    // Strings, numbers and maps only: cannot fail.
    Message::Text(serde_json::to_string(&frame).unwrap_or_default().into())
}

/// Leases ready together in one frame (`frames=batch`): `"type": "messages"` and each
/// lease as its `message` frame holds it, without the `type`.
fn batch_frame(messages: &[MessageDto]) -> Message {
    #[derive(serde::Serialize)]
    struct BatchFrame<'a> {
        #[serde(rename = "type")]
        kind: &'static str,
        messages: &'a [MessageDto],
    }
    let frame = BatchFrame {
        kind: "messages",
        messages,
    };
    // Strings, numbers and maps only: cannot fail.
    Message::Text(serde_json::to_string(&frame).unwrap_or_default().into())
}

/// Send leases as frames until the stream stops; at shutdown a `shutdown` frame, then once
/// the settle grace is over (all settled, in band or not, or the grace spent) a 1001 close.
async fn send_leases(
    mut leases: LeaseStream,
    (gateway, operations): (Arc<Gateway>, tokio_util::task::TaskTracker),
    outgoing: mpsc::Sender<Outgoing>,
    unflushed: Arc<Semaphore>,
) {
    loop {
        // Room among the unflushed leases, then a slot: a lease taken from the stream is
        // then written at once, never lost to an abort between the two.
        let Ok(room) = unflushed.acquire().await else {
            return;
        };
        let Ok(slot) = outgoing.reserve().await else {
            return;
        };
        // Its own permit and the others free: the stream leases no more than that.
        let room_left = unflushed.available_permits() + 1;
        match leases
            .next_within::<super::client::Client>(None, room_left)
            .await
        {
            Step::Lease(leased) => {
                // Given back by the writer once flushed.
                room.forget();
                slot.send(Outgoing::Lease(leased));
            }
            Step::Quiet => drop(slot),
            Step::ShuttingDown => {
                slot.send(Outgoing::Frame(shutdown_frame(SHUTTING_DOWN)));
                tokio::select! {
                    () = tokio::time::sleep(gateway.config().shutdown_grace) => {}
                    () = gateway.grace_over() => {}
                }
                operations.close();
                operations.wait().await;
                let _ = outgoing
                    .send(Outgoing::Frame(close(close_code::AWAY, SHUTTING_DOWN)))
                    .await;
                return;
            }
            // Nothing more may flow (or be settled in band): closed at once.
            Step::Ended(reason) => {
                slot.send(Outgoing::Frame(shutdown_frame(&reason)));
                let _ = outgoing
                    .send(Outgoing::Frame(close(close_code::AWAY, &reason)))
                    .await;
                return;
            }
            Step::Gone => return,
        }
    }
}

/// The close code and reason for what the client sent in violation of the protocol; `None`
/// for a connection simply gone.
fn violation(err: axum::Error) -> Option<(u16, &'static str)> {
    let err = err.into_inner().downcast::<tungstenite::Error>().ok()?;
    match *err {
        tungstenite::Error::Utf8(_) => {
            Some((close_code::INVALID, "a text frame that is not UTF-8"))
        }
        tungstenite::Error::Protocol(_) => {
            Some((close_code::PROTOCOL, "a WebSocket protocol violation"))
        }
        tungstenite::Error::Capacity(_) => Some((close_code::SIZE, "frame over --max-body-bytes")),
        _ => None,
    }
}

/// The `shutdown` frame: the last before the close, with why.
fn shutdown_frame(reason: &str) -> Message {
    text(&json!({ "type": "shutdown", "reason": reason }))
}

/// A close frame; its reason cut to the 123 bytes a close frame can carry.
fn close(code: u16, reason: &str) -> Message {
    let mut end = reason.len().min(MAX_CLOSE_REASON);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    Message::Close(Some(CloseFrame {
        code,
        reason: reason[..end].into(),
    }))
}

/// The most bytes a close frame's reason may hold (RFC 6455: 125 less the code's two).
const MAX_CLOSE_REASON: usize = 123;
