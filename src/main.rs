//! The `ruststream-nats` binary: flags → config → run, with SIGTERM/SIGINT as the shutdown
//! (bounded: the process is gone within `--shutdown-grace` + 5 s, whatever NATS does) and
//! SIGHUP as a reload of the files it reads, never a stop.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use ruststream_nats::Config;

/// jemalloc rather than glibc's malloc: thousands of idle long polls allocate and free many
/// small per-connection buffers, and glibc kept all of it once they ended (RSS stayed at its
/// peak); jemalloc fragments less and gives freed pages back.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options, read at its start: a background thread purges unused pages after
/// about a second (the default waits ten, and only on the next allocation), so memory
/// freed when a burst of connections ends is returned soon, also when the process is idle.
#[unsafe(export_name = "_rjem_malloc_conf")]
static MALLOC_CONF: MallocConf =
    MallocConf(c"background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0".as_ptr());

/// jemalloc's `const char *malloc_conf`: a thin pointer to a C string.
#[repr(transparent)]
struct MallocConf(*const std::ffi::c_char);

// SAFETY: it points to a string literal, immutable for the life of the process.
unsafe impl Sync for MallocConf {}

/// How long past `--shutdown-grace` a stopping gateway may take before it exits regardless.
const STOP_SLACK: Duration = Duration::from_secs(5);

fn main() -> ExitCode {
    let config = Config::parse();
    if let Some(url) = &config.healthcheck {
        return match ruststream_nats::healthcheck::check(url, Duration::from_secs(3)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => {
                eprintln!("unhealthy: {err}");
                ExitCode::FAILURE
            }
        };
    }
    // A consumers file that does not parse is a usage error, as a bad flag is (exit 2).
    if let Some(path) = &config.consumers_file
        && let Err(why) = ruststream_nats::config::load_consumers_file(path)
    {
        eprintln!("error: {why}");
        return ExitCode::from(2);
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: cannot start the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    let code = runtime.block_on(serve(config));
    // Work still blocked in the runtime's threads (a connection attempt to an unreachable
    // NATS server, a name lookup) must not keep a stopped gateway alive.
    runtime.shutdown_timeout(Duration::from_secs(1));
    code
}

async fn serve(config: Config) -> ExitCode {
    // From the start, before anything is read: a HUP must never take the default action
    // (terminate). The gateway's run loop handles it as a reload.
    #[cfg(unix)]
    let _hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup());
    let telemetry = match ruststream_nats::start_observing(&config) {
        Ok(started) => started,
        Err(err) => {
            eprintln!("error: tracing: {err:#}");
            return ExitCode::from(2);
        }
    };
    let grace = config.shutdown_grace;
    let listener = match tokio::net::TcpListener::bind(config.listen).await {
        Ok(listener) => listener,
        Err(err) => {
            eprintln!("error: cannot listen on {}: {err}", config.listen);
            return ExitCode::FAILURE;
        }
    };
    let shutdown = async move {
        shutdown_signal().await;
        // The drain takes the grace; should anything hang past it, exit anyway.
        let limit = grace.saturating_add(STOP_SLACK);
        std::thread::spawn(move || {
            std::thread::sleep(limit);
            eprintln!(
                "error: the gateway did not stop within --shutdown-grace + {STOP_SLACK:?}; exiting"
            );
            std::process::exit(1);
        });
    };
    let code = match ruststream_nats::run(config, listener, shutdown).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    };
    if let Some(telemetry) = telemetry {
        telemetry.stop();
    }
    code
}

/// Resolves on Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
}
