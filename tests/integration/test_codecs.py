"""Every compression codec Kafka has, written by the official Java producer (not aiokafka), read by the real
`stock-ledger run` worker, and checked by the independent ledger check.

Java is part of what the project's scripts need (the broker is the official jars), so a machine without it fails
these tests with a message; they never skip.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import asyncpg
import pytest

from tests.conftest import ROOT
from tests.support.helpers import Env, Services, WorkerPool, assert_exact, movement, wait_drained

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]
PRODUCER = ROOT / "tests" / "java" / "Producer.java"
COUNT = 3000


def kafka_libs() -> Path:
    """The Kafka jars scripts/kafka.sh fetched (kafka-clients with snappy-java, lz4-java and zstd-jni)."""
    if shutil.which("java") is None:
        pytest.fail("java is not installed: these tests run the official Kafka Java producer, and the project's "
                    "scripts need Java 17 anyway (apt-get install -y openjdk-17-jre-headless)")
    done = subprocess.run(["bash", str(ROOT / "scripts" / "kafka.sh"), "libs"], capture_output=True, text=True,
                          timeout=900, check=False)
    if done.returncode != 0:
        pytest.fail(f"scripts/kafka.sh libs could not provide the Kafka jars:\n{done.stderr}")
    return Path(done.stdout.strip().splitlines()[-1])


def java_produce(bootstrap: str, topic: str, codec: str, lines: list[tuple[str, str]], tmp: Path) -> float:
    """Send the (key, value) lines with the Java producer; returns its compression-rate-avg."""
    data = tmp / f"records-{codec}.tsv"
    data.write_text("".join(f"{k}\t{v}\n" for k, v in lines), encoding="utf-8")
    done = subprocess.run(
        ["java", "-cp", f"{kafka_libs()}/*", str(PRODUCER), bootstrap, topic, codec, str(data)],
        capture_output=True, text=True, timeout=180, check=False,
    )
    assert done.returncode == 0, f"the Java producer failed ({done.returncode}):\n{done.stderr[-4000:]}"
    found = re.search(r"sent=(\d+) compression-rate-avg=(\S+)", done.stdout)
    assert found, f"unexpected Java producer output: {done.stdout!r}"
    assert int(found[1]) == len(lines)
    return float(found[2])


@pytest.mark.parametrize("codec", ["none", "gzip", "snappy", "lz4", "zstd"])
async def test_records_the_java_producer_compressed_are_applied_exactly_once(
    codec: str, services: Services, database: Env, topic: str, workers: WorkerPool, tmp_path: Path,
) -> None:
    """3,000 movements over 40 SKUs, sent by the Java producer with compression.type=<codec> (batches of up to
    64 KiB, so many records share each compressed batch; the producer's own compression rate shows it really
    compressed). One worker drains the topic: every record is applied exactly once, stock levels equal the
    movements sent, no record is quarantined, and the worker logged no stack trace."""
    rng = random.Random(codec)
    sent: dict[tuple[str, str], int] = {}
    lines = []
    for _ in range(COUNT):
        sku, qty = f"SKU-{rng.randrange(40)}", rng.choice([1, 2, 3, 5, 8])
        lines.append((sku, json.dumps(movement(sku, qty=qty, movement_id=str(uuid.UUID(int=rng.getrandbits(128)))))))
        sent["WH-1", sku] = sent.get(("WH-1", sku), 0) + qty
    rate = java_produce(services.kafka, topic, codec, lines, tmp_path)
    if codec != "none":
        assert rate < 0.9, f"the producer reports compression rate {rate}: {codec} did not compress"
    workers.start()
    await wait_drained(services, database, topic, workers.group, 120, workers)
    await assert_exact(services, database, topic, workers.group, rows=COUNT, pool=workers)
    conn = await asyncpg.connect(database.owner_url)
    try:
        levels = {(r[0], r[1]): r[2] for r in await conn.fetch("SELECT warehouse_id, sku, on_hand FROM stock_levels")}
    finally:
        await conn.close()
    assert levels == sent
    workers.assert_no_tracebacks()
