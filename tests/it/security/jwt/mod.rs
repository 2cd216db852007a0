//! JWT bearer tokens (OIDC): tokens signed in the test with RSA, P-256 and Ed25519 keys made
//! in the test, their JWKS served by a local HTTP server that counts its reads. Valid tokens
//! work within their scopes; expired, foreign, unsigned and HMAC-forged ones are refused with
//! `invalid_token`; a rotated key is fetched, but unknown key ids cannot make the gateway
//! read the JWKS more than once per 30 s; static tokens keep working; an `Idempotency-Key`
//! belongs to the token's subject; the subject, never the token, reaches the log.

mod jwks_source;
mod keys;
mod subjects;
mod verification;
