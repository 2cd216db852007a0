//! The operations a WebSocket client sends (`{"op", "ids", "ref"?, …}`): checked as the HTTP
//! batch settle checks its body, run, and answered with one `settled` frame each.
//!
//! May import: as the rest of `http`.

use std::collections::HashSet;
use std::ops::Range;
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

/// An operation read from the client, waiting to start.
pub(super) struct Queued {
    operation: Operation,
    command: Option<AckCommand>,
    /// Counts as an operation under way from the moment it is read: the goodbye waits for
    /// its answer.
    _under_way: tokio_util::task::task_tracker::TaskTrackerToken,
}

/// Most operations started together.
const MAX_GROUPED: usize = 256;

/// Parse a client's frame and queue its operation; the answer is sent when it is done.
pub(super) fn take_operation(
    frame: &str,
    (queue, outgoing, operations, answers_owed): (
        &mpsc::UnboundedSender<Queued>,
        &mpsc::Sender<Outgoing>,
        &tokio_util::task::TaskTracker,
        &Arc<AnswersOwed>,
    ),
) {
    let (operation, command) = match parse_operation(frame) {
        Ok(parsed) => parsed,
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
    // Owed before anything settles: the leases this makes room for go out after its answer.
    answers_owed.owe(&operation.ids);
    // The receiver lives as long as the session that sends.
    let _ = queue.send(Queued {
        operation,
        command,
        _under_way: operations.token(),
    });
}

/// Start the operations queued, those queued together as one group: a client acking each
/// message as it reads sends many small operations, and the acks among them are settled as
/// one batch (one pass through the settle path and one record, not one each).
pub(super) async fn start_queued(
    gateway: Arc<Gateway>,
    settler: Arc<Settler>,
    mut queued: mpsc::UnboundedReceiver<Queued>,
    outgoing: mpsc::Sender<Outgoing>,
    answers_owed: Arc<AnswersOwed>,
) {
    while let Some(first) = queued.recv().await {
        let mut group = vec![first];
        while group.len() < MAX_GROUPED {
            match queued.try_recv() {
                Ok(next) => group.push(next),
                Err(_) => break,
            }
        }
        let (gateway, settler) = (gateway.clone(), settler.clone());
        let (outgoing, answers_owed) = (outgoing.clone(), answers_owed.clone());
        tokio::spawn(
            async move {
                let answers = run_group(&gateway, &group, &settler).await;
                for (answer, queued) in answers.into_iter().zip(&group) {
                    let _ = outgoing.send(Outgoing::Frame(answer)).await;
                    answers_owed.answered(&queued.operation.ids);
                }
            }
            .instrument(tracing::Span::current()),
        );
    }
}

/// Run a group of operations, each ack among them with the acks next to it — as long as no
/// id repeats (each operation's answer is what it would have been alone) and the ids stay
/// within what one batch settle may name; one `settled` frame per operation, in order.
async fn run_group(gateway: &Gateway, group: &[Queued], settler: &Settler) -> Vec<Message> {
    let runs = runs_of(group.iter().map(|queued| {
        let is_ack = matches!(queued.command, Some(AckCommand::Ack));
        (is_ack, queued.operation.ids.as_slice())
    }));
    let answers = runs
        .iter()
        .map(|run| run_together(gateway, &group[run.clone()], settler));
    futures::future::join_all(answers)
        .await
        .into_iter()
        .flatten()
        .collect()
}

/// The operations (whether each is an ack, and its ids) run as one, as ranges: the acks next
/// to each other, until an id repeats or the ids pass [`MAX_IDS`]; any other op alone.
fn runs_of<'a>(operations: impl Iterator<Item = (bool, &'a [String])>) -> Vec<Range<usize>> {
    let mut runs: Vec<Range<usize>> = Vec::new();
    let mut ids_of_run = HashSet::new();
    let (mut named_in_run, mut run_is_ack) = (0, false);
    for (at, (is_ack, ids)) in operations.enumerate() {
        let joins = is_ack
            && run_is_ack
            && named_in_run + ids.len() <= MAX_IDS
            && ids.iter().all(|id| !ids_of_run.contains(id.as_str()));
        if joins {
            if let Some(run) = runs.last_mut() {
                run.end = at + 1;
            }
        } else {
            ids_of_run.clear();
            named_in_run = 0;
            run_is_ack = is_ack;
            runs.push(at..at + 1);
        }
        named_in_run += ids.len();
        ids_of_run.extend(ids.iter().map(String::as_str));
    }
    runs
}

