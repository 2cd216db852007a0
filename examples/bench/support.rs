//! What every scenario shares: the benchmark's stream and consumer settings, the gateway
//! binary run as a child process, the nats-server and its version, the HTTP client, the
//! gateway's JSON answers the loops read, and an OTLP sink that drops what it gets.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context as _, anyhow, ensure};
use serde::Deserialize;
use tokio::task::JoinHandle;

use super::args::Args;
use super::nats;
use super::nats::process::ChildProcess;

/// How long the gateway may take to answer `/readyz` with 200.
const GATEWAY_READY_DEADLINE: Duration = Duration::from_secs(15);

/// Publish acks awaited together (async-nats refuses more than 5 000 in flight by default).
pub(crate) const PUBLISH_CHUNK: usize = 1_000;
/// The consumer settings both sides use (the gateway's defaults).
pub(crate) const ACK_WAIT: Duration = Duration::from_secs(30);
pub(crate) const MAX_ACK_PENDING: i64 = 1024;
/// How long a fetch (gateway and native alike) may wait for messages; with messages
/// waiting it never does.
pub(crate) const FETCH_WAIT: Duration = Duration::from_millis(500);
pub(crate) const STREAM: &str = "BENCH";
pub(crate) const SUBJECT: &str = "bench.msg";

/// The gateway binary to run (`--gateway-bin`, else this crate's release build), which must
/// exist.
pub(crate) fn gateway_binary(args: &Args) -> anyhow::Result<PathBuf> {
    let binary = args.gateway_bin.clone().unwrap_or_else(|| {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("target/release/ruststream-nats")
    });
    ensure!(
        binary.is_file(),
        "no gateway binary at {} (cargo build --release, or --gateway-bin)",
        binary.display()
    );
    Ok(binary)
}

/// A nats-server of its own for the command, and its version.
pub(crate) async fn start_nats_server() -> anyhow::Result<(nats::NatsServer, String)> {
    let version = server_version(&nats::nats_server_binary())?;
    Ok((nats::NatsServer::start().await, version))
}

pub(crate) fn server_version(binary: &Path) -> anyhow::Result<String> {
    let output = Command::new(binary)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .with_context(|| {
            format!(
                "running {} --version (set NATS_SERVER_BIN, or run scripts/bench.sh, which installs it)",
                binary.display()
            )
        })?;
    ensure!(
        output.status.success(),
        "{} --version failed: {}",
        binary.display(),
        output.status
    );
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_string())
}

/// The release binary as a child process, its output in a log file.
pub(crate) struct GatewayChild {
    process: ChildProcess,
    pub(crate) base: String,
    pub(crate) pid: u32,
}

impl GatewayChild {
    pub(crate) async fn start(
        binary: &Path,
        nats_url: &str,
        consumer: &str,
        extra: &[String],
        env: &[(String, String)],
        log: PathBuf,
        http: &reqwest::Client,
    ) -> anyhow::Result<Self> {
        Self::start_on(binary, nats_url, (STREAM, consumer), extra, env, log, http).await
    }

    /// [`GatewayChild::start`] with `stream`/`consumer` as its default consumer.
    pub(crate) async fn start_on(
        binary: &Path,
        nats_url: &str,
        (stream, consumer): (&str, &str),
        extra: &[String],
        env: &[(String, String)],
        log: PathBuf,
        http: &reqwest::Client,
    ) -> anyhow::Result<Self> {
        let port = nats::free_port();
        let listen = format!("127.0.0.1:{port}");
        let mut flags = vec![
            "--nats-url".to_string(),
            nats_url.to_string(),
            "--stream".into(),
            stream.to_string(),
            "--consumer".into(),
            consumer.to_string(),
            "--listen".into(),
            listen.clone(),
        ];
        flags.extend(extra.iter().cloned());
        let mut process = env.iter().fold(
            ChildProcess::new("the gateway", binary, flags, log),
            |process, (key, value)| process.env(key, value),
        );
        process.spawn().map_err(|err| anyhow!(err))?;
        let pid = process
            .pid()
            .ok_or_else(|| anyhow!("the gateway has no pid"))?;
        let base = format!("http://{listen}");
        let ready = format!("{base}/readyz");
        process
            .wait_until("ready", GATEWAY_READY_DEADLINE, || {
                let request = http.get(&ready).send();
                async move {
                    request
                        .await
                        .is_ok_and(|response| response.status() == reqwest::StatusCode::OK)
                }
            })
            .await
            .map_err(|err| anyhow!(err))?;
        Ok(Self { process, base, pid })
    }

