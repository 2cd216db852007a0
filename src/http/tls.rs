//! HTTPS on the main listener: the certificate and key from PEM files (and, for mTLS, the
//! CA that client certificates must chain to), ALPN `h2` and `http/1.1`, and the files
//! watched so that a certificate rotated in place (a Kubernetes secret) is used for new
//! connections without dropping the open ones.
//!
//! May import: as the rest of `http`.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{RootCertStore, ServerConfig};
use tokio_rustls::server::TlsStream;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// How often the files are looked at for a change.
const RELOAD_CHECK_EVERY: Duration = Duration::from_secs(2);

/// Where the listener's TLS material comes from.
#[derive(Debug, Clone)]
pub(crate) struct TlsFiles {
    pub(crate) cert: PathBuf,
    pub(crate) key: PathBuf,
    pub(crate) client_ca: Option<PathBuf>,
}

/// The TLS acceptor in force, replaced when the files change.
#[derive(Clone)]
pub(crate) struct Tls {
    acceptor: Arc<RwLock<TlsAcceptor>>,
}

impl Tls {
    /// Read and check the files (a one-line error naming the path on any problem).
    pub(crate) fn load(files: &TlsFiles) -> anyhow::Result<Self> {
        let config = server_config(files)?;
        Ok(Self {
            acceptor: Arc::new(RwLock::new(TlsAcceptor::from(Arc::new(config)))),
        })
    }

    /// Complete the TLS handshake on `stream`.
    pub(crate) async fn accept<IO>(&self, stream: IO) -> io::Result<TlsStream<IO>>
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        let acceptor = self
            .acceptor
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone();
        acceptor.accept(stream).await
    }

    /// Reload the files when they change, until `stop`; a bad new file is logged and the
    /// previous certificate stays in use.
    pub(crate) fn watch(&self, files: TlsFiles, stop: CancellationToken) {
        let tls = self.clone();
        tokio::spawn(async move {
            let mut seen = modified(&files);
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(RELOAD_CHECK_EVERY) => {}
                }
                let now = modified(&files);
                if now == seen {
                    continue;
                }
                seen = now;
                tls.reload(&files);
            }
        });
    }

    /// Read the files again (when they change, and on SIGHUP); files that do not load are
    /// logged and the certificate in use stays.
    pub(crate) fn reload(&self, files: &TlsFiles) {
        match server_config(files) {
            Ok(config) => {
                *self
                    .acceptor
                    .write()
                    .unwrap_or_else(|poisoned| poisoned.into_inner()) =
                    TlsAcceptor::from(Arc::new(config));
                info!(cert = %files.cert.display(), "reloaded the TLS certificate");
            }
            Err(err) => warn!(
                error = %format!("{err:#}"),
                "the TLS files do not load; keeping the certificate in use"
            ),
        }
    }
}

/// The modification times of the files (a rotated Kubernetes secret swaps a symlink, which
/// the metadata of the path follows).
fn modified(files: &TlsFiles) -> Vec<Option<SystemTime>> {
    [
        Some(&files.cert),
        Some(&files.key),
        files.client_ca.as_ref(),
    ]
    .into_iter()
    .flatten()
    .map(|path| std::fs::metadata(path).and_then(|m| m.modified()).ok())
    .collect()
}

fn server_config(files: &TlsFiles) -> anyhow::Result<ServerConfig> {
    let certs = certificates(&files.cert, "--tls-cert")?;
    let key = PrivateKeyDer::from_pem_file(&files.key).map_err(|err| {
        anyhow::anyhow!(
            "--tls-key {}: no usable PEM private key ({err})",
            files.key.display()
        )
    })?;
    let builder = ServerConfig::builder();
    let builder = match &files.client_ca {
        Some(path) => {
            let mut roots = RootCertStore::empty();
            for cert in certificates(path, "--tls-client-ca")? {
                roots.add(cert).with_context(|| {
                    format!(
                        "--tls-client-ca {}: not a usable CA certificate",
                        path.display()
                    )
                })?;
            }
            let verifier = WebPkiClientVerifier::builder(Arc::new(roots))
                .build()
                .with_context(|| format!("--tls-client-ca {}", path.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(certs, key).with_context(|| {
        format!(
            "--tls-cert {} and --tls-key {} do not make a usable certificate",
            files.cert.display(),
            files.key.display()
        )
    })?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}

fn certificates(path: &Path, flag: &str) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(Iterator::collect::<Result<Vec<_>, _>>)
        .map_err(|err| anyhow::anyhow!("{flag} {}: not readable PEM ({err})", path.display()))?;
    if certs.is_empty() {
        anyhow::bail!("{flag} {}: holds no certificate", path.display());
    }
    Ok(certs)
}

/// A connection after the handshake: TLS, or the plain TCP stream.
pub(crate) enum MaybeTls<IO> {
    Plain(IO),
    Tls(Box<TlsStream<IO>>),
}

impl<IO> tokio::io::AsyncRead for MaybeTls<IO>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(io) => std::pin::Pin::new(io).poll_read(cx, buf),
            Self::Tls(io) => std::pin::Pin::new(io.as_mut()).poll_read(cx, buf),
        }
    }
}

impl<IO> tokio::io::AsyncWrite for MaybeTls<IO>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(io) => std::pin::Pin::new(io).poll_write(cx, buf),
            Self::Tls(io) => std::pin::Pin::new(io.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(io) => std::pin::Pin::new(io).poll_flush(cx),
            Self::Tls(io) => std::pin::Pin::new(io.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(io) => std::pin::Pin::new(io).poll_shutdown(cx),
            Self::Tls(io) => std::pin::Pin::new(io.as_mut()).poll_shutdown(cx),
        }
    }
}
