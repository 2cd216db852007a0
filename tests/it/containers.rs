//! The container files stay in step with the code: every flag and RUSTSTREAM_*/NATS_*
//! variable that `docker-compose.yml` and the `Dockerfile` give the gateway exists in the clap
//! `Config` and parses (and where a flag and its variable are both given, they agree); the
//! compose stack has JetStream with a volume, a one-shot job that creates ORDERS before the
//! gateways start, and three gateway replicas on 0.0.0.0:8080 on one stream and consumer,
//! sharing one `--lease-key-file` that another one-shot job generates into a named volume;
//! no replica publishes a port: a balancer (deploy/compose/balancer.conf) publishes 8080 and
//! spreads requests over every replica, nothing sticky; the image runs as a non-root user
//! with a HEALTHCHECK on /healthz, which `--healthcheck` really performs.
//! (No Docker engine on the build machines: `scripts/containers.sh` has docker-compose parse
//! the compose file, this checks what it means.)

use std::collections::BTreeSet;
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

/// The value a `command` gives a flag, as `--flag value` or `--flag=value`.
fn flag_value(args: &[String], long: &str) -> Option<String> {
    let flag = format!("--{long}");
    args.iter().enumerate().find_map(|(at, word)| {
        if *word == flag {
            args.get(at + 1).cloned()
        } else {
            word.strip_prefix(&format!("{flag}=")).map(str::to_owned)
        }
    })
}

/// How many containers compose runs for a service: `deploy.replicas`, else `scale`, else 1.
fn replicas(service: &Yaml) -> i64 {
    service["deploy"]["replicas"]
        .as_i64()
        .or_else(|| service["scale"].as_i64())
        .unwrap_or(1)
}

/// A gateway service of docker-compose.yml: its name, definition and parsed settings.
struct ComposeGateway {
    name: String,
    service: Yaml,
    config: Config,
}

/// Every service that runs the gateway image: the one that builds it, and any other naming
/// the image it builds (three services sharing one definition would be that).
fn compose_gateways(compose: &Yaml) -> Vec<ComposeGateway> {
    let services = compose["services"]
        .as_hash()
        .expect("docker-compose.yml has services");
    let builders: Vec<&Yaml> = services
        .values()
        .filter(|service| !service["build"].is_badvalue())
        .collect();
    assert_eq!(builders.len(), 1, "one service builds the gateway image");
    let image = scalar(&builders[0]["image"]);
    services
        .iter()
        .filter(|(_, service)| {
            !service["build"].is_badvalue()
                || (image.is_some() && scalar(&service["image"]) == image)
        })
        .map(|(name, service)| {
            let name = scalar(name).expect("a service name");
            let origin = format!("docker-compose.yml service {name}");
            let env = environment(service);
            let mut args = words(&service["entrypoint"]);
            args.extend(words(&service["command"]));
            let argv = gateway_arguments(&origin, &env, &args);
            let config = Config::try_parse_from(&argv)
                .unwrap_or_else(|err| panic!("{origin}: {argv:?} does not parse: {err}"));
            // Where both give a setting, the command line and the environment agree (the
            // environment is there for tools that override `command`).
            let command = Config::command();
            for (key, value) in &env {
                let Some(long) = command
                    .get_arguments()
                    .find(|arg| arg.get_env().is_some_and(|env| env == key.as_str()))
                    .and_then(|arg| arg.get_long())
                else {
                    continue;
                };
                if let Some(given) = flag_value(&args, long) {
                    assert_eq!(
                        &given, value,
                        "{origin}: --{long} and {key} say different things"
                    );
                }
            }
            ComposeGateway {
                name,
                service: service.clone(),
                config,
            }
        })
        .collect()
}

#[test]
fn compose_gives_the_gateway_only_flags_and_variables_it_has() {
    let compose = compose();
    let services = compose["services"]
        .as_hash()
        .expect("docker-compose.yml has services");
    let gateways = compose_gateways(&compose);
    for ComposeGateway {
        name,
        service: gateway,
        config,
        ..
    } in &gateways
    {
        let origin = format!("docker-compose.yml service {name}");
        assert_eq!(
            config.listen.to_string(),
            "0.0.0.0:8080",
            "{origin} listens on all interfaces"
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
        let job_name = after
            .iter()
            .filter(|(_, condition)| {
                condition["condition"].as_str() == Some("service_completed_successfully")
            })
            .filter_map(|(job, _)| scalar(job))
            .find(|job| {
                words(&compose["services"][job.as_str()]["command"])
                    .join(" ")
                    .contains("stream add")
            })
            .unwrap_or_else(|| panic!("{origin} waits for a job that adds the stream: {after:?}"));
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
            script.contains(&format!("stream add {}", config.stream))
                && script.contains("'orders.>'"),
            "job {job_name} creates {} with orders.>: {script}",
            config.stream
        );
    }
}

