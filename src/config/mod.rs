//! Command-line flags and environment variables, parsed into validated settings.
//!
//! Every flag has an environment variable; NATS settings keep the names NATS tools use.
//!
//! May import: `domain` (subject rules). Usable from every room.

mod consumers_file;
mod durability;
mod nats_url;
mod push;
pub(crate) use push::CONNECTION_HEADERS;

pub use consumers_file::{ConsumerSpec, load as load_consumers_file};
pub use durability::DurabilityLevel;
use nats_url::parse_nats_urls;
pub use nats_url::{NatsServers, UrlCredentials};
pub use push::{PushFormat, PushSpec};

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use clap::Parser;
use time::OffsetDateTime;

use crate::domain::consumers::ConsumerPatterns;
pub use crate::domain::ordering::OrderingKeySpec;
use time::format_description::well_known::Rfc3339;

/// The default of `--max-body-bytes`: 256 KiB fits a 1000-id batch settle.
pub(crate) const DEFAULT_MAX_BODY_BYTES: u32 = 262_144;

/// `--internal-prefix` when not given.
pub(crate) const DEFAULT_INTERNAL_PREFIX: &str = "_RUSTSTREAM";

/// An HTTP gateway that leases NATS JetStream messages to HTTP clients.
#[derive(Debug, Clone, Parser)]
#[command(name = "ruststream-nats", version, about, long_about = None)]
pub struct Config {
    /// NATS server URL (comma-separated for several servers).
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222", value_parser = parse_nats_urls)]
    pub nats_url: String,

    /// NATS credentials file (JWT + nkey seed).
    #[arg(long, env = "NATS_CREDS", conflicts_with_all = ["nats_nkey", "nats_user", "nats_token"])]
    pub nats_creds: Option<PathBuf>,

    /// File holding a NATS user nkey seed (`SU…`), for servers that authenticate by nkey.
    #[arg(long, env = "NATS_NKEY", conflicts_with_all = ["nats_user", "nats_token"])]
    pub nats_nkey: Option<PathBuf>,

