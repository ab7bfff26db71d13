#!/usr/bin/env bash
# Containers on this machine kind, for `make image` and the container tests (tests/containers):
#   install          apt-get install podman, buildah, runc, mmdebstrap, prometheus; point podman at runc + cgroupfs
#   base             the Dockerfile's base image: pulled if a registry answers, else a stand-in from Debian packages
#   image            build localhost/stock-ledger:dev from the Dockerfile (runs install and base first)
#   archive-image    build localhost/stock-ledger:dev-archive: the same with the `archive` extra (pyarrow), for
#                    the chart's archive CronJob (LOCK=requirements-archive.lock)
#   test-images      local Kafka and PostgreSQL 15 images for the testcontainers path of tests/conftest.py
#   service start|stop|socket
#                    podman's Docker-compatible API on a unix socket (testcontainers talks to it)
#   cleanup          remove the containers and pods the tests left behind (label stock-ledger.test)
# Idempotent: a second run finds everything in place (images are kept in podman's store between runs; they are
# rebuilt only when their inputs change) and returns in seconds. Needs root (apt-get, rootful podman).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${STOCK_LEDGER_CACHE:-$HOME/.cache/stock-ledger}"
STATE="${STOCK_LEDGER_STATE:-$HOME/.local/state/stock-ledger}"
IMAGE="${STOCK_LEDGER_IMAGE:-localhost/stock-ledger:dev}"
# The chart's default for archive.image: the app image's repository, its tag with -archive.
ARCHIVE_IMAGE="${STOCK_LEDGER_ARCHIVE_IMAGE:-$IMAGE-archive}"
KAFKA_VERSION="${KAFKA_VERSION:-4.1.1}"
# The names tests/conftest.py asks testcontainers for (overridable there with the same variables).
KAFKA_TEST_IMAGE="${STOCK_LEDGER_KAFKA_IMAGE:-localhost/stock-ledger-kafka:$KAFKA_VERSION}"
POSTGRES_TEST_IMAGE="${STOCK_LEDGER_POSTGRES_IMAGE:-localhost/stock-ledger-postgres:15}"
SOCKET="${STOCK_LEDGER_PODMAN_SOCKET:-$STATE/podman/podman.sock}"
CONTAINERS_CONF=/etc/containers/containers.conf
STANDIN_LABEL=stock-ledger.stand-in

