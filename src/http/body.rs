//! The JSON body extractor: any Content-Type (curl's `-d` sends a form type), an empty body
//! means "all defaults", and every rejection is problem+json naming the field at fault.
//!
//! May import: as the rest of `http`.

use axum::extract::{FromRequest, Request};
use axum::http::header;
use futures::StreamExt;
use serde::de::DeserializeOwned;

use super::client::Connection;
use crate::error::Error;

/// Most bytes a request body may have by default (a 1000-id batch settle needs about 70 KB);
/// `--max-body-bytes` changes it.
pub(crate) const BODY_LIMIT: usize = crate::config::DEFAULT_MAX_BODY_BYTES as usize;
/// An oversized body is still read (and dropped) up to this size before the 413 goes out:
/// closing a connection with unread data resets it, and the client may then never see the
/// answer. Past this, or with a larger Content-Length, the connection is cut at once.
const DRAIN_LIMIT: usize = 16 * 1024 * 1024;

/// A JSON request body, `T::default()` when empty.
pub(crate) struct JsonBody<T>(pub T);

impl<S, T> FromRequest<S> for JsonBody<T>
where
    S: Send + Sync,
    T: DeserializeOwned + Default,
{
    type Rejection = Error;

    async fn from_request(req: Request, _state: &S) -> Result<Self, Self::Rejection> {
        parse(&read_body(req).await?).map(JsonBody)
    }
}

/// A JSON request body that must be there: an empty body is refused (422) rather than read
/// as "all defaults", for an endpoint whose defaults would do too much (a redrive of every
/// dead letter); `{}` still asks for the defaults.
pub(crate) struct RequiredJsonBody<T>(pub T);

impl<S, T> FromRequest<S> for RequiredJsonBody<T>
where
    S: Send + Sync,
    T: DeserializeOwned + Default,
{
    type Rejection = Error;

    async fn from_request(req: Request, _state: &S) -> Result<Self, Self::Rejection> {
        let bytes = read_body(req).await?;
        if bytes.is_empty() {
            return Err(Error::Invalid {
                field: None,
                detail: "this endpoint needs a JSON body (`{}` for all defaults)".into(),
            });
        }
        parse(&bytes).map(RequiredJsonBody)
    }
}

/// Read a request's body within the connection's limit and read timeout.
async fn read_body(req: Request) -> Result<Vec<u8>, Error> {
    let rules = req
        .extensions()
        .get::<Connection>()
        .map(|connection| connection.body);
    let limit = rules.map_or(BODY_LIMIT, |rules| rules.limit);
    let too_large = || Error::PayloadTooLarge { limit };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|length| length.to_str().ok())
        .and_then(|length| length.parse::<usize>().ok());
    if declared.is_some_and(|length| length > DRAIN_LIMIT.max(limit)) {
        return Err(too_large());
    }
    let read = read_limited(req.into_body(), limit);
    match rules.map(|rules| rules.read_timeout) {
        Some(timeout) => tokio::time::timeout(timeout, read)
            .await
            .map_err(|_| Error::BodyTimeout { timeout })?,
        None => read.await,
    }
}

/// Read a body up to `limit` bytes (413 beyond), draining up to [`DRAIN_LIMIT`].
async fn read_limited(body: axum::body::Body, limit: usize) -> Result<Vec<u8>, Error> {
    let too_large = || Error::PayloadTooLarge { limit };
    let mut body = body.into_data_stream();
    let mut bytes = Vec::new();
    let mut read = 0usize;
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|err| Error::Malformed {
            detail: format!("could not read the request body: {err}"),
        })?;
        read += chunk.len();
        if read > DRAIN_LIMIT.max(limit) {
            return Err(too_large());
        }
        if read <= limit {
            bytes.extend_from_slice(&chunk);
        }
    }
    if read > limit {
        return Err(too_large());
    }
    Ok(bytes)
}

