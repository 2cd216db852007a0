//! A child process a test owns: nats-server (alone or as a cluster node) and the gateway
//! binary. One place for spawning with a log file, waiting until it accepts connections,
//! kill -9, SIGTERM, SIGSTOP/SIGCONT and restarting the same command.
//!
//! `examples/bench.rs` includes `nats.rs` by path, which includes this file: it uses only
//! std and tokio, and names nothing else of the suite.

use std::ffi::OsString;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use tokio::time::Instant;

/// One spawned command, its output appended to `log`; killed (and reaped) on drop.
pub struct ChildProcess {
    /// What failure messages call it (`nats-server`, `n2`, `the gateway`).
    name: String,
    program: PathBuf,
    args: Vec<OsString>,
    env: Vec<(String, String)>,
    log: PathBuf,
    child: Option<Child>,
    paused: bool,
}

impl ChildProcess {
    /// A command not started yet: `program args…`, stdout and stderr appended to `log`.
    pub fn new(
        name: impl Into<String>,
        program: impl Into<PathBuf>,
        args: impl IntoIterator<Item = impl Into<OsString>>,
        log: PathBuf,
    ) -> Self {
        Self {
            name: name.into(),
            program: program.into(),
            args: args.into_iter().map(Into::into).collect(),
            env: Vec::new(),
            log,
            child: None,
            paused: false,
        }
    }

    /// Set an environment variable for every spawn of the command.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Run `program` from the next spawn on, with `extra` arguments after the others.
    pub fn replace_program(&mut self, program: impl Into<PathBuf>, extra: &[&str]) {
        self.program = program.into();
        self.args.extend(extra.iter().map(OsString::from));
    }

    /// Start the command (a running one is killed first).
    pub fn spawn(&mut self) -> Result<(), String> {
        self.kill9();
        let log = File::options()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|err| format!("open {}: {err}", self.log.display()))?;
        let log_err = log
            .try_clone()
            .map_err(|err| format!("clone the log file: {err}"))?;
        let child = Command::new(&self.program)
            .args(&self.args)
            .envs(self.env.iter().map(|(key, value)| (key, value)))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .spawn()
            .map_err(|err| format!("spawn {}: {err}", self.program.display()))?;
        self.child = Some(child);
        Ok(())
    }

    /// The process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Its output so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Where the process' output goes.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The exit status if it has exited (it is then no longer counted as running).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        let status = self.child.as_mut()?.try_wait().ok().flatten()?;
        self.child = None;
        Some(status)
    }

    /// Poll `ready` every 20 ms until it holds; an exit or `within` passing is an error
    /// quoting the log.
    pub async fn wait_until<F, Fut>(
        &mut self,
        what: &str,
        within: Duration,
        mut ready: F,
    ) -> Result<(), String>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = bool>,
    {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.exited() {
                return Err(format!(
                    "{} exited with {status} before {what}; log:\n{}",
                    self.name,
                    self.log()
                ));
            }
            if ready().await {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "{} not {what} within {within:?}; log:\n{}",
                    self.name,
                    self.log()
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGKILL and reap: the process dies holding whatever it held.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.paused = false;
    }

    /// SIGHUP (a terminal closing, a supervisor's reload).
    pub fn sighup(&mut self) {
        let pid = self
            .pid()
            .unwrap_or_else(|| panic!("{} is not running", self.name));
        self.signal("-HUP", pid);
    }

    /// SIGTERM, without waiting for the exit.
    pub fn sigterm(&mut self) {
        let pid = self
            .pid()
            .unwrap_or_else(|| panic!("{} is not running", self.name));
        self.signal("-TERM", pid);
    }

    /// SIGTERM and wait (bounded) for the exit; panics with the log when it does not come.
    pub async fn terminate(&mut self, within: Duration) -> ExitStatus {
        self.sigterm();
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.exited() {
                return status;
            }
            if Instant::now() >= deadline {
                self.kill9();
                panic!(
                    "{} did not stop within {within:?} of SIGTERM; log:\n{}",
                    self.name,
                    self.log()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGSTOP: the process keeps its sockets open but answers nothing (a hung server).
    /// Returns once the kernel shows every thread of it stopped: until then a thread still
    /// running could answer what is sent right after the pause.
    pub fn pause(&mut self) {
        let pid = self
            .pid()
            .unwrap_or_else(|| panic!("{} is not running", self.name));
        self.signal("-STOP", pid);
        self.paused = true;
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !all_threads_stopped(pid) {
            assert!(
                std::time::Instant::now() < deadline,
                "{} ({pid}) not stopped 5 s after SIGSTOP",
                self.name
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// SIGCONT after `pause`.
    pub fn resume(&mut self) {
        let pid = self
            .pid()
            .unwrap_or_else(|| panic!("{} is not running", self.name));
        self.signal("-CONT", pid);
        self.paused = false;
    }

    fn signal(&self, signal: &str, pid: u32) {
        let status = Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(
            status.success(),
            "kill {signal} {} ({pid}) failed",
            self.name
        );
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        // A stopped process is continued first, so that it is reaped at once.
        if self.paused
            && let Some(pid) = self.pid()
        {
            let _ = Command::new("kill")
                .args(["-CONT", &pid.to_string()])
                .status();
        }
        self.kill9();
    }
}

/// Whether every thread of `pid` is stopped (state `T` in `/proc/<pid>/task/*/stat`).
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|task| {
        std::fs::read_to_string(task.path().join("stat")).is_ok_and(|stat| {
            // The state follows the command name, which is in parentheses and may hold spaces.
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next())
                .is_some_and(|state| state == "T" || state == "t")
        })
    })
}
