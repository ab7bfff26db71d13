#!/usr/bin/env bash
# A release of stock-ledger (`make release VERSION=x.y.z [REGISTRY=host:port] [PLAIN_HTTP=1]`):
#   1. checks that VERSION is the one pyproject.toml declares, that the chart's version and appVersion are the same,
#      and that CHANGELOG.md has a dated section for it (`scripts/release.sh bump x.y.z` sets the three);
#   2. builds the wheel and the sdist (python -m build) into DIST;
#   3. builds the image localhost/stock-ledger:VERSION (scripts/containers.sh image: OCI labels version, revision,
#      source, licenses), and the archive image localhost/stock-ledger:VERSION-archive (the same with pyarrow);
#   4. packages the chart into DIST/stock-ledger-VERSION.tgz; with a registry its image.registry defaults to it, so
#      the published chart runs the image published beside it;
#   5. with REGISTRY: pushes the images to REGISTRY/stock-ledger:VERSION and :VERSION-archive (podman), the chart to
#      oci://REGISTRY/charts (helm). PLAIN_HTTP=1 for an HTTP registry such as scripts/oci-registry.sh's.
# Usage: scripts/release.sh VERSION [--registry HOST[:PORT]] [--plain-http] [--dist DIR]
#        scripts/release.sh bump VERSION      (pyproject.toml, Chart.yaml, and a CHANGELOG.md section dated today)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${STOCK_LEDGER_CACHE:-$HOME/.cache/stock-ledger}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
CHART="$ROOT/helm/stock-ledger"
SEMVER='^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)(-[0-9A-Za-z.-]+)?$'

