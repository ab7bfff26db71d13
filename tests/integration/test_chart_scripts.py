"""The Python the chart runs in its pods (helm/stock-ledger/files/*.py), run here against the real services
exactly as the pods run it: `python -c "<file>"` with the environment the templates set.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from pathlib import Path

import asyncpg
import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from tests.support.helpers import Services, WorkerPool, end_offsets, eventually, send_raw

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

FILES = Path(__file__).resolve().parents[2] / "helm" / "stock-ledger" / "files"


async def run_file(name: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("STOCK_LEDGER_")} | env
    return await asyncio.to_thread(subprocess.run, [sys.executable, "-c", (FILES / name).read_text()], env=full,
                                   capture_output=True, text=True, timeout=timeout, check=False)


class TestReadinessCheck:
    """helm test's first step: every expected worker must answer /readyz with 200."""

    async def test_passes_once_the_workers_are_ready_and_fails_naming_the_shortfall(
        self, workers: WorkerPool,
    ) -> None:
        worker = workers.start()
        await eventually(lambda: worker.get("/readyz")[0] == 200, 60, "the worker to be ready", workers)
        env = {"WORKERS_HOST": "127.0.0.1", "WORKERS_PORT": str(worker.port), "READY_TIMEOUT_SECONDS": "20"}
        ready = await run_file("readiness-check.py", env | {"WORKERS_EXPECTED": "1"})
        assert ready.returncode == 0, ready.stdout + ready.stderr
        assert "1/1 workers ready" in ready.stdout

        short = await run_file("readiness-check.py", env | {"WORKERS_EXPECTED": "2", "READY_TIMEOUT_SECONDS": "1"})
        assert short.returncode == 1
        assert "only 1 of 2 workers Ready" in short.stderr


class TestChaosPrepare:
    """The drill's step 2: its own database and topic, fresh on every run; never a database not named 'chaos'."""

    async def test_recreates_the_drill_database_and_topic(self, services: Services) -> None:
        """The topic has one name at every render (Argo CD); each run deletes it and creates it empty, so a drill
        never reads the records of the one before. The per-revision topics of older charts are deleted too."""
        run = uuid.uuid4().hex[:8]
        database, topic = f"sl_test_chaos_{run}", f"warehouse.movements.chaos-drill-{run}"
        url = services.url_for(database)
        env = {"DATABASE_URL": url, "KAFKA_BOOTSTRAP_SERVERS": services.kafka, "STOCK_LEDGER_TOPIC": topic,
               "CHAOS_PARTITIONS": "3", "CHAOS_REPLICATION_FACTOR": "1", "STOCK_LEDGER_LOG_FORMAT": "json"}
        admin = AIOKafkaAdminClient(bootstrap_servers=services.kafka)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(f"{topic}-r1", 1, 1)])  # a drill topic of a chart before 0.2.0
            first = await run_file("chaos-prepare.py", env)
            assert first.returncode == 0, first.stdout + first.stderr
            conn = await asyncpg.connect(url)
            try:
                assert await conn.fetchval("SELECT max(version) FROM schema_migrations") >= 6
                await conn.execute("INSERT INTO stock_levels (warehouse_id, sku, on_hand) VALUES ('W', 'S', 1)")
            finally:
                await conn.close()
            topics = set(await admin.list_topics())
            assert topic in topics
            assert f"{topic}-r1" not in topics
            described = await admin.describe_topics([topic])
            assert len(described[0]["partitions"]) == 3
            assert await send_raw(services.kafka, topic, [(b"SKU-1", b"{}")] * 5) == 5  # this drill's records

            again = await run_file("chaos-prepare.py", env)
            assert again.returncode == 0, again.stdout + again.stderr
            conn = await asyncpg.connect(url)
            try:
                assert await conn.fetchval("SELECT count(*) FROM stock_levels") == 0, "the drill must start empty"
            finally:
                await conn.close()
            assert await end_offsets(services.kafka, topic) == dict.fromkeys(range(3), 0), "the topic must start empty"
        finally:
            await admin.delete_topics([t for t in await admin.list_topics() if t.startswith(topic)])
            await admin.close()
            conn = await asyncpg.connect(services.admin_url)
            try:
                await conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
            finally:
                await conn.close()

    async def test_refuses_a_database_that_is_not_the_drills(self, services: Services) -> None:
        """A wrong Secret must not drop the production ledger: the name has to contain 'chaos'."""
        env = {"DATABASE_URL": services.url_for("stock_ledger"), "KAFKA_BOOTSTRAP_SERVERS": services.kafka,
               "STOCK_LEDGER_TOPIC": "x", "CHAOS_PARTITIONS": "1",
               "CHAOS_REPLICATION_FACTOR": "1"}
        refused = await run_file("chaos-prepare.py", env)
        assert refused.returncode == 1
        assert "refusing to drop database 'stock_ledger'" in refused.stderr
