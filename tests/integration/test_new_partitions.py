"""Partitions added to the topic while the workers run (issue 31, item 5): picked up within seconds.

The consumer refreshes the topic's metadata every STOCK_LEDGER_METADATA_MAX_AGE_MS (5 s by default); the group
leader then sees more partitions than it assigned and the group rebalances onto them. With aiokafka's own default
(300000 ms) the new partitions sat unread for about five minutes (issue 31).
"""

from __future__ import annotations

import time

import asyncpg
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import NewPartitions

from stock_ledger.produce import movements
from tests.support.helpers import Env, Services, WorkerPool, assert_exact, eventually, stored_offsets, wait_drained
from tests.support.services import kafka_admin, produce

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

BEFORE, ADDED, PER_NEW_PARTITION = 24, 6, 200
# The brief's bound: metadata age (5 s) + a rebalance + the claim, with room for a loaded machine.
PICKED_UP_WITHIN = 30.0


async def _produce_to(bootstrap: str, topic: str, partitions: range, per_partition: int, seed: int) -> None:
    """`per_partition` movements sent explicitly to each of `partitions` (acks=all, idempotent)."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True, acks="all", linger_ms=5)
    await producer.start()
    try:
        pending = [await producer.send(topic, value=value, key=key, partition=partitions[i % len(partitions)])
                   for i, (key, value) in enumerate(movements(per_partition * len(partitions), seed=seed))]
        await producer.flush()
        for future in pending:
            await future
    finally:
        await producer.stop()


async def test_partitions_added_while_two_workers_run_are_applied_within_seconds(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """Two workers drain 2,000 movements on the 24 partitions. The topic is then grown to 30 partitions (admin
    CreatePartitions) and 200 movements are sent to each new partition. Within 30 s of the send every new
    partition's stored offset reaches its log end (the metadata refresh found them and the group rebalanced onto
    them); the ledger is exact over all 30 partitions and neither worker restarted."""
    await produce(services.kafka, topic, 2_000, seed=31, show_progress=False)
    pool = [workers.start(), workers.start()]
    await wait_drained(services, database, topic, workers.group, 90, workers)

    async with kafka_admin(services.kafka) as admin:
        await admin.create_partitions({topic: NewPartitions(total_count=BEFORE + ADDED)})
    new = range(BEFORE, BEFORE + ADDED)
    await _produce_to(services.kafka, topic, new, PER_NEW_PARTITION, seed=32)
    sent = time.monotonic()

    conn = await asyncpg.connect(database.owner_url)
    try:
        async def new_partitions_applied() -> bool:
            stored = await stored_offsets(conn, workers.group, topic)
            return all((stored.get(p) or 0) == PER_NEW_PARTITION for p in new)

        await eventually(new_partitions_applied, PICKED_UP_WITHIN, "the added partitions to be applied", workers)
    finally:
        await conn.close()
    picked_up = time.monotonic() - sent
    print(f"partitions {BEFORE}-{BEFORE + ADDED - 1} added and fed: applied {picked_up:.1f}s after the send")

    await assert_exact(services, database, topic, workers.group, rows=2_000 + ADDED * PER_NEW_PARTITION,
                       pool=workers)
    assert all(w.alive() for w in pool), workers.logs_tail()
    assert [w.pid for w in workers.started] == [w.pid for w in pool]  # no restart was needed
