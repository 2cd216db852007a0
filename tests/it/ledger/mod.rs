//! The ledger test (anchor: Jepsen's NATS queue workload). Publish K messages with unique ids,
//! run W HTTP workers against the gateway (a child process, so it can be killed -9) with mixed
//! behaviour — mostly ack, some batch-ack, some nak with a delay, some term with a recorded
//! reason, some abandon the lease and let it expire — and two streaming workers, leased to
//! over SSE and over a WebSocket (acking in band), inject one kind of fault per run, and keep
//! a ledger of every delivery and every settle answer.
//!
//! Per run it prints K, acked, termed, lost, duplicates, redeliveries and the time to recover
//! after each fault, and asserts:
//! - **lost = 0**: every id ended acked or termed on purpose, and the server holds nothing
//!   pending or unacknowledged. Only a 2xx counts as acked or termed; an id whose settle
//!   answer a fault swallowed (or whose ack a vanishing client hung up on) is reported apart,
//!   as unconfirmed, and is not lost only if the server holds nothing any more.
//! - **answers as the contract says** in the runs without a server or gateway fault: every
//!   fetch 200, no settle of a worker answered 5xx or not at all (so no unconfirmed ack but
//!   those the vanishing client hung up on), naks 204, batch results one per id asked for.
//! - **duplicates** (a message handed out again after its ack or term got 2xx) are 0 in the
//!   runs without a fault and in the single-server kill -9 run (the gateway settles the
//!   redeliveries of what the server forgot again itself); in the gateway-kill and cluster
//!   runs they are counted and reported. In every run, no gateway process leases again a
//!   message whose ack or term it confirmed itself, whatever the server forgot.
//!   The servers run with `jetstream { sync_interval: always }`, so what it confirmed is on
//!   disk before the confirmation (NATS-FACTS: by default file storage fsyncs every 2
//!   minutes, and Jepsen lost acknowledged writes that way) — but for one run at the default,
//!   as most deployments run it: the gateway rolled, killed, then the server killed -9 twice
//!   and paused while that gateway lives.
//! - **recovery**: after each fault is healed, a fetch answers 200 again within 20 s.
//! - **dead letters**: the gateway runs with `--dead-letter-subject`; in the runs without a
//!   server or gateway fault, the dead-letter stream holds exactly the termed ids, once each,
//!   with the reasons the ledger recorded; with the gateway killed, it still holds every id
//!   termed with a 2xx (the advisory stream keeps what the killed gateway had not copied).
//! - **non-sticky replicas**: three gateways on the consumer, every request to a random one
//!   and every settle deliberately at another replica than the fetch, through a replica
//!   kill -9 and restart, a rolling restart (SIGTERM, start again) of the other two, a
//!   replica paused 3 s and a nats-server kill -9 (or, on the cluster, the consumer leader's
//!   node killed): lost = 0, and a settle of a live lease whose owner is alive (not killed or
//!   stopped since the fetch) is never refused (404/410).
//! - **two replicas on a 3-node cluster at the default sync**: leader step-downs, the stream
//!   leader killed -9, the consumer leader's node paused 6 s, a replica's own node killed -9:
//!   lost = 0 (so no 410 for an ack that landed: its message would never come back), and an
//!   owner still running is never taken for gone while its lease lives.

mod book;
mod faults;
mod fleet;
mod params;
mod report;
mod run;
mod runs;
mod settles;
mod streams;
mod three_consumers;
mod workers;
