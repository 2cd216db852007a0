//! What a worker does with a lease (ack, batch ack, nak with a delay, term, abandon), each
//! settle sent at another replica than the lease's and its answer recorded in the ledger.

use std::collections::HashMap;

use serde_json::json;

use crate::support::Action;
use crate::support::client::batch_results;

use super::book::{Lease, Outcome, SharedLedger, answer_text, confirm, lock, unexpected};
use super::fleet::Fleet;

/// What a worker does with one delivery: a fixed function of id and delivery count, so runs
/// are comparable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Behaviour {
    Ack,
    BatchAck,
    NakWithDelay,
    Term,
    Abandon,
}

pub(super) fn behaviour(lease: &Lease) -> Behaviour {
    let n: u64 = lease
        .ledger_id
        .trim_start_matches("id-")
        .parse()
        .unwrap_or(0);
    let roll = (n.wrapping_mul(2_654_435_761) ^ lease.delivered.wrapping_mul(40_503)) % 100;
    if lease.delivered > 2 {
        // Converge: later deliveries are acked.
        return if roll < 50 {
            Behaviour::BatchAck
        } else {
            Behaviour::Ack
        };
    }
    match roll {
        0..5 => Behaviour::Abandon,
        5..13 => Behaviour::NakWithDelay,
        13..18 if lease.delivered == 1 => Behaviour::Term,
        13..45 => Behaviour::BatchAck,
        _ => Behaviour::Ack,
    }
}

/// Send an ack (single) and record the answer; retry a 504 (the lease stays valid).
pub(super) async fn ack(fleet: &Fleet, ledger: &SharedLedger, lease: &Lease) {
    ack_after(fleet, ledger, lease, false).await;
}

/// `unanswered`: an earlier attempt of this ack got no definite answer (504, or a batch that
/// failed), so it may have landed at the server however the retries end.
pub(super) async fn ack_after(
    fleet: &Fleet,
    ledger: &SharedLedger,
    lease: &Lease,
    mut unanswered: bool,
) {
    for _ in 0..3 {
        let answer = fleet
            .settler(lease)
            .try_settle(&lease.id, Action::Ack, None, None)
            .await;
        if let Ok(reply) = &answer {
            fleet.check_refusal(ledger, lease, reply.status, &reply.text);
        }
        match answer.as_ref().map(|reply| reply.status) {
            Ok(204) => {
                confirm(ledger, lease, Outcome::Acked);
                return;
            }
            Ok(504) => {
                unexpected(
                    ledger,
                    format!("ack {}: {}", lease.ledger_id, answer_text(&answer)),
                );
                unanswered = true;
            }
            // Expired or superseded (410), from a gateway since restarted (404): it comes back,
            // unless an unanswered earlier attempt landed after all.
            Ok(404 | 409 | 410) => break,
            // 503 or no answer: the ack may or may not have reached the server.
            _ => {
                unexpected(
                    ledger,
                    format!("ack {}: {}", lease.ledger_id, answer_text(&answer)),
                );
                unanswered = true;
                break;
            }
        }
    }
    if unanswered {
        lock(ledger).ack_unconfirmed.insert(lease.ledger_id.clone());
    }
}

