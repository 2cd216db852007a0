//! Final outcomes the server confirmed: which messages were acked or terminated through this
//! gateway, remembered while it lives (up to a bound).
//!
//! nats-server confirms an ack before its consumer state is on disk: killed and restarted,
//! it delivers again messages whose ack (or term) it had confirmed. Only the gateway's own
//! memory can keep such a redelivery from reaching a client twice — the dispatcher settles
//! it again itself instead of leasing it.
//!
//! May import: the rest of `domain` only.

use std::collections::VecDeque;

use super::SequenceMap;
use super::lease_id::LeaseCoordinates;
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

/// A message as it stays across its deliveries, the consumers reading it and a stream
/// deleted and made again: its stream sequence and the time it was published. A recreated
/// consumer (or a server that recovered one as new) delivers the same message under the same
/// key; a recreated stream reuses the sequence for another message, with another time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct MessageKey {
    pub(crate) stream_sequence: u64,
    pub(crate) published_unix_nanos: i64,
}

impl MessageKey {
    pub(crate) fn of(coordinates: &LeaseCoordinates) -> Self {
        Self {
            stream_sequence: coordinates.key.stream_sequence,
            published_unix_nanos: coordinates.published_unix_nanos,
        }
    }
}

/// Who confirmed a final outcome: this process, or another gateway sharing the consumer (or
/// an earlier life of this one) whose record of it was read back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    Process,
    Fleet,
}

/// Final outcomes by message, the oldest forgotten first once there are more than `max`.
/// Not forgotten with time: a server may lose a settle it confirmed long ago (its consumer
/// state is written behind), and may lose it more than once.
#[derive(Debug)]
pub(crate) struct Finals {
    by_message: SequenceMap<MessageKey, (Final, Source)>,
    recorded: VecDeque<MessageKey>,
    max: usize,
    /// Everything at or below it ended (a floor record of the fleet's).
    floor: Option<FleetFloor>,
}

/// A floor record of the fleet's: every message of the stream at or below `stream_sequence`
/// published no later than `published_by_unix_nanos` ended. Written once the consumer's ack
/// floor was there long enough to be on disk, before the records below it are dropped: a
/// consumer made again (its floor back at 0) still settles those again. The time tells the
/// messages of a stream deleted and made again (later) apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FleetFloor {
    pub(crate) stream_sequence: u64,
    pub(crate) published_by_unix_nanos: i64,
}

impl FleetFloor {
    fn covers(&self, message: MessageKey) -> bool {
        message.stream_sequence <= self.stream_sequence
            && message.published_unix_nanos <= self.published_by_unix_nanos
    }
}

impl Finals {
    pub(crate) fn new(max: usize) -> Self {
        Self {
            by_message: SequenceMap::default(),
            recorded: VecDeque::new(),
            max,
            floor: None,
        }
    }

    /// The fleet's records say everything under `floor` ended; the highest floor is kept.
    pub(crate) fn raise_floor_from_fleet(&mut self, floor: FleetFloor) {
        if self
            .floor
            .is_none_or(|known| known.stream_sequence < floor.stream_sequence)
        {
            self.floor = Some(floor);
        }
    }

    /// The highest floor the fleet's records gave.
    pub(crate) fn fleet_floor(&self) -> Option<FleetFloor> {
        self.floor
    }

    /// The server confirmed `outcome` for `message`.
    pub(crate) fn record(&mut self, message: MessageKey, outcome: Final) {
        if self
            .by_message
            .insert(message, (outcome, Source::Process))
            .is_none()
        {
            self.recorded.push_back(message);
        }
        self.forget_oldest();
    }

    /// Another gateway's record says `message` ended: kept unless it is known already (this
    /// process's own records come back this way too).
    pub(crate) fn record_from_fleet(&mut self, message: MessageKey, outcome: Final) {
        if self.by_message.contains_key(&message) {
            return;
        }
        self.by_message.insert(message, (outcome, Source::Fleet));
        self.recorded.push_back(message);
        self.forget_oldest();
    }

    /// A record said `message` ended, and a later one that its settle went unconfirmed
    /// after all: forgotten, unless this process confirmed it itself. (Its place in the
    /// order of forgetting stays; at worst a later outcome of it is forgotten early.)
    pub(crate) fn void_from_fleet(&mut self, message: MessageKey) {
        if self.source(message) == Some(Source::Fleet) {
            self.by_message.remove(&message);
        }
    }

