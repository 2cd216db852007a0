//! Security: bearer tokens and scopes, JWTs, the lease-key file, request limits, NATS
//! authentication and TLS, and error bodies that reveal nothing internal.

mod auth;
mod errors;
mod jwt;
mod lease_ids;
mod limits;
mod nats_auth;
mod tls;
