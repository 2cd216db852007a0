//! The ledger test: every run in turn, and the scenarios each group of runs checks.

use super::faults::Scenario;
use super::report::{check, print_table};
use super::run::run;
use super::three_consumers::ledger_three_consumers_on_two_replicas;

/// A ledger run, started as a task of its own.
type LedgerRun = fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// Every ledger run, one after another, in one test. The runs share two cores, so they never
/// overlap; as five tests, the ones waiting for their turn held the suite's other test
/// threads idle (about 100 s of a CI run). Each run is a task: one that fails (its panic is
/// printed above) does not keep the others from running. `RUSTSTREAM_LEDGER=<part of a
/// name>` runs only the matching ones, e.g. `RUSTSTREAM_LEDGER=cluster cargo test --test it
/// ledger::`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_ledger_run_in_turn() {
    let only = std::env::var("RUSTSTREAM_LEDGER").unwrap_or_default();
    let runs: [(&str, LedgerRun); 5] = [
        ("single_node_faults", || {
            Box::pin(ledger_single_node_faults())
        }),
        ("cluster_faults", || Box::pin(ledger_cluster_faults())),
        ("non_sticky_replicas", || {
            Box::pin(ledger_non_sticky_replicas())
        }),
        ("three_consumers_on_two_replicas", || {
            Box::pin(ledger_three_consumers_on_two_replicas())
        }),
        ("rolling_upgrade_from_the_previous_release", || {
            Box::pin(ledger_rolling_upgrade_from_the_previous_release())
        }),
    ];
    let mut failed = Vec::new();
    let mut ran = 0;
    for (name, run) in runs {
        if !name.contains(only.as_str()) {
            continue;
        }
        ran += 1;
        if tokio::spawn(run()).await.is_err() {
            failed.push(name);
        }
    }
    assert!(ran > 0, "RUSTSTREAM_LEDGER={only} names no ledger run");
    assert!(
        failed.is_empty(),
        "ledger runs failed: {failed:?} (each one's failure is printed above)"
    );
}

async fn ledger_single_node_faults() {
    let mut reports = Vec::new();
    let mut failures = Vec::new();
    // A server killed -9 forgets acks it had confirmed; the gateway, still running, settles
    // those redeliveries again itself, so no client sees a duplicate.
    for (scenario, faulty, duplicates_allowed) in [
        (Scenario::NoFault, false, false),
        (Scenario::VanishingClients, false, false),
        (Scenario::KillNatsServer, true, false),
        (Scenario::KillGateway, true, true),
        (Scenario::DefaultSync, true, true),
    ] {
        let gateway_killed = matches!(scenario, Scenario::KillGateway);
        let report = run(scenario).await;
        failures.extend(check(&report, faulty, duplicates_allowed, false));
        // A gateway killed -9 loses no dead letter of a term it answered: the advisory stream
        // keeps the advisories it had not copied.
        if gateway_killed && report.termed_not_dead_lettered > 0 {
            failures.push(format!(
                "{}: {} ids termed with a 2xx were not dead-lettered: {:?}",
                report.scenario, report.termed_not_dead_lettered, report.dead_letter_mismatches
            ));
        }
        reports.push(report);
    }
    print_table(
        "single nats-server (sync_interval: always; the last run at the default)",
        &reports,
    );
    assert!(failures.is_empty(), "{failures:#?}");
}

async fn ledger_cluster_faults() {
    let mut reports = Vec::new();
    let mut failures = Vec::new();
    for scenario in [
        Scenario::ClusterFaults,
        Scenario::NonSticky { cluster: true },
        Scenario::TwoReplicasOnCluster,
    ] {
        let replicas = scenario.gateways() > 1;
        let report = run(scenario).await;
        failures.extend(check(&report, true, true, replicas));
        reports.push(report);
    }
    print_table(
        "3-node cluster, stream R3 (sync_interval: always; the last run at the default)",
        &reports,
    );
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Three replicas behind no sticky balancer: every settle at another replica than the
/// fetch, through replica and server faults.
async fn ledger_rolling_upgrade_from_the_previous_release() {
    // Nothing is killed: every settle answered 2xx must hold, on old and new replicas alike.
    let report = run(Scenario::RollingUpgrade).await;
    let mut failures = check(&report, true, false, true);
    // What a roll may cost a client: a fetch refused (503, retried elsewhere) by a replica
    // draining or starting, or no answer from one between its stop and its successor's
    // start. Never a settle refused: an old replica's lease settles at a new one and the
    // other way round.
    let refused: Vec<&String> = report
        .unexpected
        .iter()
        .filter(|answer| !answer.starts_with("fetch: 503") && !answer.contains(": no answer: "))
        .collect();
    if !refused.is_empty() {
        failures.push(format!(
            "answers a roll must not cause: {:?}",
            &refused[..refused.len().min(10)]
        ));
    }
    print_table(
        "3 gateway replicas rolled from the previous release under load",
        &[report],
    );
    assert!(failures.is_empty(), "{failures:#?}");
}

async fn ledger_non_sticky_replicas() {
    // Replicas are killed: their memory of confirmed settles dies with them, so duplicates
    // are reported, not failed (as for the single gateway killed).
    let report = run(Scenario::NonSticky { cluster: false }).await;
    let failures = check(&report, true, true, true);
    print_table(
        "3 gateway replicas, non-sticky, single nats-server (sync_interval: always)",
        &[report],
    );
    assert!(failures.is_empty(), "{failures:#?}");
}
