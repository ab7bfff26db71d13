"""The last line of defence, on a real PostgreSQL: rows the database (or its driver) refuses are isolated by
bisection and quarantined as `database_rejected`, and the rest of the batch commits in the one transaction.

The rows are put into a built batch by hand, bypassing the parser (which would have rejected them), to stand for
whatever the parser may miss: a database with another encoding, a constraint someone added, a bug of ours.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from typing import Any

import asyncpg
import pytest
import pytest_asyncio

from stock_ledger.domain import RejectCode
from stock_ledger.faults import Faults
from stock_ledger.ledger.batch import MOVEMENT_COLUMNS, Batch, Record, build_batch
from stock_ledger.ledger.transaction import Ledger
from tests.support.helpers import FROM_ZERO, Env, claims_of, insert_foreign_row, make_segments, movement

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]
TOPIC = "warehouse.movements"
SKU = MOVEMENT_COLUMNS.index("sku")
WAREHOUSE = MOVEMENT_COLUMNS.index("warehouse_id")
QTY = MOVEMENT_COLUMNS.index("qty")
OCCURRED = MOVEMENT_COLUMNS.index("occurred_at")
KAFKA_TS = MOVEMENT_COLUMNS.index("kafka_timestamp")


def records(partition: int, count: int, qty: int = 2) -> list[Record]:
    def value(offset: int) -> bytes:
        movement_id = str(uuid.uuid5(uuid.NAMESPACE_OID, f"refusals/{partition}/{offset}"))
        return json.dumps(movement("SKU-1", qty=qty, movement_id=movement_id)).encode()

    return [Record(partition, o, 1_700_000_000_000, b"SKU-1", value(o)) for o in range(count)]


def corrupt(batch: Batch, index: int, column: int, bad: object) -> tuple[int, int]:
    """Replace one column of one movement row in place; returns its (partition, offset)."""
    row: list[Any] = list(batch.movements[index])
    row[column] = bad
    batch.movements[index] = tuple(row)
    return row[7], row[8]


@pytest_asyncio.fixture
async def conn(database: Env) -> AsyncIterator[asyncpg.Connection]:
    c = await asyncpg.connect(database.worker_url)
    yield c
    await c.close()


async def ledger_of(database: Env) -> dict[str, Any]:
    c = await asyncpg.connect(database.owner_url)
    try:
        return {
            "applied": {(r[0], r[1]) for r in await c.fetch(
                "SELECT kafka_partition, kafka_offset FROM stock_movements")},
            "rejected": {(r[0], r[1]): (r[2], r[3], r[4], r[5]) for r in await c.fetch(
                "SELECT kafka_partition, kafka_offset, reason_code, reason, value, kafka_timestamp "
                "FROM rejected_movements")},
            "levels": {(r[0], r[1]): r[2] for r in await c.fetch(
                "SELECT warehouse_id, sku, on_hand FROM stock_levels")},
            "offsets": {r[0]: r[1] for r in await c.fetch("SELECT partition, next_offset FROM consumer_offsets")},
        }
    finally:
        await c.close()


async def test_refused_rows_are_isolated_and_quarantined_and_the_rest_commits(
    conn: asyncpg.Connection, database: Env,
) -> None:
    """A batch of 2 x 100 movements (qty 2 each) in which four rows are refused, two by PostgreSQL (a NUL in sku:
    22021; qty 0: the CHECK, 23514) and two by the driver inside COPY (a lone surrogate: UnicodeEncodeError; an
    occurred_at that overflows once converted to UTC: OverflowError). The batch commits once: the other 196 are
    applied, the four are in rejected_movements as database_rejected with the refusal and their raw bytes, both
    offsets advance, stock_levels hold exactly the applied sum, and the bisection stayed within 4 x log2(200)."""
    ledger = Ledger("g", Faults(None))
    claimed = await claims_of(ledger).claim(conn, TOPIC, [0, 1], None, None, reset=FROM_ZERO)
    claims = {c.partition: c.epoch for c in claimed}
    batch = build_batch(TOPIC, {0: records(0, 100), 1: records(1, 100)}, claims)
    bad = {
        corrupt(batch, 3, SKU, "SKU\x00X"): "22021",
        corrupt(batch, 77, QTY, 0): "23514",
        corrupt(batch, 120, WAREHOUSE, "WH-\ud800"): "UnicodeEncodeError",
        corrupt(batch, 199, OCCURRED, datetime(1, 1, 1, 0, 30, tzinfo=timezone(timedelta(hours=1)))): "Overflow",
    }
    outcome = await ledger.apply(conn, batch)
    assert outcome.applied == 196
    assert outcome.rejected == {RejectCode.DATABASE_REJECTED.value: 4}
    assert 4 <= outcome.bisections <= 4 * math.ceil(math.log2(200))
    state = await ledger_of(database)
    assert set(state["rejected"]) == set(bad)
    for coordinates, refusal in bad.items():
        code, reason, value, _ = state["rejected"][coordinates]
        assert code == "database_rejected"
        assert refusal in reason, reason
        assert value == batch.raw[[m[7:9] for m in batch.movements].index(coordinates)][1]
    assert len(state["applied"]) == 196
    assert not state["applied"] & set(bad)
    assert state["levels"] == {("WH-1", "SKU-1"): 196 * 2}
    assert state["offsets"] == {0: 100, 1: 100}


async def test_a_quarantine_row_the_database_refuses_is_stored_bare(conn: asyncpg.Connection, database: Env) -> None:
    """A refused movement whose Kafka timestamp is what the driver cannot encode: its quarantine row would be
    refused too, so it is stored bare (coordinates, raw bytes, NULL timestamp) with both reasons; nothing is lost."""
    ledger = Ledger("g", Faults(None))
    (claim,) = await claims_of(ledger).claim(conn, TOPIC, [0], None, None, reset=FROM_ZERO)
    batch = build_batch(TOPIC, {0: records(0, 10)}, {0: claim.epoch})
    bad = corrupt(batch, 4, KAFKA_TS, datetime(9999, 12, 31, 23, 30, tzinfo=timezone(timedelta(hours=-1))))
    outcome = await ledger.apply(conn, batch)
    assert (outcome.applied, outcome.rejected) == (9, {"database_rejected": 1})
    state = await ledger_of(database)
    code, reason, value, kafka_ts = state["rejected"][bad]
    assert (code, kafka_ts) == ("database_rejected", None)
    assert "OverflowError" in reason
    assert value == batch.raw[4][1]
    assert state["offsets"] == {0: 10}
    assert state["levels"] == {("WH-1", "SKU-1"): 18}


async def test_a_clean_batch_takes_no_savepoint_and_no_bisection(conn: asyncpg.Connection, database: Env) -> None:
    """The common path is unchanged: a batch PostgreSQL accepts is applied with zero bisections."""
    ledger = Ledger("g", Faults(None))
    (claim,) = await claims_of(ledger).claim(conn, TOPIC, [0], None, None, reset=FROM_ZERO)
    outcome = await ledger.apply(conn, build_batch(TOPIC, {0: records(0, 50)}, {0: claim.epoch}))
    assert (outcome.applied, outcome.bisections) == (50, 0)
    assert (await ledger_of(database))["offsets"] == {0: 50}


async def test_a_refusal_and_an_upstream_resend_in_one_batch_are_both_handled(
    conn: asyncpg.Connection, database: Env,
) -> None:
    """Offsets 0-9 applied; the next batch carries a resend of offset 0's movement_id (quarantined as
    duplicate_movement_id by the unique backstop's redo) and a row PostgreSQL refuses (database_rejected)."""
    ledger = Ledger("g", Faults(None))
    (claim,) = await claims_of(ledger).claim(conn, TOPIC, [0], None, None, reset=FROM_ZERO)
    first = records(0, 10)
    await ledger.apply(conn, build_batch(TOPIC, {0: first}, {0: claim.epoch}))
    later = [Record(0, 10 + i, 1_700_000_000_000, b"SKU-1", json.dumps(movement("SKU-1")).encode())
             for i in range(10)]
    later[5] = Record(0, 15, 1_700_000_000_000, b"SKU-1", first[0].value)
    batch = build_batch(TOPIC, {0: later}, {0: claim.epoch})
    corrupt(batch, 8, SKU, "SKU\x00")
    outcome = await ledger.apply(conn, batch)
    assert outcome.rejected == {"duplicate_movement_id": 1, "database_rejected": 1}
    assert outcome.applied == 8
    state = await ledger_of(database)
    assert len(state["applied"]) == 18
    assert state["levels"] == {("WH-1", "SKU-1"): 10 * 2 + 8 * 5}


