//! Reading `deploy/kubernetes/` as kubectl would apply it: its documents and objects, the
//! Deployment's pod template and gateway container, label selectors, and where a mounted
//! file comes from.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use ruststream_nats::Config;
use yaml_rust2::{Yaml, YamlLoader};

use crate::containers::files::{gateway_arguments, image_env, read, runtime_stage};

pub(super) const DIR: &str = "deploy/kubernetes";

/// What `stop` may still take after the shutdown grace and the last settle's timeout: the
/// dispatcher (5 s), the naks of leases still out (2 s) and the NATS flush (2 s), each bounded
/// in `Gateway::stop`.
pub(super) const STOP_BOUNDS: Duration = Duration::from_secs(9);

/// Every YAML document of one file of the directory (empty documents left out).
pub(super) fn documents(file: &str) -> Vec<Yaml> {
    let path = format!("{DIR}/{file}");
    YamlLoader::load_from_str(&read(&path))
        .unwrap_or_else(|err| panic!("{path} is YAML: {err}"))
        .into_iter()
        .filter(|document| !document.is_null())
        .collect()
}

pub(super) fn kustomization() -> Yaml {
    documents("kustomization.yaml")
        .into_iter()
        .next()
        .expect("kustomization.yaml has a document")
}

pub(super) fn strings(yaml: &Yaml) -> Vec<String> {
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
pub(super) fn applied() -> Vec<Yaml> {
    strings(&kustomization()["resources"])
        .iter()
        .flat_map(|file| documents(file))
        .collect()
}

/// Every object of every YAML file in the directory, applied or example.
pub(super) fn everything() -> Vec<Yaml> {
    let mut files: Vec<String> = std::fs::read_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join(DIR))
        .expect("deploy/kubernetes exists")
        .map(|entry| entry.expect("a directory entry").file_name())
        .map(|name| name.to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".yaml") && name != "kustomization.yaml")
        .collect();
    files.sort();
    files.iter().flat_map(|file| documents(file)).collect()
}

pub(super) fn the(objects: &[Yaml], kind: &str) -> Yaml {
    let found: Vec<&Yaml> = objects
        .iter()
        .filter(|object| object["kind"].as_str() == Some(kind))
        .collect();
    assert_eq!(found.len(), 1, "kustomization.yaml applies one {kind}");
    found[0].clone()
}

pub(super) fn scalar(yaml: &Yaml) -> Option<String> {
    match yaml {
        Yaml::String(text) | Yaml::Real(text) => Some(text.clone()),
        Yaml::Integer(number) => Some(number.to_string()),
        Yaml::Boolean(flag) => Some(flag.to_string()),
        _ => None,
    }
}

/// The Deployment's pod template and its gateway container.
pub(super) struct Pod {
    pub(super) deployment: Yaml,
    pub(super) spec: Yaml,
    pub(super) container: Yaml,
}

impl Pod {
    pub(super) fn of_the_deployment() -> Self {
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

    pub(super) fn labels(&self) -> Vec<(String, String)> {
        pairs(&self.deployment["spec"]["template"]["metadata"]["labels"])
    }

    /// The container's environment: `(name, value)`; a `valueFrom` entry has an empty value.
    pub(super) fn env(&self) -> Vec<(String, String)> {
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
    pub(super) fn config(&self) -> Config {
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
    pub(super) fn port(&self, port: &Yaml) -> u16 {
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

    pub(super) fn named_port(&self, name: &str) -> u16 {
        self.port(&Yaml::String(name.to_owned()))
    }
}

pub(super) fn pairs(yaml: &Yaml) -> Vec<(String, String)> {
    yaml.as_hash()
        .map(|map| {
            map.iter()
                .filter_map(|(key, value)| Some((scalar(key)?, scalar(value)?)))
                .collect()
        })
        .unwrap_or_default()
}

/// A `matchLabels` (or a Service's selector) that the pod template's labels satisfy.
pub(super) fn selects(selector: &Yaml, labels: &[(String, String)]) -> bool {
    let wanted = pairs(selector);
    !wanted.is_empty() && wanted.iter().all(|pair| labels.contains(pair))
}

pub(super) fn seconds(duration: Duration) -> u64 {
    duration.as_secs() + u64::from(duration.subsec_nanos() > 0)
}

/// The Secret and its key that a mounted file path comes from, if any.
pub(super) fn secret_file(
    volumes: &[Yaml],
    mounts: &[Yaml],
    path: &Path,
) -> Option<(String, String)> {
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
