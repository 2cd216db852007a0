//! The Kubernetes manifests (`deploy/kubernetes/`) stay in step with the code and the image,
//! checked the way `containers.rs` checks the Docker files: the kustomization lists files that
//! exist; every flag and RUSTSTREAM_*/NATS_* variable the Deployment gives the gateway exists
//! and parses; the probes ask /healthz and /readyz on the port `--admin-listen` really serves
//! (and the gateway answers them there, tokens or not); ports agree between the args, the
//! container, the probes and the Service; the termination grace period outlasts the preStop
//! wait and the shutdown; the pods run as the Dockerfile's USER, locked down; three replicas
//! under a disruption budget that selects them, behind a Service with no session affinity
//! (any replica settles any lease); every Secret mounted is defined and holds the file the
//! flags point to. (No cluster on the build machines: this checks what the YAML
//! means, not that an API server accepts it.)

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use ruststream_nats::Config;
use yaml_rust2::{Yaml, YamlLoader};

use crate::containers::{gateway_arguments, image_env, read, runtime_stage};
use crate::support::nats::free_port;
use crate::support::{Client, Setup};

const DIR: &str = "deploy/kubernetes";

/// What `stop` may still take after the shutdown grace and the last settle's timeout: the
/// dispatcher (5 s), the naks of leases still out (2 s) and the NATS flush (2 s), each bounded
/// in `Gateway::stop`.
const STOP_BOUNDS: Duration = Duration::from_secs(9);

/// Every YAML document of one file of the directory (empty documents left out).
fn documents(file: &str) -> Vec<Yaml> {
    let path = format!("{DIR}/{file}");
    YamlLoader::load_from_str(&read(&path))
        .unwrap_or_else(|err| panic!("{path} is YAML: {err}"))
        .into_iter()
        .filter(|document| !document.is_null())
        .collect()
}

fn kustomization() -> Yaml {
    documents("kustomization.yaml")
        .into_iter()
        .next()
        .expect("kustomization.yaml has a document")
}