    /// SIGKILL it (`--ordering-ledger`).
    pub(crate) fn kill9(&mut self) {
        self.process.kill9();
    }

    /// Start it again with the same flags and wait until it is ready.
    pub(crate) async fn restart(&mut self, http: &reqwest::Client) -> anyhow::Result<()> {
        self.process.spawn().map_err(|err| anyhow!(err))?;
        self.pid = self
            .process
            .pid()
            .ok_or_else(|| anyhow!("the gateway has no pid"))?;
        let ready = format!("{}/readyz", self.base);
        self.process
            .wait_until("ready", GATEWAY_READY_DEADLINE, || {
                let request = http.get(&ready).send();
                async move {
                    request
                        .await
                        .is_ok_and(|response| response.status() == reqwest::StatusCode::OK)
                }
            })
            .await
            .map_err(|err| anyhow!(err))
    }

    pub(crate) fn log_size(&self) -> (u64, u64) {
        let text = std::fs::read(self.process.log_path()).unwrap_or_default();
        let lines = text.iter().filter(|&&byte| byte == b'\n').count() as u64;
        (lines, text.len() as u64)
    }

    pub(crate) async fn stop(mut self) -> anyhow::Result<()> {
        let status = self.process.terminate(Duration::from_secs(30)).await;
        ensure!(status.success(), "the gateway exited with {status}");
        Ok(())
    }
}

#[derive(Debug, Deserialize)]
pub(crate) struct FetchReply {
    pub(crate) messages: Vec<Leased>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct Leased {
    pub(crate) id: String,
    pub(crate) stream_sequence: u64,
    pub(crate) delivered: u64,
    pub(crate) data: String,
}

#[derive(Debug, Deserialize)]
pub(crate) struct BatchReply {
    pub(crate) results: Vec<SettleResult>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct SettleResult {
    pub(crate) id: String,
    pub(crate) status: u16,
    #[serde(default)]
    pub(crate) detail: Option<serde_json::Value>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct ConsumerReply {
    pub(crate) leases_in_flight: u64,
}

/// The suite's client style: reqwest, no proxies from the environment, a bound per request.
pub(crate) fn http_client() -> anyhow::Result<reqwest::Client> {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(60))
        .build()
        .context("building the HTTP client")
}

/// An OTLP/HTTP receiver that takes every export and drops it (answering as a collector
/// does), on a free port; stops when the handle is dropped.
pub(crate) async fn otlp_sink() -> anyhow::Result<(std::net::SocketAddr, AbortOnDrop)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .context("binding the OTLP sink")?;
    let address = listener.local_addr().context("the OTLP sink's address")?;
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(|_body: axum::body::Bytes| async {
            [(axum::http::header::CONTENT_TYPE, "application/x-protobuf")]
        }),
    );
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok((address, AbortOnDrop(task)))
}

/// A task stopped when this is dropped.
pub(crate) struct AbortOnDrop(pub(crate) JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A gateway serving the consumers of `entries` (a consumers file's text, on `stream`) and
/// no default one, and the directory of its consumers file and log.
pub(crate) async fn gateway_with(
    args: &super::args::Args,
    nats_url: &str,
    stream: &str,
    entries: &str,
) -> anyhow::Result<(GatewayChild, tempfile::TempDir)> {
    let dir = tempfile::Builder::new().prefix("bench-push-").tempdir()?;
    let file = dir.path().join("consumers.toml");
    std::fs::write(&file, entries)?;
    let gateway = GatewayChild::start_on(
        &gateway_binary(args)?,
        nats_url,
        (stream, "unused"),
        &[
            "--no-default-consumer".into(),
            "--consumers-file".into(),
            file.display().to_string(),
        ],
        &args.gateway_env,
        dir.path().join("gateway.log"),
        &http_client()?,
    )
    .await?;
    Ok((gateway, dir))
}
