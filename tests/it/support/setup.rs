//! How a test starts a gateway: a builder of its flags (consumer name, ack_wait, …), then
//! where it runs — in process on a fresh nats-server with the `ORDERS` stream, in process
//! against a given server, or as the binary in a child process.

use std::time::Duration;

use super::gateway::{Gateway, GatewayProcess};
use super::nats::{Js, NatsServer};

/// The stream every test uses, as the README's demo does.
pub const STREAM: &str = "ORDERS";

/// The gateway's flags, built up by name; `--nats-url` is added where it runs.
#[derive(Debug, Clone)]
pub struct Setup {
    stream: String,
    consumer: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
    rust_log: String,
}

impl Setup {
    /// A gateway of durable consumer `name` on the `ORDERS` stream, every other flag at its
    /// default.
    pub fn consumer(name: &str) -> Self {
        Self {
            stream: STREAM.to_owned(),
            consumer: name.to_owned(),
            args: vec!["--consumer".to_owned(), name.to_owned()],
            env: Vec::new(),
            rust_log: "info".to_owned(),
        }
    }

    /// No flag at all (the defaults: consumer `billing`), for the tests of the defaults.
    pub fn defaults() -> Self {
        Self {
            stream: STREAM.to_owned(),
            consumer: "billing".to_owned(),
            args: Vec::new(),
            env: Vec::new(),
            rust_log: "info".to_owned(),
        }
    }

    /// `--<name> <value>`, for any flag without a method of its own.
    pub fn flag(mut self, name: &str, value: impl Into<String>) -> Self {
        assert!(name.starts_with("--"), "a flag: {name}");
        self.args.push(name.to_owned());
        self.args.push(value.into());
        self
    }

    /// A flag without a value (`--create-stream`, `--ephemeral`).
    pub fn switch(mut self, name: &str) -> Self {
        assert!(name.starts_with("--"), "a flag: {name}");
        self.args.push(name.to_owned());
        self
    }

    pub fn stream(mut self, stream: &str) -> Self {
        self.stream = stream.to_owned();
        self.flag("--stream", stream)
    }

    pub fn ack_wait(self, value: &str) -> Self {
        self.flag("--ack-wait", value)
    }

    pub fn max_ack_pending(self, value: u32) -> Self {
        self.flag("--max-ack-pending", value.to_string())
    }

    pub fn max_deliver(self, value: u32) -> Self {
        self.flag("--max-deliver", value.to_string())
    }

    pub fn settle_timeout(self, value: &str) -> Self {
        self.flag("--settle-timeout", value)
    }

    pub fn shutdown_grace(self, value: &str) -> Self {
        self.flag("--shutdown-grace", value)
    }

    pub fn dead_letter_subject(self, subject: &str) -> Self {
        self.flag("--dead-letter-subject", subject)
    }

    pub fn deliver_policy(self, policy: &str) -> Self {
        self.flag("--deliver-policy", policy)
    }

    pub fn filter_subject(self, subject: &str) -> Self {
        self.flag("--filter-subject", subject)
    }

    /// `--auth-tokens-file <path>`.
    pub fn auth_tokens_file(self, path: &std::path::Path) -> Self {
        self.flag("--auth-tokens-file", path.to_str().expect("a UTF-8 path"))
    }

    /// `--lease-key-file <path>`.
    pub fn lease_key_file(self, path: &std::path::Path) -> Self {
        self.flag("--lease-key-file", path.to_str().expect("a UTF-8 path"))
    }

    pub fn create_stream(self) -> Self {
        self.switch("--create-stream")
    }

    pub fn ephemeral(self) -> Self {
        self.switch("--ephemeral")
    }

    /// An environment variable for the binary (the in-process gateway reads flags only).
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_owned(), value.to_owned()));
        self
    }

    /// `RUST_LOG` for the binary (default `info`).
    pub fn rust_log(mut self, filter: &str) -> Self {
        self.rust_log = filter.to_owned();
        self
    }

    pub fn stream_name(&self) -> &str {
        &self.stream
    }

    pub fn consumer_name(&self) -> &str {
        &self.consumer
    }

    /// The command line after the program name, with `--nats-url <url>` first.
    pub fn args(&self, nats_url: &str) -> Vec<String> {
        let mut args = vec!["--nats-url".to_owned(), nats_url.to_owned()];
        args.extend(self.args.iter().cloned());
        args
    }

    pub fn env_vars(&self) -> &[(String, String)] {
        &self.env
    }

    pub fn rust_log_filter(&self) -> &str {
        &self.rust_log
    }

    /// A nats-server with the `ORDERS` stream (`orders.>`), a JetStream client on it, and a
    /// ready in-process gateway.
    pub async fn start(&self) -> (NatsServer, Js, Gateway) {
        let (server, js) = super::server_with_stream().await;
        let gateway = self.ready(&server.url()).await;
        (server, js, gateway)
    }

    /// An in-process gateway on the server at `nats_url`, ready (/readyz 200).
    pub async fn ready(&self, nats_url: &str) -> Gateway {
        let mut gateway = self.starting(nats_url).await;
        gateway.wait_ready().await;
        gateway
    }

    /// An in-process gateway on the server at `nats_url`, not waited for.
    pub async fn starting(&self, nats_url: &str) -> Gateway {
        Gateway::start(self, nats_url).await
    }

    /// The gateway binary on the server at `nats_url`, ready (/readyz 200).
    pub async fn process(&self, nats_url: &str) -> GatewayProcess {
        let mut gateway = GatewayProcess::spawn(self, nats_url);
        gateway.wait_ready(Duration::from_secs(20)).await;
        gateway
    }
}
