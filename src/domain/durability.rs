//! How durable a consumer's settles really are, from what the server and the gateway have
//! of it: the stream's and the consumer's replicas and storage, the server's sync policy
//! (when the monitoring endpoint tells), and where the gateway records confirmed settles.
//! From those: the promise the gateway can keep, the warnings an operator should read, and
//! whether a `--require-durability` level is met.
//!
//! May import: the rest of `domain` only.

use std::time::Duration;

/// How the server writes to disk, as its monitoring endpoint says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ServerSync {
    /// `sync_always`: every write is fsynced before it is acknowledged.
    Always,
    /// Fsynced every this long (nats-server's default: 2 minutes).
    Every(Duration),
    /// No `--nats-monitor-url`, or it did not answer.
    Unknown,
}

impl ServerSync {
    /// As the report shows it: `always`, a duration (`2m`), or `unknown`.
    pub(crate) fn describe(self) -> String {
        match self {
            Self::Always => "always".to_owned(),
            Self::Every(every) => humantime::format_duration(every).to_string(),
            Self::Unknown => "unknown".to_owned(),
        }
    }
}

/// What the gateway can promise of a message whose ack or term it answered 2xx.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Promise {
    /// Not known: the consumer is not bound.
    None,
    /// Only this process never hands it out again (no records for the fleet).
    Process,
    /// No gateway sharing the consumer hands it out again (records stored).
    Fleet,
}

impl Promise {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Process => "process",
            Self::Fleet => "fleet",
        }
    }

    /// The value of `ruststream_durability_promise`: 0 none, 1 process, 2 fleet.
    pub(crate) fn level(self) -> i64 {
        match self {
            Self::None => 0,
            Self::Process => 1,
            Self::Fleet => 2,
        }
    }
}

/// `--require-durability`: the least a consumer must have to be served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Requirement {
    /// The settled records are stored.
    Fleet,
    /// That, and the stream, the consumer and the records on 3 replicas or more.
    Replicated,
    /// That, and the server known to sync every write (needs `--nats-monitor-url`).
    Synced,
}

/// What is known of a consumer's durability.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Facts {
    pub(crate) stream_replicas: usize,
    /// The consumer's own (its config's 0 means the stream's).
    pub(crate) consumer_replicas: usize,
    /// `file` or `memory`.
    pub(crate) storage: String,
    /// The stream's `persist_mode` (`default`, `async`); `default` when not set.
    pub(crate) persist_mode: String,
    pub(crate) server_sync: ServerSync,
    /// Replicas of the settled records stream; `None` without one.
    pub(crate) settled_record_replicas: Option<usize>,
}

/// How many replicas `replicated` asks of each.
const REPLICATED: usize = 3;

impl Facts {
    pub(crate) fn promise(&self) -> Promise {
        if self.settled_record_replicas.is_some() {
            Promise::Fleet
        } else {
            Promise::Process
        }
    }

