# Two commands on a fresh machine: `make run` and `make test` (see README.md).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
# The owner role migrates; the worker runs as the least-privileged role. DATABASE_URL, if set, serves both.
OWNER_URL = $(or $(DATABASE_URL),$(shell scripts/postgres.sh url))
WORKER_URL = $(or $(DATABASE_URL),$(shell scripts/postgres.sh worker-url))
PYTEST_ARGS ?=

.PHONY: venv services schema-registry migrate topic run verify test lint tools bench release oci-registry

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@echo "== creating $(VENV) and installing stock-ledger with its test tools"
	python3 -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -U pip
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	touch $@

services:
	@echo "== starting local Kafka and PostgreSQL (skipped for those configured by environment)"
	scripts/kafka.sh start
	scripts/postgres.sh start

# Apicurio Registry for the declared formats (docs/formats.md): fetched from Maven Central once, then started.
schema-registry:
	scripts/schema-registry.sh start

migrate: venv services
	DATABASE_URL='$(OWNER_URL)' $(BIN)/stock-ledger migrate

topic: venv services
	$(BIN)/stock-ledger create-topic --partitions 24

run: migrate topic
	@echo "== running the worker (Ctrl-C stops it gracefully)"
	DATABASE_URL='$(WORKER_URL)' $(BIN)/stock-ledger run

# Compares the topic with the ledger (README's walkthrough): VERIFY_ARGS='--expect 50000 --wait 60'.
verify: venv services
	DATABASE_URL='$(OWNER_URL)' $(BIN)/stock-ledger verify $(VERIFY_ARGS)

tools:
	scripts/tools.sh

# ruff (style, and no function-local import), mypy (strict on src/), lint-imports (the layering: pyproject.toml).
lint: venv
	$(BIN)/ruff check src tests scripts docs/bench/warehouse-signals
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache

test: venv services schema-registry tools lint containers
	@echo "== running the whole test suite against the real broker and database"
	$(PY) -m pytest --durations=25 $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-testcontainers

# A release (scripts/release.sh): the wheel and sdist in $(DIST), the image localhost/stock-ledger:$(VERSION), the
# packaged chart; with REGISTRY=host:port both are pushed there (PLAIN_HTTP=1 for an HTTP registry, such as the
# one `make oci-registry` starts on 127.0.0.1:5000). VERSION must be pyproject.toml's, the chart's and CHANGELOG.md's.
DIST ?= dist
release: venv tools
	$(if $(VERSION),,$(error VERSION is required: make release VERSION=x.y.z (scripts/release.sh bump x.y.z sets it)))
	scripts/release.sh $(VERSION) --dist $(DIST) $(if $(REGISTRY),--registry $(REGISTRY)) \
		$(if $(filter 1,$(PLAIN_HTTP)),--plain-http)

# Debian's docker-registry (CNCF distribution) on 127.0.0.1:5000, plain HTTP: a real OCI registry for releases.
oci-registry:
	scripts/oci-registry.sh start

bench: BENCH_ARGS ?= drain
bench: venv services
	$(PY) -m scripts.bench $(BENCH_ARGS)

# --- Containers: the image, its lock, and the tests that run what we ship (scripts/containers.sh) ---
UV_VERSION ?= 0.13.8
LOCK_COMMAND = $(BIN)/uv pip compile pyproject.toml --universal --python-version 3.11 --generate-hashes \
	--quiet --custom-compile-command 'make lock'
TESTCONTAINERS_ENV = env -u KAFKA_BOOTSTRAP_SERVERS -u DATABASE_URL \
	DOCKER_HOST=$$(scripts/containers.sh service socket) TESTCONTAINERS_RYUK_DISABLED=true \
	TESTCONTAINERS_CONNECTION_MODE=docker_host \
	STOCK_LEDGER_KAFKA_IMAGE=localhost/stock-ledger-kafka:4.1.1 \
	STOCK_LEDGER_POSTGRES_IMAGE=localhost/stock-ledger-postgres:15

.PHONY: lock image archive-image containers test-testcontainers

# Regenerates requirements.lock (hash-pinned, what the image installs) from pyproject.toml's dependencies, and
# requirements-archive.lock (the same plus the `archive` extra: the archive image) from the same resolution.
lock: venv
	@test -x $(BIN)/uv || $(BIN)/pip install -q --disable-pip-version-check uv==$(UV_VERSION)
	$(LOCK_COMMAND) -o requirements.lock
	$(LOCK_COMMAND) --extra archive --constraint requirements.lock -o requirements-archive.lock

# localhost/stock-ledger:dev from the Dockerfile with podman (a stand-in base where no registry answers).
image:
	scripts/containers.sh image

# localhost/stock-ledger:dev-archive: the same with the `archive` extra (pyarrow), for the archive CronJob.
archive-image:
	scripts/containers.sh archive-image

# Everything the container tests need: the image, and local Kafka/PostgreSQL images for testcontainers.
containers: image archive-image
	scripts/containers.sh test-images

# The path a laptop with a container engine takes: tests/conftest.py starts Kafka and PostgreSQL through
# testcontainers, here against podman's Docker-compatible API; the core ledger tests run once on them.
test-testcontainers: venv containers
	@echo "== the core ledger tests through testcontainers (podman's Docker API)"
	scripts/containers.sh service start
	$(TESTCONTAINERS_ENV) $(PY) -m pytest tests/integration/test_ledger.py; \
		status=$$?; scripts/containers.sh service stop; scripts/containers.sh cleanup; exit $$status
