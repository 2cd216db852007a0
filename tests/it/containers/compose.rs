//! docker-compose.yml: only flags and variables the gateway has, an optional collector and
//! Jaeger for traces, and three replicas sharing one lease key behind a balancer.

use std::collections::BTreeSet;
use std::path::Path;

use yaml_rust2::{Yaml, YamlLoader};

use super::files::{
    ComposeGateway, compose, compose_gateways, environment, mounts, read, replicas, runtime_stage,
    scalar, words,
};

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
