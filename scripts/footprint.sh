#!/usr/bin/env bash
# Memory footprint (see docs/benchmark.md): starts nats-server and the gateway's release binary,
# opens 10 000 idle long polls (wait_ms 20000, empty stream) with the test suite's kind of
# HTTP client, and prints the gateway's VmRSS idle, at the peak while they wait, and after
# they ended. It is the bench example in --footprint mode; arguments go to it
# (`--polls N`, `--poll-wait-ms MS`, `--gateway-flag=...`; `--streams-not-polls` opens as many
# idle Server-Sent Event streams instead, holds them until all are open, then closes them).
set -euo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$ROOT"

need_cargo
use_nats_server
guard_leftovers footprint

# 10 000 sockets on each side (the client here, the gateway it starts): the usual soft limit
# of 1024 open files is far too low.
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
if (($(ulimit -n) < 10200)); then
    log "warning: ulimit -n is $(ulimit -n); 10 000 polls need about 10 100 descriptors per process"
fi

cargo build --release --bin ruststream-nats --example bench
"$ROOT/target/release/examples/bench" --footprint "$@"
