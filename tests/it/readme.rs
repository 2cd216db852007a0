//! The README stays true: its ```console examples, then those of the tour it goes on to
//! (docs/tour.md), run in order in one bash session against a live gateway and nats-server,
//! and each command must print what the page shows (`[..]` matches any text within a line,
//! `...` on its own line any number of lines). The endpoint list of the spec must appear in
//! those examples, and the flags of `--help` in the table of docs/configuration.md, whose rows
//! the README's short table copies. Console examples live in those two pages only: the other
//! docs pages hold none this test would not run.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use clap::CommandFactory;
use ruststream_nats::Config;
use snapbox::IntoData;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

use crate::support::Setup;
use crate::support::nats::NatsServer;

/// The address the README's examples use; the test points them at its own gateway.
const README_ADDRESS: &str = "localhost:8080";
/// The longest one README command may take (the slowest waits on a delayed nak).
const COMMAND_DEADLINE: Duration = Duration::from_secs(30);

/// The pages whose console examples run, in this order, in one session: the tour picks up
/// where the README stops.
const RUN_PAGES: [&str; 2] = ["README.md", "docs/tour.md"];

/// One `$ command` of a console block with the output its page promises for it.
#[derive(Debug)]
struct Example {
    /// The page it is on, from the repository root.
    page: &'static str,
    /// 1-based line of the `$` on its page, for the failure message.
    line: usize,
    command: String,
    expected: String,
}

fn readme() -> String {
    page("README.md")
}

/// A file of the repository, by its path from the root.
fn page(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("read {}: {err}", path.display()))
}

/// The rows of a flags table: those that start with a flag.
fn flag_rows(text: &str) -> impl Iterator<Item = &str> {
    text.lines().filter(|line| line.starts_with("| `--"))
}

/// Every `$ ` command of the pages that run, in order.
fn all_examples() -> Vec<Example> {
    RUN_PAGES
        .iter()
        .flat_map(|name| examples(name, &page(name)))
        .collect()
}

/// Every `$ ` command (with its `> ` continuation lines) in the console blocks of `text`,
/// the page `name`.
fn examples(name: &'static str, text: &str) -> Vec<Example> {
    let mut examples: Vec<Example> = Vec::new();
    let mut in_console = false;
    for (index, line) in text.lines().enumerate() {
        let trimmed = line.trim_end();
        if trimmed.starts_with("```") {
            in_console = !in_console && trimmed == "```console";
            continue;
        }
        if !in_console {
            continue;
        }
        if let Some(command) = trimmed.strip_prefix("$ ") {
            examples.push(Example {
                page: name,
                line: index + 1,
                command: command.to_owned(),
                expected: String::new(),
            });
        } else if let Some(example) = examples.last_mut() {
            match trimmed.strip_prefix("> ") {
                Some(more) if example.expected.is_empty() => {
                    example.command.push('\n');
                    example.command.push_str(more);
                }
                _ => {
                    example.expected.push_str(trimmed);
                    example.expected.push('\n');
                }
            }
        } else {
            panic!(
                "{name}:{}: console block output before any `$ ` command",
                index + 1
            );
        }
    }
    examples
}

/// A bash session that keeps its variables between commands, like the reader's terminal.
struct Shell {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Shell {
    fn start() -> Self {
        let mut child = Command::new("bash")
            .args(["--noprofile", "--norc"])
            .env("LC_ALL", "C")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start bash");
        let stdin = child.stdin.take().expect("bash stdin");
        let stdout = BufReader::new(child.stdout.take().expect("bash stdout"));
        Self {
            child,
            stdin,
            stdout,
        }
    }

