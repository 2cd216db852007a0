//! How the pods run in the cluster: as the image's user and locked down, three replicas under
//! a disruption budget, a Service with no session affinity, and every Secret and ConfigMap
//! defined and mounted where the flags point.

use std::path::{Path, PathBuf};

use yaml_rust2::Yaml;

use crate::containers::files::runtime_stage;

use super::manifests::{DIR, Pod, applied, everything, scalar, secret_file, selects, strings, the};

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
