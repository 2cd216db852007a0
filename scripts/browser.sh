#!/usr/bin/env bash
# Swagger UI (GET /docs) in a real browser: Debian's headless Chromium, driven by playwright-core
# (tests/browser/swagger-ui.mjs), authorizes with a bearer token, runs "Try it out" on
# POST /fetch and on POST /messages/{id}/ack against a live gateway and nats-server, and reads
# the 200 (with the lease id) and the 204 from the page. The page may load nothing from
# anywhere but the gateway. Screenshots are kept in target/browser/: swagger-ui.png (the whole
# page), swagger-ui-fetchMessages.png and swagger-ui-ackMessage.png (each request as sent and
# the page's answer), or swagger-ui-failed.png (the page when a step failed). Then
# tests/browser/stream-tickets.mjs: a page of another origin (the gateway runs with
# --cors-allow-origin for it) asks for stream tickets with the token, opens an EventSource and
# a WebSocket with them, and settles a message over each. Then tests/browser/ruststream-worker.mjs:
# a page of that origin loads the TypeScript worker library (clients/typescript, npm
# `ruststream`, built here by its own tsc into a temporary folder and served as it is, ESM
# named by an import map) and runs `new Worker({ url, token, transport: "ws" })` with the
# token: the library asks for a stream ticket (a browser WebSocket cannot send
# Authorization), handles 50 messages published beforehand, acks each in band and stops;
# every message handled once, the WebSocket's URL holding a ticket and not the token, and
# GET /consumer showing nothing pending, ack-pending or leased. Last tests/browser/console.mjs: the
# console (GET /console) asks for a token, shows a publish in its table without a reload, draws
# a consumer's chart, and redrives a terminated message by its buttons; no request leaves the
# gateway's origin, and axe-core (pinned) finds no serious or critical violation. Its
# screenshot, target/browser/console.png, is the one docs/console.png copies.
#
# Chromium is Debian's `chromium` package (/usr/bin/chromium, or CHROMIUM_BIN): under CI
# (CI=true) as root it is installed with apt-get when missing; elsewhere without it the test
# is SKIPPED, saying so. Nothing downloads a browser build: playwright-core has no browser of
# its own, and is installed pinned by `npm ci` from tests/browser/package-lock.json into
# tests/browser/node_modules (git-ignored, reused while the pins are unchanged); the
# TypeScript library's own pins (typescript for its build) likewise into
# clients/typescript/node_modules.
#
# It builds the gateway as scripts/ecosystem.sh does (a no-op after scripts/test.sh's cargo
# test), starts nats-server (free port, temporary store) and the gateway (--create-stream,
# a bearer token with the fetch, settle and publish scopes and one with admin, dead letters to
# dlq.orders), publishes one message with
# curl, and always stops everything it started. The last line counts, e.g.
# `browser: 4 passed, 0 failed`; the exit status is non-zero unless the test passed (or was
# skipped outside CI).
set -euo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$ROOT"

BROWSER_DIR="$ROOT/tests/browser"
TS_PACKAGE="$ROOT/clients/typescript"
ARTEFACTS="$ROOT/target/browser"
SCREENSHOT="$ARTEFACTS/swagger-ui.png"
CHROMIUM_BIN="${CHROMIUM_BIN:-/usr/bin/chromium}"
export CHROMIUM_BIN

started=$SECONDS
# The gateway log's length when the current test began (see failed_test).
TEST_LOG_FROM=0
step() {
    printf '\n== browser: %s (at %ss)\n' "$*" "$((SECONDS - started))" >&2
    if [[ -n "${WORK:-}" && -f "$WORK/gateway.log" ]]; then TEST_LOG_FROM="$(wc -l <"$WORK/gateway.log")"; fi
}
# Test $1 failed: say so, with what the gateway logged while it ran (at most 100 lines).
failed_test() {
    FAILED+=("$1")
    log "FAILED: $1"
    log "the gateway's log while it ran:"
    tail -n "+$((TEST_LOG_FROM + 1))" "$WORK/gateway.log" | head -n 100 >&2 || true
}

TESTS=("Swagger UI: authorize, fetch, ack" "Stream tickets: EventSource and WebSocket from another origin"
    "TypeScript worker library in the browser: consumes over ws with a stream ticket"
    "Console: live table, redrive by its buttons, only its origin, axe-core")
PASSED=()
FAILED=()
SKIPPED=()