    /// NATS user name (with --nats-password).
    #[arg(
        long,
        env = "NATS_USER",
        requires = "nats_password",
        conflicts_with = "nats_token"
    )]
    pub nats_user: Option<String>,

    /// NATS password (with --nats-user). Prefer the environment variable: flags show in `ps`.
    #[arg(
        long,
        env = "NATS_PASSWORD",
        requires = "nats_user",
        hide_env_values = true
    )]
    pub nats_password: Option<Secret>,

    /// NATS authentication token. Prefer the environment variable: flags show in `ps`.
    #[arg(long, env = "NATS_TOKEN", hide_env_values = true)]
    pub nats_token: Option<Secret>,

    /// CA certificate (PEM) that signed the NATS server's certificate; implies TLS.
    #[arg(long, env = "NATS_CA")]
    pub nats_tls_ca: Option<PathBuf>,

    /// Client certificate (PEM) for NATS servers that verify clients (with --nats-tls-key).
    #[arg(long, env = "NATS_CERT", requires = "nats_tls_key")]
    pub nats_tls_cert: Option<PathBuf>,

    /// Private key (PEM) of --nats-tls-cert.
    #[arg(long, env = "NATS_KEY", requires = "nats_tls_cert")]
    pub nats_tls_key: Option<PathBuf>,

    /// JetStream stream to consume from.
    #[arg(long, env = "RUSTSTREAM_STREAM", default_value = "ORDERS", value_parser = parse_name)]
    pub stream: String,

    /// Consumer name (the durable name unless --ephemeral).
    #[arg(long, env = "RUSTSTREAM_CONSUMER", default_value = "billing", value_parser = parse_name)]
    pub consumer: String,

    /// Only deliver messages whose subject matches this filter. Not given: an existing
    /// consumer keeps its filter, a new one gets none.
    #[arg(long, env = "RUSTSTREAM_FILTER_SUBJECT", value_parser = parse_filter)]
    pub filter_subject: Option<String>,

    /// Where a new consumer starts: all | last | new | last-per-subject |
    /// by-start-sequence=N | by-start-time=RFC3339. Immutable once the consumer exists.
    #[arg(long, env = "RUSTSTREAM_DELIVER_POLICY", default_value = "all")]
    pub deliver_policy: DeliverPolicy,

    /// How long a leased message may stay unsettled before NATS redelivers it (e.g. 30s, 1m);
    /// at least 1s.
    #[arg(long, env = "RUSTSTREAM_ACK_WAIT", default_value = "30s", value_parser = parse_ack_wait)]
    pub ack_wait: Duration,

    /// Most messages leased out at once (the consumer's max_ack_pending).
    #[arg(long, env = "RUSTSTREAM_MAX_ACK_PENDING", default_value_t = 1024,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub max_ack_pending: u32,

    /// Most deliveries of one message; not given: the server's default (unlimited), and an
    /// existing consumer keeps its value.
    #[arg(long, env = "RUSTSTREAM_MAX_DELIVER",
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_deliver: Option<u32>,

    /// Republish messages that exhausted --max-deliver or were terminated to this subject
    /// (with their headers and delivery metadata); a stream must capture it. Not given: off.
    #[arg(long, env = "RUSTSTREAM_DEAD_LETTER_SUBJECT", value_parser = parse_dead_letter_subject)]
    pub dead_letter_subject: Option<String>,

    /// Lease the default consumer's messages one at a time per key, in stream order:
    /// `subject:<n>` (the n-th subject token, from 1), `header:<Name>`, or `header`
    /// (the Ruststream-Ordering-Key header). Not given: unordered.
    #[arg(long, env = "RUSTSTREAM_ORDERING_KEY")]
    pub ordering_key: Option<OrderingKeySpec>,

    /// Use an ephemeral consumer (no durable name); the server removes it after the gateway is gone.
    #[arg(long, env = "RUSTSTREAM_EPHEMERAL")]
    pub ephemeral: bool,

    /// Serve no default consumer (--stream/--consumer): only those of --consumers-file and
    /// --serve-existing, at /streams/{stream}/consumers/{consumer}/….
    #[arg(long, env = "RUSTSTREAM_NO_DEFAULT_CONSUMER")]
    pub no_default_consumer: bool,

    /// TOML file declaring more consumers to serve (`[[consumer]]` with stream, name and
    /// optional settings); read again when it changes.
    #[arg(long, env = "RUSTSTREAM_CONSUMERS_FILE")]
    pub consumers_file: Option<PathBuf>,

    /// Serve consumers that already exist on the server, bound on first request:
    /// comma-separated STREAM/CONSUMER patterns, `*` standing for any whole name
    /// (`ORDERS/*`, `*/*`). Their settings are never changed.
    #[arg(long, env = "RUSTSTREAM_SERVE_EXISTING", value_parser = parse_patterns)]
    pub serve_existing: Option<ConsumerPatterns>,

    /// Unbind an existing consumer (--serve-existing) after this long with no live lease and
    /// no request; the next request binds it again.
    #[arg(long, env = "RUSTSTREAM_IDLE_UNBIND", default_value = "10m", value_parser = parse_positive_duration)]
    pub idle_unbind: Duration,

    /// Set for a consumer served through --serve-existing: bound as it is on the server,
    /// its settings never sent.
    #[arg(skip)]
    pub(crate) adopt_existing: bool,

    /// Address the HTTP server listens on.
    #[arg(long, env = "RUSTSTREAM_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,

    /// Certificate chain (PEM) for HTTPS on the main listener (with --tls-key); reloaded when
    /// the file changes.
    #[arg(long, env = "RUSTSTREAM_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,

    /// Private key (PEM) of --tls-cert.
    #[arg(long, env = "RUSTSTREAM_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,

    /// CA certificates (PEM): with TLS on, require client certificates signed by them (mTLS).
    #[arg(long, env = "RUSTSTREAM_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,

    /// A second address serving only /healthz, /readyz and /metrics, with a connection
    /// budget of its own, so probes and scrapes answer while the main listener is full.
    #[arg(long, env = "RUSTSTREAM_ADMIN_LISTEN")]
    pub admin_listen: Option<SocketAddr>,

    /// How far ahead a delayed message (`delay`, `deliver_at`) may be scheduled; further is
    /// refused (422).
    #[arg(long, env = "RUSTSTREAM_MAX_SCHEDULE_AHEAD", default_value = "365d", value_parser = parse_positive_duration)]
    pub max_schedule_ahead: Duration,

    /// How long the record of a confirmed ack or term is kept: for that long no gateway
    /// sharing the consumer leases the message again, whatever the server forgot.
    #[arg(long, env = "RUSTSTREAM_SETTLED_RETENTION", default_value = "7d", value_parser = parse_positive_duration)]
    pub settled_retention: Duration,

    /// Serve a consumer only when its settles are at least this durable (see the consumer's
    /// `durability`): `fleet` (the settled records are stored), `replicated` (that, and the
    /// stream, the consumer and the records on 3 replicas or more), `synced` (that, and the
    /// server known to sync every write: needs --nats-monitor-url). Short of it: an error at
    /// start, 503 `durability-insufficient` later. Not given: anything is served.
    #[arg(long, env = "RUSTSTREAM_REQUIRE_DURABILITY", value_enum)]
    pub require_durability: Option<DurabilityLevel>,

    /// nats-server's monitoring endpoint (`http://host:8222`): its `/varz` tells the
    /// server's sync policy, shown in each consumer's `durability`. Not given: `unknown`.
    #[arg(long, env = "RUSTSTREAM_NATS_MONITOR_URL")]
    pub nats_monitor_url: Option<String>,

    /// How long a settle waits for the NATS server's confirmation before answering 504.
    #[arg(long, env = "RUSTSTREAM_SETTLE_TIMEOUT", default_value = "5s", value_parser = parse_positive_duration)]
    pub settle_timeout: Duration,

    /// On SIGTERM/SIGINT, how long settles are still accepted before the gateway exits.
    #[arg(long, env = "RUSTSTREAM_SHUTDOWN_GRACE", default_value = "5s", value_parser = humantime::parse_duration)]
    pub shutdown_grace: Duration,

    /// Create the stream when it does not exist (for a first try; off by default, when a missing
    /// stream is an error), set up for TTLs, atomic batches and schedules.
    #[arg(long, env = "RUSTSTREAM_CREATE_STREAM")]
    pub create_stream: bool,

    /// Subjects of a stream made by --create-stream (comma-separated).
    #[arg(
        long,
        env = "RUSTSTREAM_STREAM_SUBJECTS",
        value_delimiter = ',',
        default_value = "orders.>",
        value_parser = parse_filter
    )]
    pub stream_subjects: Vec<String>,

    /// File of HTTP bearer tokens, one `<token> <scope>[,<scope>…]` per line (scopes: fetch,
    /// settle, publish, admin, or * for all; `#` starts a comment), or JSON
    /// `{"<token>": [scopes]}`. With neither this nor --auth-tokens, HTTP authentication is off.
    #[arg(long, env = "RUSTSTREAM_AUTH_TOKENS_FILE")]
    pub auth_tokens_file: Option<PathBuf>,

    /// HTTP bearer tokens inline, in the file's format with `;` between entries (added to
    /// those of --auth-tokens-file).
    #[arg(long, env = "RUSTSTREAM_AUTH_TOKENS", hide_env_values = true)]
    pub auth_tokens: Option<Secret>,

    /// JWKS file (`{"keys": […]}`) whose keys verify JWT bearer tokens (RS256, ES256,
    /// EdDSA); re-read every 5 minutes and on a token naming an unknown key. Needs
    /// --auth-jwt-audience. Static tokens keep working beside JWTs.
    #[arg(
        long,
        env = "RUSTSTREAM_AUTH_JWKS_FILE",
        requires = "auth_jwt_audience"
    )]
    pub auth_jwks_file: Option<PathBuf>,

    /// JWKS URL (http or https, e.g. the identity provider's `jwks_uri`), fetched at start,
    /// every 5 minutes, and on a token naming an unknown key (at most once per 30 s).
    #[arg(long, env = "RUSTSTREAM_AUTH_JWKS_URL", requires = "auth_jwt_audience")]
    pub auth_jwks_url: Option<String>,

    /// The `iss` a JWT must carry. Not given: any issuer whose keys are in the JWKS.
    #[arg(long, env = "RUSTSTREAM_AUTH_JWT_ISSUER")]
    pub auth_jwt_issuer: Option<String>,

    /// An `aud` a JWT must carry (required with a JWKS: without it, a token the issuer
    /// made for any other service would be accepted).
    #[arg(long, env = "RUSTSTREAM_AUTH_JWT_AUDIENCE")]
    pub auth_jwt_audience: Option<String>,

    /// The claim holding a JWT's scopes: a space-separated string or an array of strings.
    /// Values that are not a scope (fetch, settle, publish, admin, *) are ignored.
    #[arg(long, env = "RUSTSTREAM_AUTH_JWT_SCOPE_CLAIM", default_value = "scope")]
    pub auth_jwt_scope_claim: String,

    /// A prefix the JWT's scope values carry (e.g. `ruststream:` for `ruststream:fetch`);
    /// values without it are ignored.
    #[arg(long, env = "RUSTSTREAM_AUTH_JWT_SCOPE_PREFIX")]
    pub auth_jwt_scope_prefix: Option<String>,

    /// An origin whose browser pages may call the API and open its streams, exactly as a
    /// browser sends it (`https://app.example.com`, `http://localhost:3000`): preflights are
    /// answered and answers carry `Access-Control-Allow-Origin` for it. Repeatable (in the
    /// variable: comma-separated). Browsers authenticate a stream with `POST
    /// /stream-tickets` and `?ticket=`.
    #[arg(long = "cors-allow-origin", env = "RUSTSTREAM_CORS_ALLOW_ORIGIN", value_delimiter = ',', value_parser = parse_origin)]
    pub cors_allow_origins: Vec<String>,

    /// File holding the lease-id signing key: at least 32 bytes, raw or as hex or base64
    /// text. A gateway restarted with the same file knows its predecessor's ids as genuine
    /// (410, not 404). Not given: a random key per process.
    #[arg(long, env = "RUSTSTREAM_LEASE_KEY_FILE")]
    pub lease_key_file: Option<PathBuf>,

    /// Subject prefix of what replicas exchange: forwarded settles on
    /// `<prefix>.<stream>.<consumer>.settle.…`, heartbeats and keyed fetch answers on
    /// `<prefix>.fleet.…`. Every message there is sealed with the lease key; others are
    /// dropped and counted.
    #[arg(long, env = "RUSTSTREAM_INTERNAL_PREFIX", default_value = DEFAULT_INTERNAL_PREFIX, value_parser = parse_subject_prefix)]
    pub internal_prefix: String,

    /// Believe unsealed messages under --internal-prefix too: those of replicas of a release
    /// before seals, for the length of a rolling upgrade. Anyone allowed to publish under the
    /// prefix can then forge heartbeats, keyed answers and forwarded settles.
    #[arg(long, env = "RUSTSTREAM_ACCEPT_UNSIGNED_REPLICAS")]
    pub accept_unsigned_replicas: bool,

    /// Most messages one fetch may ask for (`batch`).
    #[arg(long, env = "RUSTSTREAM_MAX_BATCH", default_value_t = 1000,
          value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub max_batch: u32,

    /// Longest a fetch may wait for messages (`wait_ms`); at most 30s.
    #[arg(long, env = "RUSTSTREAM_MAX_WAIT", default_value = "30s", value_parser = parse_max_wait)]
    pub max_wait: Duration,

    /// Most fetches one bearer token may have waiting at once (429 beyond); applies when
    /// authentication is on.
    #[arg(long, env = "RUSTSTREAM_MAX_WAITING_FETCHES_PER_TOKEN", default_value_t = 100,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_waiting_fetches_per_token: u32,

    /// Most open HTTP connections; further clients wait in the listen backlog. Keep it below
    /// the open-files limit (`ulimit -n`).
    #[arg(long, env = "RUSTSTREAM_MAX_CONNECTIONS", default_value_t = 10_000,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: u32,

    /// How long a client may take to send a request's headers (also the idle keep-alive
    /// time); slower connections are closed.
    #[arg(long, env = "RUSTSTREAM_HEADER_READ_TIMEOUT", default_value = "10s", value_parser = parse_positive_duration)]
    pub header_read_timeout: Duration,

    /// How long a client may take to send a request's body (408 beyond).
    #[arg(long, env = "RUSTSTREAM_BODY_READ_TIMEOUT", default_value = "10s", value_parser = parse_positive_duration)]
    pub body_read_timeout: Duration,

    /// Most bytes a request body may have (413 beyond); the default, 256 KiB, fits a
    /// 1000-id batch settle.
    #[arg(long, env = "RUSTSTREAM_MAX_BODY_BYTES", default_value_t = DEFAULT_MAX_BODY_BYTES,
          value_parser = clap::value_parser!(u32).range(1..=67_108_864))]
    pub max_body_bytes: u32,

    /// Log format: text or json (RUST_LOG sets the level; default info).
    #[arg(long, env = "RUSTSTREAM_LOG_FORMAT", default_value = "text")]
    pub log_format: LogFormat,

    /// Export OpenTelemetry traces to this OTLP endpoint (e.g. http://collector:4318; a base,
    /// as OTEL_EXPORTER_OTLP_ENDPOINT is: /v1/traces is appended for http/protobuf).
    /// Without it, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT turn
    /// tracing on; with none, tracing is off. OTEL_EXPORTER_OTLP_PROTOCOL=grpc exports
    /// over gRPC.
    #[arg(long, value_name = "URL", value_parser = parse_otlp_endpoint)]
    pub otlp_endpoint: Option<String>,

    /// Instead of serving: GET this URL (e.g. http://127.0.0.1:8080/healthz), exit 0 if it
    /// answers 200, else 1. For a container HEALTHCHECK in an image without curl. No
    /// environment variable: set in a container's environment it would stop the gateway.
    #[arg(long, value_name = "URL")]
    pub healthcheck: Option<String>,
}

