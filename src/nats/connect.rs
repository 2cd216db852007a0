//! Connecting to NATS: authentication and TLS options from the config, and the connection's
//! events translated into [`ConnectionEvent`]s, so no caller has to know async-nats' own.
//!
//! May import: `config`. Nothing of the gateway above the NATS boundary.

use std::time::Duration;

use anyhow::Context as _;
use async_nats::{Client, ConnectOptions, Event};
use tokio::sync::mpsc;

use crate::config::{Config, UrlCredentials};

/// What happened to the NATS connection.
#[derive(Debug, Clone)]
pub(crate) enum ConnectionEvent {
    Connected,
    Disconnected,
    /// The server reported an error on the connection (e.g. a permission violation).
    ServerError(String),
    /// A connection attempt failed (async-nats says only "IO error" and the like).
    ClientError(String),
    /// Anything else worth a log line (slow consumer, lame duck, ...).
    Other(String),
}

impl From<Event> for ConnectionEvent {
    fn from(event: Event) -> Self {
        match event {
            Event::Connected => Self::Connected,
            Event::Disconnected => Self::Disconnected,
            Event::ServerError(err) => Self::ServerError(err.to_string()),
            Event::ClientError(err) => Self::ClientError(err.to_string()),
            other => Self::Other(other.to_string()),
        }
    }
}

/// Why the first NATS server cannot be reached, in words an operator can act on: the
/// client's own error says only "IO error", so try a plain TCP connection to it.
pub(crate) async fn unreachable_because(config: &Config) -> String {
    let Some(url) = config
        .nats_servers()
        .ok()
        .and_then(|servers| servers.urls.into_iter().next())
    else {
        return "no server URL".into();
    };
    let authority = url.split_once("://").map_or(url.as_str(), |(_, rest)| rest);
    let authority = authority.split('/').next().unwrap_or_default();
    let authority = authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host);
    let address = if authority
        .rsplit_once(':')
        .is_some_and(|(_, port)| port.parse::<u16>().is_ok())
    {
        authority.to_owned()
    } else {
        format!("{authority}:4222")
    };
    match tokio::time::timeout(
        Duration::from_secs(2),
        tokio::net::TcpStream::connect(&address),
    )
    .await
    {
        Ok(Ok(_)) => {
            "the server accepts TCP connections but not this client (TLS or credentials?)".into()
        }
        Ok(Err(err)) => format!("{address}: {err}"),
        Err(_) => format!("{address}: no answer within 2s"),
    }
}

/// Whether the client is connected now.
pub(crate) fn is_connected(client: &Client) -> bool {
    client.connection_state() == async_nats::connection::State::Connected
}

/// Connect to NATS. Returns at once; the client keeps (re)connecting in the background and
/// reports connection events on `events`.
pub(crate) async fn connect(
    config: &Config,
    events: mpsc::UnboundedSender<ConnectionEvent>,
) -> anyhow::Result<Client> {
    let mut options = ConnectOptions::new()
        .name("ruststream-nats")
        .retry_on_initial_connect()
        // The default 60 s ping notices a dead socket only after minutes; leases are shorter.
        .ping_interval(Duration::from_secs(10))
        .event_callback(move |event| {
            let events = events.clone();
            async move {
                let _ = events.send(ConnectionEvent::from(event));
            }
        });
    options = authenticate(options, config).await?;
    // async-nats parses a string as one URL; a cluster's list is comma-separated. Credentials
    // in the URLs go in as options: the client logs the URLs it connects to.
    let servers = config.nats_servers().map_err(anyhow::Error::msg)?;
    options = match servers.credentials {
        Some(UrlCredentials::UserPassword(user, password)) => {
            options.user_and_password(user, password.expose().to_owned())
        }
        Some(UrlCredentials::Token(token)) => options.token(token.expose().to_owned()),
        None => options,
    };
    let urls: Vec<&str> = servers.urls.iter().map(String::as_str).collect();
    options
        .connect(urls.as_slice())
        .await
        .with_context(|| format!("connecting to {}", config.nats_url_redacted()))
}

/// Add the configured NATS authentication and TLS to `options`. Files are read and checked
/// here, so a wrong path or a malformed seed stops the start with a clear error instead of an
/// endless reconnect loop. No error names a secret: only paths and what is wrong with them.
async fn authenticate(
    mut options: ConnectOptions,
    config: &Config,
) -> anyhow::Result<ConnectOptions> {
    if let Some(creds) = &config.nats_creds {
        options = options
            .credentials_file(creds)
            .await
            .with_context(|| format!("reading NATS credentials file {}", creds.display()))?;
    }
    if let Some(path) = &config.nats_nkey {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading NATS nkey seed file {}", path.display()))?;
        // The file may hold comments or other lines (as `nsc` writes them): take the seed line.
        let seed = text
            .lines()
            .map(str::trim)
            .find(|line| line.starts_with("SU"))
            .filter(|seed| nkeys::KeyPair::from_seed(seed).is_ok())
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "NATS nkey seed file {} holds no valid user seed (a line starting with SU)",
                    path.display()
                )
            })?;
        options = options.nkey(seed.to_owned());
    }
    if let (Some(user), Some(password)) = (&config.nats_user, &config.nats_password) {
        options = options.user_and_password(user.clone(), password.expose().to_owned());
    }
    if let Some(token) = &config.nats_token {
        options = options.token(token.expose().to_owned());
    }
    let readable = |path: &std::path::Path, what: &str| {
        std::fs::metadata(path)
            .map(|_| ())
            .with_context(|| format!("reading NATS {what} {}", path.display()))
    };
    if let Some(ca) = &config.nats_tls_ca {
        readable(ca, "TLS CA certificate")?;
        options = options.add_root_certificates(ca.clone()).require_tls(true);
    }
    if let (Some(cert), Some(key)) = (&config.nats_tls_cert, &config.nats_tls_key) {
        readable(cert, "TLS client certificate")?;
        readable(key, "TLS client key")?;
        options = options
            .add_client_certificate(cert.clone(), key.clone())
            .require_tls(true);
    }
    Ok(options)
}
