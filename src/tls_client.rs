//! TLS for the connections the gateway opens as a client over HTTPS (a `--auth-jwks-url`, an
//! OTLP/HTTP collector, a push endpoint): the system's root certificates, rustls with ring (the provider
//! async-nats already uses), given explicitly rather than installed process-wide.
//!
//! May import: nothing of the crate. Usable from every room.

use std::sync::Arc;

use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
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

/// The certificates in a PEM file's bytes: at least one, each parsable.
fn certificates(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|err| format!("not PEM certificates: {err}"))?;
    if certs.is_empty() {
        return Err("no certificate in it".into());
    }
    Ok(certs)
}

/// Whether a PEM file's bytes hold certificates (a private CA, say).
pub(crate) fn check_certificates(pem: &[u8]) -> Result<(), String> {
    certificates(pem).map(drop)
}

/// Whether a certificate and a private key make a client identity.
pub(crate) fn check_identity(cert: &[u8], key: &[u8]) -> Result<(), String> {
    certificates(cert)?;
    PrivateKeyDer::from_pem_slice(key).map_err(|err| format!("not a PEM private key: {err}"))?;
    Ok(())
}

/// A client configuration for one endpoint: the system's roots plus `ca` (PEM) when given,
/// and a client identity (certificate and key, PEM) for mutual TLS when given.
pub(crate) fn config_for(
    ca: Option<&[u8]>,
    client: Option<(&[u8], &[u8])>,
) -> Result<rustls::ClientConfig, String> {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = rustls::RootCertStore::empty();
    roots.add_parsable_certificates(found.certs);
    if let Some(pem) = ca {
        for cert in certificates(pem)? {
            roots
                .add(cert)
                .map_err(|err| format!("CA certificate: {err}"))?;
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|err| format!("TLS: {err}"))?
        .with_root_certificates(roots);
    match client {
        None => Ok(builder.with_no_client_auth()),
        Some((cert, key)) => {
            let key = PrivateKeyDer::from_pem_slice(key)
                .map_err(|err| format!("not a PEM private key: {err}"))?;
            builder
                .with_client_auth_cert(certificates(cert)?, key)
                .map_err(|err| format!("client certificate: {err}"))
        }
    }
}
