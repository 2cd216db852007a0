//! Ordering per key: at most one message of a key out at a time, a key's messages in stream
//! order through naks, expiries and terms, nothing of other keys held back, held messages
//! kept alive, a restarted gateway fenced behind what the killed one held, and bad specs
//! refused.

mod fleet;
mod keys;
mod one_gateway;
