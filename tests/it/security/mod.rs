//! Security: bearer tokens and scopes, JWTs, the lease-key file, request limits, NATS
//! authentication and TLS, error bodies that reveal nothing internal, and replica traffic
//! that cannot be forged.

mod auth;
mod errors;
mod jwt;
mod lease_ids;
mod limits;
mod nats_auth;
mod replica_trust;
mod tickets;
mod tls;
