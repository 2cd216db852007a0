//! The integration suite: one binary (one link on two cores), every test with its own
//! nats-server and gateway. Modules follow the contract: start-up, fetch, settle, capacity,
//! lease rules, delivery guarantees, rebinding, concurrency, introspection, shutdown, … and
//! the ledger run under faults (`cargo test --test it ledger`).

mod capacity;
mod concurrency;
mod console;
mod consumers;
mod consumers_shared;
mod containers;
mod dead_letter;
mod dead_letters_read;
mod delivery_guarantees;
mod doc_links;
mod docs;
mod durability;
mod events;
mod exactly_once;
mod exactly_once_cluster;
mod fetch;
mod idempotency;
mod introspection;
mod kubernetes;
mod leases;
mod ledger;
mod logs;
mod metrics;
mod nats_outage;
mod ordering;
mod pause;
mod poison;
mod publish;
mod publish_batch;
mod publish_cluster;
mod push;
mod readme;
mod rebinding;
mod redrive;
mod replicas;
mod robustness;
mod schedules;
mod security;
mod seek;
mod settle;
mod shutdown;
mod signals;
mod startup;
mod stream_ends;
mod support;
mod tracing;
mod websocket;