/// Where a newly created consumer starts in the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeliverPolicy {
    All,
    Last,
    New,
    LastPerSubject,
    ByStartSequence(u64),
    ByStartTime(OffsetDateTime),
}

impl FromStr for DeliverPolicy {
    type Err = String;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        let invalid = || {
            format!(
                "invalid deliver policy {value:?}: expected all, last, new, last-per-subject, \
                 by-start-sequence=N or by-start-time=RFC3339"
            )
        };
        match value {
            "all" => Ok(Self::All),
            "last" => Ok(Self::Last),
            "new" => Ok(Self::New),
            "last-per-subject" => Ok(Self::LastPerSubject),
            _ => match value.split_once('=') {
                Some(("by-start-sequence", seq)) => match seq.parse::<u64>() {
                    Ok(seq) if seq > 0 => Ok(Self::ByStartSequence(seq)),
                    _ => Err(format!("{}: the sequence must be a number ≥ 1", invalid())),
                },
                Some(("by-start-time", at)) => OffsetDateTime::parse(at, &Rfc3339)
                    .map(Self::ByStartTime)
                    .map_err(|err| format!("{}: {err}", invalid())),
                _ => Err(invalid()),
            },
        }
    }
}

impl fmt::Display for DeliverPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::All => f.write_str("all"),
            Self::Last => f.write_str("last"),
            Self::New => f.write_str("new"),
            Self::LastPerSubject => f.write_str("last-per-subject"),
            Self::ByStartSequence(seq) => write!(f, "by-start-sequence={seq}"),
            Self::ByStartTime(at) => match at.format(&Rfc3339) {
                Ok(at) => write!(f, "by-start-time={at}"),
                Err(_) => write!(f, "by-start-time={at}"),
            },
        }
    }
}

