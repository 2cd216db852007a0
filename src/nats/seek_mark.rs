//! The seek mark: what a move of a consumer (a seek) leaves in its metadata, so that every
//! replica learns of the move, and what a floor record of the settled records is checked
//! against (a floor read under one mark says nothing of the consumer under another).
//!
//! A move leaves its mark twice: `<id>~moving` before it forgets the records and resets the
//! consumer, `<id>` once it has. No floor is written while a move is under way: a floor read
//! then is the consumer's before the move, yet would carry the new mark.
//!
//! May import: nothing of the crate.

use std::time::Duration;

use async_nats::jetstream::consumer;

/// The consumer metadata key a move leaves behind (its value is unique per move): a replica
/// that sees it change knows the consumer was moved under it.
pub(crate) const SEEK_MARK: &str = "ruststream_seek";
/// What a mark ends with while its move is under way.
const MOVING: &str = "~moving";
/// A move a replica has seen under way for longer than this (on its own clock) died between
/// its two marks: its records were forgotten or not, the consumer reset or not, and floors
/// are written again.
pub(crate) const MOVE_DIES_AFTER: Duration = Duration::from_secs(60);

/// The mark the last move left, as the consumer's metadata has it.
pub(crate) fn mark_of(info: &consumer::Info) -> Option<&str> {
    info.config.metadata.get(SEEK_MARK).map(String::as_str)
}

/// A new move's id: when it began (ns since the epoch) and where it moves to.
pub(crate) fn new_move(began_unix_nanos: i128, sequence: u64) -> String {
    format!("{began_unix_nanos}:{sequence}")
}

/// The mark a move leaves while it is under way.
pub(crate) fn under_way(move_id: &str) -> String {
    format!("{move_id}{MOVING}")
}

/// Whether `mark` is of a move under way (its first mark).
pub(crate) fn is_under_way(mark: &str) -> bool {
    mark.ends_with(MOVING)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_move_is_marked_under_way_then_done() {
        let id = new_move(1_000_000_000_000, 7);
        assert_eq!(id, "1000000000000:7");
        assert!(is_under_way(&under_way(&id)));
        assert!(!is_under_way(&id));
        assert!(!is_under_way("set by hand"));
    }
}
