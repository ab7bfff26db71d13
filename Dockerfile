# syntax=docker/dockerfile:1.7
# stock-ledger worker image (built with LOCK=requirements-archive.lock: the archive image). Two stages: `build`
# resolves dependencies and builds the wheel into a venv, `runtime` copies only that venv onto a fresh slim base.
# The image runs as a numeric non-root uid and writes nowhere but /tmp (and the archive CronJob's volume), so it
# runs under readOnlyRootFilesystem (the Helm chart mounts an emptyDir there).
# Rules checked by tests/deploy/test_dockerfile.py.

# One pinned patch release for both stages: the venv's interpreter symlinks must resolve to the same Python.
ARG PYTHON_VERSION=3.11.14

FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
WORKDIR /src
# Dependencies layer: it depends on pyproject.toml and the hash-pinned locks alone, so an edit to the source reuses
# it. --require-hashes: every distribution is checked against requirements.lock (`make lock` regenerates it);
# binary wheels only, so nothing is compiled from an unpinned build environment.
# LOCK=requirements-archive.lock builds the archive image (`make archive-image`, tag <version>-archive): the same
# pins plus the `archive` extra (pyarrow, about 170 MiB), which `stock-ledger archive` needs and the worker never
# loads, so the worker's image leaves it out.
ARG LOCK=requirements.lock
COPY pyproject.toml requirements.lock requirements-archive.lock ./
RUN pip install --require-hashes --only-binary=:all: --no-deps -r "$LOCK"
# The wheels' extension modules carry their symbol tables (uvloop's loop: 13.6 MB, 1.6 MB stripped; fastavro and
# asyncpg alike): stripped, the venv is under half its size. binutils stays in this stage (the official slim base
# has none; the stand-in scripts/containers.sh builds has it).
RUN command -v strip >/dev/null \
    || { apt-get update -qq && apt-get install -y -qq --no-install-recommends binutils >/dev/null; } \
    && find /opt/venv -name '*.so' -exec strip --strip-unneeded {} +
# The package itself; .dockerignore narrows the context to what a wheel build needs. The worker needs neither pip
# nor setuptools at run time: they leave the venv once `pip check` has seen the whole dependency set.
COPY . .
RUN pip install --no-deps . && pip check \
    && pip uninstall -q -y pip setuptools

FROM python:${PYTHON_VERSION}-slim-bookworm AS runtime
ARG PYTHON_VERSION
# scripts/containers.sh passes pyproject.toml's version and Source URL and the commit (`make image`, `make release`).
ARG VERSION=0.0.0
ARG REVISION=unknown
ARG SOURCE=""
LABEL org.opencontainers.image.title="stock-ledger" \
      org.opencontainers.image.description="Kafka warehouse.movements to PostgreSQL stock ledger, effectively-once" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="docker.io/library/python:${PYTHON_VERSION}-slim-bookworm"

# Numeric uid/gid so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd; HOME is /tmp because
# that is the only writable path at run time.
RUN groupadd --system --gid 10001 stock-ledger \
    && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home \
        --shell /usr/sbin/nologin stock-ledger

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH \
    STOCK_LEDGER_MIGRATIONS_DIR=/app/migrations

# Everything below stays root-owned: the worker cannot modify its own code or migrations.
COPY --from=build /opt/venv /opt/venv
COPY migrations/ /app/migrations/
# The chaos drill (the chart's opt-in chaos Job, chaos.enabled) runs this script; it needs kubectl too, which this image does
# not carry: build a chaos image FROM this one that adds kubectl (see helm/stock-ledger/values.yaml, chaos.image).
COPY --chmod=0755 scripts/chaos.sh /app/scripts/chaos.sh

WORKDIR /app
USER 10001:10001
EXPOSE 9108
ENTRYPOINT ["stock-ledger"]
CMD ["run"]
