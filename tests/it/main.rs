//! The integration suite: one binary, every test with its own nats-server and gateway.
//! Modules follow the contract (issue 2): start-up, fetch, settle, capacity, lease rules,
//! concurrency, introspection and shutdown.

mod capacity;
mod concurrency;
mod containers;
mod dead_letter;
mod docs;
mod fetch;
mod idempotency;
mod introspection;
mod leases;
mod logs;
mod metrics;
mod publish;
mod readme;
mod review;
mod robustness;
mod rules;
mod security;
mod settle;
mod shutdown;
mod startup;
mod support;
