//! What a run ended with: its report, the table printed past the test harness' capture,
//! and the checks that fail a run.

use std::io::Write as _;
use std::time::Duration;

use super::params::{K, RECOVERY_BOUND};

/// What a run ended with.
pub(super) struct Report {
    pub(super) scenario: &'static str,
    /// Acked or termed with a 2xx.
    pub(super) acked: usize,
    /// Not settled with a 2xx, settled at the server after all: a worker's settle whose answer
    /// a fault swallowed …
    pub(super) acked_unconfirmed: usize,
    /// … or an ack the vanishing client hung up on.
    pub(super) hung_up: usize,
    /// Answers outside the contract (see `Ledger::unexpected`).
    pub(super) unexpected: Vec<String>,
    pub(super) termed: usize,
    pub(super) lost: Vec<String>,
    /// Termed ids without a recorded reason (must be 0: every term is on purpose).
    pub(super) terms_without_reason: usize,
    /// Dead letters stored, and how many of them disagree with the ledger's terms (an id
    /// not termed with a 2xx, a missing one, a different reason, a second copy).
    pub(super) dead_lettered: usize,
    pub(super) dead_letter_mismatches: Vec<String>,
    /// Ids termed with a 2xx that are not in the dead-letter stream.
    pub(super) termed_not_dead_lettered: usize,
    pub(super) duplicates: Vec<(String, u64)>,
    pub(super) same_process_duplicates: Vec<(String, u64)>,
    pub(super) redeliveries: u64,
    pub(super) refused_live: Vec<String>,
    pub(super) recoveries: Vec<(&'static str, Option<Duration>)>,
    pub(super) took: Duration,
}

impl Report {
    fn row(&self) -> String {
        let recoveries = if self.recoveries.is_empty() {
            "–".to_owned()
        } else {
            self.recoveries
                .iter()
                .map(|(name, took)| match took {
                    Some(took) => format!("{name} {:.1}s", took.as_secs_f64()),
                    None => format!("{name} NOT RECOVERED"),
                })
                .collect::<Vec<_>>()
                .join("; ")
        };
        format!(
            "| {:<28} | {:>3} | {:>5} ({:>2} unconfirmed) | {:>6} | {:>3} ({} differ) | {:>4} | {:>10} | {:>12} | {:>9} | {:>4} | {} | {:.0}s |",
            self.scenario,
            K,
            self.acked + self.acked_unconfirmed + self.hung_up,
            self.acked_unconfirmed + self.hung_up,
            self.termed,
            self.dead_lettered,
            self.dead_letter_mismatches.len(),
            self.lost.len(),
            self.duplicates.len(),
            self.redeliveries,
            self.unexpected.len(),
            self.refused_live.len(),
            recoveries,
            self.took.as_secs_f64()
        )
    }
}

const HEADER: &str = "| scenario                     |   K | acked (of which unconfirmed) | termed | dead-lettered | lost | duplicates | redeliveries | off-contract answers | live leases refused | recovery after fault | run |\n|---|---|---|---|---|---|---|---|---|---|---|---|";

/// Print past the test harness' capture, so CI logs show the table.
pub(super) fn print_table(title: &str, reports: &[Report]) {
    let mut text = format!("\n==== ledger: {title} ====\n{HEADER}\n");
    for report in reports {
        text.push_str(&report.row());
        text.push('\n');
    }
    let _ = std::io::stderr().write_all(text.as_bytes());
}

/// `faulty`: a server or gateway was killed during the run; then off-contract answers and
/// dead-letter differences are reported, not failed (a term whose answer was lost is
/// dead-lettered but not in the ledger; a server killed before it stored the advisory of a
/// term it had confirmed loses that advisory). `duplicates_allowed`: the gateway itself was killed
/// (its memory of confirmed settles died with it) or a cluster changed leaders while an ack
/// was in flight; everywhere else a message handed out again after a 2xx ack or term fails.
/// `replicas`: a non-sticky run, where a settle of a live lease at a live owner must never
/// be refused (reported in every run).
pub(super) fn check(
    report: &Report,
    faulty: bool,
    duplicates_allowed: bool,
    replicas: bool,
) -> Vec<String> {
    let mut failures = Vec::new();
    // What docs/guarantees.md's ledger table shows for the runs without a server or gateway fault: every
    // answer as the contract says, no worker's settle left unanswered (unconfirmed acks
    // there are only those a vanishing client hung up on).
    if !faulty && !report.unexpected.is_empty() {
        failures.push(format!(
            "{}: {} answers outside the contract, e.g. {:?}",
            report.scenario,
            report.unexpected.len(),
            &report.unexpected[..report.unexpected.len().min(10)]
        ));
    }
    if !faulty && report.acked_unconfirmed > 0 {
        failures.push(format!(
            "{}: {} settles of well-behaved workers went unanswered",
            report.scenario, report.acked_unconfirmed
        ));
    }
    if !faulty && !report.dead_letter_mismatches.is_empty() {
        failures.push(format!(
            "{}: dead letters differ from the ledger's terms: {:?}",
            report.scenario, report.dead_letter_mismatches
        ));
    }
    if !report.lost.is_empty() {
        failures.push(format!(
            "{}: lost {} ids, e.g. {:?}",
            report.scenario,
            report.lost.len(),
            &report.lost[..report.lost.len().min(10)]
        ));
    }
    if replicas && !report.refused_live.is_empty() {
        failures.push(format!(
            "{}: {} settles of live leases at live owners refused: {:?}",
            report.scenario,
            report.refused_live.len(),
            &report.refused_live[..report.refused_live.len().min(10)]
        ));
    }
    if report.terms_without_reason > 0 {
        failures.push(format!(
            "{}: {} ids termed without a recorded reason",
            report.scenario, report.terms_without_reason
        ));
    }
    // A gateway process never leases again what it confirmed an ack or term of, whatever
    // the server forgot; only a successor (whose memory started empty) may.
    if !report.same_process_duplicates.is_empty() {
        failures.push(format!(
            "{}: {} messages leased again by the gateway process that had confirmed their ack/term: {:?}",
            report.scenario,
            report.same_process_duplicates.len(),
            &report.same_process_duplicates[..report.same_process_duplicates.len().min(10)]
        ));
    }
    if !duplicates_allowed && !report.duplicates.is_empty() {
        failures.push(format!(
            "{}: {} messages handed out again after a confirmed ack/term: {:?}",
            report.scenario,
            report.duplicates.len(),
            &report.duplicates[..report.duplicates.len().min(10)]
        ));
    }
    for (fault, recovered) in &report.recoveries {
        match recovered {
            Some(took) if *took <= RECOVERY_BOUND => {}
            other => failures.push(format!(
                "{}: no fetch answered 200 within {RECOVERY_BOUND:?} after {fault}: {other:?}",
                report.scenario
            )),
        }
    }
    failures
}
