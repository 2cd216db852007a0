//! What a run injects: the scenarios, a fault and the time to recover after it was healed,
//! and the previous release the rolling-upgrade run starts from.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::support::{Action, FetchRequest};

use super::fleet::{Fleet, client};
use super::params::RECOVERY_BOUND;

/// A fault injected during a run, and how long after it was healed a fetch answered 200.
pub(super) struct Fault {
    pub(super) name: &'static str,
    pub(super) recovered: tokio::task::JoinHandle<Option<Duration>>,
}

impl Fault {
    /// Start probing right after the heal: `POST /fetch` (wait 0) every 50 ms until one
    /// answers 200; a message it leases is nak'd back at once.
    pub(super) fn healed(name: &'static str, base: &str) -> Self {
        let client = client(base);
        let recovered = tokio::spawn(async move {
            let healed_at = Instant::now();
            while healed_at.elapsed() < RECOVERY_BOUND + Duration::from_secs(5) {
                let answer = client
                    .try_fetch(&FetchRequest::new(1, 0), Some(Duration::from_secs(2)))
                    .await;
                if let Ok(reply) = answer
                    && reply.status == 200
                {
                    let took = healed_at.elapsed();
                    for message in reply.body["messages"].as_array().into_iter().flatten() {
                        if let Some(id) = message["id"].as_str() {
                            let _ = client.try_settle(id, Action::Nak, None, None).await;
                        }
                    }
                    return Some(took);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            None
        });
        Self { name, recovered }
    }

    /// [`Fault::healed`] of a server fault: until the consumer answers again (a cluster
    /// elects a new leader, which may redeliver early or have lost deliveries: a new lease
    /// epoch), the failover may void leases issued meanwhile, which is not the replicas'
    /// doing; so the fleet's generations move on again once it has recovered.
    pub(super) fn healed_then(name: &'static str, base: &str, fleet: &Arc<Fleet>) -> Self {
        let probe = Self::healed(name, base);
        let fleet = fleet.clone();
        let recovered = tokio::spawn(async move {
            let took = probe.recovered.await.ok().flatten();
            fleet.bump_all();
            // A rebind (and a new lease epoch) can follow the first good fetch by a moment.
            tokio::time::sleep(Duration::from_secs(4)).await;
            fleet.bump_all();
            took
        });
        Self { name, recovered }
    }
}

/// The node each replica of [`Scenario::TwoReplicasOnCluster`] connects to first.
pub(super) const OWN_NODE_OF_REPLICA: [usize; 2] = [1, 2];

/// What a run injects.
pub(super) enum Scenario {
    NoFault,
    KillNatsServer,
    KillGateway,
    VanishingClients,
    ClusterFaults,
    /// nats-server at its default sync_interval (most deployments), the stream deleted and
    /// made again beforehand: the gateway stopped and started again, killed -9 and started
    /// again, then the server killed -9 twice and paused while that gateway lives.
    DefaultSync,
    /// Three replicas, no stickiness, replica and server faults (`true`: on the cluster).
    NonSticky {
        cluster: bool,
    },
    /// Three replicas started on the previous release, rolled to this build one at a time
    /// under load (SIGTERM, this build started in its place).
    RollingUpgrade,
    /// Two replicas, no stickiness, on a 3-node cluster at nats-server's default sync, each
    /// replica first connected to a node of its own: the stream's and the consumer's leaders
    /// stepped down, the stream leader killed -9, the consumer leader's node paused 6 s, a
    /// replica's own node killed -9. No owner still running is taken for gone (the fleet
    /// stream and the heartbeats may lag meanwhile), no 410 for an ack that landed (lost 0).
    TwoReplicasOnCluster,
}

impl Scenario {
    pub(super) fn name(&self) -> &'static str {
        match self {
            Self::NoFault => "no fault",
            Self::KillNatsServer => "nats-server kill -9",
            Self::KillGateway => "gateway kill -9",
            Self::VanishingClients => "clients vanish mid-fetch/ack",
            Self::ClusterFaults => "3-node cluster: leader/pause",
            Self::DefaultSync => "default sync: gw TERM/-9, server -9 ×2, pause",
            Self::NonSticky { cluster: false } => "3 replicas, non-sticky",
            Self::NonSticky { cluster: true } => "3 replicas, non-sticky, R3",
            Self::RollingUpgrade => "3 replicas rolled from the previous release",
            Self::TwoReplicasOnCluster => "2 replicas, R3, default sync: step-downs, -9, pause 6s",
        }
    }

    pub(super) fn nodes(&self) -> usize {
        match self {
            Self::ClusterFaults
            | Self::NonSticky { cluster: true }
            | Self::TwoReplicasOnCluster => 3,
            _ => 1,
        }
    }

    pub(super) fn gateways(&self) -> usize {
        match self {
            Self::NonSticky { .. } | Self::RollingUpgrade => 3,
            Self::TwoReplicasOnCluster => 2,
            _ => 1,
        }
    }
}

/// The previous release's binary: `RUSTSTREAM_PREVIOUS_RELEASE_BIN` (scripts/test.sh builds
/// it before the tests), else built now by scripts/previous-release.sh in a target
/// directory of its own.
pub(super) fn previous_release() -> String {
    if let Ok(path) = std::env::var("RUSTSTREAM_PREVIOUS_RELEASE_BIN")
        && !path.is_empty()
    {
        return path;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/previous-release.sh");
    let output = std::process::Command::new("bash")
        .arg(&script)
        .env("PREVIOUS_RELEASE_OWN_TARGET", "1")
        .output()
        .expect("run scripts/previous-release.sh");
    assert!(
        output.status.success(),
        "building the previous release failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}
