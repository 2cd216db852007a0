//! The ledger's parameters: the streams and the consumer it works on, how many messages and
//! workers a run has, and its time bounds.

use std::time::Duration;

pub(super) const STREAM: &str = "LEDGER";
pub(super) const CONSUMER: &str = "ledger";
/// Termed messages are dead-lettered here; the ledger checks them against its terms.
pub(super) const DLQ_STREAM: &str = "LEDGER_DLQ";
pub(super) const DLQ_SUBJECT: &str = "dlq.ledger";
/// Messages per run.
pub(super) const K: usize = 300;
/// HTTP workers per run.
pub(super) const W: usize = 8;
/// The consumer's ack_wait: short, so abandoned leases come back quickly.
pub(super) const ACK_WAIT: &str = "2s";
/// A fetch must answer 200 again within this long after a fault is healed.
pub(super) const RECOVERY_BOUND: Duration = Duration::from_secs(20);
/// The longest one run may take before it is declared stuck.
pub(super) const RUN_DEADLINE: Duration = Duration::from_secs(90);
