"""The batch transaction's refusals, on a real PostgreSQL: fencing, replays, the unique backstop, lost replies."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest
import pytest_asyncio

from stock_ledger.errors import FencedError, LedgerIntegrityError, OffsetMismatchError
from stock_ledger.faults import Faults
from stock_ledger.gaps import find_gap
from stock_ledger.ledger.batch import Record, build_batch
from stock_ledger.ledger.transaction import Ledger
from tests.support.helpers import FROM_ZERO, Env, claims_of, insert_foreign_row, movement

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]
TOPIC = "warehouse.movements"


def records(partition: int, first: int, count: int) -> list[Record]:
    """Valid movements at consecutive offsets; the movement_id is derived from the coordinates."""

    def value(offset: int) -> bytes:
        movement_id = str(uuid.uuid5(uuid.NAMESPACE_OID, f"{partition}/{offset}"))
        return json.dumps(movement("SKU-1", movement_id=movement_id)).encode()

    return [Record(partition, o, 1_700_000_000_000, b"SKU-1", value(o)) for o in range(first, first + count)]


@pytest_asyncio.fixture
async def conn(database: Env) -> AsyncIterator[asyncpg.Connection]:
    c = await asyncpg.connect(database.worker_url)
    yield c
    await c.close()


async def _rows(database: Env) -> int:
    c = await asyncpg.connect(database.owner_url)
    try:
        return int(await c.fetchval("SELECT count(*) FROM stock_movements"))
    finally:
        await c.close()


async def test_a_stale_epoch_is_fenced_and_writes_nothing(conn: asyncpg.Connection, database: Env) -> None:
    """Worker A claims partition 0 (epoch 1), worker B claims it after (epoch 2): A's batch is refused as fenced,
    rolled back whole; B's batch commits."""
    ledger_a, ledger_b = Ledger("g", Faults(None)), Ledger("g", Faults(None))
    (a,) = await claims_of(ledger_a).claim(conn, TOPIC, [0], 7, "member-a", reset=FROM_ZERO)
    (b,) = await claims_of(ledger_b).claim(conn, TOPIC, [0], 8, "member-b", reset=FROM_ZERO)
    assert (a.epoch, b.epoch, a.next_offset, b.next_offset) == (1, 2, 0, 0)
    assert (a.reset, b.reset) == (True, False)  # stored by the first claim: the second finds it
    with pytest.raises(FencedError) as fenced:
        await ledger_a.apply(conn, build_batch(TOPIC, {0: records(0, 0, 10)}, {0: a.epoch}))
    assert fenced.value.partitions == {0: (1, 2)}
    assert await _rows(database) == 0
    outcome = await ledger_b.apply(conn, build_batch(TOPIC, {0: records(0, 0, 10)}, {0: b.epoch}))
    assert outcome.applied == 10
    assert await _rows(database) == 10
    stored = await conn.fetchrow("SELECT next_offset, generation, member_id FROM consumer_offsets")
    assert tuple(stored) == (10, 8, "member-b")


async def test_one_fenced_partition_rolls_back_the_whole_batch(conn: asyncpg.Connection, database: Env) -> None:
    """A batch spanning partitions 0 and 1, of which only 1 was claimed away: nothing of either is written."""
    ledger = Ledger("g", Faults(None))
    claimed = await claims_of(ledger).claim(conn, TOPIC, [0, 1], None, None, reset=FROM_ZERO)
    claims = {c.partition: c.epoch for c in claimed}
    await claims_of(Ledger("g", Faults(None))).claim(conn, TOPIC, [1], None, None, reset=FROM_ZERO)
    with pytest.raises(FencedError):
        await ledger.apply(conn, build_batch(TOPIC, {0: records(0, 0, 5), 1: records(1, 0, 5)}, claims))
    assert await _rows(database) == 0
    assert await conn.fetchval("SELECT count(*) FROM consumer_offsets WHERE next_offset <> 0") == 0  # none moved


async def test_a_replay_under_our_own_epoch_is_refused(conn: asyncpg.Connection, database: Env) -> None:
    """Offsets 0-9 applied; a batch that expects the ledger at 5 (a broken seek, or someone moved the offset) is an
    OffsetMismatchError (ahead: stored 10, expected 5), not a duplicate; nothing is written."""
    ledger = Ledger("g", Faults(None))
    (c,) = await claims_of(ledger).claim(conn, TOPIC, [0], None, None, reset=FROM_ZERO)
    await ledger.apply(conn, build_batch(TOPIC, {0: records(0, 0, 10)}, {0: c.epoch}))
    with pytest.raises(OffsetMismatchError, match="stored next_offset 10 is ahead of the expected 5") as raised:
        await ledger.apply(conn, build_batch(TOPIC, {0: records(0, 5, 10)}, {0: c.epoch}))
    assert raised.value.partitions[0].direction == "ahead"
    assert await _rows(database) == 10