async fn batch_ack(fleet: &Fleet, ledger: &SharedLedger, leases: &[Lease]) {
    if leases.is_empty() {
        return;
    }
    let ids: Vec<&str> = leases.iter().map(|lease| lease.id.as_str()).collect();
    // Not at the replica of the first lease (the others may be anywhere).
    let answer = fleet
        .settler(&leases[0])
        .try_post("/messages/ack", Some(&json!({ "ids": ids })), None)
        .await;
    let results = match &answer {
        Ok(reply) if reply.status == 200 => Some(batch_results(reply)),
        _ => None,
    };
    let Some(results) = results else {
        unexpected(ledger, format!("batch ack: {}", answer_text(&answer)));
        let mut ledger = lock(ledger);
        for lease in leases {
            ledger.ack_unconfirmed.insert(lease.ledger_id.clone());
        }
        return;
    };
    // Matched by id, not by position: each id asked for has exactly one result.
    let mut by_id: HashMap<&str, u16> = HashMap::new();
    for result in &results {
        if let Some(lease) = leases.iter().find(|lease| lease.id == result.id) {
            let detail = result.detail.as_deref().unwrap_or_default();
            fleet.check_refusal(ledger, lease, result.status, detail);
        }
        if by_id.insert(result.id.as_str(), result.status).is_some() {
            unexpected(ledger, format!("batch ack: two results for {}", result.id));
        }
    }
    if results.len() != leases.len() {
        unexpected(
            ledger,
            format!(
                "batch ack of {} ids: {} results",
                leases.len(),
                results.len()
            ),
        );
    }
    for lease in leases {
        match by_id.get(lease.id.as_str()) {
            Some(204) => confirm(ledger, lease, Outcome::Acked),
            Some(404 | 409 | 410) => {}
            // 504 in a batch: retry it alone.
            Some(_) => ack_after(fleet, ledger, lease, true).await,
            None => {
                unexpected(
                    ledger,
                    format!("batch ack: no result for {}", lease.ledger_id),
                );
                ack_after(fleet, ledger, lease, true).await;
            }
        }
    }
}

async fn term(fleet: &Fleet, ledger: &SharedLedger, lease: &Lease) {
    let reason = format!("ledger: {} rejected on purpose", lease.ledger_id);
    lock(ledger)
        .term_reasons
        .insert(lease.ledger_id.clone(), reason.clone());
    let answer = fleet
        .settler(lease)
        .try_settle(
            &lease.id,
            Action::Term,
            Some(&json!({ "reason": reason })),
            None,
        )
        .await;
    let status = answer.as_ref().map(|reply| reply.status).ok();
    if let Ok(reply) = &answer {
        fleet.check_refusal(ledger, lease, reply.status, &reply.text);
    }
    if status == Some(204) {
        confirm(ledger, lease, Outcome::Termed);
    } else {
        if !matches!(status, Some(404 | 409 | 410)) {
            unexpected(
                ledger,
                format!("term {}: {}", lease.ledger_id, answer_text(&answer)),
            );
        }
        // Not confirmed: the message comes back, and is then acked or termed again. A term
        // that did land counts as unconfirmed-but-settled, like an ack.
        lock(ledger).ack_unconfirmed.insert(lease.ledger_id.clone());
    }
}

/// Nak with a 300 ms delay, at another replica than the lease's: the message comes back
/// either way, but anything but 204 (or a lease that just expired) breaks the contract.
async fn nak_with_delay(fleet: &Fleet, ledger: &SharedLedger, lease: &Lease) {
    let answer = fleet
        .settler(lease)
        .try_settle(
            &lease.id,
            Action::Nak,
            Some(&json!({ "delay_ms": 300 })),
            None,
        )
        .await;
    let status = answer.as_ref().map(|reply| reply.status).ok();
    if let Ok(reply) = &answer {
        fleet.check_refusal(ledger, lease, reply.status, &reply.text);
    }
    if !matches!(status, Some(204 | 410)) {
        unexpected(
            ledger,
            format!("nak {}: {}", lease.ledger_id, answer_text(&answer)),
        );
    }
}

/// Do with the leases of one fetch (or one streamed batch) what [`behaviour`] says, over
/// HTTP, each settle at another replica than the lease's.
pub(super) async fn settle_leases(fleet: &Fleet, ledger: &SharedLedger, leases: Vec<Lease>) {
    let mut batch = Vec::new();
    for lease in leases {
        match behaviour(&lease) {
            Behaviour::Ack => ack(fleet, ledger, &lease).await,
            Behaviour::BatchAck => batch.push(lease),
            Behaviour::NakWithDelay => nak_with_delay(fleet, ledger, &lease).await,
            Behaviour::Term => term(fleet, ledger, &lease).await,
            Behaviour::Abandon => {}
        }
    }
    batch_ack(fleet, ledger, &batch).await;
}