log() { printf '[containers] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

dockerfile_arg() {
    # The default of a global ARG in the Dockerfile, e.g. PYTHON_VERSION.
    sed -n "s/^ARG $1=\\(.*\\)$/\\1/p" "$ROOT/Dockerfile" | head -n1
}

pyproject_value() {
    # A top-level `key = "value"` of pyproject.toml: `version`, or `Source` of [project.urls].
    sed -n "s/^$1 = \"\(.*\)\"\$/\1/p" "$ROOT/pyproject.toml" | head -n1
}

base_image() {
    printf 'docker.io/library/python:%s-slim-bookworm\n' "$(dockerfile_arg PYTHON_VERSION)"
}

install() {
    local missing=()
    local tool
    for tool in podman buildah runc mmdebstrap prometheus promtool iptables curl; do
        command -v "$tool" >/dev/null || missing+=("$tool")
    done
    if ((${#missing[@]} > 0)); then
        [[ "$(id -u)" == 0 ]] || die "installing ${missing[*]} needs root: run this script as root (apt-get)"
        log "apt-get install podman buildah runc mmdebstrap prometheus (missing: ${missing[*]})"
        apt-get -o DPkg::Lock::Timeout=600 update -qq
        # podman's recommends bring catatonit (the --init process) and uidmap; its network stack
        # (containernetworking-plugins) comes through containers-common; iptables is what the bridge's port
        # mapping needs. Only promtool/prometheus are wanted from `prometheus`: not its exporters or web assets.
        DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
            podman buildah runc catatonit uidmap iptables mmdebstrap curl >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
            --no-install-recommends prometheus >/dev/null
    fi
    configure_podman
}

configure_podman() {
    # crun fails here on setrlimit and on the hybrid cgroup layout; runc with cgroupfs works. podman's default
    # ulimits (nofile 1048576, nproc 4194304) exceed this machine's limits and every container would fail with
    # "error setting rlimit": use the hard limits, and for nproc no more than kernel.pid_max (measured here: runc
    # is refused an nproc above pid_max even below the hard limit).
    local nofile nproc pid_max
    nofile="$(ulimit -Hn)"
    nproc="$(ulimit -Hu)"
    pid_max="$(cat /proc/sys/kernel/pid_max)"
    [[ "$nofile" == unlimited ]] && nofile=1048576
    [[ "$nproc" == unlimited || "$nproc" -gt "$pid_max" ]] && nproc="$pid_max"
    local wanted
    wanted="$(cat <<EOF
# Written by stock-ledger scripts/containers.sh: podman on this machine kind (see that script).
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
)"
    if [[ -f "$CONTAINERS_CONF" ]] && [[ "$(cat "$CONTAINERS_CONF")" == "$wanted" ]]; then
        return
    fi
    if [[ -f "$CONTAINERS_CONF" ]] && ! grep -q 'stock-ledger scripts/containers.sh' "$CONTAINERS_CONF"; then
        die "$CONTAINERS_CONF exists and was not written by this script: add runtime=\"runc\", cgroup_manager=\"cgroupfs\" and default_ulimits nofile/nproc <= the hard limits yourself, or move it away"
    fi
    log "writing $CONTAINERS_CONF (runc, cgroupfs, nofile=$nofile, nproc=$nproc)"
    mkdir -p "$(dirname "$CONTAINERS_CONF")"
    printf '%s\n' "$wanted" >"$CONTAINERS_CONF"
}

image_exists() { podman image exists "$1" 2>/dev/null; }

base() {
    local name
    name="$(base_image)"
    if image_exists "$name"; then
        if [[ "$(podman image inspect --format "{{index .Labels \"$STANDIN_LABEL\"}}" "$name")" == true ]]; then
            log "base $name: the stand-in built from Debian packages is in podman's store"
        else
            log "base $name: in podman's store"
        fi
        return
    fi
    log "pulling $name"
    if timeout 60 podman pull -q "$name" >/dev/null 2>&1; then
        return
    fi
    log "no registry answered: building a stand-in for $name from Debian packages (mmdebstrap, a few minutes)"
    standin "$name"
}

standin() {
    # A minimal Debian bookworm with Debian's python3 (3.11.2, not the Dockerfile's pinned patch release) from the
    # machine's own apt sources, laid out like the official image where the Dockerfile relies on it: `python` on
    # PATH, groupadd/useradd (passwd is in minbase), CA certificates for pip; binutils for the build stage's strip.
    local work
    work="$(mktemp -d)"
    # shellcheck disable=SC2064 # expand now: the trap must remove this very directory
    trap "rm -rf '$work'" RETURN
    # Like the official slim image: no documentation, manual pages or translations.
    local sources=()
    [[ -f /etc/apt/sources.list.d/debian.sources ]] && sources=(/etc/apt/sources.list.d/debian.sources)
    mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates,binutils \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        bookworm "$work/rootfs.tar" "${sources[@]}"
    podman import -q \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change "LABEL $STANDIN_LABEL=true" \
        --change 'CMD ["python3"]' \
        "$work/rootfs.tar" "$1" >/dev/null
    log "stand-in $1 imported ($(podman image inspect --format '{{.Size}}' "$1" | numfmt --to=iec) )"
}

image() {
    # image [TAG [LOCK]]: the worker's image by default; archive-image passes its tag and lock.
    local tag="${1:-$IMAGE}" lock="${2:-requirements.lock}"
    install
    base
    local name revision
    name="$(base_image)"
    # The commit the image is built from; "-dirty" when tracked files differ from it.
    revision="$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)"
    if [[ "$revision" != unknown ]] && ! git -C "$ROOT" diff --quiet HEAD 2>/dev/null; then
        revision+="-dirty"
    fi
    log "building $tag from $ROOT/Dockerfile (base $name, $lock)"
    # pip reaches the package index only with the host's CA bundle (TLS-intercepting proxies do this too): it is
    # mounted for the build's RUN steps only, so nothing of it ends up in a layer. --pull=never: the base is
    # local (pulled or stand-in) by now.
    local started=$SECONDS
    podman build --pull=never --layers -q \
        -v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro \
        --build-arg "REVISION=$revision" \
        --build-arg "VERSION=$(pyproject_value version)" \
        --build-arg "SOURCE=$(pyproject_value Source)" \
        --build-arg "LOCK=$lock" \
        -t "$tag" "$ROOT" >/dev/null
    log "built $tag in $((SECONDS - started)) s: image $(image_size "$tag"), venv $(venv_size "$tag")"
}

image_size() { podman image inspect --format '{{.Size}}' "$1" | numfmt --to=iec --suffix=B; }

venv_size() {
    podman run --rm --network=none --entrypoint du "$1" -s -B1 /opt/venv | cut -f1 | numfmt --to=iec --suffix=B
}

test_images() {
    install
    base
    local libs="$CACHE/kafka-$KAFKA_VERSION/libs"
    if [[ ! -d "$libs" ]] || ! compgen -G "$libs/kafka_2.13-*.jar" >/dev/null; then
        log "fetching the Kafka $KAFKA_VERSION jars (scripts/kafka.sh)"
        bash "$ROOT/scripts/kafka.sh" jars
    fi
    build_context_image "$KAFKA_TEST_IMAGE" "$ROOT/scripts/images/kafka" "$libs"
    build_context_image "$POSTGRES_TEST_IMAGE" "$ROOT/scripts/images/postgres" ""
}

build_context_image() {
    # Rebuilt only when the Containerfile or the extra context (the jars) changed: the digest of both is a label.
    local tag="$1" dir="$2" extra="$3"
    local digest
    digest="$( { cat "$dir"/*; [[ -z "$extra" ]] || ls -l "$extra"; } | sha256sum | cut -c1-16)"
    if image_exists "$tag" \
        && [[ "$(podman image inspect --format '{{index .Labels "stock-ledger.inputs"}}' "$tag")" == "$digest" ]]; then
        log "$tag: up to date in podman's store"
        return
    fi
    local context
    context="$(mktemp -d)"
    cp "$dir"/* "$context/"
    [[ -z "$extra" ]] || cp -r "$extra" "$context/libs"
    log "building $tag"
    podman build --pull=never -q \
        -v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro \
        -v /etc/apt/sources.list.d:/etc/apt/sources.list.d:ro \
        --build-arg "BASE=$(base_image)" --label "stock-ledger.inputs=$digest" \
        -t "$tag" "$context" >/dev/null
    rm -rf "$context"
}

service() {
    case "${1:-}" in
        start)
            install
            if curl -sf --unix-socket "$SOCKET" http://d/_ping >/dev/null 2>&1; then
                log "podman API already serving unix://$SOCKET"
                return
            fi
            mkdir -p "$(dirname "$SOCKET")"
            rm -f "$SOCKET"
            # --time=0: no idle exit; `service stop` ends it by its pid file.
            podman system service --time=0 "unix://$SOCKET" >"$(dirname "$SOCKET")/service.log" 2>&1 &
            echo $! >"$(dirname "$SOCKET")/service.pid"
            local _
            for _ in $(seq 100); do
                curl -sf --unix-socket "$SOCKET" http://d/_ping >/dev/null 2>&1 && break
                sleep 0.1
            done
            curl -sf --unix-socket "$SOCKET" http://d/_ping >/dev/null \
                || die "podman system service did not answer on $SOCKET (log: $(dirname "$SOCKET")/service.log)"
            log "podman API serving unix://$SOCKET (pid $(cat "$(dirname "$SOCKET")/service.pid"))"
            ;;
        stop)
            local pidfile
            pidfile="$(dirname "$SOCKET")/service.pid"
            if [[ -f "$pidfile" ]] && kill "$(cat "$pidfile")" 2>/dev/null; then
                log "podman API stopped"
            fi
            rm -f "$pidfile" "$SOCKET"
            ;;
        socket) printf 'unix://%s\n' "$SOCKET" ;;
        *) die "usage: $0 service start|stop|socket" ;;
    esac
}

cleanup() {
    # What an interrupted test run can leave: containers of tests/containers (label stock-ledger.test) and of
    # testcontainers, whose reaper (Ryuk) cannot run here.
    command -v podman >/dev/null || return 0
    local label
    for label in stock-ledger.test=true org.testcontainers=true; do
        podman ps -aq --filter "label=$label" | xargs -r podman rm -f -t 0 >/dev/null 2>&1 || true
    done
}

main() {
    case "${1:-}" in
        install) install ;;
        base) install; base ;;
        image) image ;;
        archive-image) image "$ARCHIVE_IMAGE" requirements-archive.lock ;;
        test-images) test_images ;;
        service) shift; service "$@" ;;
        cleanup) cleanup ;;
        base-name) base_image ;;
        *) die "usage: $0 install|base|image|archive-image|test-images|service start|stop|socket|cleanup|base-name" ;;
    esac
}

main "$@"