async def test_a_database_gone_back_in_time_is_never_written_past(conn: asyncpg.Connection, database: Env) -> None:
    """The worker committed offsets 0-19 of partition 0; the database then lost 10-19 (rows and offset, as a
    failover to a standby that lost commits leaves it). The next batch, which expects 20 and starts at 20, is
    refused as an OffsetMismatchError (behind: stored 10), writing nothing: the old guard (stored <= first record)
    let it through and 10-19 were lost for good. A batch expecting 10 (after the claim again) commits."""
    ledger = Ledger("g", Faults(None))
    (c,) = await claims_of(ledger).claim(conn, TOPIC, [0], None, None, reset=FROM_ZERO)
    await ledger.apply(conn, build_batch(TOPIC, {0: records(0, 0, 10)}, {0: c.epoch}))
    await ledger.apply(conn, build_batch(TOPIC, {0: records(0, 10, 10)}, {0: c.epoch}))
    owner = await asyncpg.connect(database.owner_url)
    try:
        await owner.execute("DELETE FROM stock_movements WHERE kafka_offset >= 10")
        await owner.execute("UPDATE consumer_offsets SET next_offset = 10")
    finally:
        await owner.close()
    with pytest.raises(OffsetMismatchError, match="behind the expected 20") as raised:
        await ledger.apply(conn, build_batch(TOPIC, {0: records(0, 20, 5)}, {0: c.epoch}))
    assert (raised.value.partitions[0].direction, raised.value.partitions[0].stored) == ("behind", 10)
    assert await _rows(database) == 10
    assert await conn.fetchval("SELECT next_offset FROM consumer_offsets") == 10
    (again,) = await claims_of(ledger).claim(conn, TOPIC, [0], None, None, reset=FROM_ZERO)
    assert (again.epoch, again.next_offset, again.reset) == (c.epoch + 1, 10, False)
    await ledger.apply(conn, build_batch(TOPIC, {0: records(0, 10, 15)}, {0: again.epoch}))
    assert await _rows(database) == 25


async def test_an_older_stored_epoch_is_a_rewind_not_a_fence(conn: asyncpg.Connection, database: Env) -> None:
    """A restore put the offsets row back to before our claim (epoch 1, while we hold 2): that is the database
    gone back in time (OffsetMismatchError), not another worker's claim (FencedError: epochs only grow)."""
    ledger = Ledger("g", Faults(None))
    await claims_of(ledger).claim(conn, TOPIC, [0], None, None, reset=FROM_ZERO)
    (c,) = await claims_of(ledger).claim(conn, TOPIC, [0], None, None, reset=FROM_ZERO)
    owner = await asyncpg.connect(database.owner_url)
    try:
        await owner.execute("UPDATE consumer_offsets SET epoch = 1")
    finally:
        await owner.close()
    with pytest.raises(OffsetMismatchError) as raised:
        await ledger.apply(conn, build_batch(TOPIC, {0: records(0, 0, 5)}, {0: c.epoch}))
    assert raised.value.partitions[0].epoch == 1
    assert await _rows(database) == 0


async def test_retrying_a_batch_whose_commit_reply_was_lost_applies_nothing_twice(
    conn: asyncpg.Connection, database: Env,
) -> None:
    """The COMMIT went through but its reply was lost; the worker retries the very same batch: it is recognised
    as already applied (offsets sit exactly at its end), nothing is written twice, and no error is raised."""
    ledger = Ledger("g", Faults(None))
    (c,) = await claims_of(ledger).claim(conn, TOPIC, [0], None, None, reset=FROM_ZERO)
    batch = build_batch(TOPIC, {0: records(0, 0, 10)}, {0: c.epoch})
    assert (await ledger.apply(conn, batch)).applied == 10
    again = await ledger.apply(conn, batch)
    assert again.already_applied
    assert again.applied == 0
    assert await _rows(database) == 10


