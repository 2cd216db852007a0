//! Reading the container files as the gateway would be given them: docker-compose.yml's
//! services, environments, commands and mounts (with `${VAR:-default}` resolved), the
//! Dockerfile's runtime stage, and the argument list `Config` parses from them (also used by
//! the Kubernetes checks).

use std::path::Path;

use clap::{CommandFactory, Parser};
use ruststream_nats::Config;
use yaml_rust2::{Yaml, YamlLoader};

pub(crate) fn read(file: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
    std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("read {}: {err}", path.display()))
}

pub(crate) fn compose() -> Yaml {
    YamlLoader::load_from_str(&read("docker-compose.yml"))
        .expect("docker-compose.yml is YAML")
        .into_iter()
        .next()
        .expect("docker-compose.yml has a document")
}

/// A compose string value with `${VAR:-default}` replaced by its default.
pub(crate) fn interpolated(value: &str) -> String {
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

pub(crate) fn scalar(yaml: &Yaml) -> Option<String> {
    match yaml {
        Yaml::String(text) | Yaml::Real(text) => Some(interpolated(text)),
        Yaml::Integer(number) => Some(number.to_string()),
        Yaml::Boolean(flag) => Some(flag.to_string()),
        _ => None,
    }
}

/// A service's `environment`, in either of compose's forms (map, or list of `K=V`).
pub(crate) fn environment(service: &Yaml) -> Vec<(String, String)> {
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
pub(crate) fn words(value: &Yaml) -> Vec<String> {
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
pub(crate) fn flag_value(args: &[String], long: &str) -> Option<String> {
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
pub(crate) fn replicas(service: &Yaml) -> i64 {
    service["deploy"]["replicas"]
        .as_i64()
        .or_else(|| service["scale"].as_i64())
        .unwrap_or(1)
}

/// A gateway service of docker-compose.yml: its name, definition and parsed settings.
pub(crate) struct ComposeGateway {
    pub(crate) name: String,
    pub(crate) service: Yaml,
    pub(crate) config: Config,
}

/// Every service that runs the gateway image: the one that builds it, and any other naming
/// the image it builds (three services sharing one definition would be that).
pub(crate) fn compose_gateways(compose: &Yaml) -> Vec<ComposeGateway> {
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

/// A `source:target[:mode]` volume entry of a service: `(source, target, read_only)`.
pub(crate) fn mounts(service: &Yaml) -> Vec<(String, String, bool)> {
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
pub(crate) fn exec_words(arguments: &str) -> Vec<String> {
    match serde_json::from_str::<Vec<String>>(arguments) {
        Ok(words) => words,
        Err(_) => arguments.split_whitespace().map(str::to_owned).collect(),
    }
}
