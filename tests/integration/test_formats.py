"""Declared formats through `stock-ledger run` on the real broker, database and Apicurio Registry (issue 40): topics
written by confluent-kafka's own serializers are applied exactly, through the mapping, with the contract's checks;
a schema the ledger cannot read, bytes that do not decode and an id the registry does not know are quarantined
naming the id; the registry down is not bad input; `rejected replay` decodes again with the current mapping."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import asyncpg
import pytest

from tests.integration.test_poison import on_hand, reasons
from tests.support.helpers import Env, Services, WorkerPool, assert_exact, eventually, movement, wait_drained
from tests.support.registry import (
    AVRO_FLOAT_QTY,
    AVRO_MAPPING,
    AVRO_V1,
    AVRO_V2,
    JSON_SCHEMA_MAPPING,
    PROTOBUF_MAPPING,
    Writer,
    avro_movement,
    framed,
    registry_control,
    registry_url,
    send_with_headers,
)

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]
N = 100  # good records per schema


@pytest.fixture(scope="session")
def registry() -> str:
    return registry_url()


@pytest.fixture
def writer(registry: str, topic: str) -> Iterator[Writer]:
    """confluent-kafka's serializers for the test's topic (its HTTP session closed afterwards)."""
    serializers = Writer(registry, topic)
    yield serializers
    serializers.close()


def mapped(mapping: dict[str, Any], registry: str, **extra: str) -> dict[str, str]:
    return {"STOCK_LEDGER_MAPPING": json.dumps(mapping), "SCHEMA_REGISTRY_URL": registry,
            "STOCK_LEDGER_SCHEMA_UNKNOWN_SECONDS": "3"} | extra


async def reason_of(db: Env, code: str) -> str:
    conn = await asyncpg.connect(db.owner_url)
    try:
        return str(await conn.fetchval("SELECT string_agg(reason, ' | ') FROM rejected_movements "
                                       "WHERE reason_code = $1", code))
    finally:
        await conn.close()


async def test_an_evolving_avro_topic_is_applied_through_the_mapping_and_its_poison_quarantined(
    services: Services, database: Env, topic: str, workers: WorkerPool, registry: str, writer: Writer,
) -> None:
    """An Avro topic as a warehouse team has it: keys registry-framed Avro strings, sku named itemCode, kind an enum
    of upper-case symbols, qty a decimal of scale 0, occurred_at a timestamp-millis, warehouse_id in a header; 100
    records of v1 and 100 of v2 (fields reordered, one added, one dropped), and seven poison records. All 200 are
    applied exactly; each poison record is quarantined with its code and a reason naming the schema id and field;
    the registry is asked once per schema id, never per record; `rejected replay` under a mapping that now knows
    the ADJUSTMENT kind applies that one record, and only it."""
    v1, v2, floating = writer.avro(AVRO_V1), writer.avro(AVRO_V2), writer.avro(AVRO_FLOAT_QTY)
    value, wh = writer.context(), [("warehouse", b"WH-7")]
    records = [(writer.avro_key(f"SKU-{i % 20}"), v1(avro_movement(f"SKU-{i % 20}"), value), wh) for i in range(N)]
    records += [(writer.avro_key(f"SKU-{i % 20}"), v2(avro_movement(f"SKU-{i % 20}", batch_note="b"), value), wh)
                for i in range(N)]
    good = v1(avro_movement("SKU-1"), value)
    key = writer.avro_key("SKU-1")
    poison = [
        (key, floating({"movement_id": "x", "itemCode": "SKU-1", "qty": 1.0, "kind": "RECEIPT",
                        "occurred_at": 0}, value), wh),                               # incompatible_schema
        (key, good[:-9], wh),                                                        # invalid_encoding (truncated)
        (key, json.dumps(movement("SKU-1")).encode(), wh),                          # invalid_encoding (plain JSON)
        (key, v1(avro_movement("SKU-1"), value), []),                               # invalid_field (no header)
        (key, framed(2_000_000_000, good[5:]), wh),                                  # unknown_schema
        (key, v1(avro_movement("SKU-1", kind="PICK"), value), wh),                  # sign_mismatch: a pick of +1
        (key, v1(avro_movement("SKU-1", kind="ADJUSTMENT"), value), wh),            # invalid_field: unmapped kind
    ]
    await send_with_headers(services.kafka, topic, records[:N] + poison + records[N:])
    without_adjustment = AVRO_MAPPING | {"kind": {"RECEIPT": "receipt", "PICK": "pick"}}
    worker = workers.start(**mapped(without_adjustment, registry))
    await wait_drained(services, database, topic, workers.group, 90, workers)
    await assert_exact(services, database, topic, workers.group, rows=2 * N, rejected=len(poison), pool=workers)
    assert await reasons(database, topic) == {"incompatible_schema": 1, "invalid_encoding": 2, "invalid_field": 2,
                                              "unknown_schema": 1, "sign_mismatch": 1}
    incompatible = await reason_of(database, "incompatible_schema")
    assert "field 'qty' for qty is double" in incompatible, incompatible
    assert "2000000000" in await reason_of(database, "unknown_schema")
    assert await on_hand(database) == 2 * N
    # v1, v2, the float schema and the key's "string": four ids, four fetches, for 207 records.
    await eventually(lambda: worker.metric("stock_ledger_schema_registry_requests_total", {"outcome": "fetched"}) == 4,
                     10, "one fetch per schema id", workers)
    workers.assert_no_tracebacks()

    replay = subprocess.run(
        [sys.executable, "-m", "stock_ledger", "rejected", "replay", "--json"], capture_output=True, text=True,
        timeout=120, check=False, env=workers.env(DATABASE_URL=database.owner_url,
                                                  **mapped(AVRO_MAPPING, registry)))
    assert replay.returncode == 0, replay.stderr
    report = json.loads(replay.stdout)
    assert (report["examined"], report["applied"]) == (len(poison), 1), report
    await assert_exact(services, database, topic, workers.group, rows=2 * N + 1, rejected=len(poison) - 1)


@pytest.mark.parametrize("form", ["protobuf", "json_schema"])
async def test_protobuf_and_json_schema_topics_are_applied_exactly(
    form: str, services: Services, database: Env, topic: str, workers: WorkerPool, registry: str, writer: Writer,
) -> None:
    """Protobuf (an enum kind, a google.protobuf.Timestamp, UTF-8 keys) and JSON Schema (JSON-quoted keys, renamed
    fields, epoch milliseconds), each written by confluent-kafka's serializer: every record applied once, with its
    sign and time; a payload that is not a message of its schema is quarantined."""
    records: list[tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]] = []
    serialize = writer.protobuf() if form == "protobuf" else writer.json_schema()
    for i in range(N):
        sku, qty = f"SKU-{i % 10}", (5 if i % 2 == 0 else -2)
        if form == "protobuf":
            message = serialize._msg_class(
                movement_id=str(uuid.uuid4()), warehouse_id="WH-1", sku=sku, qty=qty,
                kind=1 if qty > 0 else 2)
            message.occurred_at.seconds = 1_795_000_000
            records.append((sku.encode(), serialize(message, writer.context()), []))
        else:
            document = {"id": str(uuid.uuid4()), "warehouse_id": "WH-1", "sku": sku, "qty": qty,
                        "kind": "receipt" if qty > 0 else "pick", "ts": 1_795_000_000_123}
            records.append((json.dumps(sku).encode(), serialize(document, writer.context()), []))
    schema_id = int.from_bytes(records[0][1][1:5], "big")  # type: ignore[index]
    records.append((records[0][0], framed(schema_id, b"\x00\xff\xff\xff"), []))  # not a message of it
    await send_with_headers(services.kafka, topic, records)
    mapping = PROTOBUF_MAPPING if form == "protobuf" else JSON_SCHEMA_MAPPING
    worker = workers.start(**mapped(mapping, registry))
    await wait_drained(services, database, topic, workers.group, 90, workers)
    await assert_exact(services, database, topic, workers.group, rows=N, rejected=1, pool=workers)
    assert await on_hand(database) == 5 * (N // 2) - 2 * (N // 2)
    conn = await asyncpg.connect(database.owner_url)
    try:
        times = await conn.fetch("SELECT DISTINCT extract(epoch FROM occurred_at)::numeric AS t FROM stock_movements")
    finally:
        await conn.close()
    assert [float(r["t"]) for r in times] == [1_795_000_000.0 if form == "protobuf" else 1_795_000_000.123]
    assert worker.metric("stock_ledger_schema_registry_requests_total", {"outcome": "fetched"}) == 1
    workers.assert_no_tracebacks()


async def test_the_registry_killed_mid_drain_is_waited_out_and_nothing_is_quarantined(
    services: Services, database: Env, topic: str, workers: WorkerPool, registry: str, writer: Writer,
) -> None:
    """1. 100 Avro records (schema v1) are drained. 2. The registry is SIGKILLed; 100 records of a schema id the
    worker has not fetched yet (v2) arrive. 3. The worker waits: nothing applied, nothing quarantined, /readyz 503
    saying the registry is unavailable, retries counted as schema_registry, the process alive. 4. The registry comes
    back: exact, zero quarantined."""
    v1, v2, value = writer.avro(AVRO_V1), writer.avro(AVRO_V2), writer.context()
    wh = [("warehouse", b"WH-1")]
    first = [(writer.avro_key("SKU-1"), v1(avro_movement("SKU-1"), value), wh) for _ in range(N)]
    second = [(writer.avro_key("SKU-2"), v2(avro_movement("SKU-2"), value), wh) for _ in range(N)]  # registered now
    await send_with_headers(services.kafka, topic, first)
    worker = workers.start(**mapped(AVRO_MAPPING, registry))
    await wait_drained(services, database, topic, workers.group, 90, workers)
    try:
        registry_control("kill")
        await send_with_headers(services.kafka, topic, second)
        await eventually(lambda: "schema registry unavailable" in worker.get("/readyz")[1], 60,
                         "/readyz to say the registry is unavailable", workers)
        assert worker.get("/readyz")[0] == 503
        await eventually(lambda: (worker.metric("stock_ledger_retries_total", {"cause": "schema_registry"}) or 0) >= 2,
                         30, "retries of the registry", workers)
        conn = await asyncpg.connect(database.owner_url)
        try:
            counts = await conn.fetchrow("SELECT (SELECT count(*) FROM stock_movements) AS rows, "
                                         "(SELECT count(*) FROM rejected_movements) AS rejected")
        finally:
            await conn.close()
        assert (counts["rows"], counts["rejected"]) == (N, 0)
        assert worker.alive(), workers.logs_tail()
    finally:
        registry_control("start")
    await wait_drained(services, database, topic, workers.group, 120, workers)
    await assert_exact(services, database, topic, workers.group, rows=2 * N, rejected=0, pool=workers)
    await eventually(lambda: worker.get("/readyz")[0] == 200, 30, "/readyz back to 200", workers)
    workers.assert_no_tracebacks()
