//! The gateway binary as a child process, so that a test can kill it with SIGKILL (a crash)
//! or SIGTERM (a graceful stop) and start another on the same port.

use std::fs::File;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tempfile::TempDir;
use tokio::time::Instant;

use crate::support::nats::free_port;

/// How long a started gateway may take to answer /readyz 200.
const READY_DEADLINE: Duration = Duration::from_secs(20);

pub struct GatewayProcess {
    port: u16,
    args: Vec<String>,
    dir: TempDir,
    child: Option<Child>,
    http: reqwest::Client,
}

impl GatewayProcess {
    /// Start `ruststream-nats --nats-url <url> --listen 127.0.0.1:<free port> <flags…>` and
    /// wait until it is ready.
    pub async fn start(nats_url: &str, flags: &[&str]) -> Self {
        let port = free_port();
        let mut args = vec![
            "--nats-url".to_owned(),
            nats_url.to_owned(),
            "--listen".to_owned(),
            format!("127.0.0.1:{port}"),
        ];
        args.extend(flags.iter().map(|flag| (*flag).to_owned()));
        let mut gateway = Self {
            port,
            args,
            dir: tempfile::Builder::new()
                .prefix("gateway-it-")
                .tempdir()
                .expect("temp dir for the gateway log"),
            child: None,
            http: reqwest::Client::builder()
                .no_proxy()
                .timeout(Duration::from_secs(60))
                .build()
                .expect("reqwest client"),
        };
        gateway.spawn();
        gateway.wait_ready().await;
        gateway
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    pub fn http(&self) -> &reqwest::Client {
        &self.http
    }

    /// The process' log so far (stdout and stderr).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("gateway.log")
    }

    fn spawn(&mut self) {
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("open the gateway log");
        let log_err = log.try_clone().expect("clone the log file");
        let child = Command::new(env!("CARGO_BIN_EXE_ruststream-nats"))
            .args(&self.args)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .spawn()
            .expect("spawn the gateway binary");
        self.child = Some(child);
    }

    /// Poll /readyz until 200; panic with the log when the process exits or the deadline passes.
    pub async fn wait_ready(&mut self) {
        let deadline = Instant::now() + READY_DEADLINE;
        loop {
            if let Ok(response) = self.http.get(self.url("/readyz")).send().await
                && response.status().as_u16() == 200
            {
                return;
            }
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                panic!("the gateway exited with {status}; log:\n{}", self.log());
            }
            if Instant::now() >= deadline {
                panic!(
                    "the gateway was not ready within {READY_DEADLINE:?}; log:\n{}",
                    self.log()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGKILL: the process dies holding whatever it held.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM and wait (bounded) for the graceful stop; returns whether it exited 0.
    pub async fn terminate(&mut self, within: Duration) -> bool {
        let Some(mut child) = self.child.take() else {
            return false;
        };
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let deadline = Instant::now() + within;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return status.success();
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "the gateway did not stop within {within:?} of SIGTERM; log:\n{}",
                    self.log()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Start the same command again (same port) and wait until it is ready.
    #[allow(dead_code)] // the ledger test restarts crashed gateways; the suite starts new ones
    pub async fn restart(&mut self) {
        self.kill9();
        self.spawn();
        self.wait_ready().await;
    }
}

impl Drop for GatewayProcess {
    fn drop(&mut self) {
        self.kill9();
    }
}
