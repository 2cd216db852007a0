//! One ledger run: the servers and gateways started, the workers let loose, the scenario's
//! faults injected, and the ledger read into a report.

use std::io::Write as _;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::support::cluster::Cluster;
use crate::support::{GatewayProcess, Setup, wait_for};

use super::book::{Lease, Outcome, SharedLedger, lock};
use super::faults::{Fault, OWN_NODE_OF_REPLICA, Scenario, previous_release};
use super::fleet::Fleet;
use super::params::{ACK_WAIT, CONSUMER, DLQ_SUBJECT, K, RUN_DEADLINE, STREAM, W};
use super::report::Report;
use super::settles::behaviour;
use super::streams::{
    consumer_leader, create_streams, dead_letters, publish_all, server_backlog, step_down,
    stream_leader,
};
use super::workers::{sse_worker, vanishing_client, worker, ws_worker};

pub(super) async fn run(scenario: Scenario) -> Report {
    let started = Instant::now();
    let replicas = scenario.nodes();
    let default_sync = matches!(
        scenario,
        Scenario::DefaultSync | Scenario::TwoReplicasOnCluster
    );
    let mut cluster = Cluster::start(replicas, !default_sync).await;
    let urls = cluster.urls();
    let mut js = create_streams(&urls, replicas).await;
    if matches!(scenario, Scenario::DefaultSync) {
        // A stream deleted and made again in the same store: what the server recovers
        // after a crash then mixes the two lives of its files.
        js.delete_stream(STREAM).await.expect("delete the stream");
        js = create_streams(&urls, replicas).await;
    }
    let ids = publish_all(&js).await;
    let mut key = tempfile::NamedTempFile::new().expect("lease key file");
    key.write_all(b"the ledger's replicas share this lease key: 0123456789")
        .expect("write the lease key");
    // Longer than a lease lives: a replica being rolled answers every settle of its leases
    // until they are settled or expired, and only then exits.
    let grace = if scenario.gateways() > 1 { "3s" } else { "1s" };
    let setup = Setup::consumer(CONSUMER)
        .stream(STREAM)
        .ack_wait(ACK_WAIT)
        .settle_timeout("2s")
        .shutdown_grace(grace)
        .dead_letter_subject(DLQ_SUBJECT)
        .lease_key_file(key.path());
    let mut gateways: Vec<GatewayProcess> = Vec::new();
    for own_node in OWN_NODE_OF_REPLICA.iter().cycle().take(scenario.gateways()) {
        gateways.push(match scenario {
            Scenario::RollingUpgrade => {
                let mut old = GatewayProcess::spawn_program(&setup, &urls, &previous_release());
                old.wait_ready(Duration::from_secs(20)).await;
                old
            }
            // Replica r first connects to node r + 1 (the cluster tells it of the others),
            // so that "its own node" is known.
            Scenario::TwoReplicasOnCluster => {
                setup.process(&cluster.nodes[*own_node].1.url()).await
            }
            _ => setup.process(&urls).await,
        });
    }
    let bases: Vec<String> = gateways.iter().map(|gateway| gateway.base()).collect();
    let base = bases[0].clone();
    let fleet = Fleet::new(&bases);
    let ledger: SharedLedger = Arc::default();
    let stop = CancellationToken::new();
    let mut tasks = Vec::new();
    for _ in 0..W {
        tasks.push(tokio::spawn(worker(
            fleet.clone(),
            ledger.clone(),
            stop.clone(),
        )));
    }
    // Streaming workers among the fetchers: one over SSE, one over a WebSocket (not in the
    // roll from the previous release, which streams nothing).
    if !matches!(scenario, Scenario::RollingUpgrade) {
        tasks.push(tokio::spawn(sse_worker(
            fleet.clone(),
            ledger.clone(),
            stop.clone(),
        )));
        tasks.push(tokio::spawn(ws_worker(
            fleet.clone(),
            ledger.clone(),
            stop.clone(),
        )));
    }
    if matches!(scenario, Scenario::VanishingClients) {
        for round in 0..2 {
            tasks.push(tokio::spawn(vanishing_client(
                base.clone(),
                ledger.clone(),
                stop.clone(),
                round,
            )));
        }
    }
    let settled = |ledger: &SharedLedger| lock(ledger).settled.len();
    let wait_for_settled = |fraction: usize| {
        let ledger = ledger.clone();
        async move {
            let deadline = Instant::now() + RUN_DEADLINE;
            while settled(&ledger) < K * fraction / 100 && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };

    let mut faults = Vec::new();
    match scenario {
        Scenario::NoFault | Scenario::VanishingClients => {}
        Scenario::KillNatsServer => {
            wait_for_settled(30).await;
            cluster.nodes[0].1.kill();
            // Down for a second (pacing: the outage itself is the fault).
            tokio::time::sleep(Duration::from_secs(1)).await;
            cluster.nodes[0].1.restart().await;
            faults.push(Fault::healed("restart", &base));
        }
        Scenario::KillGateway => {
            wait_for_settled(30).await;
            gateways[0].kill9();
            fleet.replaced(0);
            // Measured from the restart of the process, its start-up included.
            let probe = Fault::healed("restart", &base);
            gateways[0].restart().await;
            faults.push(probe);
        }
        Scenario::DefaultSync => {
            // A rolled gateway (SIGTERM, started again), then one killed -9.
            wait_for_settled(10).await;
            let status = gateways[0].terminate(Duration::from_secs(15)).await;
            assert!(status.success(), "stopped badly: {}", gateways[0].log());
            fleet.replaced(0);
            let probe = Fault::healed("gateway TERM", &base);
            gateways[0].restart().await;
            faults.push(probe);
            wait_for_settled(25).await;
            gateways[0].kill9();
            fleet.replaced(0);
            let probe = Fault::healed("gateway -9", &base);
            gateways[0].restart().await;
            faults.push(probe);
            // The server killed -9 twice while this gateway lives, settles confirmed between
            // the two (what a restarted server confirms it may lose again), then paused.
            for (share, name) in [(40, "server -9"), (55, "server -9 again")] {
                wait_for_settled(share).await;
                cluster.nodes[0].1.kill();
                tokio::time::sleep(Duration::from_secs(1)).await;
                cluster.nodes[0].1.restart().await;
                faults.push(Fault::healed(name, &base));
            }
            wait_for_settled(70).await;
            cluster.nodes[0].1.pause();
            tokio::time::sleep(Duration::from_secs(2)).await;
            cluster.nodes[0].1.resume();
            faults.push(Fault::healed("server pause 2s", &base));
        }
        Scenario::ClusterFaults => {
            wait_for_settled(15).await;
            let leader = consumer_leader(&js)
                .await
                .expect("the consumer has a leader");
            fleet.bump_all();
            cluster.node(&leader).kill();
            tokio::time::sleep(Duration::from_secs(1)).await;
            cluster.node(&leader).restart().await;
            faults.push(Fault::healed_then("leader kill", &base, &fleet));
            wait_for_settled(45).await;
            // Pause a node for 3 s: a hung server, sockets open, nothing answered.
            let paused = cluster
                .nodes
                .iter()
                .position(|(name, _)| *name != leader)
                .expect("another node");
            fleet.bump_all();
            cluster.nodes[paused].1.pause();
            tokio::time::sleep(Duration::from_secs(3)).await;
            cluster.nodes[paused].1.resume();
            faults.push(Fault::healed_then("pause 3s", &base, &fleet));
        }
        Scenario::NonSticky {
            cluster: on_cluster,
        } => {
            // A replica killed -9 and started again.
            wait_for_settled(15).await;
            fleet.bump(0);
            gateways[0].kill9();
            fleet.replaced(0);
            let probe = Fault::healed("replica kill", &bases[0]);
            gateways[0].restart().await;
            faults.push(probe);
            // A rolling restart of the other two, one at a time.
            wait_for_settled(30).await;
            for replica in [1, 2] {
                let status = gateways[replica].terminate(Duration::from_secs(15)).await;
                assert!(
                    status.success(),
                    "replica {replica} stopped badly: {}",
                    gateways[replica].log()
                );
                fleet.bump(replica);
                fleet.replaced(replica);
                gateways[replica].restart().await;
            }
            faults.push(Fault::healed("rolling restart", &bases[2]));
            // A replica stalled for 3 s: settles of its leases elsewhere wait (504).
            wait_for_settled(50).await;
            gateways[1].pause();
            tokio::time::sleep(Duration::from_secs(3)).await;
            // A settle it takes up after the stall finds a lease that expired meanwhile
            // (410, rightly): its leases from before are not counted as live.
            fleet.bump(1);
            gateways[1].resume();
            faults.push(Fault::healed("replica pause 3s", &bases[1]));
            // The server (or the consumer leader's node) killed -9 and started again.
            wait_for_settled(65).await;
            let node = if on_cluster {
                let leader = consumer_leader(&js)
                    .await
                    .expect("the consumer has a leader");
                cluster
                    .nodes
                    .iter()
                    .position(|(name, _)| *name == leader)
                    .expect("the leader is a node")
            } else {
                0
            };
            fleet.bump_all();
            cluster.nodes[node].1.kill();
            tokio::time::sleep(Duration::from_secs(1)).await;
            cluster.nodes[node].1.restart().await;
            faults.push(Fault::healed_then("server kill", &bases[0], &fleet));
        }
        Scenario::TwoReplicasOnCluster => {
            // Leaders stepped down. A new consumer leader may redeliver early, and the
            // owner then refuses the superseded lease rightly; what must never happen
            // (checked in every fault) is an owner still running taken for gone.
            wait_for_settled(15).await;
            fleet.bump_all();
            step_down(&js, &format!("STREAM.LEADER.STEPDOWN.{STREAM}")).await;
            step_down(
                &js,
                &format!("CONSUMER.LEADER.STEPDOWN.{STREAM}.{CONSUMER}"),
            )
            .await;
            faults.push(Fault::healed_then("leader step-downs", &bases[0], &fleet));
            // The stream leader killed -9 and started again a second later.
            wait_for_settled(30).await;
            let leader = wait_for("the stream has a leader", Duration::from_secs(20), || {
                stream_leader(&js)
            })
            .await;
            fleet.bump_all();
            cluster.node(&leader).kill();
            tokio::time::sleep(Duration::from_secs(1)).await;
            cluster.node(&leader).restart().await;
            faults.push(Fault::healed_then("stream leader -9", &bases[0], &fleet));
            // The consumer leader's node paused 6 s: sockets open, nothing answered.
            wait_for_settled(45).await;
            let leader = wait_for("the consumer has a leader", Duration::from_secs(20), || {
                consumer_leader(&js)
            })
            .await;
            // A consumer leader deposed may be followed by early redeliveries (the new
            // leader's timers): leases they supersede are refused rightly.
            fleet.bump_all();
            cluster.node(&leader).pause();
            tokio::time::sleep(Duration::from_secs(6)).await;
            cluster.node(&leader).resume();
            faults.push(Fault::healed_then(
                "consumer leader paused 6s",
                &bases[0],
                &fleet,
            ));
            // Replica 0's own node killed -9: the replica reconnects to another.
            wait_for_settled(60).await;
            fleet.bump_all();
            let own = OWN_NODE_OF_REPLICA[0];
            cluster.nodes[own].1.kill();
            tokio::time::sleep(Duration::from_secs(1)).await;
            cluster.nodes[own].1.restart().await;
            faults.push(Fault::healed_then(
                "replica's own node -9",
                &bases[0],
                &fleet,
            ));
        }
        Scenario::RollingUpgrade => {
            // One replica at a time: the old one drains (its leases settle through it or
            // any other), and this build takes its place. The release before sealed replica
            // traffic: the new replicas believe its unsealed messages for the length of the
            // roll.
            for (replica, gateway) in gateways.iter_mut().enumerate() {
                wait_for_settled(15 + 20 * replica).await;
                let status = gateway.terminate(Duration::from_secs(15)).await;
                assert!(
                    status.success(),
                    "old replica {replica} stopped badly: {}",
                    gateway.log()
                );
                fleet.bump(replica);
                fleet.replaced(replica);
                fleet.set_out(replica, true);
                gateway.upgrade(&["--accept-unsigned-replicas"]).await;
                fleet.set_out(replica, false);
            }
            faults.push(Fault::healed("rolling upgrade", &bases[2]));
        }
    }

    // Run until every id is settled, or nothing is left anywhere (an ack that landed without
    // its answer never comes back), and at least 2 ack_waits after the last fault healed.
    let last_heal = Instant::now();
    let deadline = Instant::now() + RUN_DEADLINE;
    let mut quiet_since: Option<Instant> = None;
    loop {
        let all_settled = settled(&ledger) == K;
        let quiet = !all_settled
            && last_heal.elapsed() >= Duration::from_secs(4)
            && server_backlog(&js).await == Some((0, 0));
        quiet_since = if quiet {
            quiet_since.or(Some(Instant::now()))
        } else {
            None
        };
        if all_settled || quiet_since.is_some_and(|at| at.elapsed() >= Duration::from_secs(3)) {
            break;
        }
        if Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.cancel();
    for task in tasks {
        let _ = task.await;
    }
    let backlog = server_backlog(&js).await;
    let mut recoveries = Vec::new();
    for fault in faults {
        recoveries.push((fault.name, fault.recovered.await.ok().flatten()));
    }
    // The workers have stopped: take the ledger out to read it.
    let ledger = std::mem::take(&mut *lock(&ledger));
    // Dead letters arrive shortly after the term, or, for advisories a killed gateway held,
    // after the advisory consumer's ack_wait (10 s): wait (bounded) for every termed id.
    let termed: Vec<&String> = ledger
        .settled
        .iter()
        .filter(|(_, outcome)| **outcome == Outcome::Termed)
        .map(|(id, _)| id)
        .collect();
    let termed_ids = termed.len();
    let dead_deadline = Instant::now() + Duration::from_secs(25);
    let letters = loop {
        let letters = dead_letters(&js).await.unwrap_or_default();
        let all_there = termed.iter().all(|id| letters.contains_key(*id));
        if (all_there && letters.len() >= termed_ids) || Instant::now() >= dead_deadline {
            break letters;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let mut dead_letter_mismatches: Vec<String> = letters
        .iter()
        .filter(|(id, reason)| ledger.term_reasons.get(*id) != Some(*reason))
        .map(|(id, reason)| {
            format!(
                "{id}: dead-lettered with {reason:?}, ledger {:?}",
                ledger.term_reasons.get(id)
            )
        })
        .collect();
    let not_dead_lettered: Vec<String> = termed
        .iter()
        .filter(|id| !letters.contains_key(**id))
        .map(|id| format!("{id}: termed (204), not dead-lettered"))
        .collect();
    let termed_not_dead_lettered = not_dead_lettered.len();
    dead_letter_mismatches.extend(not_dead_lettered);
    let acked = ledger
        .settled
        .values()
        .filter(|outcome| **outcome == Outcome::Acked)
        .count();
    let termed = ledger.settled.len() - acked;
    // Not settled with a 2xx: never counted as acked or termed. It is not lost only if a
    // settle of it was sent whose answer was lost (a fault, or the client hung up on it) and
    // the server holds nothing any more (the settle landed); the check below says in which
    // runs that may happen at all.
    let unsettled: Vec<&String> = ids
        .iter()
        .filter(|id| !ledger.settled.contains_key(*id))
        .collect();
    let server_empty = backlog == Some((0, 0));
    let answer_lost =
        |id: &String| ledger.ack_unconfirmed.contains(id) || ledger.hung_up.contains(id);
    let lost: Vec<String> = unsettled
        .iter()
        .filter(|id| !server_empty || !answer_lost(id))
        .map(|id| (*id).clone())
        .collect();
    let hung_up = unsettled
        .iter()
        .filter(|id| {
            server_empty && !ledger.ack_unconfirmed.contains(**id) && ledger.hung_up.contains(**id)
        })
        .count();
    let terms_without_reason = ledger
        .settled
        .iter()
        .filter(|(id, outcome)| {
            **outcome == Outcome::Termed && !ledger.term_reasons.contains_key(*id)
        })
        .count();
    if !lost.is_empty() {
        let stream = js.get_stream(STREAM).await.ok();
        for id in &lost {
            let sequence = id.trim_start_matches("id-").parse::<u64>().unwrap_or(0) + 1;
            let stored = match &stream {
                Some(stream) => stream.get_raw_message(sequence).await.is_ok(),
                None => false,
            };
            let seen = ledger.seen.get(id).cloned().unwrap_or_default();
            let behaviours: Vec<String> = seen
                .iter()
                .map(|delivered| {
                    let lease = Lease {
                        id: String::new(),
                        ledger_id: id.clone(),
                        delivered: *delivered,
                        owner: 0,
                        generation: 0,
                        life: 0,
                        expires_at: None,
                    };
                    format!("{delivered}:{:?}", behaviour(&lease))
                })
                .collect();
            eprintln!(
                "lost {id} (stream seq {sequence}, in stream: {stored}): deliveries {behaviours:?}"
            );
        }
        let info = match &stream {
            Some(stream) => stream
                .consumer_info(CONSUMER)
                .await
                .ok()
                .map(|info| format!("{info:?}")),
            None => None,
        };
        eprintln!(
            "{}: server backlog (num_pending, num_ack_pending) {backlog:?}; consumer {info:?}; gateway log (warnings):\n{}",
            scenario.name(),
            gateway_warnings(&gateways)
        );
    } else if !ledger.refused_live.is_empty() {
        // Why the owners refused them: a new lease epoch is logged as a warning.
        eprintln!(
            "{}: live leases refused {:?}; gateway log (warnings):\n{}",
            scenario.name(),
            ledger.refused_live,
            gateway_warnings(&gateways)
        );
    }
    Report {
        scenario: scenario.name(),
        acked,
        acked_unconfirmed: unsettled.len() - lost.len() - hung_up,
        hung_up,
        unexpected: ledger.unexpected.clone(),
        termed,
        lost,
        terms_without_reason,
        dead_lettered: letters.len(),
        dead_letter_mismatches,
        termed_not_dead_lettered,
        duplicates: ledger.duplicates.clone(),
        same_process_duplicates: ledger.same_process_duplicates.clone(),
        redeliveries: ledger.redeliveries,
        refused_live: ledger.refused_live.clone(),
        recoveries,
        took: started.elapsed(),
    }
}

/// Every warning and error the gateways logged, each line prefixed with its replica.
fn gateway_warnings(gateways: &[GatewayProcess]) -> String {
    gateways
        .iter()
        .enumerate()
        .flat_map(|(replica, gateway)| {
            gateway
                .log()
                .lines()
                .filter(|line| line.contains("WARN") || line.contains("ERROR"))
                .map(|line| format!("[replica {replica}] {line}"))
                .collect::<Vec<_>>()
        })
        .collect::<Vec<_>>()
        .join("\n")
}