    fn forget_oldest(&mut self) {
        while self.recorded.len() > self.max {
            if let Some(oldest) = self.recorded.pop_front() {
                self.by_message.remove(&oldest);
            }
        }
    }

    /// How `message` ended, if it did through this gateway.
    pub(crate) fn get(&self, message: MessageKey) -> Option<Final> {
        match self.by_message.get(&message) {
            Some((outcome, _)) => Some(outcome.clone()),
            // Acked or terminated, which the floor does not tell: settled again as acked,
            // which ends it without a second dead letter.
            None => self.under_floor(message).then_some(Final::Acked),
        }
    }

    /// Who confirmed how `message` ended, if it did.
    pub(crate) fn source(&self, message: MessageKey) -> Option<Source> {
        match self.by_message.get(&message) {
            Some((_, source)) => Some(*source),
            None => self.under_floor(message).then_some(Source::Fleet),
        }
    }

    fn under_floor(&self, message: MessageKey) -> bool {
        self.floor.is_some_and(|floor| floor.covers(message))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(stream_sequence: u64) -> MessageKey {
        MessageKey {
            stream_sequence,
            published_unix_nanos: 1_000 + i64::try_from(stream_sequence).expect("small"),
        }
    }

    #[test]
    fn remembers_acks_and_terms_with_their_reason() {
        let mut finals = Finals::new(10);
        finals.record(message(1), Final::Acked);
        let term = Final::of(&AckCommand::Term {
            reason: Some("bad".into()),
        });
        finals.record(message(2), term.clone().expect("a term is final"));
        assert_eq!(finals.get(message(1)), Some(Final::Acked));
        assert_eq!(finals.get(message(2)), term);
        assert_eq!(
            finals
                .get(message(2))
                .map(|f| f.command())
                .map(|c| format!("{c:?}")),
            Some(format!(
                "{:?}",
                AckCommand::Term {
                    reason: Some("bad".into())
                }
            ))
        );
        assert_eq!(finals.get(message(3)), None);
    }

    #[test]
    fn a_void_forgets_what_the_fleet_said_not_what_this_process_confirmed() {
        let mut finals = Finals::new(10);
        finals.record_from_fleet(message(1), Final::Acked);
        finals.record(message(2), Final::Acked);
        finals.void_from_fleet(message(1));
        finals.void_from_fleet(message(2));
        assert_eq!(finals.get(message(1)), None);
        assert_eq!(finals.get(message(2)), Some(Final::Acked));
    }

    #[test]
    fn a_fleet_floor_covers_what_was_published_before_it_at_or_below_its_sequence() {
        let mut finals = Finals::new(10);
        finals.raise_floor_from_fleet(FleetFloor {
            stream_sequence: 5,
            published_by_unix_nanos: 1_005,
        });
        finals.raise_floor_from_fleet(FleetFloor {
            stream_sequence: 3,
            published_by_unix_nanos: 1_003,
        });
        assert_eq!(finals.get(message(5)), Some(Final::Acked));
        assert_eq!(finals.source(message(4)), Some(Source::Fleet));
        assert_eq!(finals.get(message(6)), None, "above the floor");
        let republished = MessageKey {
            stream_sequence: 2,
            published_unix_nanos: 2_000,
        };
        assert_eq!(finals.get(republished), None, "a stream made again");
    }

    #[test]
    fn another_message_at_the_same_sequence_is_not_the_one_that_ended() {
        let mut finals = Finals::new(10);
        finals.record(message(1), Final::Acked);
        let republished = MessageKey {
            stream_sequence: 1,
            published_unix_nanos: 99,
        };
        assert_eq!(finals.get(republished), None, "a stream made again");
    }

    #[test]
    fn naks_and_extensions_are_not_final_and_the_count_is_bounded() {
        assert_eq!(Final::of(&AckCommand::Nak { delay: None }), None);
        assert_eq!(Final::of(&AckCommand::InProgress), None);
        let mut finals = Finals::new(2);
        for sequence in 1..=3 {
            finals.record(message(sequence), Final::Acked);
        }
        assert_eq!(finals.get(message(1)), None, "the oldest went first");
        assert_eq!(finals.get(message(3)), Some(Final::Acked));
    }
}