async def test_our_own_uniqueness_backstops_are_not_refusals(conn: asyncpg.Connection, database: Env) -> None:
    """A coordinate already in the ledger together with a refused row: the refused row is quarantined as
    database_rejected, the coordinate is left as found (named in Outcome.present), never quarantined as a refusal."""
    ledger = Ledger("g", Faults(None))
    (claim,) = await claims_of(ledger).claim(conn, TOPIC, [0], None, None, reset=FROM_ZERO)
    await insert_foreign_row(database.owner_url, TOPIC, 0, 7)
    batch = build_batch(TOPIC, {0: records(0, 10)}, {0: claim.epoch})
    corrupt(batch, 2, QTY, 0)
    outcome = await ledger.apply(conn, batch)
    assert (outcome.applied, outcome.rejected, outcome.present) == (8, {"database_rejected": 1}, {0: [7]})
    state = await ledger_of(database)
    assert set(state["rejected"]) == {(0, 2)}
    assert state["applied"] == {(0, o) for o in range(10) if o != 2}
    assert state["offsets"] == {0: 10}


async def test_a_unique_index_someone_added_is_a_refusal_not_a_crash(conn: asyncpg.Connection, database: Env) -> None:
    """A unique index that is not one of our backstops (added by hand: one row per warehouse, sku and qty, on the
    segment that holds partition 0's first offsets, since one across segments would have to hold the coordinates)
    refuses 9 of 10 identical-looking movements: the first is applied, the other 9 are database_rejected, offsets
    move."""
    owner = await asyncpg.connect(database.owner_url)
    try:
        await make_segments(owner, [0])
        await owner.execute("CREATE UNIQUE INDEX one_per_qty ON stock_movements_p0_o0 (warehouse_id, sku, qty)")
    finally:
        await owner.close()
    ledger = Ledger("g", Faults(None))
    (claim,) = await claims_of(ledger).claim(conn, TOPIC, [0], None, None, reset=FROM_ZERO)
    outcome = await ledger.apply(conn, build_batch(TOPIC, {0: records(0, 10)}, {0: claim.epoch}))
    assert (outcome.applied, outcome.rejected) == (1, {"database_rejected": 9})
    state = await ledger_of(database)
    assert state["applied"] == {(0, 0)}
    assert all("one_per_qty" in reason for _, reason, _, _ in state["rejected"].values())
    assert state["offsets"] == {0: 10}
    assert state["levels"] == {("WH-1", "SKU-1"): 2}
