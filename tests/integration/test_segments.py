"""The ledger in segments (issue 39, migrations/0014_segments.sql), on the real broker and database: segments are
made ahead by the running workers, a resend is recognised whichever segment holds the original, and an existing
ledger is moved to the new layout while the previous release's workers keep writing."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import uuid
from typing import TYPE_CHECKING

import asyncpg
import pytest

import stock_ledger.migrate as migrations
from stock_ledger.migrate import find_migrations_dir, migrate
from tests.integration.test_repair import send_to_partition
from tests.support.helpers import (
    Env,
    Services,
    WorkerPool,
    assert_exact,
    eventually,
    movement,
    scratch_database,
    wait_drained,
)
from tests.support.services import WORKER_PASSWORD, produce

if TYPE_CHECKING:
    from pathlib import Path

    from tests.support.services import WorkerProcess

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(240)]

SEGMENTS_OF_EACH = """
SELECT s.kafka_partition, array_agg(s.first_offset ORDER BY s.first_offset),
       array_agg(s.end_offset ORDER BY s.first_offset)
  FROM ledger_segments AS s GROUP BY 1 ORDER BY 1
"""

PARTITIONED = "SELECT relkind = 'p' FROM pg_class WHERE oid = 'stock_movements'::regclass"


async def _fetch(url: str, query: str, *args: object) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(url)
    try:
        return list(await conn.fetch(query, *args))
    finally:
        await conn.close()


async def test_a_drain_across_many_segments_is_exact_and_keeps_headroom(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """Segments of 25 offsets: 1,500 records over 24 partitions cross two or three segment bounds on every partition
    while two workers drain in batches of at most 20 (under a segment: every partition's first batch leaves its
    first segment short of its records, so segments are made as it goes whatever the timing). The ledger is exact
    with nothing quarantined (no insert failed for want of a segment); each partition's segments run from 0 without a
    gap, the last ending at least half a segment past the stored offset; every table under stock_movements is a
    registered segment (no default partition collects rows); the workers export the headroom."""
    await _fetch(database.owner_url, "UPDATE ledger_layout SET segment_offsets = 25")
    await produce(services.kafka, topic, 1_500, seed=91, show_progress=False)
    # Small batches: each partition's offset moves a few at a time, so segments are made as it goes.
    pair = [workers.start(STOCK_LEDGER_BATCH_MAX_RECORDS="20") for _ in range(2)]
    await wait_drained(services, database, topic, workers.group, 120, workers)
    await assert_exact(services, database, topic, workers.group, rows=1_500, pool=workers)
    stored = {r[0]: r[1] for r in await _fetch(database.owner_url,
                                               "SELECT partition, next_offset FROM consumer_offsets")}
    segments = await _fetch(database.owner_url, SEGMENTS_OF_EACH)
    assert {r[0] for r in segments} == set(stored)
    for partition, firsts, ends in segments:
        assert firsts[0] == 0
        assert firsts[1:] == ends[:-1], f"p{partition}: segments not contiguous: {firsts} {ends}"
        assert ends[-1] - stored[partition] >= 25 // 2, (partition, ends[-1], stored[partition])
        # The first segment reaches a whole segment past the first batch; a partition that went further needed more.
        assert len(firsts) >= 2 or stored[partition] <= ends[0] - 25 // 2, (partition, firsts, stored[partition])
    assert sum(len(firsts) for _, firsts, _ in segments) >= 2 * len(segments), "segments were not made as it went"
    unregistered = await _fetch(database.owner_url, """
        SELECT relid::text FROM pg_partition_tree('stock_movements') WHERE isleaf
        EXCEPT SELECT table_name FROM ledger_segments""")
    assert not unregistered
    assert await _fetch(database.owner_url, "SELECT partdefid FROM pg_partitioned_table "
                                            "WHERE partrelid = 'stock_movements'::regclass AND partdefid <> 0") == []
    headroom = [w.metric("stock_ledger_segment_headroom", {"partition": str(p)}) for p in range(24) for w in pair]
    assert [h for h in headroom if h is not None], "no worker exports stock_ledger_segment_headroom"
    assert all(h >= 0.5 for h in headroom if h is not None), headroom
    workers.assert_no_tracebacks()


async def test_a_partition_s_headroom_is_exported_by_its_owner_only(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """One worker drains alone and exports the headroom of every partition; a second joins and takes some of them.
    Once both have applied more movements, each partition's headroom is exported by exactly one worker, the one that
    owns it: a worker forgets the series of the partitions it lost (a frozen low value would keep the alert, a min
    over the pods, firing after the partition moved)."""
    def exported(worker: WorkerProcess) -> set[int]:
        return {p for p in range(24) if worker.metric("stock_ledger_segment_headroom", {"partition": str(p)})
                is not None}

    await produce(services.kafka, topic, 1_200, seed=93, show_progress=False)
    first = workers.start()
    await wait_drained(services, database, topic, workers.group, 60, workers)
    assert exported(first) == set(range(24))
    second = workers.start()
    await eventually(lambda: (second.metric("stock_ledger_assigned_partitions") or 0) > 0
                     and (first.metric("stock_ledger_assigned_partitions") or 24) < 24, 60, "the partitions shared",
                     workers)
    await produce(services.kafka, topic, 1_200, seed=94, show_progress=False)
    await wait_drained(services, database, topic, workers.group, 60, workers)
    await assert_exact(services, database, topic, workers.group, rows=2_400, pool=workers)
    mine, theirs = exported(first), exported(second)
    assert mine, theirs
    assert theirs, mine
    assert not mine & theirs, f"exported by both: {sorted(mine & theirs)}"
    assert mine | theirs == set(range(24))
    workers.assert_no_tracebacks()


async def test_a_resend_is_quarantined_whichever_segment_holds_the_original(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """Segments of 10 offsets: a movement at offset 0 of partition 4 and, 35 records later (three segments on), the
    same movement again: the resend is quarantined as duplicate_movement_id, never applied twice (the id registry,
    not a per-segment index, decides)."""
    await _fetch(database.owner_url, "UPDATE ledger_layout SET segment_offsets = 10")
    original = movement("SKU-4", qty=7)
    records = [(b"SKU-4", json.dumps(original).encode())]
    records += [(b"SKU-4", json.dumps(movement("SKU-4", qty=1)).encode()) for _ in range(34)]
    records += [(b"SKU-4", json.dumps(original).encode())]
    await send_to_partition(services.kafka, topic, 4, records)
    workers.start(STOCK_LEDGER_BATCH_MAX_RECORDS="4")
    await wait_drained(services, database, topic, workers.group, 60, workers)
    await assert_exact(services, database, topic, workers.group, rows=35, rejected=1, pool=workers)
    (row,) = await _fetch(database.owner_url, "SELECT kafka_offset, reason_code FROM rejected_movements")
    assert (row[0], row[1]) == (35, "duplicate_movement_id")
    (segments,) = await _fetch(database.owner_url, "SELECT count(*) FROM ledger_segments WHERE kafka_partition = 4")
    assert segments[0] >= 4


async def previous_release_ledger(services: Services, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  version: int = 13) -> str:
    """A database migrated as a previous release left it (migrations 0001 to `version`); its owner URL."""
    old = tmp_path / f"migrations-{version:04d}"
    old.mkdir()
    for path in sorted(find_migrations_dir(None).glob("00*.sql")):
        if int(path.name[:4]) <= version:
            shutil.copy(path, old / path.name)
    url = services.url_for(name)
    with monkeypatch.context() as m:
        m.setattr(migrations, "SCHEMA_VERSION", version)
        await migrate(url, old)
    return url


async def test_an_existing_ledger_moves_to_segments_while_the_previous_release_writes(
    services: Services, worker_role: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ledger of 120,000 movements in the previous release's table; while migration 0014 runs, a writer with the
    worker's credential keeps inserting batches as the previous release's worker does (COPY into
    stock_movements). Afterwards stock_movements is partitioned and holds every movement exactly once, old and new,
    the registry holds each id once, the writer never failed and wrote on after the swap, and the old table is kept
    read-only for the way back."""
    async with scratch_database(services) as name:
        owner_url = await previous_release_ledger(services, name, tmp_path, monkeypatch)
        owner = await asyncpg.connect(owner_url)
        try:
            await owner.execute("""
                INSERT INTO stock_movements (movement_id, warehouse_id, sku, qty, kind, occurred_at, kafka_topic,
                                             kafka_partition, kafka_offset)
                SELECT gen_random_uuid(), 'WH-1', 'SKU-' || (i % 50), 1, 'receipt', now(), 'old', i % 24, i / 24
                  FROM generate_series(0, 119999) AS i""")
            worker_url = services.url_for(name, user=worker_role, password=WORKER_PASSWORD)
            writer = await asyncpg.connect(worker_url)
            stop = asyncio.Event()
            written, slowest, after_swap = 0, 0.0, 0

            async def previous_release() -> None:
                nonlocal written, slowest, after_swap
                offset = 5_000
                while not stop.is_set():
                    started = time.monotonic()
                    await writer.execute(
                        "INSERT INTO stock_movements (movement_id, warehouse_id, sku, qty, kind, occurred_at, "
                        "kafka_topic, kafka_partition, kafka_offset) SELECT id, 'WH-2', 'SKU-X', 1, 'receipt', now(), "
                        "'old', p, $2 FROM unnest($1::uuid[], $3::int[]) AS u(id, p)",
                        [uuid.uuid4() for _ in range(24)], offset, list(range(24)))
                    slowest = max(slowest, time.monotonic() - started)
                    written += 24
                    offset += 1
                    if await owner.fetchval(PARTITIONED):
                        after_swap += 24
                    await asyncio.sleep(0.01)

            writing = asyncio.create_task(previous_release())
            await asyncio.sleep(0.5)
            applied = await migrate(owner_url, find_migrations_dir(None))
            await asyncio.sleep(1)
            stop.set()
            await writing
            await writer.close()
            assert applied == ["0014_segments.sql", "0015_archives.sql", "0016_closings.sql", "0017_closing_place.sql"]
            total = 120_000 + written
            assert after_swap > 0, "the writer never wrote into the new layout"
            assert await owner.fetchval(PARTITIONED)
            assert await owner.fetchval("SELECT count(*) FROM stock_movements") == total
            assert await owner.fetchval("SELECT count(DISTINCT source) FROM stock_movements") == total
            assert await owner.fetchval("SELECT count(*) FROM movement_ids") == total
            assert await owner.fetchval("SELECT count(*) FROM movement_ids AS i JOIN stock_movements USING "
                                        "(movement_id)") == total
            # Every BRIN of the upgraded ledger is the monitor's pass's to check (nothing marks what 0016 built: it
            # may have been applied long before, and summarized by autovacuum since), and one pass settles them all.
            behind = await owner.fetchval("SELECT count(*) FROM brin_backlog WHERE blocks_behind > 0")
            assert behind >= await owner.fetchval("SELECT count(*) FROM ledger_segments WHERE pg_relation_size("
                                                  "table_name::regclass) > 0"), "a segment's BRIN is not listed"
            assert await owner.fetchval("SELECT stock_ledger_summarize_brins(1000000)") > 0
            assert not await owner.fetchval("SELECT sum(blocks_behind) FROM brin_backlog")
            kept = await owner.fetchval("SELECT count(*) FROM stock_movements_before_0014")
            assert 120_000 <= kept <= total - after_swap
            assert not await owner.fetchval("SELECT has_table_privilege('stock_ledger_app', "
                                            "'stock_movements_before_0014', 'INSERT')")
            print(f"online upgrade: {written} rows written meanwhile, slowest insert {slowest:.2f} s")
        finally:
            await owner.close()