/// A secret from a flag or the environment: usable, never shown by `Debug` (logs, panics).
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl FromStr for Secret {
    type Err = String;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        Ok(Self(value.to_owned()))
    }
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

impl Config {
    /// The settings of a consumer served through `--serve-existing`: its own, as the
    /// server has them (read at bind), no dead letters, everything else as given at start.
    pub(crate) fn for_existing(&self, stream: &str, consumer: &str) -> Self {
        Self {
            stream: stream.to_owned(),
            consumer: consumer.to_owned(),
            filter_subject: None,
            max_deliver: None,
            dead_letter_subject: None,
            ordering_key: None,
            ephemeral: false,
            create_stream: false,
            adopt_existing: true,
            ..self.clone()
        }
    }

    /// The settings of a consumer the file declares: its own stream, name and consumer
    /// settings, everything else as given at start.
    pub(crate) fn for_declared(&self, spec: &ConsumerSpec) -> Self {
        Self {
            stream: spec.stream.clone(),
            consumer: spec.name.clone(),
            filter_subject: spec.filter_subject.clone(),
            deliver_policy: spec.deliver_policy.clone(),
            ack_wait: spec.ack_wait,
            max_ack_pending: spec.max_ack_pending,
            max_deliver: spec.max_deliver,
            dead_letter_subject: spec.dead_letter_subject.clone(),
            ordering_key: spec.ordering_key.clone(),
            ephemeral: false,
            // The default consumer's stream may be made by either: the same config.
            create_stream: self.create_stream && spec.stream == self.stream,
            ..self.clone()
        }
    }
}

