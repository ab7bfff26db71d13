#!/usr/bin/env bash
# Installs the offline deploy-validation tooling used by tests/deploy:
#   helm                 built from source through the Go module proxy into $STOCK_LEDGER_CACHE/bin
#   toxiproxy-server     Shopify's TCP fault proxy (tests/chaos/test_network_faults.py), built the same way
#   promtool, shellcheck Debian packages `prometheus` and `shellcheck` (needs root)
#   zsh                  Debian package `zsh`: tests/unit/test_completion.py runs the completion script in it
#   kubernetes-validate  PyPI package, into the project venv (bundles the Kubernetes JSON schemas)
# Idempotent: a second run finds everything in place and returns in about a second.
# No prebuilt binaries are downloaded: only package registries reach this machine and CI (so hadolint and the
# helm release tarballs are out of reach).
set -euo pipefail

# v3.22.0 is the newest Helm 3 release the Go module proxy serves (checked with `go list -m -versions`).
HELM_VERSION="${HELM_VERSION:-v3.22.0}"
# Helm's release Makefile stamps the Kubernetes version of its client-go (v0.37.0 in v3.22.0) as the default for
# Capabilities and lint deprecation checks; a plain `go install` would leave them at 1.20.
HELM_KUBE_MINOR="${HELM_KUBE_MINOR:-37}"
# The newest toxiproxy the Go module proxy serves (`go list -m -versions github.com/Shopify/toxiproxy/v2`).
TOXIPROXY_VERSION="${TOXIPROXY_VERSION:-v2.12.0}"
KUBERNETES_VALIDATE_VERSION="${KUBERNETES_VALIDATE_VERSION:-1.37.0}"
PYYAML_VERSION="${PYYAML_VERSION:-6.0.3}"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${STOCK_LEDGER_CACHE:-$HOME/.cache/stock-ledger}"
BIN="$CACHE/bin"
VENV="${STOCK_LEDGER_VENV:-$ROOT/.venv}"

log() { printf '[tools] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

helm_installed_version() {
    # The build below stamps the release into `helm version` (a plain `go install` would report only "v3.22").
    [[ -x "$BIN/helm" ]] || return 0
    "$BIN/helm" version --template '{{.Version}}' 2>/dev/null || true
}

install_helm() {
    if [[ "$(helm_installed_version)" == "$HELM_VERSION" ]]; then
        log "helm $HELM_VERSION already in $BIN"
        return
    fi
    command -v go >/dev/null || die "go is required to build helm (install a Go toolchain first)"
    mkdir -p "$BIN"
    log "building helm $HELM_VERSION with go install (takes a few minutes on a cold Go cache)"
    # Same -X stamps as Helm's own Makefile; build outside any module so the repo cannot influence resolution.
    local ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
    local pkg
    for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
        ldflags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$HELM_KUBE_MINOR"
    done
    (cd "$CACHE" && GOBIN="$BIN" GOFLAGS=-buildvcs=false CGO_ENABLED=0 \
        go install -ldflags "$ldflags" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION")
    [[ "$(helm_installed_version)" == "$HELM_VERSION" ]] || die "helm build did not produce $BIN/helm $HELM_VERSION"
    log "helm $HELM_VERSION installed"
}

toxiproxy_installed_version() {
    # The build below stamps the release (a plain `go install` reports "git"); prints e.g. "v2.12.0".
    [[ -x "$BIN/toxiproxy-server" ]] || return 0
    "$BIN/toxiproxy-server" -version 2>/dev/null | awk '{print $NF}' || true
}

install_toxiproxy() {
    if [[ "$(toxiproxy_installed_version)" == "$TOXIPROXY_VERSION" ]]; then
        log "toxiproxy-server $TOXIPROXY_VERSION already in $BIN"
        return
    fi
    command -v go >/dev/null || die "go is required to build toxiproxy (install a Go toolchain first)"
    mkdir -p "$BIN" "$CACHE"
    log "building toxiproxy-server $TOXIPROXY_VERSION with go install (about 20 s on a warm Go cache)"
    # `go install` names the binary after its package directory (cmd/server): build into a scratch GOBIN, then
    # give it its own name. The -X stamp is the one toxiproxy's release build (goreleaser) sets.
    local scratch
    scratch="$(mktemp -d)"
    (cd "$CACHE" && GOBIN="$scratch" GOFLAGS=-buildvcs=false CGO_ENABLED=0 \
        go install -ldflags "-s -w -X github.com/Shopify/toxiproxy/v2.Version=$TOXIPROXY_VERSION" \
        "github.com/Shopify/toxiproxy/v2/cmd/server@$TOXIPROXY_VERSION")
    mv "$scratch/server" "$BIN/toxiproxy-server"
    rmdir "$scratch"
    [[ "$(toxiproxy_installed_version)" == "$TOXIPROXY_VERSION" ]] ||
        die "toxiproxy build did not produce $BIN/toxiproxy-server $TOXIPROXY_VERSION"
    log "toxiproxy-server $TOXIPROXY_VERSION installed"
}

install_debian_packages() {
    local missing=()
    command -v promtool >/dev/null || missing+=(prometheus)
    command -v shellcheck >/dev/null || missing+=(shellcheck)
    command -v zsh >/dev/null || missing+=(zsh)
    if ((${#missing[@]} == 0)); then
        log "promtool, shellcheck and zsh already installed"
        return
    fi
    [[ "$(id -u)" == 0 ]] || die "installing ${missing[*]} needs root: run this script as root (apt-get)"
    log "apt-get update"
    # The lock timeout lets this run queue behind another apt-get instead of failing at once.
    apt-get -o DPkg::Lock::Timeout=600 update -qq
    log "apt-get install ${missing[*]}"
    # `prometheus` is only wanted for promtool; its recommends (node exporter, web assets) are not.
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
        --no-install-recommends "${missing[@]}" >/dev/null
    command -v promtool >/dev/null || die "promtool missing after installing prometheus"
    command -v shellcheck >/dev/null || die "shellcheck missing after installing shellcheck"
    command -v zsh >/dev/null || die "zsh missing after installing zsh"
}

install_python_packages() {
    if [[ ! -x "$VENV/bin/python" ]]; then
        log "creating venv $VENV"
        python3 -m venv "$VENV"
    fi
    # Any installed version will do (pyproject's test extras may have brought a newer one); pin only new installs.
    if "$VENV/bin/python" -c 'import kubernetes_validate, yaml' 2>/dev/null; then
        log "kubernetes-validate and pyyaml already in $VENV"
        return
    fi
    log "pip install kubernetes-validate==$KUBERNETES_VALIDATE_VERSION pyyaml==$PYYAML_VERSION into $VENV"
    "$VENV/bin/pip" install -q --disable-pip-version-check \
        "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" "pyyaml==$PYYAML_VERSION"
}

main() {
    install_helm
    install_toxiproxy
    install_debian_packages
    install_python_packages
    log "tools ready:"
    log "  helm                $BIN/helm ($("$BIN/helm" version --short))"
    log "  promtool            $(command -v promtool)"
    log "  toxiproxy-server    $BIN/toxiproxy-server ($(toxiproxy_installed_version))"
    log "  shellcheck          $(command -v shellcheck)"
    log "  zsh                 $(command -v zsh)"
    log "  kubernetes-validate $VENV/bin/kubernetes-validate"
    log "tests/deploy find helm, tests/chaos find toxiproxy-server, through PATH or $BIN"
}

main "$@"
