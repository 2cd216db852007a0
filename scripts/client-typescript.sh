#!/usr/bin/env bash
# The TypeScript worker library (clients/typescript, npm package `ruststream`), checked as its
# users meet it:
#   1. `npm ci` in clients/typescript (node_modules reused while package.json and
#      package-lock.json are unchanged);
#   2. `tsc --strict` builds the package (dist/, ESM + type declarations) and type-checks the
#      tests and the benchmark (build/);
#   3. `node --test` runs the suite: unit tests, and the integration tests of every transport
#      (ws, sse, fetch), each starting a real nats-server and the real gateway on free ports
#      with temporary store directories, and stopping them.
#
# The gateway binary: RUSTSTREAM_BIN when set, else the integration tests' build (lib.sh's
# test_gateway_binary); nats-server from scripts/nats-server.sh (NATS_SERVER_BIN). Needs
# Node >= 20 with npm and the Rust toolchain. The suite takes about 2-3 minutes on 2 cores.
#
# The last line counts the tests, e.g. `client-typescript: 31 passed, 0 failed`; a step that
# fails before the tests (npm, the build) counts as one failure. Exits non-zero on any failure,
# and when a test left a process running (see lib.sh's guard_leftovers).
set -euo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$ROOT"

PACKAGE="$ROOT/clients/typescript"
started=$SECONDS
PASSED=0
FAILED=0
step() { printf '\n== client-typescript: %s (at %ss)\n' "$*" "$((SECONDS - started))" >&2; }

WORK="$(mktemp -d "${TMPDIR:-/tmp}/ruststream-client-typescript.XXXXXX")"

# shellcheck disable=SC2317  # only called through at_exit
cleanup() {
    rm -rf "$WORK"
    stop_leftovers
    if ((EXIT_STATUS != 0 && FAILED == 0)); then FAILED=1; fi
    log "took $((SECONDS - started))s"
    echo "client-typescript: $PASSED passed, $FAILED failed"
    if ((FAILED && EXIT_STATUS == 0)); then EXIT_STATUS=1; fi
}
# Every process the tests start carries this marker; whatever still runs at the end is stopped
# and fails the run (lib.sh).
RUSTSTREAM_TEST_RUN="client-typescript-$$-${RANDOM}${RANDOM}"
export RUSTSTREAM_TEST_RUN
at_exit cleanup

command -v node >/dev/null 2>&1 || die "node not found: Node.js >= 20 with npm is needed"
command -v npm >/dev/null 2>&1 || die "npm not found: Node.js >= 20 with npm is needed"
node -e 'process.exit(Number(process.versions.node.split(".")[0]) >= 20 ? 0 : 1)' \
    || die "Node.js $(node --version) is too old: the package needs >= 20"

step "npm ci in ${PACKAGE#"$ROOT"/}"
# --ignore-scripts: the build is the next step, with its own output.
ensure_node_modules "$PACKAGE" --ignore-scripts

step "tsc --strict: the package, then the tests and the benchmark"
rm -rf "$PACKAGE/dist" "$PACKAGE/build"
(cd "$PACKAGE" && npx --no-install tsc -p tsconfig.json --strict && npx --no-install tsc -p tsconfig.test.json --strict)

step "the gateway and nats-server"
if [[ -n "${RUSTSTREAM_BIN:-}" ]]; then
    [[ -x "$RUSTSTREAM_BIN" ]] || die "RUSTSTREAM_BIN=$RUSTSTREAM_BIN is not an executable"
else
    need_cargo
    RUSTSTREAM_BIN="$(test_gateway_binary)"
fi
export RUSTSTREAM_BIN
use_nats_server

step "node --test"
set +e
(cd "$PACKAGE" && node --test --test-concurrency=1 --test-reporter=tap build/test/*.test.js) | tee "$WORK/tap" >&2
status=${PIPESTATUS[0]}
set -e
PASSED="$(sed -n 's/^# pass \([0-9]*\)$/\1/p' "$WORK/tap" | tail -n 1)"
FAILED="$(sed -n 's/^# fail \([0-9]*\)$/\1/p' "$WORK/tap" | tail -n 1)"
PASSED="${PASSED:-0}"
FAILED="${FAILED:-0}"
if ((status != 0 && FAILED == 0)); then FAILED=1; fi