async def test_holes_in_the_log_are_allowed(conn: asyncpg.Connection, database: Env) -> None:
    """Transaction markers and aborted records leave offsets without records: a batch may start past the stored
    offset it continues (10), which is what the guard compares."""
    ledger = Ledger("g", Faults(None))
    (c,) = await claims_of(ledger).claim(conn, TOPIC, [0], None, None, reset=FROM_ZERO)
    await ledger.apply(conn, build_batch(TOPIC, {0: records(0, 0, 10)}, {0: c.epoch}))
    await ledger.apply(conn, build_batch(TOPIC, {0: records(0, 12, 3)}, {0: c.epoch}, expected={0: 10}))
    assert await conn.fetchval("SELECT next_offset FROM consumer_offsets") == 15
    assert await _rows(database) == 13


async def test_coordinates_already_in_the_ledger_are_left_as_found_never_a_failure_for_good(
    conn: asyncpg.Connection, database: Env,
) -> None:
    """A row already at (topic, 0, 20) although offsets say 10 (written outside the guard: a repair racing an
    `offsets set`, a tool, a restore that kept rows): the COPY hits the coordinates constraint (which used to fail the
    batch on every retry and every restart); the batch is redone leaving offset 20 as found, applies 10-19 and 21-24,
    moves the offset to 25 and names offset 20 in `Outcome.present`. A batch with no such row names none."""
    ledger = Ledger("g", Faults(None))
    (c,) = await claims_of(ledger).claim(conn, TOPIC, [0], None, None, reset=FROM_ZERO)
    first = await ledger.apply(conn, build_batch(TOPIC, {0: records(0, 0, 10)}, {0: c.epoch}))
    assert first.present == {}
    await insert_foreign_row(database.owner_url, TOPIC, 0, 20)
    outcome = await ledger.apply(conn, build_batch(TOPIC, {0: records(0, 10, 15)}, {0: c.epoch}))
    assert (outcome.applied, outcome.present) == (14, {0: [20]})
    assert await _rows(database) == 25
    assert await conn.fetchval("SELECT next_offset FROM consumer_offsets") == 25
    left = await conn.fetchval("SELECT movement_id FROM stock_movements WHERE kafka_offset = 20")
    assert left != uuid.uuid5(uuid.NAMESPACE_OID, "0/20")  # the row found there, not the record's


async def test_a_late_claim_of_an_older_generation_takes_nothing(conn: asyncpg.Connection, database: Env) -> None:
    """Worker B claims partition 0 under generation 8 and applies a batch. A claim of worker A under generation 7
    (it started before the rebalance and reached the database after it) takes nothing: B keeps its epoch and its
    next batch commits. A claim of a newer generation, or a forced one, still takes the partition."""
    ledger_a, ledger_b = Ledger("g", Faults(None)), Ledger("g", Faults(None))
    (b,) = await claims_of(ledger_b).claim(conn, TOPIC, [0], 8, "member-b", reset=FROM_ZERO)
    await ledger_b.apply(conn, build_batch(TOPIC, {0: records(0, 0, 5)}, {0: b.epoch}))
    assert await claims_of(ledger_a).claim(conn, TOPIC, [0], 7, "member-a", reset=FROM_ZERO) == []
    outcome = await ledger_b.apply(conn, build_batch(TOPIC, {0: records(0, 5, 5)}, {0: b.epoch}))
    assert outcome.applied == 5
    assert tuple(await conn.fetchrow("SELECT epoch, generation, member_id FROM consumer_offsets")) == (
        b.epoch, 8, "member-b")
    (newer,) = await claims_of(ledger_a).claim(conn, TOPIC, [0], 9, "member-a", reset=FROM_ZERO)
    assert (newer.epoch, newer.next_offset) == (b.epoch + 1, 10)
    (forced,) = await claims_of(ledger_b).claim(conn, TOPIC, [0], 1, "member-b", force=True, reset=FROM_ZERO)
    assert forced.epoch == b.epoch + 2


