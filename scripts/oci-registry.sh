#!/usr/bin/env bash
# A real OCI registry on localhost for releases (`make release REGISTRY=...`) and their test
# (tests/containers/test_release.py): Debian's `docker-registry` (CNCF distribution 2.8), plain HTTP on 127.0.0.1.
#   start     install docker-registry with apt-get if missing, run it on 127.0.0.1:$STOCK_LEDGER_REGISTRY_PORT
#             (default 5000) with its blobs under $STOCK_LEDGER_STATE/oci-registry; idempotent
#   stop      stop the one this script started
#   address   host:port, what `make release REGISTRY=` takes
# podman pushes to it with --tls-verify=false and helm with --plain-http (scripts/release.sh --plain-http): it speaks
# HTTP only, on the loopback address, with no authentication. Not for anything but this machine.
set -euo pipefail

STATE="${STOCK_LEDGER_STATE:-$HOME/.local/state/stock-ledger}/oci-registry"
PORT="${STOCK_LEDGER_REGISTRY_PORT:-5000}"
ADDRESS="127.0.0.1:$PORT"

log() { printf '[oci-registry] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

answers() { curl -sf -o /dev/null "http://$ADDRESS/v2/"; }

install() {
    command -v docker-registry >/dev/null && return
    [[ "$(id -u)" == 0 ]] || die "installing docker-registry needs root: run this script as root (apt-get)"
    log "apt-get install docker-registry curl"
    apt-get -o DPkg::Lock::Timeout=600 update -qq
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends \
        docker-registry curl >/dev/null
    command -v docker-registry >/dev/null || die "docker-registry missing after installing it"
}

start() {
    install
    if answers; then
        log "a registry already answers on $ADDRESS"
        return
    fi
    mkdir -p "$STATE/data"
    # The package's own /etc/docker/registry/config.yml asks for htpasswd auth and listens on every address.
    cat >"$STATE/config.yml" <<EOF
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: $STATE/data
  delete:
    enabled: true
http:
  addr: $ADDRESS
EOF
    docker-registry serve "$STATE/config.yml" >"$STATE/registry.log" 2>&1 &
    echo $! >"$STATE/registry.pid"
    local _
    for _ in $(seq 100); do
        answers && break
        sleep 0.1
    done
    answers || die "docker-registry did not answer on $ADDRESS (log: $STATE/registry.log)"
    log "docker-registry $(docker-registry --version 2>/dev/null | awk '{print $3}') serving http://$ADDRESS (pid $(cat "$STATE/registry.pid"))"
}

stop() {
    if [[ -f "$STATE/registry.pid" ]] && kill "$(cat "$STATE/registry.pid")" 2>/dev/null; then
        log "stopped the registry on $ADDRESS"
    fi
    rm -f "$STATE/registry.pid"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    address) printf '%s\n' "$ADDRESS" ;;
    *) die "usage: $0 start|stop|address" ;;
esac
