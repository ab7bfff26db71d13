# Two commands on a fresh machine: `make run` and `make test` (see README.md).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
# The owner role migrates; the worker runs as the least-privileged role. DATABASE_URL, if set, serves both.
OWNER_URL = $(or $(DATABASE_URL),$(shell scripts/postgres.sh url))
WORKER_URL = $(or $(DATABASE_URL),$(shell scripts/postgres.sh worker-url))
PYTEST_ARGS ?=

.PHONY: venv services migrate topic run test lint tools bench

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

migrate: venv services
	DATABASE_URL='$(OWNER_URL)' $(BIN)/stock-ledger migrate

topic: venv services
	$(BIN)/stock-ledger create-topic --partitions 24

run: migrate topic
	@echo "== running the worker (Ctrl-C stops it gracefully)"
	DATABASE_URL='$(WORKER_URL)' $(BIN)/stock-ledger run

tools:
	scripts/tools.sh

lint: venv
	$(BIN)/ruff check src tests scripts
	$(BIN)/mypy

test: venv services tools lint
	@echo "== running the whole test suite against the real broker and database"
	$(PY) -m pytest $(PYTEST_ARGS)

bench: venv services
	$(PY) scripts/bench.py $(BENCH_ARGS)
