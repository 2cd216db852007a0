//! TLS for the connections the gateway opens as a client over HTTPS (a `--auth-jwks-url`, an
//! OTLP/HTTP collector): the system's root certificates, rustls with ring (the provider
//! async-nats already uses), given explicitly rather than installed process-wide.
//!
//! May import: nothing of the crate. Usable from every room.

use std::sync::Arc;

use tokio_rustls::rustls;

/// A client configuration that verifies servers against the system's roots, and how many
/// roots were found (none: every HTTPS server fails verification).
pub(crate) fn config() -> Result<(rustls::ClientConfig, usize), String> {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = rustls::RootCertStore::empty();
    let (added, _) = roots.add_parsable_certificates(found.certs);
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|err| format!("TLS: {err}"))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok((config, added))
}
