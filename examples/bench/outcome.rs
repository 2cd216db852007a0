//! One timed drain run (its kind and client count) and what it measured, as the report
//! prints it.

use super::args::Kind;

/// One timed run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Run {
    pub(crate) kind: Kind,
    pub(crate) clients: u32,
}

impl Run {
    pub(crate) fn label(self) -> String {
        match self.kind {
            Kind::Native => "native".into(),
            Kind::Batch => format!("batch x{}", self.clients),
            Kind::Single => format!("single x{}", self.clients),
            Kind::Latency => "latency".into(),
            Kind::Forwarded => format!("fwd x{}", self.clients),
            Kind::Floor => format!("floor x{}", self.clients),
            Kind::WsEach => format!("ws-each x{}", self.clients),
            Kind::WsHundred => format!("ws-100 x{}", self.clients),
            Kind::Traced => format!("traced x{}", self.clients),
            Kind::SseBatch => format!("sse-batch x{}", self.clients),
            Kind::EventLatency => "event-latency".into(),
        }
    }
}

pub(crate) struct Outcome {
    pub(crate) run: Run,
    pub(crate) round: u32,
    /// The target of the run; `acked` may exceed it by what loops held when it was met.
    pub(crate) messages: u64,
    pub(crate) acked: u64,
    pub(crate) seconds: f64,
    pub(crate) fetches: u64,
    pub(crate) fetch_p99_ms: f64,
    pub(crate) ack_p99_ms: f64,
    /// The native run's CPU (user + system) over its drain: the benchmark process, which
    /// runs nothing else meanwhile.
    pub(crate) native_cpu_seconds: Option<f64>,
    pub(crate) gateway: Option<GatewayFigures>,
}

pub(crate) struct GatewayFigures {
    /// Gateway CPU (user + system) from the start to the moment the target was met.
    pub(crate) cpu_seconds: f64,
    /// HTTP requests the loops sent (fetches and settles).
    pub(crate) requests: u64,
    /// What the gateway wrote to its log over the whole run.
    pub(crate) log_lines: u64,
    pub(crate) log_bytes: u64,
    /// Its peak resident memory (VmHWM) at the end of the run.
    pub(crate) rss_kb: Option<u64>,
}

impl GatewayFigures {
    pub(crate) fn cpu_micros_per_message(&self, messages: u64) -> f64 {
        self.cpu_seconds * 1e6 / messages as f64
    }
}

impl Outcome {
    pub(crate) fn rate(&self) -> f64 {
        self.messages as f64 / self.seconds
    }
}