async def test_an_unknown_generation_never_takes_a_partition_a_known_one_holds(
    conn: asyncpg.Connection, database: Env,
) -> None:
    """aiokafka resets the generation to -1 (None here) on UnknownMemberId / IllegalGeneration until it rejoins. A
    claim made meanwhile takes nothing that a known generation holds, not even forced (the old guard took it
    unconditionally and fenced the rightful owner); a partition nobody holds it may take."""
    owner, zombie = Ledger("g", Faults(None)), Ledger("g", Faults(None))
    (b,) = await claims_of(owner).claim(conn, TOPIC, [0], 8, "member-b", reset=FROM_ZERO)
    assert await claims_of(zombie).claim(conn, TOPIC, [0], None, "member-a", reset=FROM_ZERO) == []
    assert await claims_of(zombie).claim(conn, TOPIC, [0], None, "member-a", force=True, reset=FROM_ZERO) == []
    assert tuple(await conn.fetchrow("SELECT epoch, generation, member_id FROM consumer_offsets")) == (
        b.epoch, 8, "member-b")
    assert (await owner.apply(conn, build_batch(TOPIC, {0: records(0, 0, 5)}, {0: b.epoch}))).applied == 5
    (fresh,) = await claims_of(zombie).claim(conn, TOPIC, [0, 1], None, "member-a", reset=FROM_ZERO)
    assert fresh.partition == 1


async def test_a_second_consumer_group_is_refused_loudly(conn: asyncpg.Connection, database: Env) -> None:
    """The unique constraints span the whole ledger, so one database serves one group: a claim by another group
    raises LedgerIntegrityError naming both groups, and changes nothing."""
    await claims_of(Ledger("ledger-eu", Faults(None))).claim(conn, TOPIC, [0], None, None, reset=FROM_ZERO)
    with pytest.raises(LedgerIntegrityError, match="'ledger-eu', not 'ledger-us'"):
        await claims_of(Ledger("ledger-us", Faults(None))).claim(conn, TOPIC, [0, 1], None, None, reset=FROM_ZERO)
    assert await conn.fetchval("SELECT count(*) FROM consumer_offsets") == 1


async def test_moving_past_a_hole_records_it_in_the_same_transaction(conn: asyncpg.Connection, database: Env) -> None:
    """Offsets 10-19 were deleted before they were applied: skip_gap moves the stored offset to 20 and writes
    the range to ledger_gaps, both or neither; with a stale epoch or a moved offset it does nothing."""
    ledger = Ledger("g", Faults(None))
    (c,) = await claims_of(ledger).claim(conn, TOPIC, [0], None, None, reset=FROM_ZERO)
    await ledger.apply(conn, build_batch(TOPIC, {0: records(0, 0, 10)}, {0: c.epoch}))
    hole = find_gap(0, 10, 20, 30)
    assert hole is not None
    assert hole.skippable
    assert await claims_of(ledger).skip_gap(conn, TOPIC, hole, c.epoch + 1) is None  # not our epoch: nothing
    gap_id = await claims_of(ledger).skip_gap(conn, TOPIC, hole, c.epoch)
    assert gap_id is not None
    assert await claims_of(ledger).skip_gap(conn, TOPIC, hole, c.epoch) is None  # already moved: nothing twice
    assert await conn.fetchval("SELECT next_offset FROM consumer_offsets") == 20
    row = await conn.fetchrow("SELECT first_offset, last_offset, reason, acknowledged_at FROM ledger_gaps")
    assert tuple(row) == (10, 19, "below_log_start", None)
    await ledger.apply(conn, build_batch(TOPIC, {0: records(0, 20, 5)}, {0: c.epoch}))
    assert await _rows(database) == 15


async def test_batches_and_claims_on_the_same_partitions_never_deadlock(database: Env) -> None:
    """Batches over partitions 0-7 and claims of the same partitions run concurrently on two sessions, 60 times:
    both lock offset rows in partition order, so PostgreSQL never has to break a deadlock (fenced batches are
    expected; a DeadlockDetectedError is not)."""
    a, b = await asyncpg.connect(database.worker_url), await asyncpg.connect(database.worker_url)
    ledger = Ledger("g", Faults(None))
    parts = list(range(8))
    try:
        next_offset = 0
        for round_ in range(60):
            claimed = await claims_of(ledger).claim(a, TOPIC, parts, None, None, reset=FROM_ZERO)
            claims = {c.partition: c.epoch for c in claimed}
            batch = build_batch(TOPIC, {p: records(p, next_offset, 3) for p in reversed(parts)}, claims)
            results = await asyncio.gather(
                ledger.apply(a, batch),
                claims_of(ledger).claim(b, TOPIC, list(reversed(parts)) if round_ % 2 else parts, None, None,
                                        reset=FROM_ZERO),
                return_exceptions=True,
            )
            assert not any(isinstance(r, asyncpg.DeadlockDetectedError) for r in results), results
            if not isinstance(results[0], BaseException):
                next_offset += 3
    finally:
        await a.close()
        await b.close()
