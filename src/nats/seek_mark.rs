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
/// A move under way longer than this (by the clock of the replica that began it) has died
/// between its two marks: its records were forgotten or not, the consumer reset or not, and
/// floors are written again.
const MOVE_DIES_AFTER: Duration = Duration::from_secs(60);

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

/// The move a mark names, under way or done.
pub(crate) fn move_of(mark: &str) -> &str {
    mark.strip_suffix(MOVING).unwrap_or(mark)
}

/// Whether `mark` is of a move still under way at `now_unix_nanos` (one under way for longer
/// than a minute has died; a mark not of this form is of no move under way).
pub(crate) fn moving(mark: &str, now_unix_nanos: i128) -> bool {
    let Some(id) = mark.strip_suffix(MOVING) else {
        return false;
    };
    let began = id
        .split_once(':')
        .and_then(|(began, _)| began.parse::<i128>().ok());
    began.is_some_and(|began| {
        now_unix_nanos.saturating_sub(began)
            < i128::try_from(MOVE_DIES_AFTER.as_nanos()).unwrap_or(i128::MAX)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_move_is_one_move_under_way_and_done() {
        let id = new_move(1_000_000_000_000, 7);
        let pending = under_way(&id);
        assert_eq!(move_of(&pending), id);
        assert_eq!(move_of(&id), id);
        assert!(moving(&pending, 1_000_000_000_000 + 5_000_000_000));
        assert!(!moving(&id, 1_000_000_000_000));
        // Under way for over a minute: it died between its marks.
        assert!(!moving(&pending, 1_000_000_000_000 + 61_000_000_000));
        // A mark not of this form (set by hand) is of no move under way.
        assert!(!moving("by hand~moving", 0));
        assert!(!moving("by hand", 0));
    }
}
