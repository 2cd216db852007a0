# shellcheck shell=bash
# Shared shell for the scripts in this folder; sourced, never run:
#
#     source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
#
# It sets ROOT (the repository, symlinks resolved) and defines: log/die (messages on stderr,
# prefixed with the calling script's name), need_cargo, use_nats_server (NATS_SERVER_BIN from
# scripts/nats-server.sh), stop_pid (TERM, a bounded wait, KILL), at_exit (one cleanup on every
# way out), guard_leftovers (whatever a run leaves behind is stopped and fails the run), and
# ensure_venv/ensure_node_modules (pinned tool folders, made again only when their pins change).
# It changes no shell options and no directory: each script says that itself.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
SCRIPT_NAME="$(basename "$0")"

log() { printf '%s: %s\n' "$SCRIPT_NAME" "$*" >&2; }
die() { log "$*"; exit 1; }

# The gateway binary the integration tests use (built with their features: after
# scripts/test.sh's cargo test this is a no-op, where a plain `cargo build` would rebuild the
# dependencies). Prints its path.
test_gateway_binary() {
    local binary
    binary="$(cargo test --no-run --quiet --test it --message-format=json-render-diagnostics | python3 -c '
import json, sys
for line in sys.stdin:
    message = json.loads(line)
    if message.get("reason") == "compiler-artifact" and "bin" in message["target"]["kind"] \
            and message["target"]["name"] == "ruststream-nats":
        print(message["executable"])
')"
    [[ -x "$binary" ]] || die "no gateway binary (cargo said: '$binary')"
    printf '%s\n' "$binary"
}

# A TCP port free on 127.0.0.1 now.
# A venv at $1 holding exactly the pins of the requirements file $2, made (again) only when
# that file changed since: its hash is kept in $1/.stamp, written once the install succeeded.
ensure_venv() {
    local venv="$1" requirements="$2" stamp
    stamp="$(sha256sum "$requirements" | cut -d' ' -f1)"
    [[ "$(cat "$venv/.stamp" 2>/dev/null)" == "$stamp" ]] && return 0
    command -v python3 >/dev/null 2>&1 || die "python3 not found (apt-get install python3 python3-venv)"
    rm -rf "$venv"
    python3 -m venv "$venv" || die "could not make a venv (on Debian/Ubuntu: apt-get install python3-venv)"
    PIP_ROOT_USER_ACTION=ignore "$venv/bin/python" -m pip install --disable-pip-version-check \
        --no-input --quiet --no-compile -r "$requirements" || die "pip install -r ${requirements#"$ROOT"/} failed"
    echo "$stamp" >"$venv/.stamp"
}

# `npm ci` in the folder $1 (further arguments go to npm ci), again only when its package.json
# or package-lock.json changed since: their hash is kept in node_modules/.stamp.
ensure_node_modules() {
    local dir="$1" stamp
    shift
    stamp="$(cat "$dir/package.json" "$dir/package-lock.json" | sha256sum | cut -d' ' -f1)"
    [[ "$(cat "$dir/node_modules/.stamp" 2>/dev/null)" == "$stamp" ]] && return 0
    command -v npm >/dev/null 2>&1 || die "npm not found: Node.js >= 20 with npm is needed"
    (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error "$@") || die "npm ci in ${dir#"$ROOT"/} failed"
    echo "$stamp" >"$dir/node_modules/.stamp"
}

# `free_port NAME` sets NAME to a port free now, below the kernel's ephemeral range: ports
# in that range are what bind(0) and every outgoing connection take, so one probed free there
# can be taken before its server binds it. Ports handed out by this script are not handed out
# again (a server started in the background may not have bound its port yet).
FREE_PORTS_GIVEN=""
free_port() {
    local port
    port="$(python3 - "$FREE_PORTS_GIVEN" <<'PY'
import random, socket, sys
given = {int(p) for p in sys.argv[1].split()}
try:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_from = int(f.read().split()[0])
except (OSError, ValueError, IndexError):
    ephemeral_from = 32768
candidates = list(range(10000, ephemeral_from)) if ephemeral_from - 10000 >= 1000 else []
random.shuffle(candidates)
for port in candidates:
    if port in given:
        continue
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            continue
    print(port)
    break
else:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        print(s.getsockname()[1])
PY
)" || die "no free port"
    FREE_PORTS_GIVEN+=" $port"
    printf -v "$1" '%s' "$port"
}

need_cargo() {
    command -v cargo >/dev/null 2>&1 || die "cargo not found: install the Rust toolchain (rustup) first"
}

# The tests and the benchmark start their own servers with the binary named here.
use_nats_server() {
    NATS_SERVER_BIN="$("$ROOT/scripts/nats-server.sh")" || die "no nats-server (see the message above)"
    export NATS_SERVER_BIN
    log "using $NATS_SERVER_BIN ($("$NATS_SERVER_BIN" --version))"
}

# stop_pid PID NAME: stop a child we started, TERM first so it can shut down cleanly, KILL
# when it has not gone within 10 s, then reap it. An empty or already gone PID is fine.
stop_pid() {
    local pid="$1" name="$2" deadline
    [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null || return 0
    log "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    deadline=$((SECONDS + 10))
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
        log "$name (pid $pid) did not stop within 10s; killing it"
        kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
}

# at_exit FUNCTION: run FUNCTION once however the script ends (normally, by an error under
# set -e, by Ctrl-C, TERM or hang-up). FUNCTION finds the script's exit status in EXIT_STATUS
# and may raise it; the script then exits with EXIT_STATUS. Signals become the usual 128+n
# statuses through exit, so the cleanup runs after the foreground command has returned.
EXIT_STATUS=0
at_exit() {
    AT_EXIT_FUNCTION="$1"
    trap run_at_exit EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    trap 'exit 129' HUP
}
# shellcheck disable=SC2317  # only called through the trap above
run_at_exit() {
    EXIT_STATUS=$?
    trap - EXIT INT TERM HUP
    "$AT_EXIT_FUNCTION"
    exit "$EXIT_STATUS"
}

# guard_leftovers LABEL: a safety net. Every process started after this call inherits a marker
# in its environment (RUSTSTREAM_TEST_RUN); when the script ends, whatever still carries it (a
# nats-server or gateway that a test or the benchmark failed to stop) is stopped, and a run
# that otherwise passed fails, since a test that leaks a process is broken. The children that
# were started and stopped properly are gone by then, so nothing is found on a clean run.
guard_leftovers() {
    RUSTSTREAM_TEST_RUN="$1-$$-${RANDOM}${RANDOM}"
    export RUSTSTREAM_TEST_RUN
    at_exit stop_leftovers
}

# shellcheck disable=SC2317  # only called through at_exit
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
                log "LEFTOVER: process $pid is still running after the run: ${args[*]:-?}"
                break
            fi
        done
    done
    ((${#pids[@]})) || return 0
    kill -TERM "${pids[@]}" 2>/dev/null || true
    local deadline=$((SECONDS + 5)) alive=()
    while :; do
        alive=()
        for pid in "${pids[@]}"; do
            if kill -0 "$pid" 2>/dev/null; then alive+=("$pid"); fi
        done
        ((${#alive[@]} && SECONDS < deadline)) || break
        sleep 0.1
    done
    if ((${#alive[@]})); then kill -KILL "${alive[@]}" 2>/dev/null || true; fi
    log "FAILED: ${#pids[@]} leftover process(es) stopped; whatever started them did not stop them"
    ((EXIT_STATUS != 0)) || EXIT_STATUS=1
}
