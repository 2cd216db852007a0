//! A consumer's `[consumer.push]` table in the consumers file: where the gateway delivers its
//! messages over HTTP, in which format, how fast and how it retries — every value checked,
//! and every file it names read, when the file is, so that a mistake is refused at start or
//! reload rather than found at the first delivery.
//!
//! May import: as the rest of `config`.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use serde::Deserialize;
use toml::Spanned;

use crate::domain::leases::lease_margin;

/// How a pushed message is put into its request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PushFormat {
    /// `application/json`: the message as `POST /fetch` returns it (`{"messages": […]}` for a
    /// batch).
    Json,
    /// The message's exact bytes, its metadata in `Ruststream-*` headers.
    Binary,
    /// A CloudEvents 1.0 event in HTTP binary content mode.
    CloudEvents,
}

/// A Standard Webhooks signing secret (`whsec_<base64>`), decoded; never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct SigningSecret(pub(crate) Vec<u8>);

impl fmt::Debug for SigningSecret {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("SigningSecret(…)")
    }
}

/// The PEM files of the endpoint's TLS, as read: a private CA, a client certificate and key.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct PushTls {
    pub(crate) ca: Option<Vec<u8>>,
    pub(crate) client: Option<(Vec<u8>, Vec<u8>)>,
}

impl fmt::Debug for PushTls {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("PushTls")
            .field("ca", &self.ca.is_some())
            .field("client", &self.client.is_some())
            .finish()
    }
}

/// A consumer's push settings, checked.
#[derive(Clone, PartialEq, Eq)]
pub struct PushSpec {
    pub url: reqwest::Url,
    pub format: PushFormat,
    pub batch: usize,
    pub batch_wait: Duration,
    pub timeout: Duration,
    pub max_in_flight: usize,
    /// Messages a second across the fleet; 0: no limit.
    pub rate_limit: u32,
    pub retry_initial: Duration,
    pub retry_max: Duration,
    pub retry_after_max: Duration,
    pub(crate) secrets: Vec<SigningSecret>,
    /// Static request headers (an `Authorization`, say): values never printed.
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) tls: PushTls,
}

impl PushSpec {
    /// The endpoint as it may be shown: no user, password or query (where secrets go).
    pub fn shown_url(&self) -> String {
        let mut shown = self.url.clone();
        let _ = shown.set_username("");
        let _ = shown.set_password(None);
        shown.set_query(None);
        shown.set_fragment(None);
        shown.to_string()
    }
}

impl fmt::Debug for PushSpec {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("PushSpec")
            .field("url", &self.shown_url())
            .field("format", &self.format)
            .field("batch", &self.batch)
            .field("timeout", &self.timeout)
            .field("max_in_flight", &self.max_in_flight)
            .field("rate_limit", &self.rate_limit)
            .field("secrets", &self.secrets.len())
            .field(
                "headers",
                &self
                    .headers
                    .iter()
                    .map(|(name, _)| name)
                    .collect::<Vec<_>>(),
            )
            .field("tls", &self.tls)
            .finish_non_exhaustive()
    }
}

/// The table as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PushEntry {
    url: Spanned<String>,
    format: Option<Spanned<String>>,
    batch: Option<Spanned<i64>>,
    batch_wait: Option<Spanned<String>>,
    timeout: Option<Spanned<String>>,
    max_in_flight: Option<Spanned<i64>>,
    rate_limit: Option<Spanned<i64>>,
    retry_initial: Option<Spanned<String>>,
    retry_max: Option<Spanned<String>>,
    retry_after_max: Option<Spanned<String>>,
    signing_secret_file: Option<Spanned<String>>,
    headers: Option<Spanned<std::collections::BTreeMap<String, String>>>,
    ca_file: Option<Spanned<String>>,
    client_cert_file: Option<Spanned<String>>,
    client_key_file: Option<Spanned<String>>,
}

/// Headers the gateway sets itself, or that speak of the connection rather than the request
/// (HTTP/1.1 framing and the hop-by-hop fields of RFC 9110 §7.6.1): a static header of these
/// names would contradict the request.
/// The fields of the connection itself (framing, hop-by-hop per RFC 9110 §7.6.1, the
/// host): neither the operator's table nor a message may set them on a push request.
pub(crate) const CONNECTION_HEADERS: &[&str] = &[
    "content-length",
    "transfer-encoding",
    "connection",
    "proxy-connection",
    "keep-alive",
    "te",
    "trailer",
    "upgrade",
    "expect",
    "host",
];
/// Besides those, what the gateway itself writes on every request.
const RESERVED_HEADERS: &[&str] = &["content-type", "traceparent", "tracestate"];
const RESERVED_PREFIXES: &[&str] = &["webhook-", "ruststream-", "ce-"];

