//! The gateway's pod: the kustomization lists files that exist, the Deployment gives only
//! flags and variables the gateway has, ports agree everywhere, the probes are answered on the
//! admin listener, and the termination grace outlasts the preStop wait and the shutdown.

use std::collections::BTreeSet;
use std::path::Path;

use crate::support::nats::free_port;
use crate::support::{Client, Setup};

use super::manifests::{
    DIR, Pod, STOP_BOUNDS, applied, documents, kustomization, seconds, selects, strings, the,
};

#[test]
fn kustomization_lists_every_manifest_and_only_files_that_exist() {
    let kustomization = kustomization();
    assert_eq!(
        kustomization["kind"].as_str(),
        Some("Kustomization"),
        "kustomization.yaml is a Kustomization"
    );
    let resources = strings(&kustomization["resources"]);
    assert!(!resources.is_empty(), "kustomization.yaml lists resources");
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(DIR);
    for file in &resources {
        assert!(
            dir.join(file).is_file(),
            "kustomization.yaml lists {file}, which is not in {DIR}"
        );
        for object in documents(file) {
            assert!(
                object["apiVersion"].as_str().is_some() && object["kind"].as_str().is_some(),
                "{file}: every document is a Kubernetes object: {object:?}"
            );
        }
    }
    // Everything else is a template or an example, named so, and left out on purpose.
    for entry in std::fs::read_dir(&dir).expect("deploy/kubernetes exists") {
        let name = entry.expect("a directory entry").file_name();
        let name = name.to_string_lossy();
        if name.ends_with(".yaml") && name != "kustomization.yaml" {
            assert!(
                resources.iter().any(|file| *file == name) || name.ends_with(".example.yaml"),
                "{name} is neither in kustomization.yaml nor an .example.yaml"
            );
        }
    }
    let kinds: BTreeSet<String> = applied()
        .iter()
        .filter_map(|object| object["kind"].as_str().map(str::to_owned))
        .collect();
    for kind in ["Deployment", "Service", "PodDisruptionBudget"] {
        assert!(kinds.contains(kind), "kustomization.yaml applies a {kind}");
    }
    // `images:` must name the Deployment's image, or the override would change nothing.
    let pod = Pod::of_the_deployment();
    let image = pod.container["image"].as_str().expect("an image");
    let names: Vec<&str> = kustomization["images"]
        .as_vec()
        .map(|items| {
            items
                .iter()
                .filter_map(|item| item["name"].as_str())
                .collect()
        })
        .unwrap_or_default();
    assert!(
        names.contains(&image),
        "kustomization.yaml's images override {image}: {names:?}"
    );
}

#[test]
fn deployment_gives_the_gateway_only_flags_and_variables_it_has() {
    let pod = Pod::of_the_deployment();
    let config = pod.config();
    assert!(
        config.listen.ip().is_unspecified(),
        "the gateway listens on all interfaces of the pod, not {}",
        config.listen
    );
    let admin = config
        .admin_listen
        .expect("--admin-listen is set: probes and scrapes get a listener of their own");
    assert!(
        admin.ip().is_unspecified(),
        "the admin listener is reachable by the kubelet and Prometheus, not {admin}"
    );
    assert_ne!(
        admin.port(),
        config.listen.port(),
        "two listeners, two ports"
    );
}

