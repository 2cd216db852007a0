//! The gateway a test talks to, two ways: run in process on a port-0 listener (with a handle
//! to trigger the graceful shutdown and collect `run`'s result), or the binary as a child
//! process (so it can be killed -9 or sent SIGTERM and started again on the same port).
//! Both dereference to the typed [`Client`] at their address.

use std::ops::{Deref, DerefMut};
use std::process::ExitStatus;
use std::time::Duration;

use clap::Parser;
use ruststream_nats::Config;
use serde_json::json;
use tempfile::TempDir;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::client::Client;
use super::nats::free_port;
use super::nats::process::ChildProcess;
use super::setup::Setup;

/// How long `wait_ready` waits for /readyz to answer 200.
pub const READY_DEADLINE: Duration = Duration::from_secs(20);

/// A gateway run in process, owned by one test.
pub struct Gateway {
    client: Client,
    pub stream: String,
    pub consumer: String,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<anyhow::Result<()>>>,
}

/// Every endpoint of the gateway is a method of its client.
impl Deref for Gateway {
    type Target = Client;

    fn deref(&self) -> &Client {
        &self.client
    }
}

/// Tests swap the HTTP client (another bearer token) in place.
impl DerefMut for Gateway {
    fn deref_mut(&mut self) -> &mut Client {
        &mut self.client
    }
}

impl Gateway {
    /// Parse the flags like the binary does and start `run` on a port-0 listener. Does not
    /// wait for readiness.
    pub async fn start(setup: &Setup, nats_url: &str) -> Self {
        let mut args = vec!["ruststream-nats".to_owned()];
        args.extend(setup.args(nats_url));
        let config = Config::try_parse_from(args.clone())
            .unwrap_or_else(|err| panic!("flags {args:?} do not parse: {err}"));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the gateway listener");
        let addr = listener.local_addr().expect("listener addr");
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(ruststream_nats::run(config, listener, async move {
            let _ = rx.await;
        }));
        Self {
            client: Client::new(format!("http://{addr}")),
            stream: setup.stream_name().to_owned(),
            consumer: setup.consumer_name().to_owned(),
            shutdown: Some(tx),
            task: Some(task),
        }
    }