fn strings(yaml: &Yaml) -> Vec<String> {
    yaml.as_vec()
        .map(|items| {
            items
                .iter()
                .filter_map(|item| item.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// The objects `kubectl apply -k` creates.
fn applied() -> Vec<Yaml> {
    strings(&kustomization()["resources"])
        .iter()
        .flat_map(|file| documents(file))
        .collect()
}

/// Every object of every YAML file in the directory, applied or example.
fn everything() -> Vec<Yaml> {
    let mut files: Vec<String> = std::fs::read_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join(DIR))
        .expect("deploy/kubernetes exists")
        .map(|entry| entry.expect("a directory entry").file_name())
        .map(|name| name.to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".yaml") && name != "kustomization.yaml")
        .collect();
    files.sort();
    files.iter().flat_map(|file| documents(file)).collect()
}

fn the(objects: &[Yaml], kind: &str) -> Yaml {
    let found: Vec<&Yaml> = objects
        .iter()
        .filter(|object| object["kind"].as_str() == Some(kind))
        .collect();
    assert_eq!(found.len(), 1, "kustomization.yaml applies one {kind}");
    found[0].clone()
}

fn scalar(yaml: &Yaml) -> Option<String> {
    match yaml {
        Yaml::String(text) | Yaml::Real(text) => Some(text.clone()),
        Yaml::Integer(number) => Some(number.to_string()),
        Yaml::Boolean(flag) => Some(flag.to_string()),
        _ => None,
    }
}

/// The Deployment's pod template and its gateway container.
struct Pod {
    deployment: Yaml,
    spec: Yaml,
    container: Yaml,
}

impl Pod {
    fn of_the_deployment() -> Self {
        let deployment = the(&applied(), "Deployment");
        let spec = deployment["spec"]["template"]["spec"].clone();
        let containers = spec["containers"].as_vec().expect("the pod has containers");
        assert_eq!(
            containers.len(),
            1,
            "one container: the gateway (a sidecar would need its own checks)"
        );
        let container = containers[0].clone();
        Self {
            deployment,
            spec,
            container,
        }
    }

    fn labels(&self) -> Vec<(String, String)> {
        pairs(&self.deployment["spec"]["template"]["metadata"]["labels"])
    }

    /// The container's environment: `(name, value)`; a `valueFrom` entry has an empty value.
    fn env(&self) -> Vec<(String, String)> {
        self.container["env"]
            .as_vec()
            .map(|items| {
                items
                    .iter()
                    .map(|item| {
                        (
                            scalar(&item["name"]).expect("an env entry has a name"),
                            scalar(&item["value"]).unwrap_or_default(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The settings the gateway runs with: the image's ENV under the container's env, then
    /// the container's args after the image's ENTRYPOINT (which it must not replace).
    fn config(&self) -> Config {
        assert!(
            self.container["command"].is_badvalue(),
            "the container keeps the image's ENTRYPOINT (the gateway): no `command`"
        );
        let image_env = image_env(&runtime_stage());
        let own = self.env();
        let mut env: Vec<(String, String)> = image_env
            .into_iter()
            .filter(|(key, _)| !own.iter().any(|(name, _)| name == key))
            .collect();
        env.extend(own);
        let args = strings(&self.container["args"]);
        let argv = gateway_arguments("deploy/kubernetes/deployment.yaml", &env, &args);
        Config::try_parse_from(&argv)
            .unwrap_or_else(|err| panic!("deployment.yaml: {argv:?} does not parse: {err}"))
    }

    /// A container port by name or number, as a probe or a Service's targetPort names it.
    fn port(&self, port: &Yaml) -> u16 {
        let ports = self.container["ports"]
            .as_vec()
            .expect("the container declares its ports");
        let number = |item: &Yaml| {
            item["containerPort"]
                .as_i64()
                .and_then(|n| u16::try_from(n).ok())
                .expect("a containerPort number")
        };
        match port {
            Yaml::Integer(n) => {
                let n = u16::try_from(*n).expect("a port number");
                assert!(
                    ports.iter().any(|item| number(item) == n),
                    "port {n} is a declared container port"
                );
                n
            }
            Yaml::String(name) => ports
                .iter()
                .find(|item| item["name"].as_str() == Some(name))
                .map(number)
                .unwrap_or_else(|| panic!("no container port is named {name:?}")),
            other => panic!("a port is a name or a number, not {other:?}"),
        }
    }

    fn named_port(&self, name: &str) -> u16 {
        self.port(&Yaml::String(name.to_owned()))
    }
}

fn pairs(yaml: &Yaml) -> Vec<(String, String)> {
    yaml.as_hash()
        .map(|map| {
            map.iter()
                .filter_map(|(key, value)| Some((scalar(key)?, scalar(value)?)))
                .collect()
        })
        .unwrap_or_default()
}

/// A `matchLabels` (or a Service's selector) that the pod template's labels satisfy.
fn selects(selector: &Yaml, labels: &[(String, String)]) -> bool {
    let wanted = pairs(selector);
    !wanted.is_empty() && wanted.iter().all(|pair| labels.contains(pair))
}

fn seconds(duration: Duration) -> u64 {
    duration.as_secs() + u64::from(duration.subsec_nanos() > 0)
}

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

#[test]
fn pods_run_as_the_images_user_and_are_locked_down() {
    let user = runtime_stage()
        .into_iter()
        .rev()
        .find(|(instruction, _)| instruction == "USER")
        .map(|(_, user)| user)
        .expect("the Dockerfile's runtime stage sets a USER");
    let (uid, gid) = user.split_once(':').unwrap_or((&user, &user));
    let uid: i64 = uid
        .parse()
        .unwrap_or_else(|_| panic!("the Dockerfile's USER is numeric: {user}"));
    let gid: i64 = gid
        .parse()
        .unwrap_or_else(|_| panic!("the Dockerfile's USER group is numeric: {user}"));
    let pod = Pod::of_the_deployment();
    let container = &pod.container["securityContext"];
    let pod_level = &pod.spec["securityContext"];
    // A container's setting wins over the pod's; either may carry it, and where both do
    // they agree (a container added later inherits the pod's).
    let setting = |key: &str| -> Yaml {
        let (own, inherited) = (&container[key], &pod_level[key]);
        assert!(
            own.is_badvalue() || inherited.is_badvalue() || own == inherited,
            "securityContext.{key}: the pod says {inherited:?}, the container {own:?}"
        );
        if own.is_badvalue() {
            inherited.clone()
        } else {
            own.clone()
        }
    };
    assert_eq!(
        setting("runAsUser").as_i64(),
        Some(uid),
        "runAsUser is {user}"
    );
    assert_eq!(
        setting("runAsGroup").as_i64(),
        Some(gid),
        "runAsGroup is {user}"
    );
    assert_eq!(
        setting("runAsNonRoot").as_bool(),
        Some(true),
        "runAsNonRoot"
    );
    assert_eq!(
        setting("seccompProfile")["type"].as_str(),
        Some("RuntimeDefault"),
        "seccomp RuntimeDefault"
    );
    assert_eq!(
        container["readOnlyRootFilesystem"].as_bool(),
        Some(true),
        "read-only root filesystem (the gateway writes nothing)"
    );
    assert_eq!(
        container["allowPrivilegeEscalation"].as_bool(),
        Some(false),
        "allowPrivilegeEscalation false"
    );
    assert_eq!(
        strings(&container["capabilities"]["drop"]),
        ["ALL"],
        "every capability dropped"
    );
    for bound in ["requests", "limits"] {
        for resource in ["cpu", "memory"] {
            assert!(
                scalar(&pod.container["resources"][bound][resource]).is_some(),
                "resources.{bound}.{resource} is set"
            );
        }
    }
}

#[test]
fn three_replicas_under_a_disruption_budget_that_selects_them() {
    let pod = Pod::of_the_deployment();
    let replicas = pod.deployment["spec"]["replicas"].as_i64();
    assert_eq!(replicas, Some(3), "three replicas");
    let labels = pod.labels();
    assert!(
        selects(&pod.deployment["spec"]["selector"]["matchLabels"], &labels),
        "the Deployment's selector matches its pod template"
    );
    let pdb = the(&applied(), "PodDisruptionBudget");
    assert!(
        selects(&pdb["spec"]["selector"]["matchLabels"], &labels),
        "the PodDisruptionBudget selects the Deployment's pods"
    );
    let spec = &pdb["spec"];
    let keeps_two_of_three = match (
        spec["maxUnavailable"].as_i64(),
        spec["minAvailable"].as_i64(),
    ) {
        (Some(max), None) => max == 1,
        (None, Some(min)) => min == 2,
        other => panic!("an integer maxUnavailable or minAvailable, not both: {other:?}"),
    };
    assert!(
        keeps_two_of_three,
        "voluntary disruptions take one replica at a time, and may take one: {spec:?}"
    );
}

/// Any replica settles any lease (a settle of another replica's lease is forwarded to it),
/// so the Service spreads every request over the ready replicas: no `sessionAffinity`, which
/// would pin each client to one replica and undo the spread.
#[test]
fn the_service_spreads_requests_over_every_replica() {
    let service = the(&applied(), "Service");
    let spec = &service["spec"];
    assert!(
        matches!(spec["sessionAffinity"].as_str(), None | Some("None")),
        "the Service has no session affinity: {:?}",
        spec["sessionAffinity"]
    );
    assert!(
        spec["sessionAffinityConfig"].is_badvalue(),
        "no sessionAffinityConfig: {:?}",
        spec["sessionAffinityConfig"]
    );
    // Neither does anything else here pin clients to a replica.
    for object in everything() {
        let kind = object["kind"].as_str().unwrap_or_default().to_owned();
        assert!(
            object["spec"]["sessionAffinity"].is_badvalue(),
            "{kind}: no session affinity"
        );
    }
    // Every replica runs the same consumer, key and internal prefix: the pod template is
    // theirs alike, and it names the shared lease key (checked with the Secrets below).
    let config = Pod::of_the_deployment().config();
    assert!(!config.ephemeral, "the replicas share a durable consumer");
    assert!(
        config.lease_key_file.is_some(),
        "the replicas share one --lease-key-file"
    );
}

#[test]
fn secrets_are_defined_and_mounted_where_the_flags_point() {
    let pod = Pod::of_the_deployment();
    let config = pod.config();
    let secrets: Vec<Yaml> = everything()
        .into_iter()
        .filter(|object| object["kind"].as_str() == Some("Secret"))
        .collect();
    let volumes = pod.spec["volumes"].as_vec().cloned().unwrap_or_default();
    let mounts = pod.container["volumeMounts"]
        .as_vec()
        .cloned()
        .unwrap_or_default();
    // Every Secret volume names a Secret that a file here defines, and is mounted read-only.
    for volume in volumes
        .iter()
        .filter(|volume| !volume["secret"].is_badvalue())
    {
        let volume_name = volume["name"].as_str().expect("a volume name");
        let secret = volume["secret"]["secretName"]
            .as_str()
            .expect("a secretName");
        assert!(
            secrets
                .iter()
                .any(|defined| defined["metadata"]["name"].as_str() == Some(secret)),
            "volume {volume_name} mounts Secret {secret}, which no file in {DIR} defines"
        );
        let mount = mounts
            .iter()
            .find(|mount| mount["name"].as_str() == Some(volume_name))
            .unwrap_or_else(|| panic!("volume {volume_name} is mounted"));
        assert_eq!(
            mount["readOnly"].as_bool(),
            Some(true),
            "volume {volume_name} is mounted readOnly"
        );
    }

    let files: [(&str, Option<&PathBuf>); 7] = [
        ("--lease-key-file", config.lease_key_file.as_ref()),
        ("--auth-tokens-file", config.auth_tokens_file.as_ref()),
        ("--nats-creds", config.nats_creds.as_ref()),
        ("--nats-nkey", config.nats_nkey.as_ref()),
        ("--nats-tls-ca", config.nats_tls_ca.as_ref()),
        ("--nats-tls-cert", config.nats_tls_cert.as_ref()),
        ("--nats-tls-key", config.nats_tls_key.as_ref()),
    ];
    for required in ["--lease-key-file", "--auth-tokens-file"] {
        assert!(
            files
                .iter()
                .any(|(flag, path)| *flag == required && path.is_some()),
            "{required} is given: replicas share one lease key, and the API is not open"
        );
    }
    assert!(
        config.nats_creds.is_some() || config.nats_nkey.is_some(),
        "the gateway authenticates to NATS with a credentials or nkey file"
    );
    for (flag, path) in files {
        let Some(path) = path else { continue };
        let (secret, key) = secret_file(&volumes, &mounts, path)
            .unwrap_or_else(|| panic!("{flag} {} is no file of a mounted Secret", path.display()));
        let defined = secrets
            .iter()
            .find(|defined| defined["metadata"]["name"].as_str() == Some(secret.as_str()))
            .unwrap_or_else(|| panic!("{flag}: Secret {secret} is defined"));
        assert!(
            !defined["stringData"][key.as_str()].is_badvalue()
                || !defined["data"][key.as_str()].is_badvalue(),
            "{flag} {} reads key {key} of Secret {secret}, which the template does not hold",
            path.display()
        );
    }
}

/// The Secret and its key that a mounted file path comes from, if any.
fn secret_file(volumes: &[Yaml], mounts: &[Yaml], path: &Path) -> Option<(String, String)> {
    for mount in mounts {
        let mount_path = Path::new(mount["mountPath"].as_str()?);
        let volume = volumes
            .iter()
            .find(|volume| volume["name"].as_str() == mount["name"].as_str())?;
        let secret = volume["secret"]["secretName"].as_str()?.to_owned();
        // The file inside the volume: the whole path for a subPath mount, else below it.
        let inside = match mount["subPath"].as_str() {
            Some(sub) if mount_path == path => PathBuf::from(sub),
            Some(_) => continue,
            None => match path.strip_prefix(mount_path) {
                Ok(rest) => rest.to_path_buf(),
                Err(_) => continue,
            },
        };
        let inside = inside.to_string_lossy().into_owned();
        // `items` maps keys to paths; without it each key is a file of its own name.
        let key = match volume["secret"]["items"].as_vec() {
            Some(items) => items
                .iter()
                .find(|item| item["path"].as_str() == Some(inside.as_str()))
                .and_then(|item| item["key"].as_str())?
                .to_owned(),
            None => inside,
        };
        return Some((secret, key));
    }
    None
}

/// `RUSTSTREAM_CONSUMERS_FILE` names a file of a mounted ConfigMap (a directory mount, so an
/// edit reaches the pod), and that file is a consumers file the gateway takes.
#[test]
fn the_consumers_file_comes_from_a_mounted_config_map_and_parses() {
    let pod = Pod::of_the_deployment();
    let path = pod
        .config()
        .consumers_file
        .expect("the deployment gives --consumers-file");
    let volumes = pod.spec["volumes"].as_vec().cloned().unwrap_or_default();
    let mounts = pod.container["volumeMounts"]
        .as_vec()
        .cloned()
        .unwrap_or_default();
    let mount = mounts
        .iter()
        .find(|mount| {
            mount["mountPath"]
                .as_str()
                .is_some_and(|dir| path.parent() == Some(Path::new(dir)))
        })
        .unwrap_or_else(|| panic!("{} is inside a mounted volume", path.display()));
    assert!(
        mount["subPath"].is_badvalue(),
        "mounted whole, not by subPath"
    );
    assert_eq!(mount["readOnly"].as_bool(), Some(true));
    let volume = volumes
        .iter()
        .find(|volume| volume["name"].as_str() == mount["name"].as_str())
        .expect("the mount's volume");
    let name = volume["configMap"]["name"]
        .as_str()
        .expect("the volume is a ConfigMap");
    let map = everything()
        .into_iter()
        .find(|object| {
            object["kind"].as_str() == Some("ConfigMap")
                && object["metadata"]["name"].as_str() == Some(name)
        })
        .unwrap_or_else(|| panic!("ConfigMap {name} is defined in {DIR}"));
    let file_name = path
        .file_name()
        .and_then(|name| name.to_str())
        .expect("a file name");
    let text = map["data"][file_name]
        .as_str()
        .unwrap_or_else(|| panic!("ConfigMap {name} holds {file_name}"));
    let dir = crate::support::nats::files_dir();
    let copy = dir.path().join(file_name);
    std::fs::write(&copy, text).expect("write the copy");
    let specs = ruststream_nats::config::load_consumers_file(&copy)
        .unwrap_or_else(|why| panic!("the ConfigMap's consumers file: {why}"));
    assert!(!specs.is_empty(), "it declares a consumer");
}
