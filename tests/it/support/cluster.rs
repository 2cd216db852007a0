//! nats-servers started from config files with `jetstream { sync_interval: always }` (every
//! write fsync'd, so what the server confirmed survives SIGKILL): one node, or a cluster of
//! nodes on loopback (routes on free ports, each with its own store and server name).
//! Each node can be killed (-9), restarted on the same ports and store, paused and resumed.

use std::fs::File;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tempfile::TempDir;
use tokio::time::Instant;

use crate::support::nats::{free_port, nats_server_binary};

const START_DEADLINE: Duration = Duration::from_secs(10);

/// One nats-server of a [`Cluster`].
pub struct Node {
    pub name: String,
    pub client_port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl Node {
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.client_port)
    }

    fn config_path(&self) -> PathBuf {
        self.dir.join("server.conf")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.join("server.log")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    fn spawn(&mut self) {
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("open the node's log");
        let log_err = log.try_clone().expect("clone the log file");
        let child = Command::new(nats_server_binary())
            .arg("-c")
            .arg(self.config_path())
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .spawn()
            .expect("spawn nats-server");
        self.child = Some(child);
    }

    async fn wait_accepting(&mut self) {
        let deadline = Instant::now() + START_DEADLINE;
        loop {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                panic!("{} exited with {status}; log:\n{}", self.name, self.log());
            }
            if tokio::net::TcpStream::connect(("127.0.0.1", self.client_port))
                .await
                .is_ok()
            {
                return;
            }
            if Instant::now() >= deadline {
                panic!(
                    "{} did not accept connections; log:\n{}",
                    self.name,
                    self.log()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGKILL and reap; the store stays for `restart`.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Start again on the same ports with the same store.
    pub async fn restart(&mut self) {
        self.kill9();
        self.spawn();
        self.wait_accepting().await;
    }

    /// SIGSTOP: the process keeps its sockets but answers nothing.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("the node runs").id();
        let status = Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {signal} {pid} failed");
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // A paused process ignores SIGKILL's reaping until continued on some systems.
        if self.child.is_some() {
            let _ = Command::new("kill")
                .args([
                    "-CONT",
                    &self.child.as_ref().map_or(0, Child::id).to_string(),
                ])
                .status();
        }
        self.kill9();
    }
}

/// `size` nats-servers with JetStream; with `size > 1` they form one cluster.
pub struct Cluster {
    pub nodes: Vec<Node>,
    _dir: TempDir,
}

impl Cluster {
    pub async fn start(size: usize) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("nats-cluster-")
            .tempdir()
            .expect("temp dir for the cluster");
        let client_ports: Vec<u16> = (0..size).map(|_| free_port()).collect();
        let route_ports: Vec<u16> = (0..size).map(|_| free_port()).collect();
        let routes = route_ports
            .iter()
            .map(|port| format!("\"nats://127.0.0.1:{port}\""))
            .collect::<Vec<_>>()
            .join(", ");
        let mut nodes = Vec::with_capacity(size);
        for i in 0..size {
            let name = format!("n{}", i + 1);
            let node_dir = dir.path().join(&name);
            std::fs::create_dir_all(&node_dir).expect("node dir");
            let store = node_dir.join("store");
            let mut config = format!(
                "server_name: {name}\nlisten: \"127.0.0.1:{}\"\n\
                 jetstream {{\n  store_dir: \"{}\"\n  sync_interval: always\n}}\n",
                client_ports[i],
                store.display()
            );
            if size > 1 {
                config.push_str(&format!(
                    "cluster {{\n  name: ledger\n  listen: \"127.0.0.1:{}\"\n  routes: [{routes}]\n}}\n",
                    route_ports[i]
                ));
            }
            std::fs::write(node_dir.join("server.conf"), config).expect("write server.conf");
            nodes.push(Node {
                name,
                client_port: client_ports[i],
                dir: node_dir,
                child: None,
            });
        }
        for node in &mut nodes {
            node.spawn();
        }
        for node in &mut nodes {
            node.wait_accepting().await;
        }
        Self { nodes, _dir: dir }
    }

    /// Every node's URL, comma-separated (what a client given the whole cluster uses).
    pub fn urls(&self) -> String {
        self.nodes
            .iter()
            .map(Node::url)
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn node(&mut self, name: &str) -> &mut Node {
        self.nodes
            .iter_mut()
            .find(|node| node.name == name)
            .unwrap_or_else(|| panic!("no node named {name}"))
    }
}
