//! The container files stay in step with the code: every flag and RUSTSTREAM_*/NATS_*
//! variable that `docker-compose.yml` and the `Dockerfile` give the gateway exists in the clap
//! `Config` and parses; the compose stack has JetStream with a volume, a one-shot job that
//! creates ORDERS before the gateway starts, and the gateway on 0.0.0.0:8080; the image runs
//! as a non-root user with a HEALTHCHECK on /healthz, which `--healthcheck` really performs.
//! (No Docker engine on the build machines: `scripts/containers.sh` has docker-compose parse
//! the compose file, this checks what it means.)

use std::path::Path;
use std::process::Command;

use clap::{CommandFactory, Parser};
use ruststream_nats::Config;
use yaml_rust2::{Yaml, YamlLoader};

use crate::support::Setup;
use crate::support::nats::free_port;

pub(crate) fn read(file: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
    std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("read {}: {err}", path.display()))
}

fn compose() -> Yaml {
    YamlLoader::load_from_str(&read("docker-compose.yml"))
        .expect("docker-compose.yml is YAML")
        .into_iter()
        .next()
        .expect("docker-compose.yml has a document")
}

/// A compose string value with `${VAR:-default}` replaced by its default.
fn interpolated(value: &str) -> String {
    let mut out = String::new();
    let mut rest = value;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let Some(end) = rest[start..].find('}') else {
            break;
        };
        let inner = &rest[start + 2..start + end];
        out.push_str(inner.split_once(":-").map_or("", |(_, default)| default));
        rest = &rest[start + end + 1..];
    }
    out.push_str(rest);
    out
}

fn scalar(yaml: &Yaml) -> Option<String> {
    match yaml {
        Yaml::String(text) | Yaml::Real(text) => Some(interpolated(text)),
        Yaml::Integer(number) => Some(number.to_string()),
        Yaml::Boolean(flag) => Some(flag.to_string()),
        _ => None,
    }
}