/// Parse a body, mapping serde's errors to 400 (not JSON) or 422 (wrong shape or value).
pub(crate) fn parse<T: DeserializeOwned + Default>(bytes: &[u8]) -> Result<T, Error> {
    // No body at all; whitespace alone is not JSON (400, as the spec's schema says).
    if bytes.is_empty() {
        return Ok(T::default());
    }
    // Every body is a JSON object; serde would also build a struct from an array (`[5000]`).
    if bytes.iter().find(|byte| !byte.is_ascii_whitespace()) != Some(&b'{') {
        return Err(
            match serde_json::from_slice::<serde::de::IgnoredAny>(bytes) {
                Ok(_) => Error::Invalid {
                    field: None,
                    detail: "the request body must be a JSON object".into(),
                },
                Err(err) => Error::Malformed {
                    detail: format!("the request body is not valid JSON: {err}"),
                },
            },
        );
    }
    // Parsed once without tracking where it is (a batch of 1000 ids pays per element for
    // that); only a body that fails is parsed again to name the field at fault.
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    if let Ok(parsed) = T::deserialize(&mut deserializer) {
        // Trailing bytes after the JSON value make the body malformed too.
        deserializer.end().map_err(|err| Error::Malformed {
            detail: format!("the request body is not valid JSON: {err}"),
        })?;
        return Ok(parsed);
    }
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let parsed: Result<T, _> = serde_path_to_error::deserialize(&mut deserializer);
    if parsed.is_ok() {
        // Trailing bytes after the JSON value make the body malformed too.
        deserializer.end().map_err(|err| Error::Malformed {
            detail: format!("the request body is not valid JSON: {err}"),
        })?;
    }
    parsed.map_err(|err| {
        let path = err.path().to_string();
        let inner = err.into_inner();
        match inner.classify() {
            serde_json::error::Category::Data => {
                let message = strip_position(&inner.to_string());
                // serde_path_to_error's path already ends with an unknown field's name; a
                // field left out is named by serde's message alone.
                let field = if path.is_empty() || path == "." {
                    named_field(&message).map(str::to_owned)
                } else {
                    Some(path)
                };
                let detail = match &field {
                    Some(field) => format!("{field}: {message}"),
                    None => message,
                };
                Error::Invalid { field, detail }
            }
            _ => Error::Malformed {
                detail: format!("the request body is not valid JSON: {inner}"),
            },
        }
    })
}

/// serde_json appends " at line L column C", which says little to an HTTP client.
fn strip_position(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(at) => message[..at].to_owned(),
        None => message.to_owned(),
    }
}

