"""Closing balances (issue 39, requirement 4) on the real broker and database: `stock show --at T` stays exact when
it starts from a closing taken while movements kept arriving, late (back-dated) and early (future-dated) ones
included; when rows below a closing's cut are deleted by hand, written back by `repair`, or applied by `rejected
replay`; and when a stored offset is moved back below a cut.

The expectations are computed in the test: from the movements it sent, and from the definition (Σ qty of the
ledger's rows with occurred_at <= T, summed by the test's own SQL), never from the closings.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import signal
import time
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import asyncpg
import pytest

from stock_ledger.ledger import stock
from stock_ledger.ledger.stock import IN_STEP
from stock_ledger.migrate import find_migrations_dir, migrate
from tests.integration.test_operate import cli
from tests.integration.test_repair import lose_range, send_to_partition
from tests.integration.test_segments import previous_release_ledger
from tests.support.helpers import (
    Env,
    Services,
    WorkerPool,
    closings_off,
    delete_records_below,
    eventually,
    movement,
    scratch_database,
    send_raw,
    wait_drained,
)
from tests.support.services import WORKER_PASSWORD

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(300)]

WAREHOUSES = ("WH-1", "WH-2")
# Closings every second: the monitor's leader takes one at each tick (the interval is also its tick, under 300 s).
CLOSINGS = {"STOCK_LEDGER_CLOSING_SECONDS": "1", "STOCK_LEDGER_POSITION_REFRESH_SECONDS": "0.5"}


def _movements(rng: random.Random, count: int, around: datetime) -> list[dict[str, Any]]:
    """`count` movements of 6 SKUs in two warehouses that occurred around `around`: most within the last two
    seconds, one in ten back-dated by up to two hours (a late scanner), one in twenty future-dated by up to an
    hour (a clock ahead)."""
    found = []
    for _ in range(count):
        roll = rng.random()
        if roll < 0.1:
            occurred = around - timedelta(seconds=rng.uniform(60, 7_200))
        elif roll < 0.15:
            occurred = around + timedelta(seconds=rng.uniform(60, 3_600))
        else:
            occurred = around - timedelta(seconds=rng.uniform(0, 2))
        qty = rng.choice((3, 5, 8, 13, -2, -4, -9))
        found.append(movement(f"SKU-{rng.randrange(6)}", qty=qty, kind="receipt" if qty > 0 else "pick",
                              warehouse=rng.choice(WAREHOUSES), occurred_at=occurred.isoformat()))
    return found


def _expected(sent: list[dict[str, Any]], warehouse: str, at: datetime) -> dict[str, int]:
    totals: dict[str, int] = defaultdict(int)
    for m in sent:
        if m["warehouse_id"] == warehouse and datetime.fromisoformat(str(m["occurred_at"])) <= at:
            totals[str(m["sku"])] += int(str(m["qty"]))
    return {sku: qty for sku, qty in totals.items() if qty != 0}


async def _by_definition(url: str, warehouse: str, at: datetime) -> dict[str, int]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch("SELECT sku, sum(qty)::bigint FROM stock_movements WHERE warehouse_id = $1 "
                                "AND occurred_at <= $2 GROUP BY sku HAVING sum(qty) <> 0", warehouse, at)
    finally:
        await conn.close()
    return {r[0]: r[1] for r in rows}


async def _stock_at(workers: WorkerPool, warehouse: str, at: datetime, sku: str | None = None,
                    **env: str) -> dict[str, int]:
    args = ["stock", "show", "--warehouse", warehouse, "--at", at.isoformat(), "--json"]
    done = await cli(workers, *args, *(["--sku", sku] if sku else []), **env)
    assert done.code == 0, done.err
    return {x["sku"]: x["on_hand"] for x in json.loads(done.out)["levels"]}


async def _levels_at(conn: asyncpg.Connection, warehouse: str, at: datetime, sku: str | None = None) -> dict[str, int]:
    """`stock show --at` without its process: what it calls (no archive here for it to add)."""
    found = await stock.levels(conn, warehouse, sku=sku, at=at)
    assert not found.straddling
    levels = {x.sku: x.on_hand for x in found.levels}
    return levels if sku is None else {sku: levels.get(sku, 0)}


async def _closings(url: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(url)
    try:
        return list(await conn.fetch(
            "SELECT closing_id, taken_at, positioned_at, pairs FROM ledger_closings ORDER BY positioned_at"))
    finally:
        await conn.close()


def _times_around(closings: list[asyncpg.Record], sent: list[dict[str, Any]]) -> list[datetime]:
    """Just before and after each closing (where it sits in business time, and when it was taken), between each two,
    far before and after them all, and at the exact business time of a few movements (counted: occurred_at <= T)."""
    placed = [r["positioned_at"] for r in closings]
    found = [t + timedelta(milliseconds=d) for r in closings for t in (r["positioned_at"], r["taken_at"])
             for d in (-1, 1)]
    found += [a + (b - a) / 2 for a, b in itertools.pairwise(placed)]
    found += [placed[0] - timedelta(hours=3), placed[0] - timedelta(minutes=30), placed[-1] + timedelta(minutes=30),
              placed[-1] + timedelta(hours=2)]
    found += [datetime.fromisoformat(str(m["occurred_at"])) for m in sent[::37]]
    return sorted(found)


async def _wait_for_closings(url: str, more_than: int, workers: WorkerPool) -> int:
    async def enough() -> bool:
        return len(await _closings(url)) > more_than
    await eventually(enough, 30, f"more than {more_than} closings", workers)
    return len(await _closings(url))


async def test_stock_at_is_exact_from_closings_taken_while_movements_arrive(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """Four rounds of movements, each drained and followed by a closing, while the worker keeps taking closings
    every second. `stock show --at T` (the whole warehouse, and one SKU) equals the Σ of the sent movements that
    occurred at or before T for T just before and after every closing, between them, before and after them all and
    at movements' exact times. Each closing holds exactly the ledger's movements below its cut."""
    rng = random.Random(39)
    sent: list[dict[str, Any]] = []
    worker = workers.start(**CLOSINGS)
    seen = 0
    for _ in range(4):
        batch = _movements(rng, 150, datetime.now(UTC))
        sent += batch
        await send_raw(services.kafka, topic, [(str(m["sku"]).encode(), json.dumps(m).encode()) for m in batch])
        await wait_drained(services, database, topic, workers.group, 60, workers)
        seen = await _wait_for_closings(database.owner_url, seen, workers)
        await asyncio.sleep(1.1)
    closings = await _closings(database.owner_url)
    assert len(closings) >= 4

    assert not await closings_off(database.owner_url)

    # Every T read by what the CLI calls, on one connection; every eighth through the CLI itself as well (a process
    # each: through it alone the test took minutes).
    reader = await asyncpg.connect(database.owner_url)
    try:
        for n, at in enumerate(_times_around(closings, sent)):
            for warehouse in WAREHOUSES:
                expected = _expected(sent, warehouse, at)
                assert await _levels_at(reader, warehouse, at) == expected, f"{warehouse} at {at.isoformat()}"
                if n % 8 == 0:
                    assert await _stock_at(workers, warehouse, at) == expected, f"{warehouse} at {at.isoformat()}"
            one = {"SKU-2": _expected(sent, "WH-1", at).get("SKU-2", 0)}
            assert await _levels_at(reader, "WH-1", at, sku="SKU-2") == one, at.isoformat()
            if n % 8 == 0:
                assert await _stock_at(workers, "WH-1", at, sku="SKU-2") == one, at.isoformat()
    finally:
        await reader.close()
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    workers.assert_no_tracebacks()


P = 5


async def test_closings_taken_while_catching_up_sit_at_their_movements_time_not_the_clocks(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """A backlog: two rounds of movements whose Kafka timestamps are 6 and 5 hours old (they waited in Kafka while no
    worker ran), each drained and closed. Each closing's `positioned_at` is the time of the movements it counts, hours
    before it was taken, so a read of T around 6 h ago starts from the first closing; `stock show --at T` equals the
    Σ of the sent movements that occurred at or before T around both closings, between them and at movements' times.
    Fails on closings placed at the clock: positioned_at would be the time they were taken."""
    rng = random.Random(41)
    now = datetime.now(UTC)
    rounds = (now - timedelta(hours=6), now - timedelta(hours=5))
    sent: list[dict[str, Any]] = []
    worker = workers.start(**CLOSINGS)
    positions = []
    for stamp in rounds:
        batch = _movements(rng, 120, stamp)
        sent += batch
        await send_raw(services.kafka, topic, [(str(m["sku"]).encode(), json.dumps(m).encode()) for m in batch],
                       timestamp_ms=int(stamp.timestamp() * 1000))
        await wait_drained(services, database, topic, workers.group, 60, workers)
        seen = len(await _closings(database.owner_url))
        await asyncio.sleep(1.1)  # a closing taken from here on counts the whole round
        await _wait_for_closings(database.owner_url, seen, workers)
        newest = max(await _closings(database.owner_url), key=lambda c: c["taken_at"])
        assert newest["positioned_at"] == stamp.replace(microsecond=stamp.microsecond // 1000 * 1000), (
            f"a closing counting the round stamped {stamp.isoformat()} sits at {newest['positioned_at'].isoformat()} "
            f"(taken at {newest['taken_at'].isoformat()})")
        assert newest["taken_at"] - newest["positioned_at"] > timedelta(hours=4)
        positions.append(newest["positioned_at"])
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0

    times = [p + timedelta(seconds=d) for p in positions for d in (-600, -1, 0, 1, 600)]
    times += [positions[0] + (positions[1] - positions[0]) / 2, now]
    times += [datetime.fromisoformat(str(m["occurred_at"])) for m in sent[::29]]
    for at in times:
        for warehouse in WAREHOUSES:
            assert await _stock_at(workers, warehouse, at) == _expected(sent, warehouse, at), (
                f"{warehouse} at {at.isoformat()}")
    workers.assert_no_tracebacks()


async def test_rows_deleted_repaired_and_replayed_below_a_cut_keep_stock_at_exact(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """After closings were taken over the whole ledger: rows deleted by hand below their cuts (a lost range of
    partition 5, and six movements moved back to quarantine as an older parser would have left them) leave the
    closings with them; `repair` writes the range back and `rejected replay` applies the six, each below every cut.
    At every step `stock show --at T`, for T between closings (where it reads from one), equals the definition over
    the rows the ledger then holds, and after repair and replay the answers are those from before the damage."""
    rng = random.Random(40)
    now = datetime.now(UTC)
    records = [movement(f"SKU-{i % 4}", qty=i + 1, warehouse=WAREHOUSES[i % 2],
                        occurred_at=(now + timedelta(seconds=rng.uniform(-3_600, 3_600))).isoformat())
               for i in range(50)]
    await send_to_partition(services.kafka, topic, P, [(str(m["sku"]).encode(), json.dumps(m).encode())
                                                      for m in records])
    spread = _movements(rng, 300, now)
    await send_raw(services.kafka, topic, [(str(m["sku"]).encode(), json.dumps(m).encode()) for m in spread])
    worker = workers.start(**CLOSINGS)
    await wait_drained(services, database, topic, workers.group, 60, workers)
    await _wait_for_closings(database.owner_url, 2, workers)
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    closings = await _closings(database.owner_url)
    taken = [c["positioned_at"] for c in closings]
    times = [a + (b - a) / 2 for a, b in itertools.pairwise(taken)]
    times += [t + timedelta(seconds=s) for t in taken[-1:] for s in (-900, -60, 60)]

    async def answers() -> dict[tuple[str, datetime], dict[str, int]]:
        found = {}
        for at in times:
            for warehouse in WAREHOUSES:
                got = await _stock_at(workers, warehouse, at)
                assert got == await _by_definition(database.owner_url, warehouse, at), f"{warehouse} at {at}"
                found[warehouse, at] = got
        return found

    before = await answers()
    assert any(before.values())

    await lose_range(database, topic, 20, 39)
    conn = await asyncpg.connect(database.owner_url)
    try:
        async with conn.transaction():
            moved = await conn.fetch(
                "DELETE FROM stock_movements WHERE movement_id IN (SELECT movement_id FROM stock_movements "
                "WHERE kafka_partition <> $1 AND movement_id = ANY($2::uuid[]) LIMIT 6) "
                "RETURNING kafka_topic, kafka_partition, kafka_offset, kafka_timestamp, movement_id, warehouse_id, "
                "sku, qty", P, [str(m["movement_id"]) for m in spread])
            for r in moved:
                value = json.dumps(next(m for m in spread if m["movement_id"] == str(r["movement_id"]))).encode()
                await conn.execute(
                    "INSERT INTO rejected_movements (kafka_topic, kafka_partition, kafka_offset, kafka_timestamp, "
                    "key, value, reason_code, reason, movement_id) VALUES ($1, $2, $3, $4, $5, $6, 'invalid_field', "
                    "'rejected by an older parser', $7)", r["kafka_topic"], r["kafka_partition"], r["kafka_offset"],
                    r["kafka_timestamp"], r["sku"].encode(), value, r["movement_id"])
                await conn.execute(
                    "UPDATE stock_levels SET on_hand = on_hand - $3, went_negative_at = CASE WHEN on_hand - $3 < 0 "
                    "THEN coalesce(went_negative_at, now()) END WHERE warehouse_id = $1 AND sku = $2",
                    r["warehouse_id"], r["sku"], r["qty"])
    finally:
        await conn.close()
    assert len(moved) == 6
    damaged = await answers()
    assert damaged != before, "the damage must change some answer"

    repaired = await cli(workers, "repair", "--json")
    assert repaired.code == 0, repaired.err
    assert repaired.json()["totals"]["applied"] == 20
    replayed = await cli(workers, "rejected", "replay", "--json")
    assert replayed.code == 0, replayed.err
    assert replayed.json()["applied"] == 6
    assert await answers() == before
    workers.assert_no_tracebacks()


async def test_a_stored_offset_moved_back_below_a_cut_forgets_those_closings(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """A partition's stored offset skipped forward over 20 records and then moved back to them: the closings taken
    in between (their cut lies past the records the worker then applies) are forgotten, as `offsets set` says, and
    `stock show --at` stays exact around every closing once the worker has applied the skipped records."""
    rng = random.Random(41)
    first = _movements(rng, 20, datetime.now(UTC))
    await send_to_partition(services.kafka, topic, P, [(str(m["sku"]).encode(), json.dumps(m).encode())
                                                      for m in first])
    worker = workers.start(**CLOSINGS)
    await wait_drained(services, database, topic, workers.group, 60, workers)
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    later = _movements(rng, 20, datetime.now(UTC))
    await send_to_partition(services.kafka, topic, P, [(str(m["sku"]).encode(), json.dumps(m).encode())
                                                      for m in later])
    skipped = await cli(workers, "offsets", "set", "--partition", str(P), "--offset", "40", "--note", "test skip",
                        "--force", "--json")
    assert skipped.code == 0, skipped.err
    before_skip = len(await _closings(database.owner_url))
    worker = workers.start(**CLOSINGS)
    await wait_drained(services, database, topic, workers.group, 60, workers)
    count = await _wait_for_closings(database.owner_url, before_skip, workers)
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    conn = await asyncpg.connect(database.owner_url)
    try:
        past = await conn.fetchval("SELECT count(*) FROM closing_cuts WHERE kafka_partition = $1 AND next_offset > 20",
                                   P)
    finally:
        await conn.close()
    assert past >= 1, "a closing must have been taken past the skipped records"

    back = await cli(workers, "offsets", "set", "--partition", str(P), "--offset", "20", "--note", "test back",
                     "--force", "--json")
    assert back.code == 0, back.err
    assert back.json()["closings_forgotten"] == past
    assert len(await _closings(database.owner_url)) == count - past
    worker = workers.start(**CLOSINGS)
    await wait_drained(services, database, topic, workers.group, 60, workers)
    await _wait_for_closings(database.owner_url, count - past, workers)
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    closings = await _closings(database.owner_url)
    sent = first + later
    for c in closings:
        for at in (c["positioned_at"] - timedelta(seconds=1), c["positioned_at"] + timedelta(milliseconds=1)):
            assert await _stock_at(workers, "WH-1", at) == _expected(sent, "WH-1", at), at.isoformat()


async def test_closings_stay_exact_across_archived_segments(
    services: Services, database: Env, topic: str, workers: WorkerPool, tmp_path: Path,
) -> None:
    """Partition 5's movements, which occurred within an hour either side of now, in segments of 20 offsets; closings
    taken while they were applied. The first segment, offsets 0-39, is archived (Kafka deleted its records):
    `stock show --at T` between and around the closings gives the same answers as before, equal to the Σ of the
    sent movements, with the archive's files read for the pairs whose archived movements lie on both sides of T;
    the closings taken while the worker was still inside an archived segment are never read."""
    conn = await asyncpg.connect(database.owner_url)
    try:
        await conn.execute("UPDATE ledger_layout SET segment_offsets = 20")
    finally:
        await conn.close()
    rng = random.Random(42)
    now = datetime.now(UTC)
    sent = [movement(f"SKU-{rng.randrange(3)}", qty=rng.choice((4, 7, -3)), warehouse=rng.choice(WAREHOUSES),
                     occurred_at=(now + timedelta(seconds=rng.uniform(-3_600, 3_600))).isoformat())
            for _ in range(60)]
    for m in sent:
        m["kind"] = "receipt" if int(str(m["qty"])) > 0 else "pick"
    worker = workers.start(**CLOSINGS, STOCK_LEDGER_BATCH_MAX_RECORDS="7")
    await send_to_partition(services.kafka, topic, P, [(str(m["sku"]).encode(), json.dumps(m).encode())
                                                      for m in sent])
    await wait_drained(services, database, topic, workers.group, 60, workers)
    await _wait_for_closings(database.owner_url, len(await _closings(database.owner_url)) + 1, workers)
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    closings = await _closings(database.owner_url)
    taken = [c["taken_at"] for c in closings]
    times = [a + (b - a) / 2 for a, b in itertools.pairwise(taken)]
    times += [taken[-1] + timedelta(seconds=s) for s in (-1_800, -300, -1, 1, 300, 1_800)]
    times += [c["positioned_at"] + timedelta(milliseconds=d) for c in closings for d in (-1, 1)]
    times += [datetime.fromisoformat(str(m["occurred_at"])) for m in sent[::7]]
    env = {"STOCK_LEDGER_ARCHIVE_DIR": str(tmp_path), "STOCK_LEDGER_RETENTION_DAYS": "0"}

    async def answers() -> dict[tuple[str, datetime], dict[str, int]]:
        found = {}
        for at in times:
            for warehouse in WAREHOUSES:
                got = await _stock_at(workers, warehouse, at, **env)
                assert got == _expected(sent, warehouse, at), f"{warehouse} at {at.isoformat()}"
                found[warehouse, at] = got
        return found

    before = await answers()
    await delete_records_below(services.kafka, topic, P, 45)
    archived = await cli(workers, "archive", "run", "--json", **env)
    assert archived.code == 0, archived.err
    report = json.loads(archived.out)
    # The first segment reaches a whole segment past the first batch: [0, 40).
    assert [a["segment"] for a in report["archived"]] == [f"stock_movements_p{P}_o0"], report["decisions"]
    assert await answers() == before


async def _empty_window_blocks(conn: asyncpg.Connection, table: str, window: str) -> int:
    """Heap blocks a read of a time window that holds no row (before them all) reads from `table` through its BRIN:
    0 when every range is summarized right. rejected_movements' B-tree on (reason_code, rejected_at) would answer the
    window without its BRIN: it is dropped for the read, and the drop rolled back."""
    read = conn.transaction()
    await read.start()
    try:
        await conn.execute("SET LOCAL enable_seqscan = off")
        if table == "rejected_movements":
            await conn.execute("DROP INDEX rejected_movements_reason_code_idx")
        plan = json.loads(await conn.fetchval(
            f"EXPLAIN (ANALYZE, FORMAT JSON) SELECT count(*) FROM {table} WHERE {window}"))[0]["Plan"]
    finally:
        await read.rollback()

    def walk(node: dict[str, Any]) -> list[dict[str, Any]]:
        return [node, *(n for child in node.get("Plans", []) for n in walk(child))]
    nodes = walk(plan)
    used = [n["Index Name"] for n in nodes if "Index Name" in n]
    assert used, f"not an index read: {plan}"
    assert await conn.fetchval("SELECT bool_and(a.amname = 'brin') FROM pg_class AS c JOIN pg_am AS a ON "
                               "a.oid = c.relam WHERE c.relname = ANY($1)", used), f"not a BRIN read: {plan}"
    return sum(int(n.get("Exact Heap Blocks", 0)) + int(n.get("Lossy Heap Blocks", 0)) for n in nodes)


async def test_brin_summaries_never_wait_for_a_table_and_leave_no_range_unread(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """The monitor's summarizing pass (`stock_ledger_summarize_brins`, run as the worker's role) covers every BRIN of
    the ledger (a segment's on (occurred_at, kafka_offset) that `stock show --at` reads, its applied_at one that
    `verify --since` and the invariants read, rejected_movements' rejected_at one) and must never queue for a table's
    lock: a session waiting there is what makes PostgreSQL cancel autovacuum's summarization, which leaves a
    placeholder range that makes reads scan the rest of the table. With a segment locked by another session the pass
    returns at once and leaves that segment for later; the running monitor then summarizes it, its gauge
    stock_ledger_brin_ranges_behind falls to 0, and a read of a window before every row reads no heap block through
    any of the BRINs (unsummarized ranges are read by every query)."""
    good = [(f"SKU-{i % 40}".encode(), json.dumps(movement(f"SKU-{i % 40}", qty=1 + i % 5)).encode())
            for i in range(6_000)]
    await send_raw(services.kafka, topic, good + [(b"SKU-bad", b"not json %d" % i) for i in range(200)])
    worker = workers.start()
    await wait_drained(services, database, topic, workers.group, 90, workers)
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    owner = await asyncpg.connect(database.owner_url)
    app = await asyncpg.connect(database.worker_url)
    try:
        segment = await owner.fetchval(
            "SELECT table_name FROM ledger_segments ORDER BY pg_relation_size(table_name::regclass) DESC, 1 LIMIT 1")
        windows = [(segment, f"occurred_at <= '2000-01-01' AND {IN_STEP}"), (segment, "applied_at <= '2000-01-01'"),
                   ("rejected_movements", "rejected_at <= '2000-01-01'")]
        await owner.execute("DELETE FROM brin_summaries")
        indexes = await owner.fetch("SELECT brin::text, heap::text FROM brin_backlog WHERE heap = ANY($1::regclass[])",
                                    [segment, "rejected_movements"])
        assert sorted(heap for _, heap in indexes) == sorted([segment, segment, "rejected_movements"]), indexes
        for index, heap in indexes:
            await owner.execute(f"SELECT brin_desummarize_range('{index}', b) FROM generate_series(0, "
                                f"pg_relation_size('{heap}') / 8192) AS b")
        for table, window in windows:
            assert await _empty_window_blocks(owner, table, window) > 0, f"desummarized, {table} should be read whole"

        holder = await asyncpg.connect(database.owner_url)
        try:
            await holder.execute(f"BEGIN; LOCK TABLE {segment} IN SHARE UPDATE EXCLUSIVE MODE")
            await app.execute("SET statement_timeout = '5s'")
            began = time.monotonic()
            assert await app.fetchval("SELECT stock_ledger_summarize_brins()") > 0
            assert time.monotonic() - began < 4, "the pass waited for the locked segment"
            for table, window in windows[:2]:
                assert await _empty_window_blocks(owner, table, window) > 0, "the locked segment was summarized"
            assert await _empty_window_blocks(owner, *windows[2]) == 0, "the unlocked table was left"
            # The previous release's monitors call the pass by its old name while the pods roll.
            assert await app.fetchval("SELECT stock_ledger_summarize_occurred()") == 0
            monitor = workers.start(**CLOSINGS)

            def behind() -> float | None:
                return monitor.metric("stock_ledger_brin_ranges_behind")
            await eventually(lambda: (behind() or 0) > 0, 60, "the gauge showing the locked segment's ranges", workers)
        finally:
            await holder.close()
        await eventually(lambda: behind() == 0, 60, "the monitor's pass catching up", workers)
        for table, window in windows:
            assert await _empty_window_blocks(owner, table, window) == 0, f"{table}: {window}"
        assert not await owner.fetchval("SELECT sum(blocks_behind) FROM brin_backlog")
    finally:
        await app.close()
        await owner.close()
    workers.assert_no_tracebacks()


async def test_a_ledger_at_0016_keeps_its_closings_where_the_previous_release_placed_them(
    services: Services, worker_role: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Migration 0017 on a ledger the previous release (0016) left with closings: each is placed in business time at
    its taken_at, where that release's reader looked for it; while the pods roll, a closing the previous release's
    monitor takes (it does not name positioned_at) is placed at its taken_at too, and its summarizing call, by the
    old name and as the workers' role, still runs the pass."""
    async with scratch_database(services) as name:
        owner_url = await previous_release_ledger(services, name, tmp_path, monkeypatch, version=16)
        owner = await asyncpg.connect(owner_url)
        try:
            for day in ("2026-01-01", "2026-01-02"):
                await owner.execute("INSERT INTO ledger_closings (kafka_topic, taken_at, pairs) VALUES ('t', $1, 0)",
                                    datetime.fromisoformat(f"{day}T10:00:00+00:00"))
            assert await migrate(owner_url, find_migrations_dir(None)) == ["0017_closing_place.sql"]
            placed = await owner.fetch("SELECT taken_at, positioned_at FROM ledger_closings ORDER BY closing_id")
            assert [r[0] for r in placed] == [r[1] for r in placed]
            app = await asyncpg.connect(services.url_for(name, user=worker_role, password=WORKER_PASSWORD))
            try:
                async with app.transaction():
                    row = await app.fetchrow("INSERT INTO ledger_closings (kafka_topic, pairs) VALUES ('t', 0) "
                                             "RETURNING taken_at, positioned_at")
                assert row[0] == row[1]
                assert await app.fetchval("SELECT stock_ledger_summarize_occurred()") >= 0
            finally:
                await app.close()
        finally:
            await owner.close()
