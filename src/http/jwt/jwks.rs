//! The issuer's signing keys as JWKS documents hold them: read from a file or fetched from
//! a URL (one GET, no redirect, no proxy, bounded in time and size), and which of a
//! document's keys the gateway can use — each for the one algorithm its type implies.
//!
//! May import: as the rest of `http`.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{Request, StatusCode, Uri, header};
use hyper_util::rt::TokioIo;
use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, KeyAlgorithm, PublicKeyUse};
use jsonwebtoken::{Algorithm, DecodingKey};
use serde_json::Value;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls;
use tracing::debug;

/// The whole of one JWKS fetch: connect, TLS, request and body.
const FETCH_TIMEOUT: Duration = Duration::from_secs(3);
/// Largest JWKS read: a set of a few keys is a few KiB.
const MAX_JWKS_BYTES: usize = 1024 * 1024;

/// One signing key, usable for exactly one algorithm.
pub(super) struct Key {
    pub(super) kid: Option<String>,
    pub(super) algorithm: Algorithm,
    pub(super) decoding: DecodingKey,
}

pub(super) fn read_file(path: &Path) -> Result<Vec<Arc<Key>>, String> {
    let bytes = std::fs::read(path).map_err(|err| err.to_string())?;
    parse_jwks(&bytes)
}

/// The usable keys of a JWKS document. Keys the gateway cannot use (encryption keys, other
/// curves, symmetric keys) are skipped, so an issuer's full set still loads; a set with no
/// usable key at all is an error.
pub(super) fn parse_jwks(bytes: &[u8]) -> Result<Vec<Arc<Key>>, String> {
    let document: Value =
        serde_json::from_slice(bytes).map_err(|err| format!("not a JWKS: {err}"))?;
    let Some(Value::Array(entries)) = document.get("keys") else {
        return Err("not a JWKS: no \"keys\" array".into());
    };
    let mut keys = Vec::new();
    for (index, entry) in entries.iter().enumerate() {
        let parsed = serde_json::from_value::<Jwk>(entry.clone())
            .map_err(|err| err.to_string())
            .and_then(|jwk| usable_key(&jwk));
        match parsed {
            Ok(key) => keys.push(Arc::new(key)),
            Err(why) => debug!(index, %why, "JWKS key skipped"),
        }
    }
    if keys.is_empty() {
        return Err(format!(
            "no RS256, ES256 or EdDSA signing key among its {} keys",
            entries.len()
        ));
    }
    Ok(keys)
}

/// A JWK as a key for the one algorithm its type implies (and its `alg`, if any, names).
fn usable_key(jwk: &Jwk) -> Result<Key, String> {
    if let Some(usage) = &jwk.common.public_key_use
        && *usage != PublicKeyUse::Signature
    {
        return Err("not a signing key (`use`)".into());
    }
    let algorithm = match &jwk.algorithm {
        AlgorithmParameters::RSA(_) => Algorithm::RS256,
        AlgorithmParameters::EllipticCurve(params) if params.curve == EllipticCurve::P256 => {
            Algorithm::ES256
        }
        AlgorithmParameters::OctetKeyPair(params) if params.curve == EllipticCurve::Ed25519 => {
            Algorithm::EdDSA
        }
        AlgorithmParameters::OctetKey(_) => {
            return Err("a symmetric key: HMAC tokens are not accepted".into());
        }
        _ => return Err("a key type or curve other than RSA, P-256 and Ed25519".into()),
    };
    if let Some(declared) = jwk.common.key_algorithm {
        let agrees = matches!(
            (declared, algorithm),
            (KeyAlgorithm::RS256, Algorithm::RS256)
                | (KeyAlgorithm::ES256, Algorithm::ES256)
                | (KeyAlgorithm::EdDSA, Algorithm::EdDSA)
        );
        if !agrees {
            return Err(format!("a key for {declared:?}"));
        }
    }
    let decoding = DecodingKey::from_jwk(jwk).map_err(|err| format!("unusable key: {err}"))?;
    Ok(Key {
        kid: jwk.common.key_id.clone(),
        algorithm,
        decoding,
    })
}

/// `--auth-jwks-url`, ready to fetch: one GET over a fresh HTTP/1.1 connection per read
/// (every few minutes: no pool needed), TLS for `https` against the system's roots.
/// Redirects are not followed and no proxy is used.
pub(super) struct JwksUrl {
    pub(super) shown: String,
    uri: Uri,
    host: String,
    port: u16,
    tls: Option<TlsConnector>,
}