/// The field serde names in "unknown field `x`" or "missing field `x`".
fn named_field(message: &str) -> Option<&str> {
    let rest = message
        .strip_prefix("unknown field `")
        .or_else(|| message.strip_prefix("missing field `"))?;
    rest.split('`').next()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Default, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Sample {
        #[allow(dead_code)]
        batch: Option<u32>,
    }

    #[derive(Debug, Default, Deserialize)]
    struct Required {
        #[allow(dead_code)]
        ids: Vec<String>,
    }

    fn field_of(body: &str) -> Option<String> {
        match parse::<Sample>(body.as_bytes()) {
            Err(Error::Invalid { field, .. }) => field,
            other => panic!("expected a 422, got {other:?}"),
        }
    }

    #[test]
    fn empty_body_means_defaults() {
        assert!(parse::<Sample>(b"").is_ok());
        assert!(matches!(
            parse::<Sample>(b" \r\n"),
            Err(Error::Malformed { .. })
        ));
    }

    #[test]
    fn names_the_field_at_fault() {
        assert_eq!(field_of(r#"{"batch": "ten"}"#).as_deref(), Some("batch"));
        assert_eq!(field_of(r#"{"batch": -1}"#).as_deref(), Some("batch"));
        assert_eq!(field_of(r#"{"bacth": 1}"#).as_deref(), Some("bacth"));
        match parse::<Required>(b"{}") {
            Err(Error::Invalid { field, detail }) => {
                assert_eq!(field.as_deref(), Some("ids"));
                assert_eq!(detail, "ids: missing field `ids`");
            }
            other => panic!("expected a 422 naming ids, got {other:?}"),
        }
    }

    #[test]
    fn a_body_is_an_object() {
        for body in ["[]", "[5]", "5", "\"x\"", "null", " true "] {
            assert!(
                matches!(
                    parse::<Sample>(body.as_bytes()),
                    Err(Error::Invalid { field: None, .. })
                ),
                "{body}"
            );
        }
        assert!(matches!(
            parse::<Sample>(b"[1"),
            Err(Error::Malformed { .. })
        ));
    }

    #[test]
    fn syntax_errors_are_malformed() {
        assert!(matches!(
            parse::<Sample>(b"{\"batch\": "),
            Err(Error::Malformed { .. })
        ));
        assert!(matches!(
            parse::<Sample>(b"{} trailing"),
            Err(Error::Malformed { .. })
        ));
    }

    /// The fetch body's integer fields, through the parser every handler uses.
    #[test]
    fn integers_may_be_spelled_as_integral_floats() {
        let body: crate::http::dto::FetchBody =
            parse(br#"{"batch": 10.0, "wait_ms": 5e3, "max_bytes": 1}"#)
                .expect("integral floats are integers");
        assert_eq!(
            (body.batch, body.wait_ms, body.max_bytes),
            (Some(10), Some(5000), Some(1))
        );
        for bad in [
            r#"{"batch": 1.5}"#,
            r#"{"batch": -1}"#,
            r#"{"batch": 5e9}"#,
            r#"{"wait_ms": "1"}"#,
            r#"{"max_bytes": 9223372036854775808}"#,
            r#"{"max_bytes": 1e19}"#,
        ] {
            match parse::<crate::http::dto::FetchBody>(bad.as_bytes()) {
                Err(Error::Invalid { field, .. }) => assert!(field.is_some(), "{bad}"),
                other => panic!("{bad}: {other:?}"),
            }
        }
    }

    mod properties {
        use super::*;
        use crate::http::dto::{
            BatchAckBody, BatchNakBody, BatchTermBody, FetchBody, NakBody, PublishBody, TermBody,
        };
        use proptest::prelude::*;

        /// Parse as every body type: each outcome is a value, 400 or 422 — never a panic,
        /// never a server error.
        fn parse_all(bytes: &[u8]) -> Result<(), TestCaseError> {
            fn check<T: DeserializeOwned + Default>(bytes: &[u8]) -> Result<(), TestCaseError> {
                match parse::<T>(bytes) {
                    Ok(_) => Ok(()),
                    Err(err @ (Error::Malformed { .. } | Error::Invalid { .. })) => {
                        prop_assert!(err.status().is_client_error());
                        Ok(())
                    }
                    Err(other) => Err(TestCaseError::fail(format!("unexpected {other:?}"))),
                }
            }
            check::<FetchBody>(bytes)?;
            check::<NakBody>(bytes)?;
            check::<TermBody>(bytes)?;
            check::<BatchAckBody>(bytes)?;
            check::<BatchNakBody>(bytes)?;
            check::<BatchTermBody>(bytes)?;
            check::<PublishBody>(bytes)
        }

        /// JSON values whose keys are mostly the fields the bodies know, with values of any
        /// type: reaches the field checks, not only the syntax errors.
        fn json_value() -> impl Strategy<Value = serde_json::Value> {
            let leaf = prop_oneof![
                Just(serde_json::Value::Null),
                any::<bool>().prop_map(serde_json::Value::from),
                any::<i64>().prop_map(serde_json::Value::from),
                any::<u64>().prop_map(serde_json::Value::from),
                any::<f64>().prop_map(serde_json::Value::from),
                ".{0,12}".prop_map(serde_json::Value::from),
            ];
            let key = prop_oneof![
                proptest::sample::select(vec![
                    "batch",
                    "wait_ms",
                    "max_bytes",
                    "encoding",
                    "delay_ms",
                    "reason",
                    "ids",
                    "subject",
                    "data",
                    "headers",
                ])
                .prop_map(str::to_owned),
                ".{0,8}",
            ];
            leaf.prop_recursive(3, 24, 6, move |inner| {
                prop_oneof![
                    proptest::collection::vec(inner.clone(), 0..6)
                        .prop_map(serde_json::Value::from),
                    proptest::collection::btree_map(key.clone(), inner, 0..6)
                        .prop_map(|map| serde_json::Value::Object(map.into_iter().collect())),
                ]
            })
        }

        proptest! {
            #[test]
            fn arbitrary_bytes_are_a_value_or_a_client_error(
                bytes in proptest::collection::vec(any::<u8>(), 0..256)
            ) {
                parse_all(&bytes)?;
            }

            #[test]
            fn arbitrary_json_is_a_value_or_a_client_error(value in json_value()) {
                parse_all(value.to_string().as_bytes())?;
            }
        }
    }
}