/// Operations of one command run as one: their ids settled together, one frame each.
async fn run_together(gateway: &Gateway, operations: &[Queued], settler: &Settler) -> Vec<Message> {
    let Some(first) = operations.first() else {
        return Vec::new();
    };
    let merged: Vec<String>;
    let ids = if let [only] = operations {
        &only.operation.ids
    } else {
        merged = operations
            .iter()
            .flat_map(|queued| queued.operation.ids.iter().cloned())
            .collect();
        &merged
    };
    let mut outcomes = outcomes(gateway, ids, first.command.as_ref(), settler)
        .await
        .into_iter();
    operations
        .iter()
        .map(|queued| {
            let mine = outcomes.by_ref().take(queued.operation.ids.len()).collect();
            settled_frame(&queued.operation, mine)
        })
        .collect()
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

/// Settle (or, without a command, extend) `ids`: each one's outcome, once all are answered.
async fn outcomes(
    gateway: &Gateway,
    ids: &[String],
    command: Option<&AckCommand>,
    settler: &Settler,
) -> Vec<Result<Option<time::OffsetDateTime>, Error>> {
    let may = |name: &ConsumerName| settler.may(name);
    if !settler.reaches_any() {
        let refusal = Error::Forbidden {
            scope: Scope::Settle.as_str(),
        };
        ids.iter().map(|_| Err(refusal.clone())).collect()
    } else if let Some(command) = command {
        gateway
            .settle_many(ids, command, &may)
            .await
            .into_iter()
            .map(|outcome| outcome.map(|()| None))
            .collect()
    } else {
        let extensions = ids.iter().map(|id| gateway.extend(id, &may));
        futures::future::join_all(extensions)
            .await
            .into_iter()
            .map(|outcome| outcome.map(Some))
            .collect()
    }
}

/// The `settled` frame answering `operation`.
fn settled_frame(
    operation: &Operation,
    outcomes: Vec<Result<Option<time::OffsetDateTime>, Error>>,
) -> Message {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(names: &[&str]) -> Vec<String> {
        names.iter().map(|name| (*name).to_owned()).collect()
    }

    #[test]
    fn acks_next_to_each_other_run_as_one_and_anything_else_alone() {
        let (a, b, c, d) = (ids(&["a"]), ids(&["b"]), ids(&["c", "d"]), ids(&["e"]));
        let operations = [(true, &a), (true, &b), (false, &c), (true, &c), (true, &d)];
        let runs = runs_of(operations.iter().map(|(ack, ids)| (*ack, ids.as_slice())));
        assert_eq!(runs, [0..2, 2..3, 3..5]);
    }

    #[test]
    fn an_id_named_again_starts_a_run_of_its_own() {
        let (a, ab, b) = (ids(&["a"]), ids(&["b", "a"]), ids(&["b"]));
        let operations = [(true, &a), (true, &ab), (true, &b)];
        let runs = runs_of(operations.iter().map(|(ack, ids)| (*ack, ids.as_slice())));
        assert_eq!(runs, [0..1, 1..2, 2..3]);
    }

    #[test]
    fn a_run_names_no_more_than_one_batch_settle_may() {
        let first: Vec<String> = (0..MAX_IDS - 1).map(|n| n.to_string()).collect();
        let (one, two) = (ids(&["x"]), ids(&["y", "z"]));
        let operations = [(true, &first), (true, &one), (true, &two)];
        let runs = runs_of(operations.iter().map(|(ack, ids)| (*ack, ids.as_slice())));
        assert_eq!(runs, [0..2, 2..3]);
    }
}
