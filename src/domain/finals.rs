//! Final outcomes the server confirmed: which messages (by stream sequence) were acked or
//! terminated through this gateway, remembered for a while.
//!
//! nats-server confirms an ack before its consumer state is on disk: killed and restarted,
//! it delivers again messages whose ack (or term) it had confirmed. Only the gateway's own
//! memory can keep such a redelivery from reaching a client twice — the dispatcher settles
//! it again itself instead of leasing it.
//!
//! May import: the rest of `domain` only.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

use super::SequenceMap;
use super::settle::AckCommand;

/// How a message ended for good.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Final {
    Acked,
    Terminated { reason: Option<String> },
}

impl Final {
    /// The settle that ends the message again.
    pub(crate) fn command(&self) -> AckCommand {
        match self {
            Self::Acked => AckCommand::Ack,
            Self::Terminated { reason } => AckCommand::Term {
                reason: reason.clone(),
            },
        }
    }

    /// The final outcome a confirmed settle gave, if it is one (a nak or an extension is
    /// not).
    pub(crate) fn of(command: &AckCommand) -> Option<Self> {
        match command {
            AckCommand::Ack => Some(Self::Acked),
            AckCommand::Term { reason } => Some(Self::Terminated {
                reason: reason.clone(),
            }),
            AckCommand::Nak { .. } | AckCommand::InProgress => None,
        }
    }
}

/// Final outcomes by stream sequence, each kept for `retention`, at most `max` of them.
#[derive(Debug)]
pub(crate) struct Finals {
    by_sequence: SequenceMap<u64, Final>,
    recorded: VecDeque<(Instant, u64)>,
    retention: Duration,
    max: usize,
}

impl Finals {
    pub(crate) fn new(retention: Duration, max: usize) -> Self {
        Self {
            by_sequence: SequenceMap::default(),
            recorded: VecDeque::new(),
            retention,
            max,
        }
    }

    /// The server confirmed `outcome` for `stream_sequence`.
    pub(crate) fn record(&mut self, stream_sequence: u64, outcome: Final, now: Instant) {
        self.forget_old(now);
        if self.by_sequence.insert(stream_sequence, outcome).is_none() {
            self.recorded.push_back((now, stream_sequence));
        }
        while self.recorded.len() > self.max {
            if let Some((_, oldest)) = self.recorded.pop_front() {
                self.by_sequence.remove(&oldest);
            }
        }
    }

    /// How `stream_sequence` ended, if it did through this gateway within the retention.
    pub(crate) fn get(&mut self, stream_sequence: u64, now: Instant) -> Option<Final> {
        self.forget_old(now);
        self.by_sequence.get(&stream_sequence).cloned()
    }

    /// The consumer was recreated: its sequences start over and name other deliveries.
    pub(crate) fn clear(&mut self) {
        self.by_sequence.clear();
        self.recorded.clear();
    }

    fn forget_old(&mut self, now: Instant) {
        while let Some((at, sequence)) = self.recorded.front().copied() {
            if now.saturating_duration_since(at) < self.retention {
                break;
            }
            self.recorded.pop_front();
            self.by_sequence.remove(&sequence);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembers_acks_and_terms_with_their_reason_until_the_retention_ends() {
        let now = Instant::now();
        let mut finals = Finals::new(Duration::from_secs(60), 10);
        finals.record(1, Final::Acked, now);
        let term = Final::of(&AckCommand::Term {
            reason: Some("bad".into()),
        });
        finals.record(2, term.clone().expect("a term is final"), now);
        assert_eq!(finals.get(1, now), Some(Final::Acked));
        assert_eq!(finals.get(2, now), term);
        assert_eq!(
            finals
                .get(2, now)
                .map(|f| f.command())
                .map(|c| format!("{c:?}")),
            Some(format!(
                "{:?}",
                AckCommand::Term {
                    reason: Some("bad".into())
                }
            ))
        );
        assert_eq!(finals.get(3, now), None);
        assert_eq!(
            finals.get(1, now + Duration::from_secs(60)),
            None,
            "forgotten"
        );
    }

    #[test]
    fn naks_and_extensions_are_not_final_and_the_count_is_bounded() {
        assert_eq!(Final::of(&AckCommand::Nak { delay: None }), None);
        assert_eq!(Final::of(&AckCommand::InProgress), None);
        let now = Instant::now();
        let mut finals = Finals::new(Duration::from_secs(60), 2);
        for sequence in 1..=3 {
            finals.record(sequence, Final::Acked, now);
        }
        assert_eq!(finals.get(1, now), None, "the oldest went first");
        assert_eq!(finals.get(3, now), Some(Final::Acked));
        finals.clear();
        assert_eq!(finals.get(3, now), None);
    }
}
