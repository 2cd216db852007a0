//! The ledger's book: what every delivery and every settle answer was, and the records of
//! the deliveries a fetch or a stream handed out.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use serde_json::Value;

use crate::support::Reply;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Outcome {
    Acked,
    Termed,
}

#[derive(Default)]
pub(super) struct Ledger {
    /// Confirmed (2xx) settles that end a message, by id.
    pub(super) settled: HashMap<String, Outcome>,
    /// The reason each term was sent with (whatever its answer: a term whose answer was lost
    /// may have landed and been dead-lettered).
    pub(super) term_reasons: HashMap<String, String>,
    /// Ids with a worker's settle sent whose answer never came or was a 5xx (a fault, 504):
    /// it may or may not have landed.
    pub(super) ack_unconfirmed: HashSet<String>,
    /// Ids whose ack the vanishing client sent and hung up on before the answer.
    pub(super) hung_up: HashSet<String>,
    /// Answers outside the contract for a run without a fault: a fetch not answered 200, a
    /// settle answered 5xx or not at all, a nak not answered 204, a batch whose results do
    /// not match its ids. Reported always, a failure in the runs without a fault.
    pub(super) unexpected: Vec<String>,
    pub(super) deliveries: u64,
    pub(super) redeliveries: u64,
    /// Every `(id, delivered)` seen, for the diagnosis of a lost id.
    pub(super) seen: HashMap<String, Vec<u64>>,
    /// `(id, delivered)` of deliveries after the id's ack or term got 2xx.
    pub(super) duplicates: Vec<(String, u64)>,
    /// The gateway processes (replica, life) that confirmed an id's ack or term.
    pub(super) ended_by: HashMap<String, HashSet<(usize, u64)>>,
    /// `(id, delivered)` of deliveries by a gateway process that itself had confirmed the
    /// id's ack or term: never allowed, whatever the server forgot.
    pub(super) same_process_duplicates: Vec<(String, u64)>,
    /// Settles refused (404/410) although sent well before the lease's expiry to a live
    /// owner (not killed or stopped since the fetch, no nats-server killed meanwhile).
    pub(super) refused_live: Vec<String>,
}

pub(super) type SharedLedger = Arc<Mutex<Ledger>>;

pub(super) fn lock(ledger: &SharedLedger) -> std::sync::MutexGuard<'_, Ledger> {
    ledger
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A leased message, as much of it as the ledger needs.
#[derive(Debug, Clone)]
pub(super) struct Lease {
    pub(super) id: String,
    pub(super) ledger_id: String,
    pub(super) delivered: u64,
    /// The replica that issued it, that replica's generation then and its process' life.
    pub(super) owner: usize,
    pub(super) generation: u64,
    pub(super) life: u64,
    pub(super) expires_at: Option<time::OffsetDateTime>,
}

fn record_delivery(ledger: &SharedLedger, message: &Value) -> Option<Lease> {
    let lease = Lease {
        id: message["id"].as_str()?.to_owned(),
        ledger_id: message["data"].as_str()?.to_owned(),
        delivered: message["delivered"].as_u64()?,
        owner: 0,
        generation: 0,
        life: 0,
        expires_at: message["lease_expires_at"].as_str().and_then(|at| {
            time::OffsetDateTime::parse(at, &time::format_description::well_known::Rfc3339).ok()
        }),
    };
    let mut ledger = lock(ledger);
    ledger.deliveries += 1;
    ledger
        .seen
        .entry(lease.ledger_id.clone())
        .or_default()
        .push(lease.delivered);
    if lease.delivered > 1 {
        ledger.redeliveries += 1;
    }
    if ledger.settled.contains_key(&lease.ledger_id) {
        ledger
            .duplicates
            .push((lease.ledger_id.clone(), lease.delivered));
    }
    Some(lease)
}

pub(super) fn unexpected(ledger: &SharedLedger, what: String) {
    lock(ledger).unexpected.push(what);
}

/// An answer as text for the ledger's notes.
pub(super) fn answer_text(answer: &Result<Reply, reqwest::Error>) -> String {
    match answer {
        Ok(reply) => format!("{} {}", reply.status, reply.text),
        Err(err) => format!("no answer: {err}"),
    }
}

/// A settle of `lease` got 2xx. The first confirmed outcome of an id stands (a duplicate
/// delivery settled again does not change what happened to the message).
pub(super) fn confirm(ledger: &SharedLedger, lease: &Lease, outcome: Outcome) {
    let mut ledger = lock(ledger);
    ledger
        .settled
        .entry(lease.ledger_id.clone())
        .or_insert(outcome);
    // The settle was confirmed by the process that issued the lease (a successor answers
    // 410 for its predecessor's ids).
    ledger
        .ended_by
        .entry(lease.ledger_id.clone())
        .or_default()
        .insert((lease.owner, lease.life));
}

/// The deliveries of a fetch answered 200, recorded in the ledger.
pub(super) fn record_fetched(ledger: &SharedLedger, reply: &Reply) -> Vec<Lease> {
    reply
        .body
        .get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|message| record_delivery(ledger, message))
        .collect()
}

/// [`record_fetched`] of a fetch at replica `owner` (in its `generation` and `life`).
pub(super) fn record_fetched_at(
    ledger: &SharedLedger,
    reply: &Reply,
    owner: usize,
    generation: (u64, u64),
) -> Vec<Lease> {
    let messages = reply
        .body
        .get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten();
    record_at(ledger, messages, owner, generation)
}

/// Deliveries leased by replica `owner` (in its `generation` and `life`), recorded in the
/// ledger: a fetch's, or one written to a stream.
pub(super) fn record_at<'m>(
    ledger: &SharedLedger,
    messages: impl IntoIterator<Item = &'m Value>,
    owner: usize,
    (generation, life): (u64, u64),
) -> Vec<Lease> {
    let leases: Vec<Lease> = messages
        .into_iter()
        .filter_map(|message| record_delivery(ledger, message))
        .map(|lease| Lease {
            owner,
            generation,
            life,
            ..lease
        })
        .collect();
    let mut ledger = lock(ledger);
    for lease in &leases {
        if ledger
            .ended_by
            .get(&lease.ledger_id)
            .is_some_and(|ended| ended.contains(&(owner, life)))
        {
            ledger
                .same_process_duplicates
                .push((lease.ledger_id.clone(), lease.delivered));
        }
    }
    leases
}