/// Where a value was wrong: its byte span in the file, the key under `push`, and why.
pub(super) type Refusal = (std::ops::Range<usize>, String, String);

impl PushEntry {
    /// Check the table; files named relative to `base` (the consumers file's directory).
    pub(super) fn check(&self, ack_wait: Duration, base: &Path) -> Result<PushSpec, Refusal> {
        let refuse = |span: std::ops::Range<usize>, key: &str, why: String| {
            Err::<PushSpec, Refusal>((span, key.to_owned(), why))
        };
        let url = match reqwest::Url::parse(self.url.get_ref()) {
            Ok(url) if matches!(url.scheme(), "http" | "https") && url.host().is_some() => url,
            Ok(_) => {
                return refuse(
                    self.url.span(),
                    "url",
                    "must be an http:// or https:// URL with a host".into(),
                );
            }
            Err(err) => return refuse(self.url.span(), "url", err.to_string()),
        };
        let format = match self.format.as_ref().map(|value| value.get_ref().as_str()) {
            None | Some("json") => PushFormat::Json,
            Some("binary") => PushFormat::Binary,
            Some("cloudevents") => PushFormat::CloudEvents,
            Some(_) => {
                return refuse(
                    span(self.format.as_ref()),
                    "format",
                    "must be one of json, binary, cloudevents".into(),
                );
            }
        };
        let batch = number(self.batch.as_ref(), "batch", 1, 1000, 1)?;
        if batch > 1 && format != PushFormat::Json {
            return refuse(
                span(self.batch.as_ref()),
                "batch",
                "above 1 only with format = \"json\"".into(),
            );
        }
        let batch_wait = duration(
            self.batch_wait.as_ref(),
            "batch_wait",
            Duration::from_millis(50),
            Duration::ZERO,
        )?;
        let timeout = duration(
            self.timeout.as_ref(),
            "timeout",
            Duration::from_secs(10),
            Duration::from_millis(1),
        )?;
        let lease = ack_wait.saturating_sub(lease_margin(ack_wait));
        if timeout >= lease {
            return refuse(
                span(self.timeout.as_ref()),
                "timeout",
                format!(
                    "must be below the consumer's lease ({} = ack_wait {} less its margin): an answer after it would come for a lease already ended",
                    humantime::format_duration(lease),
                    humantime::format_duration(ack_wait),
                ),
            );
        }
        let retry_initial = duration(
            self.retry_initial.as_ref(),
            "retry_initial",
            Duration::from_secs(1),
            Duration::from_millis(1),
        )?;
        let retry_max = duration(
            self.retry_max.as_ref(),
            "retry_max",
            Duration::from_secs(600),
            Duration::from_millis(1),
        )?;
        if retry_max < retry_initial {
            return refuse(
                span(self.retry_max.as_ref()),
                "retry_max",
                "must not be below retry_initial".into(),
            );
        }
        let secrets = match &self.signing_secret_file {
            Some(file) => read_secrets(&base.join(file.get_ref()))
                .map_err(|why| (file.span(), "signing_secret_file".to_owned(), why))?,
            None => Vec::new(),
        };
        let mut headers = Vec::new();
        if let Some(table) = &self.headers {
            for (name, value) in table.get_ref() {
                check_header(name, value)
                    .map_err(|why| (table.span(), format!("headers.{name}"), why))?;
                headers.push((name.clone(), value.clone()));
            }
        }
        let read = |file: &Spanned<String>, key: &str| {
            let path = base.join(file.get_ref());
            std::fs::read(&path).map_err(|err| {
                (
                    file.span(),
                    key.to_owned(),
                    format!("{}: {err}", path.display()),
                )
            })
        };
        let ca = self
            .ca_file
            .as_ref()
            .map(|file| {
                let pem = read(file, "ca_file")?;
                crate::tls_client::check_certificates(&pem)
                    .map_err(|why| (file.span(), "ca_file".to_owned(), why))?;
                Ok::<_, Refusal>(pem)
            })
            .transpose()?;
        let client = match (&self.client_cert_file, &self.client_key_file) {
            (None, None) => None,
            (Some(cert), Some(key)) => {
                let (cert_pem, key_pem) = (
                    read(cert, "client_cert_file")?,
                    read(key, "client_key_file")?,
                );
                crate::tls_client::check_identity(&cert_pem, &key_pem)
                    .map_err(|why| (cert.span(), "client_cert_file".to_owned(), why))?;
                Some((cert_pem, key_pem))
            }
            (Some(cert), None) => {
                return refuse(
                    cert.span(),
                    "client_key_file",
                    "client_cert_file needs client_key_file".into(),
                );
            }
            (None, Some(key)) => {
                return refuse(
                    key.span(),
                    "client_cert_file",
                    "client_key_file needs client_cert_file".into(),
                );
            }
        };
        Ok(PushSpec {
            url,
            format,
            batch,
            batch_wait,
            timeout,
            max_in_flight: number(self.max_in_flight.as_ref(), "max_in_flight", 1, 10_000, 64)?,
            rate_limit: u32::try_from(number(
                self.rate_limit.as_ref(),
                "rate_limit",
                0,
                1_000_000,
                0,
            )?)
            .unwrap_or(u32::MAX),
            retry_initial,
            retry_max,
            retry_after_max: duration(
                self.retry_after_max.as_ref(),
                "retry_after_max",
                Duration::from_secs(300),
                Duration::ZERO,
            )?,
            secrets,
            headers,
            tls: PushTls { ca, client },
        })
    }
}

