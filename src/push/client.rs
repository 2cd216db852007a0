//! The HTTP client of one push table (its timeout, no redirects, its TLS) and what the
//! worker reads of an answer or a failure.
//!
//! May import: as the rest of `push`.

use crate::config::PushSpec;

/// The most of an answer's body read (a batch's results): more is an endpoint's mistake.
const MOST_ANSWER_BYTES: usize = 1 << 20;

/// The HTTP client of one push table: its timeout, no redirects, its TLS.
pub(super) fn client_for(spec: &PushSpec) -> Result<reqwest::Client, String> {
    let tls = crate::tls_client::config_for(
        spec.tls.ca.as_deref(),
        spec.tls
            .client
            .as_ref()
            .map(|(cert, key)| (cert.as_slice(), key.as_slice())),
    )?;
    reqwest::Client::builder()
        .timeout(spec.timeout)
        .redirect(reqwest::redirect::Policy::none())
        .tls_backend_preconfigured(tls)
        .build()
        .map_err(|err| format!("{err}"))
}

/// The body of an answer, up to [`MOST_ANSWER_BYTES`] (what it says past that is ignored).
pub(super) async fn read_some(mut response: reqwest::Response) -> Vec<u8> {
    let mut body = Vec::new();
    while let Ok(Some(chunk)) = response.chunk().await {
        body.extend_from_slice(&chunk);
        if body.len() >= MOST_ANSWER_BYTES {
            break;
        }
    }
    body
}

/// A request's failure, without its URL.
pub(super) fn describe(err: &reqwest::Error) -> String {
    use std::error::Error as _;
    let mut why = if err.is_timeout() {
        "timed out".to_owned()
    } else if err.is_connect() {
        "cannot connect".to_owned()
    } else {
        "request failed".to_owned()
    };
    let mut source = err.source();
    while let Some(cause) = source {
        why.push_str(": ");
        why.push_str(&cause.to_string());
        source = cause.source();
    }
    why
}