/// A service's `environment`, in either of compose's forms (map, or list of `K=V`).
fn environment(service: &Yaml) -> Vec<(String, String)> {
    match &service["environment"] {
        Yaml::Hash(map) => map
            .iter()
            .map(|(key, value)| {
                (
                    scalar(key).expect("variable name"),
                    scalar(value).unwrap_or_default(),
                )
            })
            .collect(),
        Yaml::Array(items) => items
            .iter()
            .map(|item| {
                let item = scalar(item).expect("K=V entry");
                let (key, value) = item.split_once('=').unwrap_or((&item, ""));
                (key.to_owned(), value.to_owned())
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// A compose `command`/`entrypoint`, list or string form, as words.
fn words(value: &Yaml) -> Vec<String> {
    match value {
        Yaml::Array(items) => items.iter().filter_map(scalar).collect(),
        other => scalar(other)
            .map(|text| text.split_whitespace().map(str::to_owned).collect())
            .unwrap_or_default(),
    }
}

/// Turn environment variables and arguments given to the gateway into one argument list for
/// `Config`, panicking on any variable or flag `Config` does not know.
pub(crate) fn gateway_arguments(
    origin: &str,
    env: &[(String, String)],
    args: &[String],
) -> Vec<String> {
    let command = Config::command();
    let mut argv = vec!["ruststream-nats".to_owned()];
    // A flag given on the command line wins over its variable, as clap does it.
    let given: Vec<&str> = args
        .iter()
        .filter_map(|word| word.strip_prefix("--"))
        .map(|flag| flag.split_once('=').map_or(flag, |(long, _)| long))
        .collect();
    for (key, value) in env {
        if !(key.starts_with("RUSTSTREAM_") || key.starts_with("NATS_")) {
            continue;
        }
        let arg = command
            .get_arguments()
            .find(|arg| arg.get_env().is_some_and(|env| env == key.as_str()))
            .unwrap_or_else(|| panic!("{origin} sets {key}, which no gateway flag reads"));
        let long = arg.get_long().expect("every env flag has a long name");
        if given.contains(&long) {
            continue;
        }
        if arg.get_action().takes_values() {
            argv.push(format!("--{long}={value}"));
        } else if matches!(value.as_str(), "true" | "1" | "yes" | "on") {
            argv.push(format!("--{long}"));
        }
    }
    for word in args {
        if let Some(flag) = word.strip_prefix("--") {
            let long = flag.split_once('=').map_or(flag, |(long, _)| long);
            assert!(
                command
                    .get_arguments()
                    .any(|arg| arg.get_long() == Some(long)),
                "{origin} passes --{long}, which the gateway does not have"
            );
        }
        argv.push(word.clone());
    }
    argv
}

#[test]
fn compose_gives_the_gateway_only_flags_and_variables_it_has() {
    let compose = compose();
    let services = compose["services"]
        .as_hash()
        .expect("docker-compose.yml has services");
    let gateways: Vec<(&Yaml, &Yaml)> = services
        .iter()
        .filter(|(_, service)| !service["build"].is_badvalue())
        .collect();
    assert_eq!(gateways.len(), 1, "one service builds the gateway image");
    let (name, gateway) = gateways[0];
    let origin = format!(
        "docker-compose.yml service {}",
        scalar(name).unwrap_or_default()
    );
    let env = environment(gateway);
    let mut args = words(&gateway["entrypoint"]);
    args.extend(words(&gateway["command"]));
    let argv = gateway_arguments(&origin, &env, &args);
    let config = Config::try_parse_from(&argv)
        .unwrap_or_else(|err| panic!("{origin}: {argv:?} does not parse: {err}"));
    assert_eq!(
        config.listen.to_string(),
        "0.0.0.0:8080",
        "{origin} listens on all interfaces"
    );
    let ports = words(&gateway["ports"]);
    assert!(
        ports.iter().any(|port| port.ends_with(":8080")),
        "{origin} publishes 8080: {ports:?}"
    );
    let nats_url = config.nats_url.clone();
    let nats_host = nats_url
        .trim_start_matches("nats://")
        .split(':')
        .next()
        .unwrap_or_default()
        .to_owned();
    assert!(
        services.contains_key(&Yaml::String(nats_host.clone())),
        "{origin}'s NATS URL names a compose service: {nats_url}"
    );

    // NATS with JetStream storing on a volume.
    let nats = &compose["services"][nats_host.as_str()];
    let nats_args = words(&nats["command"]);
    assert!(
        nats_args
            .iter()
            .any(|arg| arg == "-js" || arg == "--jetstream"),
        "nats runs JetStream: {nats_args:?}"
    );
    let store = nats_args
        .iter()
        .position(|arg| arg == "-sd" || arg == "--store_dir")
        .and_then(|at| nats_args.get(at + 1))
        .unwrap_or_else(|| panic!("nats has a store dir: {nats_args:?}"));
    let volumes = words(&nats["volumes"]);
    assert!(
        volumes
            .iter()
            .any(|volume| volume.ends_with(&format!(":{store}"))),
        "the JetStream store {store} is a volume: {volumes:?}"
    );

    // The gateway starts only after a one-shot job created ORDERS (orders.>).
    let after = gateway["depends_on"]
        .as_hash()
        .expect("the gateway depends on the stream job");
    let (job_name, condition) = after
        .iter()
        .find(|(_, condition)| {
            condition["condition"].as_str() == Some("service_completed_successfully")
        })
        .unwrap_or_else(|| panic!("{origin} waits for a job to complete: {after:?}"));
    let job_name = scalar(job_name).expect("job name");
    assert!(!condition.is_badvalue());
    let job = &compose["services"][job_name.as_str()];
    assert_eq!(
        job["depends_on"][nats_host.as_str()]["condition"].as_str(),
        Some("service_healthy"),
        "the stream job waits for a healthy nats"
    );
    assert!(
        !nats["healthcheck"]["test"].is_badvalue(),
        "nats has a healthcheck for that condition"
    );
    let script = words(&job["command"]).join(" ");
    assert!(
        script.contains("stream add ORDERS") && script.contains("'orders.>'"),
        "job {job_name} creates ORDERS with orders.>: {script}"
    );
}

/// The Dockerfile's instructions of its last stage (the runtime image), continuation lines
/// joined: `(INSTRUCTION, arguments)`.
pub(crate) fn runtime_stage() -> Vec<(String, String)> {
    let mut instructions: Vec<(String, String)> = Vec::new();
    let mut current = String::new();
    for line in read("Dockerfile").lines() {
        let line = line.trim();
        if line.starts_with('#') || (line.is_empty() && current.is_empty()) {
            continue;
        }
        match line.strip_suffix('\\') {
            Some(part) => current.push_str(part),
            None => {
                current.push_str(line);
                let (instruction, arguments) = current
                    .split_once(char::is_whitespace)
                    .unwrap_or((&current, ""));
                let instruction = instruction.to_uppercase();
                if instruction == "FROM" {
                    instructions.clear();
                }
                instructions.push((instruction, arguments.trim().to_owned()));
                current.clear();
            }
        }
    }
    instructions
}

/// An exec-form (`["a", "b"]`) or shell-form argument list as words.
fn exec_words(arguments: &str) -> Vec<String> {
    match serde_json::from_str::<Vec<String>>(arguments) {
        Ok(words) => words,
        Err(_) => arguments.split_whitespace().map(str::to_owned).collect(),
    }
}

#[test]
fn dockerfile_runs_as_non_root_with_a_healthcheck_on_healthz() {
    let stage = runtime_stage();
    let user = stage
        .iter()
        .rev()
        .find(|(instruction, _)| instruction == "USER")
        .map(|(_, user)| user.clone())
        .expect("the runtime stage sets a USER");
    let name = user.split(':').next().unwrap_or_default();
    assert!(
        !matches!(name, "" | "0" | "root"),
        "the image runs as a non-root user, not {user:?}"
    );
    let healthcheck = stage
        .iter()
        .find(|(instruction, _)| instruction == "HEALTHCHECK")
        .map(|(_, arguments)| arguments.clone())
        .expect("the runtime stage has a HEALTHCHECK");
    let (_, command) = healthcheck
        .split_once("CMD")
        .unwrap_or_else(|| panic!("HEALTHCHECK without CMD: {healthcheck}"));
    let check = exec_words(command.trim());
    let url = check
        .iter()
        .find(|word| word.starts_with("http://"))
        .unwrap_or_else(|| panic!("the HEALTHCHECK names a URL: {check:?}"));
    assert!(url.ends_with("/healthz"), "HEALTHCHECK on /healthz: {url}");

    let env: Vec<(String, String)> = stage
        .iter()
        .filter(|(instruction, _)| instruction == "ENV")
        .filter_map(|(_, arguments)| {
            let (key, value) = arguments.split_once('=')?;
            Some((
                key.trim().to_owned(),
                value.trim().trim_matches('"').to_owned(),
            ))
        })
        .collect();
    let entrypoint = stage
        .iter()
        .find(|(instruction, _)| instruction == "ENTRYPOINT")
        .map(|(_, arguments)| exec_words(arguments))
        .expect("the runtime stage has an ENTRYPOINT");
    assert!(
        entrypoint
            .first()
            .is_some_and(|program| program.ends_with("/ruststream-nats")),
        "the gateway is the entry point: {entrypoint:?}"
    );
    let mut args = entrypoint[1..].to_vec();
    if let Some((_, cmd)) = stage.iter().find(|(instruction, _)| instruction == "CMD") {
        args.extend(exec_words(cmd));
    }
    let argv = gateway_arguments("Dockerfile", &env, &args);
    let config = Config::try_parse_from(&argv)
        .unwrap_or_else(|err| panic!("Dockerfile: {argv:?} does not parse: {err}"));
    let port = url
        .trim_start_matches("http://")
        .split(['/', ':'])
        .nth(1)
        .unwrap_or_default();
    assert_eq!(
        port,
        config.listen.port().to_string(),
        "the HEALTHCHECK asks the port the gateway listens on"
    );
    // The check's own flags exist too (the binary is the entry point of the check).
    let check_args: Vec<String> = check.into_iter().skip(1).collect();
    gateway_arguments("Dockerfile HEALTHCHECK", &env, &check_args);
}

/// A path dependency in Cargo.toml (the vendored, patched async-nats) must be in the image's
/// dependency layer — copied before the first `cargo build` — and not kept out by
/// `.dockerignore`, or `docker build` fails to resolve it.
#[test]
fn dockerfile_copies_path_dependencies_before_building_them() {
    let manifest = read("Cargo.toml");
    let directories: Vec<String> = manifest
        .lines()
        .filter(|line| !line.trim_start().starts_with('#'))
        .filter_map(|line| {
            let (_, rest) = line.split_once("path = \"")?;
            let (path, _) = rest.split_once('"')?;
            (!path.ends_with(".rs")).then(|| path.trim_end_matches('/').to_owned())
        })
        .collect();
    assert!(
        directories.iter().any(|dir| dir == "vendor/async-nats"),
        "Cargo.toml patches async-nats from vendor/: {directories:?}"
    );
    let dockerfile = read("Dockerfile");
    let build = dockerfile
        .find("cargo build")
        .expect("the Dockerfile builds with cargo");
    let copies: Vec<&str> = dockerfile[..build]
        .lines()
        .map(str::trim)
        .filter_map(|line| line.strip_prefix("COPY "))
        .collect();
    let ignored = read(".dockerignore");
    for dir in &directories {
        assert!(
            copies.iter().any(|copy| copy
                .split_whitespace()
                .next()
                .is_some_and(|source| dir.starts_with(source.trim_end_matches('/')))),
            "the dependency layer copies {dir} before `cargo build`: {copies:?}"
        );
        assert!(
            !ignored
                .lines()
                .map(|line| line.trim().trim_end_matches('/'))
                .any(|line| !line.is_empty() && !line.starts_with('#') && dir.starts_with(line)),
            ".dockerignore keeps {dir} out of the build context"
        );
    }
}

/// `--healthcheck <URL>` (the image's HEALTHCHECK) exits 0 on a 200, 1 otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_healthcheck_flag_gets_healthz() {
    // /healthz answers while NATS is unreachable: liveness, not readiness.
    let unreachable = format!("nats://127.0.0.1:{}", free_port());
    let gateway = Setup::consumer("checked").starting(&unreachable).await;
    let run = |url: String| {
        tokio::task::spawn_blocking(move || {
            Command::new(env!("CARGO_BIN_EXE_ruststream-nats"))
                .args(["--healthcheck", &url])
                .output()
                .expect("run the binary")
        })
    };
    let healthy = run(gateway.url("/healthz")).await.expect("join");
    assert!(
        healthy.status.success(),
        "healthy gateway: {:?} {}",
        healthy.status,
        String::from_utf8_lossy(&healthy.stderr)
    );
    let not_found = run(gateway.url("/no-such-endpoint")).await.expect("join");
    assert_eq!(not_found.status.code(), Some(1), "a 404 is unhealthy");
    let closed = run(format!("http://127.0.0.1:{}/healthz", free_port()))
        .await
        .expect("join");
    assert_eq!(
        closed.status.code(),
        Some(1),
        "nothing listening is unhealthy"
    );
    assert!(
        String::from_utf8_lossy(&closed.stderr).contains("unhealthy"),
        "says why"
    );
}