/// A `source:target[:mode]` volume entry of a service: `(source, target, read_only)`.
fn mounts(service: &Yaml) -> Vec<(String, String, bool)> {
    words(&service["volumes"])
        .iter()
        .map(|entry| {
            let mut parts = entry.split(':');
            let source = parts.next().unwrap_or_default().to_owned();
            let target = parts.next().unwrap_or_default().to_owned();
            let read_only = parts
                .next()
                .is_some_and(|mode| mode.split(',').any(|m| m == "ro"));
            (source, target, read_only)
        })
        .collect()
}

/// The optional `tracing` profile: an OpenTelemetry Collector taking OTLP over HTTP on 4318
/// (the endpoint the gateway's comment names) and exporting to the Jaeger service, both only
/// in that profile; without it the gateway's OTLP endpoint is empty, so tracing stays off.
#[test]
fn compose_has_an_optional_collector_and_jaeger_for_traces() {
    let compose = compose();
    let services = &compose["services"];
    for name in ["otel-collector", "jaeger"] {
        assert_eq!(
            words(&services[name]["profiles"]),
            ["tracing"],
            "{name} runs only with --profile tracing"
        );
    }
    let (source, target, read_only) = mounts(&services["otel-collector"])
        .into_iter()
        .next()
        .expect("the collector mounts its configuration");
    assert!(read_only, "the collector's configuration is read-only");
    let command = words(&services["otel-collector"]["command"]).join(" ");
    assert!(
        command.contains(&format!("--config={target}")),
        "the collector reads {target}: {command}"
    );
    let config = YamlLoader::load_from_str(&read(source.trim_start_matches("./")))
        .expect("the collector's configuration is YAML")
        .remove(0);
    assert_eq!(
        config["receivers"]["otlp"]["protocols"]["http"]["endpoint"].as_str(),
        Some("0.0.0.0:4318"),
        "OTLP/HTTP, the gateway's default protocol, on 4318"
    );
    let jaeger = config["exporters"]["otlp/jaeger"]["endpoint"]
        .as_str()
        .expect("an OTLP exporter to Jaeger");
    assert_eq!(jaeger, "jaeger:4317", "Jaeger's OTLP gRPC port");
    assert_eq!(
        words(&config["service"]["pipelines"]["traces"]["exporters"]),
        ["otlp/jaeger"]
    );
    assert!(words(&services["jaeger"]["ports"]).contains(&"16686:16686".to_owned()));

    let gateway = &services["gateway"];
    let endpoint = environment(gateway)
        .into_iter()
        .find(|(key, _)| key == "OTEL_EXPORTER_OTLP_ENDPOINT")
        .expect("the gateway's OTLP endpoint is configurable");
    assert_eq!(endpoint.1, "", "tracing off unless asked for");
    assert!(
        read("docker-compose.yml")
            .contains("OTEL_EXPORTER_OTLP_ENDPOINT=http://otel-collector:4318 docker compose --profile tracing up"),
        "the file says how to turn it on"
    );
}

