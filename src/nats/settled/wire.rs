//! The settled records' wire format: what one record says (settles, voids, a floor) as the
//! JSON every gateway of a consumer writes and reads, and what reading one back yields.
//!
//! May import: `domain`.

use serde::{Deserialize, Serialize};

use crate::domain::finals::{Final, FleetFloor, MessageKey};

/// One settle a record carries: the message and how it ended.
pub(crate) type Settled = (MessageKey, Final);

/// What a record read back says: messages that ended, and messages an earlier record said
/// ended whose settle then went unconfirmed.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Opened {
    pub(crate) ended: Vec<Settled>,
    pub(crate) voided: Vec<MessageKey>,
    /// A floor record: everything under it ended.
    pub(crate) floor: Option<FleetFloor>,
    /// The consumer's seek mark when the floor was read (`""`: none), to be checked against
    /// the mark now; `None` for a floor record of a release before marks.
    pub(crate) floor_mark: Option<String>,
    /// The highest stream sequence the record names (also for a record of this binding's
    /// own, which is otherwise not opened): below the consumer's floor, it may be dropped.
    pub(crate) max_sequence: u64,
}

#[derive(Serialize, Deserialize)]
pub(super) struct RecordWire<'a> {
    #[serde(borrow)]
    pub(super) consumer: &'a str,
    pub(super) settled: Vec<EntryWire>,
    /// Absent in records of releases before it: those are read as voiding nothing.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(super) void: Vec<VoidWire>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) floor: Option<FloorWire>,
}

#[derive(Serialize, Deserialize)]
pub(super) struct FloorWire {
    pub(super) seq: u64,
    pub(super) published_by_ns: i64,
    /// The consumer's seek mark read with the floor (`""`: none). A seek elsewhere between
    /// that read and this record's write forgot the records before it; this one, written
    /// after, speaks of the consumer before the move, and its mark says so. Absent in the
    /// floor records of releases before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) mark: Option<String>,
}

#[derive(Serialize, Deserialize)]
pub(super) struct VoidWire {
    seq: u64,
    published_ns: i64,
}

impl VoidWire {
    pub(super) fn of(message: &MessageKey) -> Self {
        Self {
            seq: message.stream_sequence,
            published_ns: message.published_unix_nanos,
        }
    }

    fn message(&self) -> MessageKey {
        MessageKey {
            stream_sequence: self.seq,
            published_unix_nanos: self.published_ns,
        }
    }
}

#[derive(Serialize, Deserialize)]
pub(super) struct EntryWire {
    seq: u64,
    published_ns: i64,
    #[serde(rename = "final")]
    outcome: FinalWire,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Copy)]
#[serde(rename_all = "lowercase")]
enum FinalWire {
    Ack,
    Term,
}

impl EntryWire {
    pub(super) fn of((message, outcome): &Settled) -> Self {
        let (outcome, reason) = match outcome {
            Final::Acked => (FinalWire::Ack, None),
            Final::Terminated { reason } => (FinalWire::Term, reason.clone()),
        };
        Self {
            seq: message.stream_sequence,
            published_ns: message.published_unix_nanos,
            outcome,
            reason,
        }
    }

    fn settled(self) -> Settled {
        let message = MessageKey {
            stream_sequence: self.seq,
            published_unix_nanos: self.published_ns,
        };
        let outcome = match self.outcome {
            FinalWire::Ack => Final::Acked,
            FinalWire::Term => Final::Terminated {
                reason: self.reason,
            },
        };
        (message, outcome)
    }
}

/// What a record's payload says; nothing when it is not one (a stranger's message).
pub(super) fn decode(payload: &[u8]) -> Opened {
    serde_json::from_slice::<RecordWire<'_>>(payload)
        .map(|record| {
            let voided: Vec<MessageKey> = record.void.iter().map(VoidWire::message).collect();
            let ended: Vec<Settled> = record.settled.into_iter().map(EntryWire::settled).collect();
            let floor_mark = record.floor.as_ref().and_then(|floor| floor.mark.clone());
            let floor = record.floor.map(|floor| FleetFloor {
                stream_sequence: floor.seq,
                published_by_unix_nanos: floor.published_by_ns,
            });
            let max_sequence = ended
                .iter()
                .map(|(message, _)| message)
                .chain(&voided)
                .map(|message| message.stream_sequence)
                .chain(floor.map(|floor| floor.stream_sequence))
                .max()
                .unwrap_or(0);
            Opened {
                ended,
                voided,
                floor,
                floor_mark,
                max_sequence,
            }
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_reads_back_as_written() {
        let settled = vec![
            (
                MessageKey {
                    stream_sequence: 7,
                    published_unix_nanos: 1_700_000_000_123_456_789,
                },
                Final::Acked,
            ),
            (
                MessageKey {
                    stream_sequence: 9,
                    published_unix_nanos: 1,
                },
                Final::Terminated {
                    reason: Some("bad \"input\"".into()),
                },
            ),
        ];
        let voided = vec![MessageKey {
            stream_sequence: 3,
            published_unix_nanos: 4,
        }];
        let payload = serde_json::to_vec(&RecordWire {
            consumer: "billing",
            settled: settled.iter().map(EntryWire::of).collect(),
            void: voided.iter().map(VoidWire::of).collect(),
            floor: None,
        })
        .expect("encodes");
        assert_eq!(
            decode(&payload),
            Opened {
                ended: settled.clone(),
                voided,
                floor: None,
                floor_mark: None,
                max_sequence: 9,
            }
        );
        // A record of a release before voids: read as voiding nothing.
        let earlier = br#"{"consumer":"billing","settled":[{"seq":7,"published_ns":1700000000123456789,"final":"ack"}]}"#;
        assert_eq!(decode(earlier).ended, settled[..1]);
        assert_eq!(decode(b"{\"not\": \"a record\"}"), Opened::default());
        assert_eq!(decode(b"\xff"), Opened::default());
    }

    #[test]
    fn a_floor_reads_back_with_the_mark_it_was_read_under() {
        let floor = FleetFloor {
            stream_sequence: 41,
            published_by_unix_nanos: 5,
        };
        let record = |mark: Option<&str>| {
            serde_json::to_vec(&RecordWire {
                consumer: "billing",
                settled: Vec::new(),
                void: Vec::new(),
                floor: Some(FloorWire {
                    seq: 41,
                    published_by_ns: 5,
                    mark: mark.map(str::to_owned),
                }),
            })
            .expect("encodes")
        };
        let marked = decode(&record(Some("1700000000:3")));
        assert_eq!(marked.floor, Some(floor));
        assert_eq!(marked.floor_mark.as_deref(), Some("1700000000:3"));
        assert_eq!(marked.max_sequence, 41);
        // No mark on the consumer is written as an empty one, told apart from a release
        // before marks, whose floor record has none.
        assert_eq!(decode(&record(Some(""))).floor_mark.as_deref(), Some(""));
        let earlier =
            br#"{"consumer":"billing","settled":[],"floor":{"seq":41,"published_by_ns":5}}"#;
        assert_eq!(decode(earlier).floor, Some(floor));
        assert_eq!(decode(earlier).floor_mark, None);
    }
}
