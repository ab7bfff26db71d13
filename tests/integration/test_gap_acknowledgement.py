"""A worker may record a gap, never acknowledge one (issue 38, item 2).

Until migration 0010 the worker role could INSERT any column of ledger_gaps: with its credential alone, move
consumer_offsets past records it never applied and insert the range already acknowledged; `verify` then listed
the still-readable records as "skipped on purpose" and `repair` left them alone. Now the database refuses that
insert, and an acknowledgement counts only when acknowledged_by names a role that may acknowledge (UPDATE on
ledger_gaps.acknowledged_at), so a row forged before the upgrade counts for nothing either.
"""

from __future__ import annotations

import asyncpg
import pytest

from tests.integration.test_operate import cli, drain_and_stop, send_to
from tests.integration.test_verify import run_verify
from tests.support.helpers import Env, Services, WorkerPool
from tests.support.services import WORKER_ROLE

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(180)]

P = 2
OPEN = "no unacknowledged gap (ledger_gaps)"
HELD = "acknowledged gaps (skipped on purpose)"
MISSING = "gaps (in topic, in neither table)"


async def _move_past_and_record(conn: asyncpg.Connection, insert: str) -> asyncpg.Record | None:
    """One transaction, as the worker's STOCK_LEDGER_ON_GAP=record writes one: the stored offset moves from 10 to 60
    and the skipped range is inserted."""
    async with conn.transaction():
        await conn.execute("UPDATE consumer_offsets SET next_offset = 60 WHERE partition = 0")
        return await conn.fetchrow(insert)


async def test_the_worker_role_may_record_a_gap_but_not_acknowledge_or_backdate_one(database: Env) -> None:
    """As the worker role, in one transaction each: move a partition's stored offset forward, then insert the skipped
    range with acknowledged_at/acknowledged_by/note filled: refused by the database (nothing moved); the same with
    a backdated detected_at: refused; a plain hole (the columns the runtime's STOCK_LEDGER_ON_GAP=record writes)
    is still recorded, detected now and unacknowledged."""
    conn = await asyncpg.connect(database.worker_url)
    try:
        await conn.execute("INSERT INTO consumer_offsets (group_id, topic, partition, epoch, next_offset) "
                           "VALUES ('g', 't', 0, 1, 10)")
        forgeries = {
            "acknowledged": "INSERT INTO ledger_gaps (group_id, topic, partition, first_offset, last_offset, reason, "
                            "acknowledged_at, acknowledged_by, note) VALUES ('g', 't', 0, 10, 59, 'below_log_start', "
                            "now(), 'stock_ledger', 'reconciled')",
            "backdated": "INSERT INTO ledger_gaps (group_id, topic, partition, first_offset, last_offset, reason, "
                         "detected_at) VALUES ('g', 't', 0, 10, 59, 'below_log_start', now() - interval '1 year')",
        }
        for what, forged in forgeries.items():
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await _move_past_and_record(conn, forged)
            assert await conn.fetchval("SELECT next_offset FROM consumer_offsets") == 10, what
        gap = await _move_past_and_record(
            conn, "INSERT INTO ledger_gaps (group_id, topic, partition, first_offset, last_offset, reason) "
                  "VALUES ('g', 't', 0, 10, 59, 'below_log_start') "
                  "RETURNING id, acknowledged_at, detected_at > now() - interval '1 minute' AS now")
    finally:
        await conn.close()
    assert gap is not None
    assert (gap["acknowledged_at"], gap["now"]) == (None, True)


async def test_an_acknowledgement_forged_before_the_upgrade_counts_for_nothing(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """1. A worker applies 30 records of partition 2 and stops; 20 more arrive (offsets 30-49).
    2. What the worker's credential could do before 0010: it moves the stored offset to 50 (as the worker role);
       the row "acknowledging" 30-49 by stock_ledger_worker is inserted (as the owner here: 0010 now refuses the
       worker), and one on partition 3 by a role that does not exist.
    3. verify exits 1: the 20 records are missing (not skipped on purpose) and both rows are named as open gaps
       whose acknowledgement does not count; `gaps list` shows them among the unacknowledged.
    4. repair re-applies the 20 records (none excluded); verify then finds nothing missing but still names both.
    5. The owner acknowledges both with `gaps ack` (the forged claim kept in the note): verify exits 0."""
    await send_to(services.kafka, topic, P, 30)
    await drain_and_stop(services, database, topic, workers)
    await send_to(services.kafka, topic, P, 20)
    worker = await asyncpg.connect(database.worker_url)
    try:
        await worker.execute("UPDATE consumer_offsets SET next_offset = 50 WHERE group_id = $1 AND topic = $2 "
                             "AND partition = $3", workers.group, topic, P)
    finally:
        await worker.close()
    owner = await asyncpg.connect(database.owner_url)
    try:
        forged = [await owner.fetchval(
            "INSERT INTO ledger_gaps (group_id, topic, partition, first_offset, last_offset, reason, acknowledged_at, "
            "acknowledged_by, note) VALUES ($1, $2, $3, $4, $5, 'below_log_start', now(), $6, 'reconciled') "
            "RETURNING id", workers.group, topic, p, first, last, by)
            for p, first, last, by in ((P, 30, 49, WORKER_ROLE), (3, 0, 4, "auditor"))]
    finally:
        await owner.close()

    broken = await run_verify(workers)
    assert broken.code == 1, broken.stdout
    assert broken.check(MISSING) == f"FAIL    20 records: p{P}: 30-49"
    assert broken.check(HELD) == "ok      none"
    named = broken.check(OPEN)
    assert named.startswith("FAIL    2 open: "), named
    assert f"p{P} 30-49 (below_log_start; acknowledged by {WORKER_ROLE}, which may not acknowledge gaps" in named
    assert "p3 0-4 (below_log_start; acknowledged by auditor, which may not acknowledge gaps" in named
    listed = await cli(workers, "gaps", "list")
    assert listed.code == 0, listed.err
    assert f"#{forged[0]} " in listed.out
    assert f"#{forged[1]} " in listed.out
    assert "does not count" in listed.out

    repaired = await cli(workers, "repair", "--json")
    assert repaired.code == 0, repaired.err
    totals = repaired.json()["totals"]
    assert (totals["missing"], totals["applied"], totals["excluded_recorded_gaps"]) == (20, 20, 0)
    after = await run_verify(workers)
    assert after.code == 1
    assert after.check(MISSING) == "ok      none"
    assert after.check(OPEN).startswith("FAIL    2 open: ")

    for gap_id in forged:
        acked = await cli(workers, "gaps", "ack", str(gap_id), "--note", "INC-38 checked by hand")
        assert acked.code == 0, acked.err
    clean = await run_verify(workers)
    assert clean.code == 0, clean.stdout
    owner = await asyncpg.connect(database.owner_url)
    try:
        note = await owner.fetchval("SELECT note FROM ledger_gaps WHERE id = $1", forged[0])
    finally:
        await owner.close()
    assert note.startswith("INC-38 checked by hand")
    assert f"by {WORKER_ROLE}" in note
    assert "reconciled" in note