/// The shortest `--ack-wait`: a lease is ack_wait less a margin, and the gateway holds an
/// unleased delivery up to ack_wait/4; below a second every lease would be born (nearly)
/// expired and the message would loop.
pub(crate) const MIN_ACK_WAIT: Duration = Duration::from_secs(1);

/// The longest duration the NATS server takes (a Go `time.Duration`: signed nanoseconds).
pub(crate) const MAX_SERVER_DURATION: Duration = Duration::from_nanos(i64::MAX as u64);

fn parse_ack_wait(value: &str) -> Result<Duration, String> {
    let duration = humantime::parse_duration(value).map_err(|err| err.to_string())?;
    if duration < MIN_ACK_WAIT {
        return Err("must be at least 1s".into());
    }
    if duration > MAX_SERVER_DURATION {
        return Err(format!(
            "must be at most {} (the NATS server counts it in signed 64-bit nanoseconds)",
            humantime::format_duration(Duration::from_secs(MAX_SERVER_DURATION.as_secs()))
        ));
    }
    Ok(duration)
}

/// An exact origin: `http` or `https`, a host, an optional port — nothing after (a browser's
/// `Origin` header never has a path), no wildcard.
fn parse_origin(value: &str) -> Result<String, String> {
    // Scheme and host are case-insensitive; browsers send them in lower case.
    let value = value.to_ascii_lowercase();
    let rest = value
        .strip_prefix("https://")
        .or_else(|| value.strip_prefix("http://"))
        .ok_or_else(|| format!("{value:?}: an origin starts with http:// or https://"))?;
    let (host, port) = match rest.rsplit_once(':') {
        Some((host, port)) if !host.ends_with(']') || rest.starts_with('[') => (host, Some(port)),
        _ => (rest, None),
    };
    if host.is_empty()
        || host.contains(['/', '?', '#', '@', '*', ' '])
        || port.is_some_and(|port| port.parse::<u16>().is_err())
        || rest.contains(['/', '?', '#'])
    {
        return Err(format!(
            "{value:?}: an origin is scheme://host[:port] exactly as a browser sends it, with no path, wildcard or user (e.g. https://app.example.com)"
        ));
    }
    Ok(value)
}

