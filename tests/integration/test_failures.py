"""Faults the worker cannot fix itself: it retries for a bounded time, then exits non-zero with one clear line."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
import uuid

import pytest
from aiokafka.admin import NewTopic

from tests.support.helpers import Env, Services, WorkerPool, kafka_admin

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
    # One translated line (dberrors): the cause with its SQLSTATE and where to fix it.
    assert "wrong password (SQLSTATE 28P01)" in out
    assert "Check the user and password in DATABASE_URL" in out
    assert "wrong-password" not in out
    assert "Traceback" not in out
    assert elapsed < 20


def _missing_topic() -> str:
    return f"warehouse.movements.missing-{uuid.uuid4().hex[:8]}"


def test_a_missing_topic_is_named_and_the_worker_exits_1_after_the_deadline(workers: WorkerPool) -> None:
    """STOCK_LEDGER_TOPIC names a topic that does not exist, deadline 5 s: one error line of ours names the
    variable, the topic and the bootstrap servers; /readyz says the topic is missing; the worker exits 1 within
    ~15 s, its last word naming the deadline and the topic (it used to run on at 40 s, saying nothing)."""
    missing = _missing_topic()
    w = workers.start(STOCK_LEDGER_TOPIC=missing, STOCK_LEDGER_RETRY_DEADLINE_SECONDS="5")
    started = time.monotonic()
    readyz: tuple[int, str] | None = None
    while w.alive() and time.monotonic() - started < 30:
        with contextlib.suppress(OSError):
            if missing in (answer := w.get("/readyz"))[1]:
                readyz = answer
        time.sleep(0.2)
    code = w.wait(5)
    elapsed = time.monotonic() - started
    out = w.log_text()
    assert code == 1, out[-3000:]
    assert elapsed < 15, f"exited after {elapsed:.0f}s"
    ours = [json.loads(line) for line in out.splitlines() if '"topic.unavailable"' in line]
    assert len(ours) == 1, out[-3000:]
    assert "STOCK_LEDGER_TOPIC" in ours[0]["detail"]
    assert missing in ours[0]["detail"]
    assert ours[0]["bootstrap_servers"] == workers.services.kafka
    assert "find the topic kept failing" in out
    assert "STOCK_LEDGER_RETRY_DEADLINE_SECONDS=5" in out
    assert readyz is not None, "/readyz never named the topic"
    assert readyz[0] == 503
    assert f"topic '{missing}' (STOCK_LEDGER_TOPIC) does not exist" in readyz[1]
    assert "Traceback" not in out


def test_a_missing_topic_with_deadline_0_keeps_the_worker_up_until_it_appears(workers: WorkerPool) -> None:
    """Deadline 0 (never give up, as for other faults): after 10 s the worker still runs, live (/healthz 200) and
    not ready (/readyz 503 naming the topic). Once the topic is created it joins and becomes ready."""
    missing = _missing_topic()
    w = workers.start(STOCK_LEDGER_TOPIC=missing, STOCK_LEDGER_RETRY_DEADLINE_SECONDS="0")
    try:
        time.sleep(10)
        assert w.alive(), w.log_text()[-3000:]
        status, body = w.get("/readyz")
        assert status == 503
        assert f"topic '{missing}' (STOCK_LEDGER_TOPIC) does not exist on {workers.services.kafka}" in body
        assert w.get("/healthz")[0] == 200
        assert w.log_text().count('"topic.unavailable"') == 1

        async def create() -> None:
            async with kafka_admin(workers.services.kafka) as admin:
                await admin.create_topics([NewTopic(missing, 3, 1)])
        asyncio.run(create())
        deadline = time.monotonic() + 60
        while w.get("/readyz")[0] != 200:
            assert time.monotonic() < deadline, w.log_text()[-3000:]
            time.sleep(0.5)
    finally:
        async def delete() -> None:
            async with kafka_admin(workers.services.kafka) as admin:
                await admin.delete_topics([missing])
        with contextlib.suppress(Exception):
            asyncio.run(delete())
