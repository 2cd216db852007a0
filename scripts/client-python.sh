#!/usr/bin/env bash
# The Python worker library (clients/python) checked as CI runs it:
#   1. a venv in .tools/client-python-venv (git-ignored, reused while
#      clients/python/requirements.txt is unchanged) with the exact pins of that file, and the
#      package itself installed from clients/python as a user would (`pip install`);
#   2. `mypy --strict` on the package and its tests;
#   3. the test suite (pytest) against a real gateway and a real nats-server, which the tests
#      start themselves on free ports with temporary store directories and always stop.
#
# The gateway binary is the integration tests' (scripts/lib.sh test_gateway_binary), or
# RUSTSTREAM_BIN when set; nats-server comes from scripts/nats-server.sh (NATS_SERVER_BIN).
# The last line counts the tests, e.g. `client-python: 24 passed, 0 failed`; mypy's errors
# count as failures, and the exit status is non-zero on any failure.
set -euo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$ROOT"

PACKAGE="$ROOT/clients/python"
VENV="$ROOT/.tools/client-python-venv"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/ruststream-client-python.XXXXXX")"
PASSED=0
FAILED=0
started=$SECONDS

# shellcheck disable=SC2317  # only called through at_exit
finish() {
    rm -rf "$WORK"
    log "took $((SECONDS - started))s"
    if ((EXIT_STATUS != 0 && FAILED == 0)); then FAILED=1; fi
    echo "client-python: $PASSED passed, $FAILED failed"
    if ((FAILED && EXIT_STATUS == 0)); then EXIT_STATUS=1; fi
}
guard_leftovers client-python
# guard_leftovers installs its own exit hook; run both.
both_at_exit() { stop_leftovers; finish; }
at_exit both_at_exit

command -v python3 >/dev/null 2>&1 || die "python3 not found (apt-get install python3 python3-venv)"
python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' || die "Python >= 3.10 is needed"

log "venv: ${VENV#"$ROOT"/} (pinned: clients/python/requirements.txt)"
ensure_venv "$VENV" "$PACKAGE/requirements.txt"
# The package as a user installs it (no build isolation: setuptools from the venv, offline).
PIP_ROOT_USER_ACTION=ignore "$VENV/bin/python" -m pip install --disable-pip-version-check \
    --no-input --quiet --no-deps --no-build-isolation --force-reinstall "$PACKAGE"

log "mypy --strict"
if (cd "$PACKAGE" && "$VENV/bin/mypy" --strict src tests); then
    PASSED=$((PASSED + 1))
else
    FAILED=$((FAILED + 1))
fi

if [[ -z "${RUSTSTREAM_BIN:-}" ]]; then
    need_cargo
    RUSTSTREAM_BIN="$(test_gateway_binary)"
fi
export RUSTSTREAM_BIN
use_nats_server

log "pytest (real gateway: $RUSTSTREAM_BIN)"
set +e
(cd "$PACKAGE" && "$VENV/bin/python" -m pytest -p no:cacheprovider -q --durations=8 \
    --junitxml="$WORK/junit.xml" tests)
rc=$?
set -e
if [[ -s "$WORK/junit.xml" ]]; then
    # A command substitution, not a process substitution: its process has ended when read runs
    # (else the leftover guard may find it still exiting).
    counts="$(python3 - "$WORK/junit.xml" <<'PY'
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suite = root if root.tag == "testsuite" else root.find("testsuite")
print(*(suite.get(k, "0") for k in ("tests", "failures", "errors", "skipped")))
PY
)"
    read -r tests failures errors skipped <<<"$counts"
    PASSED=$((PASSED + tests - failures - errors - skipped))
    FAILED=$((FAILED + failures + errors + skipped))
fi
if ((rc != 0 && FAILED == 0)); then FAILED=1; fi