fn parse_patterns(value: &str) -> Result<ConsumerPatterns, String> {
    ConsumerPatterns::parse(value)
}

fn parse_name(value: &str) -> Result<String, String> {
    crate::domain::subject::validate_name(value)?;
    Ok(value.to_owned())
}

fn parse_filter(value: &str) -> Result<String, String> {
    crate::domain::subject::validate_filter(value)?;
    Ok(value.to_owned())
}

fn parse_dead_letter_subject(value: &str) -> Result<String, String> {
    crate::domain::subject::validate_publish_subject(value)?;
    Ok(value.to_owned())
}

fn parse_subject_prefix(value: &str) -> Result<String, String> {
    crate::domain::subject::validate_publish_subject(value)?;
    Ok(value.to_owned())
}

fn parse_positive_duration(value: &str) -> Result<Duration, String> {
    let duration = humantime::parse_duration(value).map_err(|err| err.to_string())?;
    if duration.is_zero() {
        return Err("must be greater than zero".into());
    }
    Ok(duration)
}

fn parse_max_wait(value: &str) -> Result<Duration, String> {
    let duration = humantime::parse_duration(value).map_err(|err| err.to_string())?;
    if duration > Duration::from_secs(30) {
        return Err("must be at most 30s".into());
    }
    Ok(duration)
}

/// An OTLP endpoint: an http or https URL.
fn parse_otlp_endpoint(value: &str) -> Result<String, String> {
    let uri: axum::http::Uri = value.parse().map_err(|err| format!("not a URL: {err}"))?;
    match uri.scheme_str() {
        Some("http" | "https") if uri.host().is_some() => Ok(value.to_owned()),
        _ => Err(
            "expected an http:// or https:// URL with a host, e.g. http://127.0.0.1:4318".into(),
        ),
    }
}

#[cfg(test)]
mod tests;
