"""`stock-ledger repair` on the real broker and database: the records an earlier version skipped (below the stored
offset, in neither table) are re-applied from Kafka exactly as the worker applied them, exactly once, beside running
workers and another repair; what Kafka no longer has is reported and recorded, never invented.

Every test builds the damage the failover bug leaves: a worker applies a partition, then a range of its rows is
deleted as the owner in one transaction that also takes their quantities back out of stock_levels, while the
stored offset stays past them.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.records_to_delete import RecordsToDelete
from aiokafka.structs import TopicPartition

from stock_ledger.migrate import migrate
from tests.integration.test_operate import cli, drain_and_stop, send_to
from tests.integration.test_verify import run_verify
from tests.support.helpers import Env, Services, WorkerPool, assert_exact, movement, scratch_database, wait_drained
from tests.support.services import produce

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(240)]
ROOT = Path(__file__).resolve().parents[2]

P = 5
LOST = (20, 39)  # the offsets of partition P the "failover" loses
GAP = "gaps (in topic, in neither table)"


@dataclass
class Damaged:
    """The ledger before the loss: its row counts, and the rows of the lost range as the worker wrote them."""

    rows: int
    rejected: int
    movements: dict[int, tuple[Any, ...]]
    quarantined: dict[int, tuple[Any, ...]]


def _partition_records() -> list[tuple[bytes, bytes]]:
    """50 records for partition P: 0-19 good; 20-39 (the range to lose) good but for invalid JSON at 25, qty 0 at 30
    (invalid_field), a resend of offset 3 at 33 and of offset 22 at 36 (duplicate_movement_id); 40-49 good."""
    good = [movement(f"SKU-{i % 4}", qty=i + 1, warehouse=f"WH-{i % 2}") for i in range(50)]
    values: list[bytes] = [json.dumps(m).encode() for m in good]
    values[25] = b"{not json"
    values[30] = json.dumps(movement("SKU-0", qty=0)).encode()
    values[33] = json.dumps(good[3]).encode()
    values[36] = json.dumps(good[22]).encode()
    keys = [str(m["sku"]).encode() for m in good]
    keys[30], keys[33], keys[36] = b"SKU-0", keys[3], keys[22]
    return list(zip(keys, values, strict=True))


async def send_to_partition(bootstrap: str, topic: str, partition: int, records: list[tuple[bytes, bytes]]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True, acks="all", linger_ms=5)
    await producer.start()
    try:
        futures = [await producer.send(topic, value=v, key=k, partition=partition) for k, v in records]
        await producer.flush()
        for f in futures:
            await f
    finally:
        await producer.stop()


async def owner(database: Env) -> asyncpg.Connection:
    return await asyncpg.connect(database.owner_url)


async def lose_range(database: Env, topic: str, first: int, last: int) -> Damaged:
    """Delete partition P's rows of [first, last] from both tables and their deltas from stock_levels, in one
    transaction, as the failover bug leaves it: consumer_offsets untouched, past them."""
    conn = await owner(database)
    try:
        rows = await conn.fetchval("SELECT count(*) FROM stock_movements")
        rejected = await conn.fetchval("SELECT count(*) FROM rejected_movements")
        async with conn.transaction():
            moved = await conn.fetch("""
                DELETE FROM stock_movements WHERE kafka_topic = $1 AND kafka_partition = $2
                   AND kafka_offset BETWEEN $3 AND $4
                RETURNING kafka_offset, movement_id, warehouse_id, sku, qty, kind, occurred_at, kafka_timestamp""",
                topic, P, first, last)
            bad = await conn.fetch("""
                DELETE FROM rejected_movements WHERE kafka_topic = $1 AND kafka_partition = $2
                   AND kafka_offset BETWEEN $3 AND $4
                RETURNING kafka_offset, kafka_timestamp, key, value, reason_code, movement_id""",
                topic, P, first, last)
            for r in moved:
                await conn.execute("""
                    UPDATE stock_levels SET on_hand = on_hand - $3, went_negative_at =
                           CASE WHEN on_hand - $3 < 0 THEN coalesce(went_negative_at, now()) END
                     WHERE warehouse_id = $1 AND sku = $2""", r["warehouse_id"], r["sku"], r["qty"])
    finally:
        await conn.close()
    return Damaged(rows, rejected, {r[0]: tuple(r)[1:] for r in moved}, {r[0]: tuple(r)[1:] for r in bad})


async def lost_range_ledger(services: Services, database: Env, topic: str, workers: WorkerPool) -> Damaged:
    """Partition P's 50 records and 600 generated movements over all partitions, applied by a worker (stopped),
    then LOST deleted."""
    await send_to_partition(services.kafka, topic, P, _partition_records())
    await produce(services.kafka, topic, 600, seed=7, show_progress=False)
    await drain_and_stop(services, database, topic, workers)
    return await lose_range(database, topic, *LOST)


async def snapshot(database: Env) -> dict[str, Any]:
    """Everything repair may write, and the offsets it must never move."""
    conn = await owner(database)
    try:
        return {
            "movements": await conn.fetch("SELECT * FROM stock_movements ORDER BY kafka_partition, kafka_offset"),
            "rejected": await conn.fetch("SELECT * FROM rejected_movements ORDER BY kafka_partition, kafka_offset"),
            "levels": await conn.fetch("SELECT warehouse_id, sku, on_hand FROM stock_levels ORDER BY 1, 2"),
            "offsets": await conn.fetch("SELECT * FROM consumer_offsets ORDER BY partition"),
            "repairs": await conn.fetchval("SELECT count(*) FROM ledger_repairs"),
            "gaps": await conn.fetch("SELECT * FROM ledger_gaps ORDER BY id"),
        }
    finally:
        await conn.close()


async def rows_of(database: Env, topic: str, first: int, last: int) -> tuple[dict[int, tuple[Any, ...]],
                                                                            dict[int, tuple[Any, ...]]]:
    conn = await owner(database)
    try:
        moved = await conn.fetch("""
            SELECT kafka_offset, movement_id, warehouse_id, sku, qty, kind, occurred_at, kafka_timestamp
              FROM stock_movements WHERE kafka_topic = $1 AND kafka_partition = $2
               AND kafka_offset BETWEEN $3 AND $4""",
            topic, P, first, last)
        bad = await conn.fetch("""
            SELECT kafka_offset, kafka_timestamp, key, value, reason_code, movement_id
              FROM rejected_movements WHERE kafka_topic = $1 AND kafka_partition = $2
               AND kafka_offset BETWEEN $3 AND $4""", topic, P, first, last)
    finally:
        await conn.close()
    return {r[0]: tuple(r)[1:] for r in moved}, {r[0]: tuple(r)[1:] for r in bad}


def partition_entry(document: dict[str, Any], partition: int = P) -> dict[str, Any]:
    return next(p for p in document["partitions"] if p["partition"] == partition)


EXPECTED = {"missing": 20, "applied": 16, "already_present": 0, "left_to_workers": 0, "excluded_recorded_gaps": 0,
            "gone": 0, "unknown": 0, "quarantined": {"invalid_json": 1, "invalid_field": 1, "duplicate_movement_id": 2}}


class TestRepair:
    """A lost range of movements, bad records and resends, put back exactly as the worker wrote it."""

    async def test_dry_run_then_repair_puts_back_exactly_what_the_worker_wrote(
        self, services: Services, database: Env, topic: str, workers: WorkerPool,
    ) -> None:
        """1. verify fails naming the lost range p5 20-39.
        2. `repair --dry-run` changes nothing (rows, levels, offsets, audit) and reports what repair then does.
        3. `repair` writes 16 movements and 4 quarantine rows (invalid_json, invalid_field, two
           duplicate_movement_id): the same coordinates, tables, values, raw bytes and reason codes as the worker's,
           levels with their deltas; consumer_offsets untouched; ledger_repairs says who repaired what.
        4. verify passes, the independent check finds every record in exactly one table and levels = Σ movements.
        5. A second repair finds nothing and changes nothing. The worker role cannot write ledger_repairs."""
        before = await lost_range_ledger(services, database, topic, workers)
        broken = await run_verify(workers)
        assert broken.code == 1
        assert broken.check(GAP) == f"FAIL    20 records: p{P}: 20-39"
        damaged = await snapshot(database)

        dry = await cli(workers, "repair", "--dry-run", "--json")
        assert dry.code == 0, dry.err
        assert dry.json()["dry_run"] is True
        assert dry.json()["totals"] == EXPECTED
        assert partition_entry(dry.json())["missing_ranges"] == [list(LOST)]
        assert await snapshot(database) == damaged
        assert "repair: applying" in dry.err  # progress on stderr

        done = await cli(workers, "repair", "--json")
        assert done.code == 0, done.err
        assert done.json()["totals"] == EXPECTED
        assert [p["partition"] for p in done.json()["partitions"] if p["missing"]] == [P]
        assert '"repair.partition"' in done.err  # the audit log line, on stderr beside the JSON report
        movements, quarantined = await rows_of(database, topic, *LOST)
        assert movements == before.movements
        assert quarantined == before.quarantined
        assert sorted(quarantined) == [25, 30, 33, 36]

        after = await snapshot(database)
        assert after["offsets"] == damaged["offsets"]
        fixed = await run_verify(workers)
        assert fixed.code == 0, fixed.stdout
        await assert_exact(services, database, topic, workers.group, rows=before.rows, rejected=before.rejected)
        conn = await owner(database)
        try:
            audit = await conn.fetch("SELECT *, current_user AS me FROM ledger_repairs")
        finally:
            await conn.close()
        assert [(a["partition"], a["first_offset"], a["last_offset"], a["records"], a["applied"], a["quarantined"])
                for a in audit] == [(P, 20, 39, 20, 16, 4)]
        assert audit[0]["repaired_by"] == audit[0]["me"]
        assert str(audit[0]["run_id"]) == done.json()["run_id"]
        assert json.loads(audit[0]["reasons"]) == EXPECTED["quarantined"]

        again = await cli(workers, "repair")
        assert again.code == 0, again.err
        assert "total: missing 0, applied 0, quarantined 0, already present 0, gone 0" in again.out
        assert await snapshot(database) == after

        worker = await asyncpg.connect(database.worker_url)
        try:
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await worker.execute("INSERT INTO ledger_repairs (run_id, group_id, topic, partition, first_offset, "
                                     "last_offset, records, applied, quarantined) "
                                     "VALUES (gen_random_uuid(), 'g', 't', 0, 0, 0, 1, 1, 0)")
        finally:
            await worker.close()

    async def test_two_repairs_at_once_apply_each_record_once(
        self, services: Services, database: Env, topic: str, workers: WorkerPool,
    ) -> None:
        """Two repairs of 3 records per transaction run at the same time: both exit 0, together they apply the 16
        movements and quarantine the 4 bad records exactly once (what one wrote the other finds present), and the
        ledger is exact."""
        before = await lost_range_ledger(services, database, topic, workers)
        first, second = await asyncio.gather(cli(workers, "repair", "--batch-size", "3", "--json"),
                                             cli(workers, "repair", "--batch-size", "3", "--json"))
        assert first.code == second.code == 0, first.err + second.err
        a, b = first.json()["totals"], second.json()["totals"]
        assert a["applied"] + b["applied"] == 16
        codes = {c: a["quarantined"].get(c, 0) + b["quarantined"].get(c, 0) for c in EXPECTED["quarantined"]}
        assert codes == EXPECTED["quarantined"]
        for t in (a, b):  # each wrote or found present every record it found missing
            assert t["applied"] + sum(t["quarantined"].values()) + t["already_present"] == t["missing"]
        movements, quarantined = await rows_of(database, topic, *LOST)
        assert movements == before.movements
        assert {o: r[:4] for o, r in quarantined.items()} == {o: r[:4] for o, r in before.quarantined.items()}
        await assert_exact(services, database, topic, workers.group, rows=before.rows, rejected=before.rejected)
        assert (await run_verify(workers)).code == 0

    async def test_repair_beside_running_workers_and_a_producer(
        self, services: Services, database: Env, topic: str, workers: WorkerPool,
    ) -> None:
        """Two workers run while 3,000 movements arrive at 600/s, and 400 more on p5 for the lost range's own
        (warehouse, sku) pairs, so workers and repair update the same stock_levels rows. The lost range is deleted
        and repaired meanwhile: repair exits 0 having applied the 16 and quarantined the 4, the workers apply
        everything else, and once drained the ledger is exact (every record once, levels = Σ movements, offsets at
        the log end) and verify passes."""
        await send_to_partition(services.kafka, topic, P, _partition_records())
        await produce(services.kafka, topic, 600, seed=7, show_progress=False)
        workers.start()
        workers.start()
        await wait_drained(services, database, topic, workers.group, 90, workers)
        async def same_skus_on_p5() -> None:
            for n in range(20):
                await send_to_partition(services.kafka, topic, P, [
                    (f"SKU-{i % 4}".encode(),
                     json.dumps(movement(f"SKU-{i % 4}", qty=n + 1, warehouse=f"WH-{i % 2}")).encode())
                    for i in range(20)])
                await asyncio.sleep(0.25)

        producing = asyncio.gather(produce(services.kafka, topic, 3_000, rate=600, seed=8, show_progress=False),
                                   same_skus_on_p5())
        await asyncio.sleep(1)
        await lose_range(database, topic, *LOST)
        assert not producing.done(), "repair is meant to start while the producer runs"
        done = await cli(workers, "repair", "--batch-size", "4", "--json")
        assert done.code == 0, done.err
        assert done.json()["totals"]["applied"] == 16
        assert done.json()["totals"]["quarantined"] == EXPECTED["quarantined"]
        await producing
        await wait_drained(services, database, topic, workers.group, 90, workers)
        # p5's 46 good records and 400 more, 600 and 3,000 generated movements; p5's 4 bad records quarantined.
        await assert_exact(services, database, topic, workers.group, rows=46 + 400 + 600 + 3_000, rejected=4,
                           pool=workers)
        assert (await run_verify(workers)).code == 0
        workers.assert_no_tracebacks()

    async def test_a_range_gone_from_kafka_is_reported_and_recorded_never_invented(
        self, services: Services, database: Env, topic: str, workers: WorkerPool,
    ) -> None:
        """The lost range 20-39, then Kafka deletes p5's records below 30.
        1. --dry-run exits 3, reports 20-29 gone and 30-39 missing, and writes nothing (no ledger_gaps row either).
        2. repair exits 3: it applies what Kafka still has (30-39: 8 movements; qty 0 and the resend of offset 3
           quarantined; offset 36, a resend of 22, is now the only copy of its movement and is applied), writes
           nothing at 20-29, and records 20-29 as an unacknowledged ledger_gaps row, so verify fails on it.
        3. Again: exit 3, the same gap, nothing new. After `gaps ack`, repair exits 0 and verify passes."""
        await lost_range_ledger(services, database, topic, workers)
        admin = AIOKafkaAdminClient(bootstrap_servers=services.kafka)
        await admin.start()
        try:
            await admin.delete_records({TopicPartition(topic, P): RecordsToDelete(before_offset=30)},
                                       timeout_ms=10_000)
        finally:
            await admin.close()
        damaged = await snapshot(database)

        dry = await cli(workers, "repair", "--dry-run")
        assert dry.code == 3, dry.out + dry.err
        assert f"p{P}: GONE from Kafka, below the log start 30: 20-29 (not recorded: dry run)" in dry.out
        assert f"p{P}: missing 30-39" in dry.out
        assert await snapshot(database) == damaged

        done = await cli(workers, "repair", "--json")
        assert done.code == 3, done.err
        entry = partition_entry(done.json())
        assert (entry["gone_ranges"], entry["missing_ranges"]) == ([[20, 29]], [[30, 39]])
        assert (entry["applied"], entry["quarantined"]) == (8, {"invalid_field": 1, "duplicate_movement_id": 1})
        movements, quarantined = await rows_of(database, topic, 20, 29)
        assert movements == quarantined == {}
        conn = await owner(database)
        try:
            gaps = await conn.fetch("SELECT * FROM ledger_gaps")
        finally:
            await conn.close()
        assert [(g["partition"], g["first_offset"], g["last_offset"], g["reason"], g["acknowledged_at"])
                for g in gaps] == [(P, 20, 29, "skipped_below_log_start", None)]
        assert entry["gap_ids"] == [gaps[0]["id"]]
        unacknowledged = await run_verify(workers)
        assert unacknowledged.code == 1
        assert unacknowledged.check("no unacknowledged gap (ledger_gaps)").startswith(f"FAIL    1 open: p{P} 20-29")

        repaired = await snapshot(database)
        again = await cli(workers, "repair", "--json")
        assert again.code == 3
        assert partition_entry(again.json())["gap_ids"] == [gaps[0]["id"]]
        assert again.json()["totals"]["applied"] == 0
        assert await snapshot(database) == repaired

        acked = await cli(workers, "gaps", "ack", str(gaps[0]["id"]), "--note", "counted by hand")
        assert acked.code == 0, acked.err
        settled = await cli(workers, "repair", "--json")
        assert settled.code == 0, settled.err
        assert settled.json()["totals"]["excluded_recorded_gaps"] == 10
        assert (await run_verify(workers)).code == 0

    async def test_a_record_the_database_refuses_is_quarantined_as_the_worker_does(
        self, services: Services, database: Env, topic: str, workers: WorkerPool,
    ) -> None:
        """A CHECK the migrations do not define (qty <> 27, for new rows) refuses offset 26 of the lost range, which
        the parser accepts. Repair quarantines it as `database_rejected` with the refusal and its raw bytes, as the
        worker's batch does, and applies the rest: exit 0, 15 movements and 5 quarantined, the audit row counts
        them, levels hold exactly the applied movements, and verify passes (every record in exactly one table)."""
        before = await lost_range_ledger(services, database, topic, workers)
        conn = await owner(database)
        try:
            await conn.execute("ALTER TABLE stock_movements ADD CONSTRAINT not_27 CHECK (qty <> 27) NOT VALID")
        finally:
            await conn.close()
        done = await cli(workers, "repair", "--json")
        assert done.code == 0, done.out + done.err
        assert done.json()["totals"]["applied"] == 15
        assert done.json()["totals"]["quarantined"] == {**EXPECTED["quarantined"], "database_rejected": 1}
        movements, quarantined = await rows_of(database, topic, *LOST)
        assert 26 not in movements
        assert movements == {o: r for o, r in before.movements.items() if o != 26}
        assert sorted(quarantined) == [25, 26, 30, 33, 36]
        _, key, value, code, movement_id = quarantined[26]
        assert (code, movement_id) == ("database_rejected", before.movements[26][0])
        raw = json.loads(value)  # the record's own bytes, kept
        assert (key, raw["qty"], raw["movement_id"]) == (b"SKU-2", 27, str(movement_id))
        conn = await owner(database)
        try:
            reason = await conn.fetchval("SELECT reason FROM rejected_movements WHERE kafka_topic = $1 AND "
                                         "kafka_partition = $2 AND kafka_offset = 26", topic, P)
            audit = await conn.fetch("SELECT applied, quarantined, reasons FROM ledger_repairs")
        finally:
            await conn.close()
        assert reason.startswith("PostgreSQL refused the row (23514)"), reason
        assert "not_27" in reason, reason
        assert [(a["applied"], a["quarantined"]) for a in audit] == [(15, 5)]
        assert json.loads(audit[0]["reasons"])["database_rejected"] == 1
        await assert_exact(services, database, topic, workers.group, rows=before.rows - 1,
                           rejected=before.rejected + 1)
        assert (await run_verify(workers)).code == 0


class TestUnknownGroup:
    """`repair` and `verify` with a STOCK_LEDGER_GROUP_ID the database holds no stored offset of (a typo) used to
    find every stored offset "none": repair reported "missing 0" and exited 0, and `verify --since` passed. Both now
    refuse, naming the groups the database holds (issue 38, item 5)."""

    async def test_repair_and_verify_refuse_a_group_the_database_does_not_hold(
        self, services: Services, database: Env, topic: str, workers: WorkerPool,
    ) -> None:
        """1. A worker applies 10 records of partition 1 and stops; 5 of them are lost, so there is something to
           repair.
        2. With STOCK_LEDGER_GROUP_ID=<group>-typo: `repair` exits 1 with one line naming the typo, the topic and
           the group the database holds, and changes nothing; `verify` and `verify --since 1h` exit 1 the same way.
        3. On a migrated database no worker ever wrote to, `repair` exits 1 saying it holds no group at all."""
        await send_to(services.kafka, topic, 1, 10)
        await drain_and_stop(services, database, topic, workers)
        conn = await owner(database)
        try:
            await conn.execute("DELETE FROM stock_movements WHERE kafka_partition = 1 AND kafka_offset >= 5")
        finally:
            await conn.close()
        damaged = await snapshot(database)
        typo = f"{workers.group}-typo"
        refused = await cli(workers, "repair", STOCK_LEDGER_GROUP_ID=typo)
        assert refused.code == 1, refused.out + refused.err
        assert refused.out == ""
        [line] = refused.err.strip().splitlines()
        assert line.startswith(f"stock-ledger repair: group {typo!r} has no stored offsets of topic {topic!r}"), line
        assert f"group {workers.group!r} (topic {topic!r}, 24 partitions)" in line, line
        assert "STOCK_LEDGER_GROUP_ID" in line
        assert await snapshot(database) == damaged
        for args in ((), ("--since", "1h")):
            checked = await cli(workers, "verify", *args, STOCK_LEDGER_GROUP_ID=typo)
            assert checked.code == 1, f"verify {args}: {checked.out}"
            [line] = checked.err.strip().splitlines()
            assert f"group {typo!r} has no stored offsets of topic {topic!r}" in line, line
            assert f"group {workers.group!r} (topic {topic!r}, 24 partitions)" in line, line
        fixed = await cli(workers, "repair", "--json")
        assert (fixed.code, fixed.json()["totals"]["applied"]) == (0, 5), fixed.err

        async with scratch_database(services) as name:
            blank = services.url_for(name)
            await migrate(blank, ROOT / "migrations")
            empty = await cli(workers, "repair", url=blank)
        assert empty.code == 1, empty.out + empty.err
        assert "this database holds no stored offsets of any group" in empty.err, empty.err


async def _waiting(database: Env, lock: str) -> bool:
    """Whether a session of the test database waits for a lock of this kind (`transactionid`: a row another
    transaction holds; `advisory`)."""
    conn = await owner(database)
    try:
        return bool(await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' "
            "AND wait_event = $1", lock))
    finally:
        await conn.close()


async def test_offsets_set_and_a_repair_chunk_take_turns(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """The race that left workers crash-looping, interleaved deterministically by locks:
    1. p5's rows 40-49 are lost (its stored offset stays 50, so the lowest offset `offsets set` may move to is 40).
    2. A repair of p5 starts its chunk 40-49 and is held inside it (the test holds a stock_levels row it must
       update): its rows are written, not yet committed.
    3. `offsets set --partition 5 --offset 40` runs meanwhile. It must wait for the chunk (today it did not: its
       floor saw only committed rows, it moved the offset to 40 and committed, and the chunk then committed rows
       40-49 at and above the stored offset, so every worker's next batch hit the coordinates constraint).
    4. The chunk is let go: repair applies the 10 records and exits 0; `offsets set` then sees them and refuses to
       move below 50, naming the floor. The stored offset stays 50, no row is at or above it, verify passes."""
    slow = {"STOCK_LEDGER_LOCK_TIMEOUT_MS": "60000"}
    await send_to_partition(services.kafka, topic, P, _partition_records())
    await drain_and_stop(services, database, topic, workers)
    before = await lose_range(database, topic, 40, 49)
    hold = await owner(database)
    try:
        tx = hold.transaction()
        await tx.start()
        await hold.execute("SELECT on_hand FROM stock_levels WHERE warehouse_id = 'WH-0' AND sku = 'SKU-0' FOR UPDATE")
        repairing = asyncio.ensure_future(cli(workers, "repair", "--partition", str(P), "--json", **slow))
        for _ in range(600):  # the chunk has written its rows and waits for the levels row
            if await _waiting(database, "transactionid") or repairing.done():
                break
            await asyncio.sleep(0.1)
        assert not repairing.done(), (await repairing).err
        assert await _waiting(database, "transactionid"), "repair never reached its chunk"
        moving = asyncio.ensure_future(cli(workers, "offsets", "set", "--partition", str(P), "--offset", "40", **slow))
        for _ in range(600):  # waits for the chunk's lock (or, as it did, does not)
            if await _waiting(database, "advisory") or moving.done():
                break
            await asyncio.sleep(0.1)
        assert moving.done() or await _waiting(database, "advisory"), "offsets set neither finished nor waited"
        await tx.rollback()
    finally:
        await hold.close()
    repaired, moved = await repairing, await moving
    assert repaired.code == 0, repaired.err
    assert repaired.json()["totals"]["applied"] == 10
    assert moved.code == 1, moved.out + moved.err
    assert f"refusing to move partition {P} to 40: offsets up to 49 are already in the ledger" in moved.err
    conn = await owner(database)
    try:
        assert await conn.fetchval("SELECT next_offset FROM consumer_offsets WHERE partition = $1", P) == 50
        assert await conn.fetchval("SELECT count(*) FROM stock_movements WHERE kafka_partition = $1 AND "
                                   "kafka_offset >= 50", P) == 0
    finally:
        await conn.close()
    await assert_exact(services, database, topic, workers.group, rows=before.rows, rejected=before.rejected)
    assert (await run_verify(workers)).code == 0
