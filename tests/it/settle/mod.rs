//! Settling leases one at a time and in batches: confirmed 204s, nak delays, term reasons,
//! in-progress extensions, the 404/409/410/504 fences the gateway must keep itself, and
//! settles retried after a 503 outage or a client that hung up.

mod batch;
mod recovery;
mod single;
