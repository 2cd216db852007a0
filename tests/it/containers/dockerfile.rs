//! The Dockerfile: a non-root user with a HEALTHCHECK on /healthz that `--healthcheck` really
//! performs, and path dependencies copied before they are built.

use std::process::Command;

use clap::Parser;
use ruststream_nats::Config;

use crate::support::Setup;
use crate::support::nats::free_port;

use super::files::{exec_words, gateway_arguments, image_env, read, runtime_stage};

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