    /// Run one command, its stderr merged into its stdout; returns what it printed.
    async fn run(&mut self, command: &str, marker: &str) -> String {
        // The marker goes on a line of its own even when the output lacks a final newline.
        let script = format!("{{\n{command}\n}} 2>&1\nprintf '\\n%s\\n' '{marker}'\n");
        self.stdin
            .write_all(script.as_bytes())
            .await
            .expect("write to bash");
        self.stdin.flush().await.expect("flush bash stdin");
        let mut output = String::new();
        let read = async {
            loop {
                let mut line = String::new();
                let read = self.stdout.read_line(&mut line).await.expect("read bash");
                assert!(read > 0, "bash ended while running {command:?}");
                if line.trim_end() == marker {
                    break;
                }
                output.push_str(&line);
            }
        };
        tokio::time::timeout(COMMAND_DEADLINE, read)
            .await
            .unwrap_or_else(|_| panic!("{command:?} still running after {COMMAND_DEADLINE:?}"));
        normalize(&output)
    }
}

impl Drop for Shell {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

/// What a reader compares by eye: no `\r` (HTTP headers), no trailing blanks, no empty tail.
fn normalize(output: &str) -> String {
    let mut text: String = output
        .replace('\r', "")
        .lines()
        .map(|line| format!("{}\n", line.trim_end()))
        .collect();
    while text.ends_with("\n\n") || text == "\n" {
        text.pop();
    }
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readme_console_examples_answer_as_shown() {
    for tool in ["curl", "jq"] {
        let found = std::process::Command::new(tool)
            .arg("--version")
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|status| status.success());
        assert!(
            found,
            "the README examples need `{tool}` on PATH (apt-get install {tool})"
        );
    }
    let examples = all_examples();
    assert!(
        examples.len() >= 10,
        "expected the README's curl walkthrough, found {} console commands",
        examples.len()
    );
    for name in RUN_PAGES {
        assert!(
            examples.iter().any(|example| example.page == name),
            "{name} has no console example: it should not be among the pages that run"
        );
    }

    // The demo's setup: the default stream ORDERS (orders.>) and consumer billing, and the
    // consumers file it runs with (ORDERS/shipping).
    let server = NatsServer::start().await;
    let consumers_file =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/consumers/consumers.toml");
    let gateway = Setup::defaults()
        .create_stream()
        .flag("--consumers-file", consumers_file.display().to_string())
        .ready(&server.url())
        .await;
    let address = gateway.base().trim_start_matches("http://").to_owned();

    let mut shell = Shell::start();
    let mut failures = Vec::new();
    for (number, example) in examples.iter().enumerate() {
        let command = example.command.replace(README_ADDRESS, &address);
        let actual = shell
            .run(&command, &format!("@@readme-example-{number}@@"))
            .await;
        let verdict = snapbox::Assert::new().try_eq(
            Some(&format!("{}:{}", example.page, example.line)),
            actual.clone().into_data(),
            example.expected.clone().into_data(),
        );
        if let Err(err) = verdict {
            failures.push(format!(
                "{}:{} `$ {}`\n{err}--- actual output:\n{actual}",
                example.page, example.line, example.command
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} README and tour examples did not answer as shown:\n\n{}",
        failures.len(),
        examples.len(),
        failures.join("\n")
    );
}

/// "curl for every endpoint": each path of the spec is called by some example of the README
/// or its tour.
#[test]
fn readme_examples_call_every_endpoint() {
    let commands: Vec<String> = all_examples()
        .into_iter()
        .map(|example| example.command)
        .collect();
    let spec = ruststream_nats::http::openapi();
    let missing: Vec<&String> = spec
        .paths
        .paths
        .keys()
        .filter(|path| !commands.iter().any(|command| calls(command, path)))
        .collect();
    assert!(
        missing.is_empty(),
        "no console example of the README or its tour calls {missing:?}"
    );
}

/// Whether `command` requests `path` on the README's address; a `{param}` segment of the
/// path stands for any segment (a lease id passed through a shell variable, `$ID`; a stream
/// or consumer name).
fn calls(command: &str, path: &str) -> bool {
    let template: Vec<&str> = path.split('/').collect();
    command.split(README_ADDRESS).skip(1).any(|url| {
        let end = url
            .find(|c: char| c.is_whitespace() || matches!(c, '\'' | '"' | '?' | ')' | '|'))
            .unwrap_or(url.len());
        let segments: Vec<&str> = url[..end].split('/').collect();
        segments.len() == template.len()
            && template.iter().zip(&segments).all(|(want, got)| {
                if want.starts_with('{') && want.ends_with('}') {
                    !got.is_empty()
                } else {
                    want == got
                }
            })
    })
}

/// The configuration page's table lists every flag with its environment variable.
#[test]
fn configuration_page_lists_every_flag() {
    let full = page("docs/configuration.md");
    let rows: BTreeSet<&str> = flag_rows(&full).collect();
    let mut missing = Vec::new();
    for arg in Config::command().get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        if long == "help" || long == "version" {
            continue;
        }
        let flag = format!("| `--{long}` |");
        let env = arg
            .get_env()
            .map(|env| format!("`{}`", env.to_string_lossy()))
            .unwrap_or_default();
        let documented = rows
            .iter()
            .any(|row| row.starts_with(&flag) && row.contains(&env));
        if !documented {
            missing.push(format!("--{long} {env}"));
        }
    }
    assert!(
        missing.is_empty(),
        "docs/configuration.md's table lacks rows for: {missing:?}"
    );
}

/// The README's most used flags are rows of the full table: flag, variable and default agree
/// (the meaning may differ only in its links, which point elsewhere from the README).
#[test]
fn readme_flags_match_the_configuration_page() {
    fn key(row: &str) -> Vec<&str> {
        row.split(" | ").take(3).collect()
    }
    let full = page("docs/configuration.md");
    let known: Vec<Vec<&str>> = flag_rows(&full).map(key).collect();
    let readme = readme();
    let rows: Vec<&str> = flag_rows(&readme).collect();
    assert!(!rows.is_empty(), "README.md lists no flags");
    let stray: Vec<&&str> = rows
        .iter()
        .filter(|row| !known.contains(&key(row)))
        .collect();
    assert!(
        stray.is_empty(),
        "README.md's flag rows disagree with docs/configuration.md (flag, env, default): {stray:?}"
    );
}

/// Only the console examples of the README and its tour run (above): a ```console block
/// anywhere else in the documentation would show output nobody checks.
#[test]
fn console_examples_live_in_the_readme() {
    let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs");
    let mut pages = vec!["CHANGELOG.md".to_owned()];
    for entry in std::fs::read_dir(docs).expect("read docs/") {
        let name = entry.expect("a docs/ entry").file_name();
        let name = name.to_string_lossy();
        if name.ends_with(".md") {
            pages.push(format!("docs/{name}"));
        }
    }
    let unrun: Vec<&String> = pages
        .iter()
        .filter(|name| !RUN_PAGES.contains(&name.as_str()))
        .filter(|name| page(name).lines().any(|line| line.trim() == "```console"))
        .collect();
    assert!(
        unrun.is_empty(),
        "console examples outside README.md and docs/tour.md are never run; move them into one of those: {unrun:?}"
    );
}

/// The README is a front page, not the manual: at most 300 lines, the rest in docs/ (the
/// tour, every reference page) where it links them.
#[test]
fn readme_stays_a_front_page() {
    let lines = readme().lines().count();
    assert!(
        lines <= 300,
        "README.md has {lines} lines; at most 300 — move a section into docs/ and link it"
    );
}
