//! The operations a WebSocket client sends (`{"op", "ids", "ref"?, …}`): checked as the HTTP
//! batch settle checks its body, run, and answered with one `settled` frame each.
//!
//! May import: as the rest of `http`.

use std::sync::Arc;

use axum::extract::ws::Message;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tracing::Instrument as _;

use crate::domain::consumers::ConsumerName;
use crate::domain::delivery::Leased;
use crate::domain::settle::AckCommand;
use crate::error::Error;
use crate::gateway::{AnswersOwed, Gateway};
use crate::http::dto::rfc3339;
use crate::http::messages::{Settler, nak_command, term_command};
use crate::http::scopes::Scope;

/// What waits to be written to the client. A lease stays a lease until it is written, so
/// that those still waiting when the client goes are given back, not stranded.
pub(super) enum Outgoing {
    Lease(Box<Leased>),
    Frame(Message),
}

/// A JSON value as a text frame.
pub(super) fn text(value: &Value) -> Message {
    Message::Text(value.to_string().into())
}

/// Most ids one operation may name, as a batch settle.
const MAX_IDS: usize = 1000;

/// One operation a client sends.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Operation {
    op: String,
    ids: Vec<String>,
    #[serde(default)]
    delay_ms: Option<u64>,
    #[serde(default)]
    reason: Option<String>,
    /// Echoed in the `settled` frame, whatever it is.
    #[serde(default, rename = "ref")]
    reference: Option<Value>,
}

/// Parse a client's frame and start its operation; the answer is sent when it is done.
pub(super) fn take_operation(
    gateway: &Arc<Gateway>,
    frame: &str,
    settler: &Arc<Settler>,
    (outgoing, operations, answers_owed): (
        &mpsc::Sender<Outgoing>,
        &tokio_util::task::TaskTracker,
        &Arc<AnswersOwed>,
    ),
) {
    let operation = match parse_operation(frame) {
        Ok(operation) => operation,
        Err(err) => {
            let problem = err.problem();
            let mut answer = json!({
                "type": "error",
                "status": problem.status,
                "title": problem.title,
                "detail": problem.detail,
            });
            if let Some(field) = problem.field {
                answer["field"] = field.into();
            }
            let _ = outgoing.try_send(Outgoing::Frame(text(&answer)));
            return;
        }
    };
    let (gateway, outgoing, settler) = (gateway.clone(), outgoing.clone(), settler.clone());
    // Owed before anything settles: the leases this makes room for go out after its answer.
    answers_owed.owe(&operation.0.ids);
    let answers_owed = answers_owed.clone();
    operations.spawn(
        async move {
            let answer = run_operation(&gateway, &operation, &settler).await;
            let _ = outgoing.send(Outgoing::Frame(answer)).await;
            answers_owed.answered(&operation.0.ids);
        }
        .instrument(tracing::Span::current()),
    );
}

/// A frame as an operation, checked as the HTTP batch settle checks its body.
fn parse_operation(frame: &str) -> Result<(Operation, Option<AckCommand>), Error> {
    let operation: Operation = serde_json::from_str(frame).map_err(|err| {
        if err.is_data() {
            Error::Invalid {
                field: None,
                detail: format!("not an operation: {err}"),
            }
        } else {
            Error::Malformed {
                detail: format!("not a JSON object: {err}"),
            }
        }
    })?;
    if operation.ids.is_empty() || operation.ids.len() > MAX_IDS {
        return Err(Error::invalid(
            "ids",
            format!(
                "ids: must hold 1 to {MAX_IDS} lease ids, got {}",
                operation.ids.len()
            ),
        ));
    }
    let command = match operation.op.as_str() {
        "ack" => Some(AckCommand::Ack),
        "nak" => Some(nak_command(operation.delay_ms)?),
        "term" => Some(term_command(operation.reason.clone())?),
        "in_progress" => None,
        other => {
            return Err(Error::invalid(
                "op",
                format!("op: must be ack, nak, term or in_progress, got {other:?}"),
            ));
        }
    };
    Ok((operation, command))
}

/// Settle (or extend) the operation's ids: the `settled` frame, once all are answered.
async fn run_operation(
    gateway: &Gateway,
    (operation, command): &(Operation, Option<AckCommand>),
    settler: &Settler,
) -> Message {
    let may = |name: &ConsumerName| settler.may(name);
    let outcomes: Vec<Result<Option<time::OffsetDateTime>, Error>> = if !settler.reaches_any() {
        let refusal = Error::Forbidden {
            scope: Scope::Settle.as_str(),
        };
        operation.ids.iter().map(|_| Err(refusal.clone())).collect()
    } else if let Some(command) = command {
        gateway
            .settle_many(&operation.ids, command, &may)
            .await
            .into_iter()
            .map(|outcome| outcome.map(|()| None))
            .collect()
    } else {
        let extensions = operation.ids.iter().map(|id| gateway.extend(id, &may));
        futures::future::join_all(extensions)
            .await
            .into_iter()
            .map(|outcome| outcome.map(Some))
            .collect()
    };
    let frame = SettledFrame {
        kind: "settled",
        op: &operation.op,
        reference: operation.reference.as_ref(),
        results: operation
            .ids
            .iter()
            .zip(outcomes)
            .map(|(id, outcome)| SettledResult::of(id, outcome))
            .collect(),
    };
    // Strings, numbers and JSON values only: cannot fail.
    Message::Text(serde_json::to_string(&frame).unwrap_or_default().into())
}

/// A `settled` frame, serialized straight to text (no JSON tree per operation).
#[derive(serde::Serialize)]
struct SettledFrame<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    op: &'a str,
    #[serde(rename = "ref", skip_serializing_if = "Option::is_none")]
    reference: Option<&'a Value>,
    results: Vec<SettledResult<'a>>,
}

/// One id's result: what its HTTP settle would answer (204, or 200 with the new expiry).
#[derive(serde::Serialize)]
struct SettledResult<'a> {
    id: &'a str,
    status: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lease_expires_at: Option<String>,
}

impl<'a> SettledResult<'a> {
    fn of(id: &'a str, outcome: Result<Option<time::OffsetDateTime>, Error>) -> Self {
        let (status, detail, lease_expires_at) = match outcome {
            Ok(None) => (204, None, None),
            Ok(Some(expires_at)) => (200, None, Some(rfc3339(expires_at))),
            Err(err) => (err.status().as_u16(), Some(err.public_detail()), None),
        };
        Self {
            id,
            status,
            detail,
            lease_expires_at,
        }
    }
}
