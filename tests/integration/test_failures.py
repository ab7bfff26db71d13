"""Faults the worker cannot fix itself: it retries for a bounded time, then exits non-zero with one clear line."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.helpers import Env, Services

pytestmark = [pytest.mark.integration]


def _run(env: dict[str, str], timeout: float = 60) -> tuple[int, str, float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "stock_ledger", "run"], env={"PATH": "", **env},
                          capture_output=True, text=True, timeout=timeout, check=False)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started


def test_an_unreachable_database_is_retried_then_the_worker_exits_1(topic: str, services: Services) -> None:
    """PostgreSQL refuses connections: the worker logs each retry, gives up after
    STOCK_LEDGER_RETRY_DEADLINE_SECONDS and exits 1 (Kubernetes restarts it), without a stack trace."""
    code, out, elapsed = _run({"DATABASE_URL": "postgresql://nobody:secret@127.0.0.1:1/nothing",
                               "KAFKA_BOOTSTRAP_SERVERS": services.kafka, "STOCK_LEDGER_TOPIC": topic,
                               "STOCK_LEDGER_METRICS_PORT": "0", "STOCK_LEDGER_RETRY_DEADLINE_SECONDS": "2"})
    assert code == 1, out
    assert '"startup.retry"' in out
    assert "STOCK_LEDGER_RETRY_DEADLINE_SECONDS" in out
    assert "Traceback" not in out
    assert "secret" not in out, "the password must never be logged"
    assert elapsed < 30


def test_an_unreachable_broker_is_retried_then_the_worker_exits_1(database: Env, topic: str) -> None:
    """No broker at KAFKA_BOOTSTRAP_SERVERS: retried for the deadline, then exit 1 with the reason."""
    code, out, elapsed = _run({"DATABASE_URL": database.worker_url, "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1",
                               "STOCK_LEDGER_TOPIC": topic, "STOCK_LEDGER_METRICS_PORT": "0",
                               "STOCK_LEDGER_RETRY_DEADLINE_SECONDS": "2"})
    assert code == 1, out
    assert "join the Kafka cluster" in out
    assert "Traceback" not in out
    assert elapsed < 30


def test_a_wrong_password_fails_at_once_with_a_clear_message(services: Services, database: Env, topic: str) -> None:
    """Authentication failure is not transient: exit 1 at once, saying so, without the password."""
    url = database.worker_url.replace(":stock_ledger_worker@", ":wrong-password@")
    assert url != database.worker_url
    code, out, elapsed = _run({"DATABASE_URL": url, "KAFKA_BOOTSTRAP_SERVERS": services.kafka,
                               "STOCK_LEDGER_TOPIC": topic, "STOCK_LEDGER_METRICS_PORT": "0"})
    assert code == 1, out
    assert "password authentication failed" in out
    assert "wrong-password" not in out
    assert "Traceback" not in out
    assert elapsed < 20