#[test]
fn ports_agree_between_args_container_probes_and_service() {
    let pod = Pod::of_the_deployment();
    let config = pod.config();
    let admin_port = config.admin_listen.expect("--admin-listen").port();
    assert_eq!(
        pod.named_port("http"),
        config.listen.port(),
        "container port `http` is the --listen port"
    );
    assert_eq!(
        pod.named_port("metrics"),
        admin_port,
        "container port `metrics` is the --admin-listen port"
    );
    for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
        let get = &pod.container[probe]["httpGet"];
        assert_eq!(get["path"].as_str(), Some(path), "{probe} asks {path}");
        assert_eq!(
            pod.port(&get["port"]),
            admin_port,
            "{probe} asks the admin listener, which answers while the main one is full"
        );
        assert!(
            matches!(get["scheme"].as_str(), None | Some("HTTP")),
            "{probe} over plain HTTP, as the admin listener serves"
        );
    }

    let service = the(&applied(), "Service");
    assert!(
        selects(&service["spec"]["selector"], &pod.labels()),
        "the Service selects the Deployment's pods"
    );
    let ports = service["spec"]["ports"].as_vec().expect("Service ports");
    let target = |name: &str| {
        let port = ports
            .iter()
            .find(|port| port["name"].as_str() == Some(name))
            .unwrap_or_else(|| panic!("the Service has a port named {name}"));
        let target = if port["targetPort"].is_badvalue() {
            &port["port"]
        } else {
            &port["targetPort"]
        };
        pod.port(target)
    };
    assert_eq!(
        target("http"),
        config.listen.port(),
        "Service http → --listen"
    );
    assert_eq!(
        target("metrics"),
        admin_port,
        "Service metrics (what a ServiceMonitor scrapes) → --admin-listen"
    );
}

/// The probe paths of the Deployment, asked on a gateway's `--admin-listen` port: /healthz
/// and /readyz answer 200 there, without a token while tokens are on (the kubelet sends
/// none), and an unknown path would be a 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_probes_are_answered_on_the_admin_listener() {
    let pod = Pod::of_the_deployment();
    let tokens = tempfile::NamedTempFile::new().expect("a tokens file");
    std::fs::write(tokens.path(), "worker-probe fetch,settle\n").expect("write tokens");
    let admin_port = free_port();
    let (_server, _js, _gateway) = Setup::consumer("kubernetes-probes")
        .flag("--admin-listen", format!("127.0.0.1:{admin_port}"))
        .auth_tokens_file(tokens.path())
        .start()
        .await;
    let admin = Client::new(format!("http://127.0.0.1:{admin_port}"));
    for probe in ["livenessProbe", "readinessProbe"] {
        let path = pod.container[probe]["httpGet"]["path"]
            .as_str()
            .unwrap_or_else(|| panic!("{probe} is an httpGet"));
        let reply = admin.get(path).await;
        assert_eq!(reply.status, 200, "{probe} {path}: {}", reply.text);
    }
    admin.get("/no-such-probe").await.assert_problem(404);
}

#[test]
fn termination_grace_outlasts_the_prestop_wait_and_the_shutdown() {
    let pod = Pod::of_the_deployment();
    let config = pod.config();
    let pre_stop = &pod.container["lifecycle"]["preStop"];
    assert!(
        pre_stop["exec"].is_badvalue(),
        "the image is distroless: no shell or sleep binary for an exec preStop"
    );
    let sleep = pre_stop["sleep"]["seconds"]
        .as_i64()
        .and_then(|n| u64::try_from(n).ok())
        .filter(|n| *n > 0)
        .expect("a preStop sleep, so endpoints are removed before SIGTERM");
    let grace = pod.spec["terminationGracePeriodSeconds"]
        .as_i64()
        .and_then(|n| u64::try_from(n).ok())
        .expect("terminationGracePeriodSeconds is set");
    // After the preStop wait, SIGTERM: settles are accepted for --shutdown-grace, the last of
    // them may wait --settle-timeout for its confirmation, then `stop` naks and flushes.
    let needed = sleep
        + seconds(config.shutdown_grace)
        + seconds(config.settle_timeout)
        + STOP_BOUNDS.as_secs();
    assert!(
        grace > needed,
        "terminationGracePeriodSeconds {grace} must exceed preStop {sleep} s + \
         --shutdown-grace {:?} + --settle-timeout {:?} + stop {STOP_BOUNDS:?} = {needed} s",
        config.shutdown_grace,
        config.settle_timeout
    );
}