summary() {
    local not_run=$((${#TESTS[@]} - ${#PASSED[@]} - ${#FAILED[@]} - ${#SKIPPED[@]}))
    local failed=$((${#FAILED[@]} + not_run))
    printf '\n' >&2
    ((not_run == 0)) || log "NOT RUN (the script stopped before it): $not_run test"
    log "took $((SECONDS - started))s"
    if ((${#SKIPPED[@]})); then
        echo "browser: ${#PASSED[@]} passed, $failed failed, ${#SKIPPED[@]} skipped"
    else
        echo "browser: ${#PASSED[@]} passed, $failed failed"
    fi
    if ((failed && EXIT_STATUS == 0)); then EXIT_STATUS=1; fi
}

WORK="$(mktemp -d "${TMPDIR:-/tmp}/ruststream-browser.XXXXXX")"
NATS_PID=""
GATEWAY_PID=""
# Run alone (not under scripts/test.sh), this script is its own guard against a browser
# process left behind; under scripts/test.sh that guard covers it.
OWN_GUARD=0
if [[ -z "${RUSTSTREAM_TEST_RUN:-}" ]]; then
    RUSTSTREAM_TEST_RUN="browser-$$-${RANDOM}${RANDOM}"
    export RUSTSTREAM_TEST_RUN
    OWN_GUARD=1
fi

# shellcheck disable=SC2317  # only called through at_exit
cleanup() {
    local file
    if ((EXIT_STATUS != 0 || ${#FAILED[@]})); then
        for file in gateway.log nats-server.log; do
            if [[ -s "$WORK/$file" ]]; then
                log "last lines of $file:"
                tail -n 30 "$WORK/$file" >&2 || true
            fi
        done
    fi
    stop_pid "$GATEWAY_PID" gateway
    stop_pid "$NATS_PID" nats-server
    if ((OWN_GUARD)); then stop_leftovers; fi
    rm -rf "$WORK"
    summary
}
at_exit cleanup

step "Chromium"
if [[ ! -x "$CHROMIUM_BIN" ]]; then
    if [[ "${CI:-}" == true && "$(id -u)" == 0 && "$CHROMIUM_BIN" == /usr/bin/chromium ]]; then
        log "installing Debian's chromium (apt-get)"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    elif [[ "${CI:-}" == true ]]; then
        die "no Chromium at $CHROMIUM_BIN, and CI never skips the browser test (as root it installs Debian's chromium itself)"
    else
        log "SKIPPED: the Swagger UI browser test, because there is no Chromium at $CHROMIUM_BIN (apt-get install chromium; or CHROMIUM_BIN=...)"
        SKIPPED+=("${TESTS[@]}")
        exit 0
    fi
fi
# Debian's /usr/bin/chromium is a wrapper script; its own complaints are not ours.
log "using $("$CHROMIUM_BIN" --version 2>/dev/null) ($CHROMIUM_BIN)"

need_cargo
for tool in node npm curl python3; do
    command -v "$tool" >/dev/null 2>&1 || die "$tool not found (the browser test needs Node.js with npm, curl and Python 3)"
done

step "tools: npm ci in ${BROWSER_DIR#"$ROOT"/} and ${TS_PACKAGE#"$ROOT"/}"
ensure_node_modules "$BROWSER_DIR"
# --ignore-scripts: its prepare script would build dist/; the build this test serves is the next step's.
ensure_node_modules "$TS_PACKAGE" --ignore-scripts

step "build the TypeScript worker library (tsc) for the browser"
# Into a folder of this run, not the package's dist/ (scripts/client-typescript.sh's).
(cd "$TS_PACKAGE" && npx --no-install tsc -p tsconfig.json --outDir "$WORK/ruststream")

step "build the gateway"
# The binary the integration tests use (see lib.sh).
GATEWAY_BIN="$(test_gateway_binary)"

step "start nats-server and the gateway"
NATS_BIN="$("$ROOT/scripts/nats-server.sh")"
free_port NATS_PORT
"$NATS_BIN" -js -a 127.0.0.1 -p "$NATS_PORT" -sd "$WORK" -l "$WORK/nats-server.log" </dev/null &
NATS_PID=$!
free_port HTTP_PORT
# The origin of the stream-tickets test's page (served by its script).
free_port PAGE_PORT
BASE="http://127.0.0.1:$HTTP_PORT"
TOKEN="browser-$(python3 -c 'import secrets; print(secrets.token_hex(16))')"
ADMIN_TOKEN="admin-$(python3 -c 'import secrets; print(secrets.token_hex(16))')"
# None of the caller's RUSTSTREAM_* or NATS_* variables may change this run.
scrub=()
while IFS= read -r name; do
    [[ "$name" == RUSTSTREAM_TEST_RUN ]] || scrub+=(-u "$name")
done < <(compgen -e | grep -E '^(RUSTSTREAM|NATS)_' || true)
# Warnings, and each WebSocket session's end and each settle (a few per test): a failed test
# prints the lines logged while it ran.
GATEWAY_LOG_LEVELS="warn,ruststream_nats::http::ws=debug,ruststream_nats::gateway::consumer::settle=debug"
env "${scrub[@]}" RUST_LOG="$GATEWAY_LOG_LEVELS" "$GATEWAY_BIN" --nats-url "nats://127.0.0.1:$NATS_PORT" --listen "127.0.0.1:$HTTP_PORT" \
    --create-stream --stream ORDERS --stream-subjects 'orders.>' --consumer browser \
    --auth-tokens "$TOKEN fetch,settle,publish;$ADMIN_TOKEN admin" --cors-allow-origin "http://127.0.0.1:$PAGE_PORT" \
    --dead-letter-subject dlq.orders \
    </dev/null >"$WORK/gateway.log" 2>&1 &
GATEWAY_PID=$!
deadline=$((SECONDS + 30))
until curl -fso /dev/null --max-time 2 "$BASE/readyz"; do
    kill -0 "$NATS_PID" 2>/dev/null || die "nats-server exited during start-up"
    kill -0 "$GATEWAY_PID" 2>/dev/null || die "the gateway exited during start-up"
    ((SECONDS < deadline)) || die "the gateway was not ready within 30s"
    sleep 0.2
done
log "gateway ready at $BASE (nats-server on port $NATS_PORT)"

step "publish one message"
DATA="hello from the browser test $RANDOM"
status="$(curl -sS -o "$WORK/publish.json" -w '%{http_code}' --max-time 10 -X POST "$BASE/publish" \
    -H "Authorization: Bearer $TOKEN" -H 'Content-Type: application/json' \
    --data "{\"subject\": \"orders.browser\", \"data\": \"$DATA\"}")"
[[ "$status" == 201 ]] || die "POST /publish answered $status, not 201: $(cat "$WORK/publish.json")"
log "published: $(cat "$WORK/publish.json")"

step "${TESTS[0]}"
mkdir -p "$ARTEFACTS" "$WORK/profile"
rm -f "$ARTEFACTS"/swagger-ui*.png
# Bounded: a hung browser cannot hold up the run (its steps have their own 15s limits).
if timeout --kill-after=10 120 node "$BROWSER_DIR/swagger-ui.mjs" "$BASE" "$TOKEN" "$DATA" "$SCREENSHOT" "$WORK/profile"; then
    [[ -s "$SCREENSHOT" ]] || die "the test passed but wrote no screenshot at $SCREENSHOT"
    PASSED+=("${TESTS[0]}")
    log "passed; screenshots of the executed requests: $(cd "$ROOT" && echo "${ARTEFACTS#"$ROOT"/}"/swagger-ui*.png)"
else
    failed_test "${TESTS[0]}"
fi

step "${TESTS[1]}"
# One message for the EventSource; the page publishes the WebSocket's once the EventSource
# is closed (see stream-tickets.mjs).
status="$(curl -sS -o "$WORK/publish.json" -w '%{http_code}' --max-time 10 -X POST "$BASE/publish" \
    -H "Authorization: Bearer $TOKEN" -H 'Content-Type: application/json' \
    --data '{"subject": "orders.browser", "data": "streamed 1"}')"
[[ "$status" == 201 ]] || die "POST /publish answered $status, not 201: $(cat "$WORK/publish.json")"

mkdir -p "$WORK/profile-tickets"
if timeout --kill-after=10 90 node "$BROWSER_DIR/stream-tickets.mjs" "$BASE" "$TOKEN" "$PAGE_PORT" "$WORK/profile-tickets"; then
    PASSED+=("${TESTS[1]}")
    log "passed: ${TESTS[1]}"
else
    failed_test "${TESTS[1]}"
fi

step "${TESTS[2]}"
# Before the console's test, which leaves messages on the consumer: this one starts from an
# empty consumer, so that it can count every message its worker handles.
mkdir -p "$WORK/profile-worker"
if timeout --kill-after=10 90 node "$BROWSER_DIR/ruststream-worker.mjs" "$BASE" "$TOKEN" "$ADMIN_TOKEN" "$PAGE_PORT" \
    "$WORK/ruststream" "$WORK/profile-worker"; then
    PASSED+=("${TESTS[2]}")
    log "passed: ${TESTS[2]}"
else
    failed_test "${TESTS[2]}"
fi

step "${TESTS[3]}"
mkdir -p "$WORK/profile-console"
rm -f "$ARTEFACTS/console.png"
if timeout --kill-after=10 120 node "$BROWSER_DIR/console.mjs" "$BASE" "$NATS_PORT" "$TOKEN" "$ADMIN_TOKEN" \
    "$ARTEFACTS/console.png" "$WORK/profile-console"; then
    [[ -s "$ARTEFACTS/console.png" ]] || die "the console test passed but wrote no screenshot"
    PASSED+=("${TESTS[3]}")
    log "passed: ${TESTS[3]}; screenshot ${ARTEFACTS#"$ROOT"/}/console.png (docs/console.png is a copy)"
else
    failed_test "${TESTS[3]}"
fi