/// The compose stack runs three gateway replicas on one stream and consumer, signing lease
/// ids with one key that a one-shot job generates into a named volume (never a key file from
/// the repository); none of them publishes a port: a balancer in front publishes 8080 and
/// spreads the requests over all of them, with nothing sticky.
#[test]
fn compose_runs_three_replicas_with_one_lease_key_behind_a_balancer() {
    let compose = compose();
    let services = compose["services"]
        .as_hash()
        .expect("docker-compose.yml has services");
    let gateways = compose_gateways(&compose);
    let running: i64 = gateways
        .iter()
        .map(|gateway| replicas(&gateway.service))
        .sum();
    assert_eq!(running, 3, "three gateway replicas run");

    let top_volumes = &compose["volumes"];
    let mut key_files = BTreeSet::new();
    for gateway in &gateways {
        let origin = format!("docker-compose.yml service {}", gateway.name);
        assert!(
            gateway.service["ports"].is_badvalue(),
            "{origin} publishes no port: the balancer is the way in ({:?})",
            gateway.service["ports"]
        );
        assert!(
            gateway.service["container_name"].is_badvalue() || replicas(&gateway.service) == 1,
            "{origin}: replicas cannot share one container_name"
        );
        assert_eq!(
            (
                gateway.config.stream.as_str(),
                gateway.config.consumer.as_str()
            ),
            (
                gateways[0].config.stream.as_str(),
                gateways[0].config.consumer.as_str()
            ),
            "{origin}: every replica on the same stream and consumer"
        );
        assert!(!gateway.config.ephemeral, "{origin}: a durable consumer");
        let key = gateway
            .config
            .lease_key_file
            .clone()
            .unwrap_or_else(|| panic!("{origin} signs lease ids with --lease-key-file"));
        // The key file comes from a named volume, mounted read-only.
        let (volume, target, read_only) = mounts(&gateway.service)
            .into_iter()
            .find(|(_, target, _)| key.starts_with(target))
            .unwrap_or_else(|| panic!("{origin}: {} is on a volume", key.display()));
        assert!(
            top_volumes
                .as_hash()
                .is_some_and(|volumes| volumes.contains_key(&Yaml::String(volume.clone()))),
            "{origin}: the lease key comes from a named volume, not a file of the \
             repository: {volume}"
        );
        assert!(read_only, "{origin} mounts the lease key volume read-only");
        let inside = key
            .strip_prefix(&target)
            .expect("below the mount")
            .to_path_buf();

        // A one-shot job the gateway waits for writes that file into that volume.
        let job = gateway.service["depends_on"]
            .as_hash()
            .expect("the gateway depends on the jobs")
            .iter()
            .filter(|(_, condition)| {
                condition["condition"].as_str() == Some("service_completed_successfully")
            })
            .filter_map(|(job, _)| scalar(job))
            .find(|job| {
                mounts(&compose["services"][job.as_str()])
                    .iter()
                    .any(|(source, _, _)| *source == volume)
            })
            .unwrap_or_else(|| panic!("{origin} waits for a job that fills the volume {volume}"));
        let job_service = &compose["services"][job.as_str()];
        assert_eq!(
            scalar(&job_service["restart"]).as_deref(),
            Some("no"),
            "job {job} runs once"
        );
        let (_, job_target, job_read_only) = mounts(job_service)
            .into_iter()
            .find(|(source, _, _)| *source == volume)
            .expect("the job mounts the volume");
        assert!(!job_read_only, "job {job} may write the volume");
        let job_path = Path::new(&job_target).join(&inside);
        let script = words(&job_service["command"]).join(" ");
        assert!(
            script.contains(&*job_path.to_string_lossy()),
            "job {job} writes {}: {script}",
            job_path.display()
        );
        let bytes = script
            .split("head -c ")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|count| count.parse::<u32>().ok())
            .unwrap_or_else(|| panic!("job {job} takes `head -c N` random bytes: {script}"));
        assert!(
            script.contains("/dev/urandom") && bytes >= 32,
            "job {job} makes a random key of at least 32 bytes (--lease-key-file's minimum): \
             {script}"
        );
        assert!(
            script.contains(&format!("-s {}", job_path.display())),
            "job {job} keeps a key that exists (a new one would void every live lease): \
             {script}"
        );
        key_files.insert((volume, key));
    }
    assert_eq!(
        key_files.len(),
        1,
        "every replica reads the same key file of the same volume: {key_files:?}"
    );

    // The balancer: the one service publishing 8080, after the gateways, round robin (of
    // the services that always run: an optional profile's, Jaeger's UI, aside).
    let gateway_names: Vec<&str> = gateways
        .iter()
        .map(|gateway| gateway.name.as_str())
        .collect();
    let publishing: Vec<(String, &Yaml)> = services
        .iter()
        .filter(|(_, service)| service["profiles"].is_badvalue())
        .filter(|(_, service)| !service["ports"].is_badvalue())
        .map(|(name, service)| (scalar(name).expect("a service name"), service))
        .collect();
    assert_eq!(
        publishing.len(),
        1,
        "one service publishes a port: the balancer"
    );
    let (balancer_name, balancer) = &publishing[0];
    let ports = words(&balancer["ports"]);
    assert!(
        ports.iter().any(|port| port.starts_with("8080:")
            || port.starts_with("127.0.0.1:8080:")
            || port.starts_with("0.0.0.0:8080:")),
        "{balancer_name} publishes 8080 on the host (the README's curl examples): {ports:?}"
    );
    let after = balancer["depends_on"]
        .as_hash()
        .unwrap_or_else(|| panic!("{balancer_name} starts after the gateways"));
    for name in &gateway_names {
        let condition = &after[&Yaml::String((*name).to_owned())]["condition"];
        assert_eq!(
            condition.as_str(),
            Some("service_healthy"),
            "{balancer_name} starts once {name} is healthy"
        );
    }
    assert!(
        runtime_stage()
            .iter()
            .any(|(instruction, _)| instruction == "HEALTHCHECK"),
        "the image's HEALTHCHECK makes the gateways healthy"
    );
    assert!(
        !balancer["healthcheck"]["test"].is_badvalue(),
        "{balancer_name} has a healthcheck"
    );
    // Its configuration is a file of the repository, mounted read-only.
    let (config_file, _, read_only) = mounts(balancer)
        .into_iter()
        .find(|(source, _, _)| source.starts_with("./deploy/"))
        .unwrap_or_else(|| panic!("{balancer_name} mounts its configuration from deploy/"));
    assert!(
        read_only,
        "{balancer_name}'s configuration is mounted read-only"
    );
    let conf = read(config_file.trim_start_matches("./"));
    let directives: Vec<Vec<&str>> = conf
        .lines()
        .map(|line| line.split('#').next().unwrap_or_default())
        .flat_map(|line| line.split([';', '{', '}']))
        .map(|directive| directive.split_whitespace().collect::<Vec<_>>())
        .filter(|directive| !directive.is_empty())
        .collect();
    for sticky in ["ip_hash", "hash", "sticky", "least_time"] {
        assert!(
            !directives.iter().any(|directive| directive[0] == sticky),
            "{config_file}: nothing sticky ({sticky})"
        );
    }
    let listen: Vec<&str> = directives
        .iter()
        .filter(|directive| directive[0] == "listen")
        .map(|directive| directive[1])
        .collect();
    let target = ports
        .iter()
        .find_map(|port| {
            port.strip_prefix("8080:")
                .or_else(|| port.rsplit(':').next())
        })
        .expect("a published port");
    assert!(
        listen
            .iter()
            .any(|address| address.rsplit(':').next() == Some(target)),
        "{config_file} listens on the published container port {target}: {listen:?}"
    );
    let servers: Vec<&Vec<&str>> = directives
        .iter()
        .filter(|directive| directive[0] == "server" && directive.len() > 1)
        .collect();
    for gateway in &gateways {
        let address = format!("{}:{}", gateway.name, gateway.config.listen.port());
        let server = servers
            .iter()
            .find(|server| server[1] == address)
            .unwrap_or_else(|| panic!("{config_file} sends requests to {address}: {servers:?}"));
        if replicas(&gateway.service) > 1 {
            // One name for several containers: nginx must follow what Docker's DNS answers.
            assert!(
                server.contains(&"resolve")
                    && directives
                        .iter()
                        .any(|directive| directive[0] == "resolver"),
                "{config_file}: {address} names {} replicas, so it is resolved again \
                 (`resolve` and a `resolver`)",
                replicas(&gateway.service)
            );
        }
    }
    for server in &servers {
        assert!(
            gateways
                .iter()
                .any(|gateway| server[1]
                    == format!("{}:{}", gateway.name, gateway.config.listen.port())),
            "{config_file}: every upstream server is a gateway: {server:?}"
        );
    }
}

/// The Dockerfile's instructions of its last stage (the runtime image), continuation lines
/// joined: `(INSTRUCTION, arguments)`.
/// The `ENV key=value` pairs of a Dockerfile stage.
pub(crate) fn image_env(stage: &[(String, String)]) -> Vec<(String, String)> {
    stage
        .iter()
        .filter(|(instruction, _)| instruction == "ENV")
        .filter_map(|(_, arguments)| {
            let (key, value) = arguments.split_once('=')?;
            Some((
                key.trim().to_owned(),
                value.trim().trim_matches('"').to_owned(),
            ))
        })
        .collect()
}

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

    let env = image_env(&stage);
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