log() { printf '[release] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

pyproject_version() { sed -n 's/^version = "\(.*\)"$/\1/p' "$ROOT/pyproject.toml" | head -n1; }
chart_field() { sed -n "s/^$1: \"\\{0,1\\}\\([^\"]*\\)\"\\{0,1\\}\$/\\1/p" "$CHART/Chart.yaml" | head -n1; }

helm_binary() {
    if [[ -x "$CACHE/bin/helm" ]]; then
        printf '%s\n' "$CACHE/bin/helm"
    else
        command -v helm || die "helm not found in $CACHE/bin or on PATH: run scripts/tools.sh"
    fi
}

check() {
    local version="$1" problems=()
    [[ "$version" =~ $SEMVER ]] || die "VERSION '$version' is not a semantic version (x.y.z or x.y.z-rc.1)"
    [[ "$(pyproject_version)" == "$version" ]] \
        || problems+=("pyproject.toml declares version $(pyproject_version)")
    [[ "$(chart_field version)" == "$version" ]] \
        || problems+=("helm/stock-ledger/Chart.yaml has version $(chart_field version)")
    [[ "$(chart_field appVersion)" == "$version" ]] \
        || problems+=("helm/stock-ledger/Chart.yaml has appVersion $(chart_field appVersion)")
    grep -Eq "^## \[${version//./\\.}\] - [0-9]{4}-[0-9]{2}-[0-9]{2}$" "$ROOT/CHANGELOG.md" \
        || problems+=("CHANGELOG.md has no section '## [$version] - YYYY-MM-DD'")
    if ((${#problems[@]} > 0)); then
        printf '[release] error: %s\n' "${problems[@]}" >&2
        die "release $version is not in step: run scripts/release.sh bump $version, move the Unreleased entries of CHANGELOG.md under it, commit, and release again"
    fi
}

bump() {
    local version="$1" today
    [[ "$version" =~ $SEMVER ]] || die "'$version' is not a semantic version (x.y.z)"
    today="$(date +%F)"
    sed -i "s/^version = \".*\"$/version = \"$version\"/" "$ROOT/pyproject.toml"
    sed -i "s/^version: .*/version: $version/; s/^appVersion: .*/appVersion: \"$version\"/" "$CHART/Chart.yaml"
    if ! grep -q "^## \[$version\]" "$ROOT/CHANGELOG.md"; then
        sed -i "0,/^## \[Unreleased\]$/s//## [Unreleased]\n\n## [$version] - $today/" "$ROOT/CHANGELOG.md"
    fi
    log "version $version in pyproject.toml and Chart.yaml; CHANGELOG.md has '## [$version] - $today': move the Unreleased entries under it"
}

release() {
    local version="$1" registry="$2" plain_http="$3" dist="$4"
    check "$version"
    local helm
    helm="$(helm_binary)"
    mkdir -p "$dist"
    rm -f "$dist"/stock_ledger-"$version"* "$dist/stock-ledger-$version.tgz"

    log "wheel and sdist into $dist"
    "$PYTHON" -m build --sdist --wheel --outdir "$dist" "$ROOT" >"$dist/build.log" 2>&1 \
        || die "python -m build failed (log: $dist/build.log; make venv installs build)"

    local image="localhost/stock-ledger:$version"
    log "image $image"
    STOCK_LEDGER_IMAGE="$image" bash "$ROOT/scripts/containers.sh" image
    # The archive CronJob's image (the chart's archive.image default: the same repository, tag VERSION-archive).
    log "image $image-archive"
    STOCK_LEDGER_IMAGE="$image" STOCK_LEDGER_ARCHIVE_IMAGE="$image-archive" \
        bash "$ROOT/scripts/containers.sh" archive-image

    log "chart $dist/stock-ledger-$version.tgz"
    local work
    work="$(mktemp -d)"
    # shellcheck disable=SC2064 # expand now: the trap must remove this very directory
    trap "rm -rf '$work'" EXIT
    cp -r "$CHART" "$work/stock-ledger"
    if [[ -n "$registry" ]]; then
        # The published chart's default image is the one published with it: image.registry (the first
        # `  registry:` under `image:` in values.yaml) becomes the registry.
        sed -i "/^image:/,/^[^ #]/ s|^  registry: \"\"|  registry: \"$registry\"|" "$work/stock-ledger/values.yaml"
        grep -q "^  registry: \"$registry\"" "$work/stock-ledger/values.yaml" \
            || die "could not set image.registry in the packaged chart's values.yaml"
    fi
    "$helm" package "$work/stock-ledger" --destination "$dist" >/dev/null

    if [[ -n "$registry" ]]; then
        local tls=() http=()
        if [[ "$plain_http" == 1 ]]; then
            tls=(--tls-verify=false)
            http=(--plain-http)
        fi
        log "pushing $registry/stock-ledger:$version and $registry/stock-ledger:$version-archive"
        podman tag "$image" "$registry/stock-ledger:$version"
        podman push -q "${tls[@]}" --digestfile "$dist/image.digest" "$registry/stock-ledger:$version"
        podman tag "$image-archive" "$registry/stock-ledger:$version-archive"
        podman push -q "${tls[@]}" --digestfile "$dist/image-archive.digest" "$registry/stock-ledger:$version-archive"
        log "pushing the chart to oci://$registry/charts"
        "$helm" push "${http[@]}" "$dist/stock-ledger-$version.tgz" "oci://$registry/charts" >/dev/null
        log "released $version: image $registry/stock-ledger:$version@$(cat "$dist/image.digest"), archive image $registry/stock-ledger:$version-archive@$(cat "$dist/image-archive.digest"), chart oci://$registry/charts/stock-ledger --version $version"
    else
        log "built $version in $dist, $image and $image-archive (no REGISTRY: nothing pushed)"
    fi
    find "$dist" -maxdepth 1 -type f -printf "[release]   %f\n" | sort >&2
}

main() {
    if [[ "${1:-}" == bump ]]; then
        bump "${2:?usage: $0 bump VERSION}"
        return
    fi
    local version="" registry="" plain_http=0 dist="$ROOT/dist"
    while (($#)); do
        case "$1" in
            --registry) registry="${2:?--registry needs HOST[:PORT]}"; shift 2 ;;
            --plain-http) plain_http=1; shift ;;
            --dist) dist="${2:?--dist needs a directory}"; shift 2 ;;
            -*) die "unknown option $1 (usage: $0 VERSION [--registry HOST[:PORT]] [--plain-http] [--dist DIR])" ;;
            *) version="$1"; shift ;;
        esac
    done
    [[ -n "$version" ]] || die "usage: $0 VERSION [--registry HOST[:PORT]] [--plain-http] [--dist DIR] (make release VERSION=x.y.z)"
    release "$version" "$registry" "$plain_http" "$dist"
}

main "$@"
