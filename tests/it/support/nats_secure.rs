//! A nats-server started from a configuration snippet (authorization, TLS, operator mode)
//! for the NATS-security tests. Kept apart from [`super::nats::NatsServer`], whose plain
//! command-line servers every other test uses.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use tempfile::TempDir;

use super::nats::{free_port, nats_server_binary, wait_until_listening};

/// A nats-server with JetStream, configured by a snippet the test writes.
pub struct ConfiguredServer {
    port: u16,
    dir: TempDir,
    child: Option<Child>,
}

impl ConfiguredServer {
    /// A directory for the files a snippet refers to (certificates, keys); the server's
    /// temp dir is made per try, so this one outlives them.
    pub fn files() -> TempDir {
        tempfile::Builder::new()
            .prefix("nats-files-")
            .tempdir()
            .expect("temp dir for server files")
    }

    /// Start a server whose config is `listen`, `jetstream` and then `snippet`; wait until it
    /// accepts TCP connections.
    pub async fn start(snippet: &str) -> Self {
        let mut last_error = String::new();
        for _ in 0..5 {
            let dir = tempfile::Builder::new()
                .prefix("nats-secure-")
                .tempdir()
                .expect("create temp dir");
            let mut server = Self {
                port: free_port(),
                dir,
                child: None,
            };
            match server.spawn_and_wait(snippet).await {
                Ok(()) => return server,
                Err(err) => last_error = err,
            }
        }
        panic!("configured nats-server did not start: {last_error}");
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("nats-server.log")
    }

    async fn spawn_and_wait(&mut self, snippet: &str) -> Result<(), String> {
        let config_path = self.dir.path().join("server.conf");
        let store = self.dir.path().join("store");
        let config = format!(
            "listen: \"127.0.0.1:{}\"\njetstream {{ store_dir: {} }}\n{snippet}\n",
            self.port,
            quoted(&store)
        );
        std::fs::write(&config_path, config).map_err(|err| format!("write config: {err}"))?;
        let log = File::create(self.log_path()).map_err(|err| format!("log file: {err}"))?;
        let log_err = log.try_clone().map_err(|err| format!("log file: {err}"))?;
        let child = Command::new(nats_server_binary())
            .arg("-c")
            .arg(&config_path)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .spawn()
            .map_err(|err| format!("spawn nats-server: {err}"))?;
        self.child = Some(child);
        let log_path = self.log_path();
        wait_until_listening(&mut self.child, self.port, &log_path).await
    }
}

impl Drop for ConfiguredServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A path as a quoted string for the server's config format.
pub fn quoted(path: &Path) -> String {
    serde_json::to_string(&path.display().to_string()).expect("a string serializes")
}