fn span<T>(value: Option<&Spanned<T>>) -> std::ops::Range<usize> {
    value.map_or(0..0, Spanned::span)
}

fn number(
    value: Option<&Spanned<i64>>,
    key: &str,
    least: i64,
    most: i64,
    default: usize,
) -> Result<usize, Refusal> {
    let Some(value) = value else {
        return Ok(default);
    };
    let number = *value.get_ref();
    if (least..=most).contains(&number) {
        Ok(usize::try_from(number).unwrap_or(default))
    } else {
        Err((
            value.span(),
            key.to_owned(),
            format!("must be from {least} to {most}"),
        ))
    }
}

fn duration(
    value: Option<&Spanned<String>>,
    key: &str,
    default: Duration,
    least: Duration,
) -> Result<Duration, Refusal> {
    let Some(value) = value else {
        return Ok(default);
    };
    let refused = |why: String| (value.span(), key.to_owned(), why);
    let parsed =
        humantime::parse_duration(value.get_ref()).map_err(|err| refused(err.to_string()))?;
    if parsed < least {
        return Err(refused(format!(
            "must be at least {}",
            humantime::format_duration(least)
        )));
    }
    Ok(parsed)
}

/// One Standard Webhooks secret a line (`whsec_<base64>`); blank lines and `#` comments
/// skipped; at least one.
fn read_secrets(path: &PathBuf) -> Result<Vec<SigningSecret>, String> {
    let text = std::fs::read_to_string(path).map_err(|err| format!("{}: {err}", path.display()))?;
    let mut secrets = Vec::new();
    for (at, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let encoded = line.strip_prefix("whsec_").ok_or_else(|| {
            format!(
                "{} line {}: a secret is whsec_<base64>",
                path.display(),
                at + 1
            )
        })?;
        let secret = STANDARD.decode(encoded).map_err(|err| {
            format!(
                "{} line {}: not base64 after whsec_: {err}",
                path.display(),
                at + 1
            )
        })?;
        if secret.len() < 16 {
            return Err(format!(
                "{} line {}: a secret of {} bytes is too short (at least 16; Standard Webhooks suggests 24 to 64)",
                path.display(),
                at + 1,
                secret.len()
            ));
        }
        secrets.push(SigningSecret(secret));
    }
    if secrets.is_empty() {
        return Err(format!("{}: no secret in it", path.display()));
    }
    Ok(secrets)
}

fn check_header(name: &str, value: &str) -> Result<(), String> {
    let parsed = reqwest::header::HeaderName::from_bytes(name.as_bytes())
        .map_err(|_| "not a valid HTTP header name".to_owned())?;
    reqwest::header::HeaderValue::from_str(value)
        .map_err(|_| "its value is not a valid HTTP header value".to_owned())?;
    let lower = parsed.as_str();
    if CONNECTION_HEADERS.contains(&lower)
        || RESERVED_HEADERS.contains(&lower)
        || RESERVED_PREFIXES
            .iter()
            .any(|prefix| lower.starts_with(prefix))
    {
        return Err("the gateway sets this header itself".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn static_headers_may_set_credentials_but_never_the_connections_own_fields() {
        for name in ["Authorization", "Proxy-Authorization", "Cookie", "X-Tenant"] {
            assert_eq!(check_header(name, "value"), Ok(()), "{name}");
        }
        for name in [
            "Connection",
            "Keep-Alive",
            "TE",
            "Trailer",
            "Upgrade",
            "Expect",
            "Proxy-Connection",
            "Transfer-Encoding",
            "Host",
            "ce-id",
            "Ruststream-Lease-Id",
        ] {
            assert!(check_header(name, "value").is_err(), "{name}");
        }
    }
}
