#!/usr/bin/env bash
# Static checks of the container files (no Docker engine needed, none runs in CI):
# `docker-compose config` parses docker-compose.yml and checks it against the Compose schema.
# What the files mean (flags the gateway has, HEALTHCHECK, non-root USER, the stream job) is
# checked by tests/it/containers/.
#
# docker-compose comes from Debian's `docker-compose` package; in CI (CI=true) it is installed
# when missing, and CI fails when it cannot be. Elsewhere a missing docker-compose skips the
# check with a SKIPPED line, so that a local run never looks like a checked one.
set -euo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$ROOT"

if ! command -v docker-compose >/dev/null 2>&1; then
    if [[ "${CI:-}" == "true" ]]; then
        if [[ "$(id -u)" != "0" ]] || ! command -v apt-get >/dev/null 2>&1; then
            die "docker-compose not found, and CI can only install it as root with apt-get"
        fi
        log "docker-compose not found: installing Debian's docker-compose package"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq >/dev/null
        apt-get install -y -qq --no-install-recommends docker-compose >/dev/null
        command -v docker-compose >/dev/null 2>&1 || die "docker-compose still not found after installing it"
    else
        log "SKIPPED: docker-compose.yml was not checked: docker-compose not found (apt-get install docker-compose)"
        exit 0
    fi
fi

log "$(docker-compose version --short 2>/dev/null || docker-compose --version)"
# -q: validate only. No build, no engine contacted.
docker-compose -f docker-compose.yml config -q
services="$(docker-compose -f docker-compose.yml config --services | sort | tr '\n' ' ')"
log "docker-compose.yml is valid; services: $services"