    /// The typed client at this gateway's address (to move into a task).
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Poll /readyz until it answers 200; panics (with run's error, if it ended) otherwise.
    pub async fn wait_ready(&mut self) {
        let deadline = tokio::time::Instant::now() + READY_DEADLINE;
        loop {
            if self.readyz().await == 200 {
                return;
            }
            if self.task.as_ref().is_some_and(JoinHandle::is_finished) {
                let result = self.join(Duration::from_secs(1)).await;
                panic!("run() ended before the gateway became ready: {result:?}");
            }
            if tokio::time::Instant::now() >= deadline {
                panic!("/readyz did not answer 200 within {READY_DEADLINE:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Poll /readyz until it answers 503 (NATS went away).
    pub async fn wait_unready(&self) {
        super::wait_until(
            "/readyz answers 503 while NATS is down",
            Duration::from_secs(10),
            || async { self.readyz().await == 503 },
        )
        .await;
    }

    /// Resolve the shutdown future given to `run` (SIGTERM in the binary); does not wait.
    pub fn trigger_shutdown(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }

    /// Trigger the shutdown and wait until new fetches are refused (503): the drain began.
    pub async fn begin_shutdown(&mut self) {
        self.trigger_shutdown();
        super::wait_until(
            "the shutdown has begun (new fetches are refused)",
            Duration::from_secs(5),
            || async {
                self.fetch_reply(Some(&json!({ "wait_ms": 0 })))
                    .await
                    .status
                    == 503
            },
        )
        .await;
    }

    /// Wait (bounded) for `run` to return on its own or after `trigger_shutdown`.
    pub async fn join(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let task = self.task.take().expect("run() was already joined");
        match tokio::time::timeout(timeout, task).await {
            Ok(Ok(result)) => result,
            Ok(Err(join_error)) => panic!("run() panicked: {join_error}"),
            Err(_) => panic!("run() did not return within {timeout:?}"),
        }
    }

    /// Trigger the graceful shutdown and return `run`'s result.
    pub async fn shutdown(&mut self) -> anyhow::Result<()> {
        self.trigger_shutdown();
        self.join(Duration::from_secs(30)).await
    }

    /// Wait until `run` has ended on its own (start-up errors) and return its result.
    pub async fn exit_result(&mut self) -> anyhow::Result<()> {
        self.join(Duration::from_secs(20)).await
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// The gateway binary as a child process on a free port, logging to a file.
pub struct GatewayProcess {
    client: Client,
    process: ChildProcess,
    _dir: TempDir,
}

impl Deref for GatewayProcess {
    type Target = Client;

    fn deref(&self) -> &Client {
        &self.client
    }
}

impl GatewayProcess {
    /// Start `ruststream-nats --nats-url <url> --listen 127.0.0.1:<free port> <flags…>`;
    /// does not wait for readiness.
    pub fn spawn(setup: &Setup, nats_url: &str) -> Self {
        Self::spawn_program(setup, nats_url, env!("CARGO_BIN_EXE_ruststream-nats"))
    }

    /// [`GatewayProcess::spawn`] of another build of the gateway (an earlier release).
    pub fn spawn_program(setup: &Setup, nats_url: &str, program: &str) -> Self {
        let port = free_port();
        let mut args = setup.args(nats_url);
        args.extend(["--listen".to_owned(), format!("127.0.0.1:{port}")]);
        let dir = tempfile::Builder::new()
            .prefix("gateway-it-")
            .tempdir()
            .expect("temp dir for the gateway log");
        let mut process =
            ChildProcess::new("the gateway", program, args, dir.path().join("gateway.log"));
        // An empty filter: the binary's own default level, as an operator runs it.
        if !setup.rust_log_filter().is_empty() {
            process = process.env("RUST_LOG", setup.rust_log_filter());
        }
        for (key, value) in setup.env_vars() {
            process = process.env(key, value);
        }
        process
            .spawn()
            .unwrap_or_else(|err| panic!("start the gateway binary: {err}"));
        Self {
            client: Client::new(format!("http://127.0.0.1:{port}")),
            process,
            _dir: dir,
        }
    }

    /// Poll /readyz until 200; panic with the log when the process exits or `within` passes.
    pub async fn wait_ready(&mut self, within: Duration) {
        let client = self.client.clone();
        self.process
            .wait_until("ready (/readyz 200)", within, || {
                let client = client.clone();
                async move { client.readyz().await == 200 }
            })
            .await
            .unwrap_or_else(|err| panic!("{err}"));
    }

    /// Wait (bounded) until the process exits on its own; panics with the log otherwise.
    pub async fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Some(status) = self.process.exited() {
                return status;
            }
            if tokio::time::Instant::now() >= deadline {
                panic!(
                    "the gateway did not exit within {within:?}; log:\n{}",
                    self.log()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The process' log so far (stdout and stderr).
    pub fn log(&self) -> String {
        self.process.log()
    }

    /// SIGKILL: the process dies holding whatever it held.
    pub fn kill9(&mut self) {
        self.process.kill9();
    }

    /// SIGSTOP: the process stalls, holding its sockets and leases.
    pub fn pause(&mut self) {
        self.process.pause();
    }

    /// SIGCONT after [`GatewayProcess::pause`].
    pub fn resume(&mut self) {
        self.process.resume();
    }

    /// SIGHUP: the gateway reads its files again.
    pub fn sighup(&mut self) {
        self.process.sighup();
    }

    /// Whether the process has exited (reaping it if so).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.process.exited()
    }

    /// SIGTERM without waiting: the graceful stop begins.
    pub fn sigterm(&mut self) {
        self.process.sigterm();
    }

    /// SIGTERM and wait (bounded) for the graceful stop.
    pub async fn terminate(&mut self, within: Duration) -> ExitStatus {
        self.process.terminate(within).await
    }

    /// Start this build of the gateway in place of the one that ran (same port, same flags
    /// and `extra` ones) and wait until it is ready: one step of a rolling upgrade.
    pub async fn upgrade(&mut self, extra: &[&str]) {
        self.process
            .replace_program(env!("CARGO_BIN_EXE_ruststream-nats"), extra);
        self.restart().await;
    }

    /// Start the same command again (same port) and wait until it is ready.
    pub async fn restart(&mut self) {
        self.process
            .spawn()
            .unwrap_or_else(|err| panic!("restart the gateway binary: {err}"));
        self.wait_ready(READY_DEADLINE).await;
    }
}
