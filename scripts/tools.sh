#!/usr/bin/env bash
# Make the pinned tool folders of the suites that run after `cargo test` (the worker
# libraries', the spec checks', the browser test's), each exactly as its own script would
# (scripts/lib.sh ensure_venv/ensure_node_modules), so that scripts/test.sh can have them
# downloaded while cargo builds instead of one after another later. A folder whose pins are
# unchanged is left alone; one that fails here is simply made again, with its error, by its
# own script.
set -euo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$ROOT"

ensure_venv "$ROOT/.tools/client-python-venv" "$ROOT/clients/python/requirements.txt"
ensure_venv "$ROOT/.tools/ecosystem-venv" "$ROOT/tests/clients/python/requirements.txt"
ensure_node_modules "$ROOT/clients/typescript" --ignore-scripts
ensure_node_modules "$ROOT/tests/clients/ts"
ensure_node_modules "$ROOT/tests/browser"
log "tool folders ready"