    /// What an operator should know, weakest link first.
    pub(crate) fn warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        if self.settled_record_replicas.is_none() {
            warnings.push(
                "no settled records: a message whose ack the server confirmed and then forgot can be handed out again by another gateway, or by this one after a restart"
                    .to_owned(),
            );
        }
        if self.storage == "memory" {
            warnings.push(
                "memory storage: a server restart loses the stream's messages and the consumer's state"
                    .to_owned(),
            );
        }
        if self.persist_mode == "async" {
            warnings.push(
                "persist_mode async: a published 201 is answered before the message is written"
                    .to_owned(),
            );
        }
        if self.stream_replicas < 2 {
            match self.server_sync {
                ServerSync::Always => {}
                ServerSync::Every(_) => warnings.push(format!(
                    "R1 stream at a sync interval of {}: a published 201 can be lost on power failure (Jepsen NATS 2.12.1)",
                    self.server_sync.describe()
                )),
                ServerSync::Unknown => warnings.push(
                    "R1 stream at an unknown sync interval (give --nats-monitor-url): at nats-server's default of 2 minutes a published 201 can be lost on power failure (Jepsen NATS 2.12.1)"
                        .to_owned(),
                ),
            }
        }
        if self.consumer_replicas < 2 {
            warnings.push(
                "consumer R1: acks are confirmed before they are stored (the gateway's records keep them)"
                    .to_owned(),
            );
        }
        if let Some(records) = self.settled_record_replicas
            && records < self.stream_replicas
        {
            warnings.push(format!(
                "the settled records are on {records} replica(s), the stream on {}",
                self.stream_replicas
            ));
        }
        warnings
    }

    /// The first field that falls short of `required`, and why; `None` when it is met.
    pub(crate) fn shortfall(&self, required: Requirement) -> Option<(&'static str, String)> {
        let Some(records) = self.settled_record_replicas else {
            return Some((
                "settled_record_replicas",
                "no settled records stream (the server refused it, or the consumer is ephemeral)"
                    .to_owned(),
            ));
        };
        if required == Requirement::Fleet {
            return None;
        }
        for (field, replicas) in [
            ("stream_replicas", self.stream_replicas),
            ("consumer_replicas", self.consumer_replicas),
            ("settled_record_replicas", records),
        ] {
            if replicas < REPLICATED {
                return Some((
                    field,
                    format!("{field} is {replicas}; at least {REPLICATED} are required"),
                ));
            }
        }
        if required == Requirement::Synced && self.server_sync != ServerSync::Always {
            return Some((
                "server_sync",
                format!(
                    "the server's sync is {}; `always` is required (and known only with --nats-monitor-url)",
                    self.server_sync.describe()
                ),
            ));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts() -> Facts {
        Facts {
            stream_replicas: 3,
            consumer_replicas: 3,
            storage: "file".into(),
            persist_mode: "default".into(),
            server_sync: ServerSync::Always,
            settled_record_replicas: Some(3),
        }
    }

    #[test]
    fn a_replicated_synced_consumer_with_records_meets_everything_and_warns_of_nothing() {
        let facts = facts();
        assert_eq!(facts.promise(), Promise::Fleet);
        assert!(facts.warnings().is_empty(), "{:?}", facts.warnings());
        for required in [
            Requirement::Fleet,
            Requirement::Replicated,
            Requirement::Synced,
        ] {
            assert_eq!(facts.shortfall(required), None);
        }
    }

    #[test]
    fn a_single_node_at_the_default_sync_warns_of_both_weak_links() {
        let facts = Facts {
            stream_replicas: 1,
            consumer_replicas: 1,
            server_sync: ServerSync::Every(Duration::from_secs(120)),
            settled_record_replicas: Some(1),
            ..facts()
        };
        let warnings = facts.warnings();
        assert!(
            warnings[0].starts_with("R1 stream at a sync interval of 2m"),
            "{warnings:?}"
        );
        assert!(warnings[1].starts_with("consumer R1"), "{warnings:?}");
        assert_eq!(facts.shortfall(Requirement::Fleet), None);
        assert_eq!(
            facts
                .shortfall(Requirement::Replicated)
                .map(|(field, _)| field),
            Some("stream_replicas")
        );
    }

    #[test]
    fn without_records_the_promise_is_the_process_and_no_level_is_met() {
        let facts = Facts {
            settled_record_replicas: None,
            ..facts()
        };
        assert_eq!(facts.promise(), Promise::Process);
        assert_eq!(
            facts.shortfall(Requirement::Fleet).map(|(field, _)| field),
            Some("settled_record_replicas")
        );
    }

    #[test]
    fn synced_needs_the_server_known_to_sync_every_write() {
        let facts = Facts {
            server_sync: ServerSync::Unknown,
            ..facts()
        };
        assert_eq!(facts.shortfall(Requirement::Replicated), None);
        let (field, why) = facts.shortfall(Requirement::Synced).expect("short");
        assert_eq!(field, "server_sync");
        assert!(why.contains("--nats-monitor-url"), "{why}");
    }
}
