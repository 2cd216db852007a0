#!/usr/bin/env bash
# Build the previous release of the gateway — the commit below, the last before lease ids
# named their consumer — from a git worktree under target/, and print its binary's path. The
# ledger's rolling-upgrade run starts a fleet on it and rolls it to this build. Built once
# and kept (target/previous-release/<commit>/ruststream-nats); the worktree is removed.
#
# The worktree builds into this repository's target directory, so the dependencies the two
# builds share are compiled once: only the old crate and its patched async-nats are built
# again. Run so before `cargo test` builds this gateway (scripts/test.sh does), never while
# tests run: for a moment target/debug/ruststream-nats is the old binary. With
# PREVIOUS_RELEASE_OWN_TARGET=1 (the ledger test, when nobody built it first) it builds into
# a target directory of its own instead: slower, and safe while tests run.
set -euo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$ROOT"

PREVIOUS_RELEASE=7583d86dfa28886cba3fc8ad5ff3ba09464bd17f
OUT="$ROOT/target/previous-release/$PREVIOUS_RELEASE"
BIN="$OUT/ruststream-nats"
if [[ -x "$BIN" ]]; then
    printf '%s\n' "$BIN"
    exit 0
fi
need_cargo
git cat-file -e "$PREVIOUS_RELEASE^{commit}" 2>/dev/null \
    || die "commit $PREVIOUS_RELEASE (the previous release) is not in this clone; fetch the full history"
WORKTREE="$ROOT/target/previous-release/worktree"
git worktree remove --force "$WORKTREE" >/dev/null 2>&1 || rm -rf "$WORKTREE"
git worktree prune
mkdir -p "$OUT"
log "building the previous release ${PREVIOUS_RELEASE:0:7} (for the rolling-upgrade ledger)"
git worktree add --detach --quiet "$WORKTREE" "$PREVIOUS_RELEASE"
cleanup() { git worktree remove --force "$WORKTREE" >/dev/null 2>&1 || true; }
at_exit cleanup
if [[ "${PREVIOUS_RELEASE_OWN_TARGET:-}" == 1 ]]; then
    TARGET="$ROOT/target/previous-release/target"
else
    TARGET="$ROOT/target"
fi
# Built as it was released: not linted by today's clippy, should .ci/run lint this build.
unset RUSTC_WORKSPACE_WRAPPER CLIPPY_ARGS
CARGO_TARGET_DIR="$TARGET" cargo build --quiet --locked --bin ruststream-nats \
    --manifest-path "$WORKTREE/Cargo.toml"
cp "$TARGET/debug/ruststream-nats" "$BIN.partial"
mv "$BIN.partial" "$BIN"
if [[ "$TARGET" == "$ROOT/target" ]]; then
    # target/debug/ruststream-nats is the old binary now: the next cargo build of this
    # gateway must link it again, so mark its main file changed.
    touch "$ROOT/src/main.rs"
fi
printf '%s\n' "$BIN"
