//! The settle vocabulary: what a client asks to do with a lease, and how a lease ended.
//!
//! May import: the rest of `domain` only.

use std::time::Duration;

/// How a lease was (or is being) settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SettleKind {
    Ack,
    Nak,
    Term,
}

impl SettleKind {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Ack => "ack",
            Self::Nak => "nak",
            Self::Term => "term",
        }
    }
}

/// A settle (or extension) of one delivery, as a client asked for it.
#[derive(Debug, Clone)]
pub(crate) enum AckCommand {
    Ack,
    Nak { delay: Option<Duration> },
    Term { reason: Option<String> },
    InProgress,
}