impl JwksUrl {
    pub(super) fn parse(text: &str) -> anyhow::Result<Self> {
        let refused = |why: &str| anyhow::anyhow!("--auth-jwks-url {text}: {why}");
        let uri: Uri = text.parse().map_err(|_| refused("not a URL"))?;
        let https = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => return Err(refused("must be an http:// or https:// URL")),
        };
        let host = uri
            .host()
            .filter(|host| !host.is_empty())
            .ok_or_else(|| refused("has no host"))?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
        let tls = if https {
            Some(tls_connector().map_err(|why| refused(&why))?)
        } else {
            None
        };
        Ok(Self {
            shown: text.to_owned(),
            uri,
            host,
            port,
            tls,
        })
    }

    pub(super) async fn fetch(&self) -> Result<Bytes, String> {
        tokio::time::timeout(FETCH_TIMEOUT, self.get())
            .await
            .map_err(|_| format!("no answer within {}s", FETCH_TIMEOUT.as_secs()))?
    }

    async fn get(&self) -> Result<Bytes, String> {
        let tcp = TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(|err| format!("connecting: {err}"))?;
        match &self.tls {
            Some(tls) => {
                let name = rustls::pki_types::ServerName::try_from(self.host.clone())
                    .map_err(|err| format!("TLS server name: {err}"))?;
                let stream = tls
                    .connect(name, tcp)
                    .await
                    .map_err(|err| format!("TLS: {err}"))?;
                self.exchange(TokioIo::new(stream)).await
            }
            None => self.exchange(TokioIo::new(tcp)).await,
        }
    }

    async fn exchange<I>(&self, io: I) -> Result<Bytes, String>
    where
        I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    {
        let (mut sender, connection) = hyper::client::conn::http1::handshake::<_, Body>(io)
            .await
            .map_err(|err| format!("HTTP: {err}"))?;
        // Drives the connection; dropped (and the socket closed) with this read.
        let _connection = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(connection));
        let target = self
            .uri
            .path_and_query()
            .map_or("/", |target| target.as_str());
        let host = match self.uri.port() {
            Some(port) => format!("{}:{port}", self.uri.host().unwrap_or_default()),
            None => self.uri.host().unwrap_or_default().to_owned(),
        };
        let request = Request::get(target)
            .header(header::HOST, host)
            .header(header::ACCEPT, "application/jwk-set+json, application/json")
            .header(
                header::USER_AGENT,
                concat!("ruststream-nats/", env!("CARGO_PKG_VERSION")),
            )
            .body(Body::empty())
            .map_err(|err| format!("building the request: {err}"))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|err| format!("HTTP: {err}"))?;
        if response.status() != StatusCode::OK {
            return Err(format!("answered {}", response.status()));
        }
        axum::body::to_bytes(Body::new(response.into_body()), MAX_JWKS_BYTES)
            .await
            .map_err(|err| format!("reading the answer: {err}"))
    }
}

/// TLS for an `https` JWKS URL: the system's roots ([`crate::tls_client`]); none is an error.
fn tls_connector() -> Result<TlsConnector, String> {
    let (config, roots) = crate::tls_client::config()?;
    if roots == 0 {
        return Err("no system root certificates to verify it with".into());
    }
    Ok(TlsConnector::from(Arc::new(config)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_asymmetric_signing_keys_load() {
        let jwks = serde_json::json!({"keys": [
            {"kty": "oct", "k": "c2VjcmV0LXNlY3JldC1zZWNyZXQ", "kid": "hmac"},
            {"kty": "RSA", "use": "enc", "kid": "enc", "n": "AQAB", "e": "AQAB"},
            {"kty": "RSA", "alg": "PS256", "kid": "pss", "n": "AQAB", "e": "AQAB"},
            {"kty": "OKP", "crv": "Ed25519", "kid": "ed", "x": "11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"},
            {"kty": "whatever"},
        ]});
        let keys = parse_jwks(jwks.to_string().as_bytes()).expect("one usable key");
        assert_eq!(keys.len(), 1);
        assert_eq!(keys[0].kid.as_deref(), Some("ed"));
        assert_eq!(keys[0].algorithm, Algorithm::EdDSA);
        let none = serde_json::json!({"keys": [{"kty": "oct", "k": "c2VjcmV0"}]});
        assert!(parse_jwks(none.to_string().as_bytes()).is_err());
        assert!(parse_jwks(b"{\"key\": []}").is_err());
        assert!(parse_jwks(b"not json").is_err());
    }

    #[test]
    fn jwks_urls_are_http_or_https_with_a_host() {
        let url = JwksUrl::parse("http://127.0.0.1:9000/keys?x=1").expect("parses");
        assert_eq!((url.host.as_str(), url.port), ("127.0.0.1", 9000));
        assert!(url.tls.is_none());
        let url = JwksUrl::parse("http://[::1]/jwks").expect("parses");
        assert_eq!((url.host.as_str(), url.port), ("::1", 80));
        for bad in ["ftp://host/keys", "/keys", "http:///keys", "not a url"] {
            let err = JwksUrl::parse(bad).err().expect("refused").to_string();
            assert!(err.starts_with("--auth-jwks-url"), "{err}");
        }
    }
}
