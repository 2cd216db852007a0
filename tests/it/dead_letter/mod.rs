//! Poison messages: a message that exhausted `--max-deliver`, or that a client terminated, is
//! republished with its headers and delivery metadata to `--dead-letter-subject` — stored
//! exactly once in the dead-letter stream even when the advisory is seen twice, when the
//! gateway is killed right after the terms, or when no gateway runs as the advisory is
//! published; a term on a work-queue stream, which deletes the message, copies it first.

mod advisory_streams;
mod exactly_once;
mod inspect;
mod poison;
