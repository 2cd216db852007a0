//! nats-servers started from config files, with `jetstream { sync_interval: always }` (every
//! write fsync'd, so what the server confirmed survives SIGKILL) or at the default (fsync
//! every 2 minutes, as most deployments run): one node, or a cluster of nodes on loopback
//! (routes on free ports, each with its own store and server name).
//! Each node is a [`NatsServer`]: killed (-9), restarted on the same ports and store, paused.

use async_nats::jetstream;
use tempfile::TempDir;

use super::nats::{NatsServer, free_port};

/// `size` nats-servers with JetStream; with `size > 1` they form one cluster.
pub struct Cluster {
    /// `(name, server)`: `n1`, `n2`, …
    pub nodes: Vec<(String, NatsServer)>,
    _dir: TempDir,
}

impl Cluster {
    /// `sync_always`: `sync_interval: always`; else the server's default.
    pub async fn start(size: usize, sync_always: bool) -> Self {
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
            let sync = if sync_always {
                "  sync_interval: always\n"
            } else {
                ""
            };
            let mut config = format!(
                "server_name: {name}\nlisten: \"127.0.0.1:{}\"\n\
                 jetstream {{\n  store_dir: \"{}\"\n{sync}}}\n",
                client_ports[i],
                store.display()
            );
            if size > 1 {
                config.push_str(&format!(
                    "cluster {{\n  name: ledger\n  listen: \"127.0.0.1:{}\"\n  routes: [{routes}]\n}}\n",
                    route_ports[i]
                ));
            }
            let config_path = node_dir.join("server.conf");
            std::fs::write(&config_path, config).expect("write server.conf");
            let server = NatsServer::node(&name, client_ports[i], &config_path, &node_dir);
            nodes.push((name, server));
        }
        for (name, node) in &mut nodes {
            node.spawn_and_wait()
                .await
                .unwrap_or_else(|err| panic!("{name} did not start: {err}"));
        }
        Self { nodes, _dir: dir }
    }

    /// Every node's URL, comma-separated (what a client given the whole cluster uses).
    pub fn urls(&self) -> String {
        self.nodes
            .iter()
            .map(|(_, node)| node.url())
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn node(&mut self, name: &str) -> &mut NatsServer {
        self.nodes
            .iter_mut()
            .find(|(node_name, _)| node_name == name)
            .map(|(_, node)| node)
            .unwrap_or_else(|| panic!("no node named {name}"))
    }
}

/// A JetStream client of every node in `urls` (comma-separated), connecting while they
/// still start.
pub async fn jetstream_of(urls: &str) -> jetstream::Context {
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(urls.split(',').collect::<Vec<_>>().as_slice())
        .await
        .expect("connect the test client");
    jetstream::new(client)
}

/// Make a stream on a cluster, asking again for up to 30 s while it elects its meta leader.
pub async fn create_stream_when_ready(js: &jetstream::Context, config: jetstream::stream::Config) {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        match js.create_stream(config.clone()).await {
            Ok(_) => return,
            Err(err) => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "create the stream {}: {err}",
                    config.name
                );
                tokio::time::sleep(std::time::Duration::from_millis(250)).await;
            }
        }
    }
}
