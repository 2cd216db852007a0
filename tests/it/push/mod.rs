//! Push delivery against real endpoints the tests start: what is sent (each format, the
//! Standard Webhooks signature), what each class of answer does to the message, the pacing
//! (a `Retry-After` holding every request, the window shrinking and growing back), batches,
//! a push table changed live, and SIGTERM mid-push.

mod answers;
mod delivery;
mod fixtures;
mod ledger;
mod lifecycle;
mod pacing;
