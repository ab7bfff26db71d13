"""Named regressions of issue 9 on the real broker and database, through `stock-ledger run`: each poison record
that used to stop every partition (crash loop) is quarantined with its reason code, and the good movements
around it are all applied, exactly once."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import asyncpg
import pytest
import pytest_asyncio
from aiokafka import AIOKafkaProducer

from tests.support.helpers import (
    Env,
    Services,
    WorkerPool,
    assert_exact,
    eventually,
    movement,
    scratch_topic,
    send_raw,
    wait_drained,
)

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]
GOOD = 150  # good movements before and after the poison, each


def good(n: int, tag: str) -> list[tuple[bytes, bytes]]:
    """n good receipts (qty 1) spread over 30 SKUs, so over many partitions."""
    out = []
    for i in range(n):
        sku = f"SKU-{i % 30}"
        out.append((sku.encode(), json.dumps(movement(sku, qty=1, note=f"{tag}-{i}")).encode()))
    return out


async def reasons(db: Env, topic: str) -> dict[str, int]:
    conn = await asyncpg.connect(db.owner_url)
    try:
        rows = await conn.fetch(
            "SELECT reason_code, count(*) FROM rejected_movements WHERE kafka_topic = $1 GROUP BY 1", topic)
    finally:
        await conn.close()
    return {r[0]: r[1] for r in rows}


async def on_hand(db: Env) -> int:
    conn = await asyncpg.connect(db.owner_url)
    try:
        return int(await conn.fetchval("SELECT coalesce(sum(on_hand), 0) FROM stock_levels"))
    finally:
        await conn.close()


async def drain_around(services: Services, database: Env, topic: str, workers: WorkerPool,
                       poison: list[tuple[bytes, bytes]], codes: dict[str, int]) -> None:
    """Good movements, the poison, good movements again; one worker drains it all without restarting."""
    await send_raw(services.kafka, topic, [*good(GOOD, "before"), *poison, *good(GOOD, "after")])
    worker = workers.start()
    await wait_drained(services, database, topic, workers.group, 90, workers)
    await assert_exact(services, database, topic, workers.group, rows=2 * GOOD, rejected=len(poison), pool=workers)
    assert await reasons(database, topic) == codes
    assert await on_hand(database) == 2 * GOOD
    assert worker.alive(), workers.logs_tail()
    for code, n in codes.items():
        await eventually(lambda c=code, n=n: worker.metric("stock_ledger_movements_rejected_total", {"reason": c}) == n,
                         10, f"the {code} counter at {n}", workers)
    workers.assert_no_tracebacks()


async def test_json_nested_thousands_of_levels_deep_is_quarantined_and_stops_nothing(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """Three movements nesting 5,000 levels deep (in an ignored field, in the sku, and as 3,000 nested objects),
    which made build_batch raise RecursionError and crash-loop every worker: each is too_deep, and all 300 good
    movements around them are applied."""
    base = movement("SKU-1", qty=1)
    fields = b",".join(json.dumps(k).encode() + b":" + json.dumps(v).encode() for k, v in base.items())
    poison = [
        (b"SKU-1", b"{" + fields + b',"extra":' + b"[" * 5000 + b"]" * 5000 + b"}"),
        (b"SKU-1", b"{" + fields.replace(b'"sku":"SKU-1"', b'"sku":' + b"[" * 5000 + b"]" * 5000) + b"}"),
        (b"SKU-2", b'{"extra":' + b'{"a":' * 3000 + b"1" + b"}" * 3000 + b"," + fields + b"}"),
    ]
    await drain_around(services, database, topic, workers, poison, {"too_deep": 3})


async def test_occurred_at_at_either_end_of_the_datetime_range_is_quarantined_and_stops_nothing(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """0001-01-01T00:30:00+01:00 and 9999-12-31T23:30:00-01:00, valid RFC 3339 whose UTC value leaves Python's
    datetime (OverflowError inside COPY, the whole group stopped): both out_of_range; the rest is applied."""
    poison = [
        (b"SKU-3", json.dumps(movement("SKU-3", qty=1) | {"occurred_at": "0001-01-01T00:30:00+01:00"}).encode()),
        (b"SKU-4", json.dumps(movement("SKU-4", qty=1) | {"occurred_at": "9999-12-31T23:30:00-01:00"}).encode()),
    ]
    await drain_around(services, database, topic, workers, poison, {"out_of_range": 2})


async def test_values_postgresql_text_cannot_hold_are_quarantined_and_stop_nothing(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """A lone surrogate escape in the sku and in an ignored field, and a NUL in the warehouse_id: JSON that
    decodes but that PostgreSQL text cannot store. Each is quarantined; the rest is applied."""
    base = json.dumps(movement("SKU-5", qty=1)).encode()
    poison = [
        (b"SKU-5", base.replace(b'"sku": "SKU-5"', b'"sku": "SKU-5\\ud800"')),
        (b"SKU-5", base[:-1] + b', "extra": "\\udc00"}'),
        (b"SKU-5", json.dumps(movement("SKU-5", qty=1, warehouse="WH\x00")).encode()),
    ]
    await drain_around(services, database, topic, workers, poison, {"invalid_json": 2, "invalid_field": 1})


@pytest_asyncio.fixture
async def far_future_topic(services: Services) -> AsyncIterator[str]:
    """A topic that accepts record timestamps any distance in the future (Kafka 4 refuses those more than
    `message.timestamp.after.max.ms`, default 1 h, ahead; older clusters and raised topics accept them)."""
    async with scratch_topic(services, 6, {"message.timestamp.after.max.ms": str(2**63 - 1)},
                             prefix="warehouse.movements.test-ts-") as name:
        yield name


async def test_a_record_timestamp_past_year_9999_is_stored_as_null_and_counted(
    services: Services, database: Env, far_future_topic: str, workers: WorkerPool,
) -> None:
    """A producer that sends microseconds as the record timestamp (year 57868: `ValueError: year 57868 is out of
    range` used to stop the group). 20 such movements among 300 normal ones: all 320 are applied, the 20 with a
    NULL kafka_timestamp, the others with theirs, and stock_ledger_kafka_timestamps_out_of_range_total says 20."""
    topic = far_future_topic
    now_ms = int(time.time() * 1000)
    producer = AIOKafkaProducer(bootstrap_servers=services.kafka, enable_idempotence=True, acks="all")
    await producer.start()
    try:
        futures = [await producer.send(topic, key=k, value=v, timestamp_ms=now_ms) for k, v in good(GOOD, "before")]
        futures += [await producer.send(topic, key=k, value=v, timestamp_ms=now_ms * 1000)
                    for k, v in good(20, "micros")]
        futures += [await producer.send(topic, key=k, value=v, timestamp_ms=now_ms) for k, v in good(GOOD, "after")]
        await producer.flush()
        for f in futures:
            await f
    finally:
        await producer.stop()
    worker = workers.start(STOCK_LEDGER_TOPIC=topic)
    await wait_drained(services, database, topic, workers.group, 90, workers)
    await assert_exact(services, database, topic, workers.group, rows=2 * GOOD + 20, pool=workers)
    conn = await asyncpg.connect(database.owner_url)
    try:
        nulls = await conn.fetchval("SELECT count(*) FROM stock_movements WHERE kafka_timestamp IS NULL")
        stamped = await conn.fetchval(
            "SELECT count(*) FROM stock_movements WHERE kafka_timestamp = to_timestamp($1::float8 / 1000)", now_ms)
    finally:
        await conn.close()
    assert (nulls, stamped) == (20, 2 * GOOD)
    assert await on_hand(database) == 2 * GOOD + 20
    await eventually(lambda: worker.metric("stock_ledger_kafka_timestamps_out_of_range_total") == 20, 10,
                     "the out-of-range timestamp counter at 20", workers)
    assert worker.alive(), workers.logs_tail()
    workers.assert_no_tracebacks()


async def test_a_record_the_database_refuses_is_quarantined_by_the_worker_and_stops_nothing(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """A record the parser accepts but PostgreSQL refuses (here: a CHECK constraint someone added by hand, refusing
    sku 'SKU-REFUSED'), among 300 good movements: the worker isolates it by bisection inside the batch
    transaction, quarantines it as database_rejected with the server's message, applies all the rest, keeps
    running, and stock_ledger_batch_bisections_total shows the splits."""
    owner = await asyncpg.connect(database.owner_url)
    try:
        await owner.execute("ALTER TABLE stock_movements ADD CONSTRAINT no_refused_sku CHECK (sku <> 'SKU-REFUSED')")
    finally:
        await owner.close()
    poison = [(b"SKU-REFUSED", json.dumps(movement("SKU-REFUSED", qty=1)).encode())]
    await drain_around(services, database, topic, workers, poison, {"database_rejected": 1})
    conn = await asyncpg.connect(database.owner_url)
    try:
        reason = await conn.fetchval("SELECT reason FROM rejected_movements WHERE reason_code = 'database_rejected'")
    finally:
        await conn.close()
    assert "no_refused_sku" in reason
    assert "23514" in reason
    (worker,) = workers.started
    assert (worker.metric("stock_ledger_batch_bisections_total") or 0) >= 1
