"""Operator commands on the real broker and database: `offsets show|set`, `rejected list|show|replay`.

Each test drives the CLI as an operator would (a subprocess, the owner's DATABASE_URL) and checks the ledger
itself afterwards: positions, gaps, and the guarantee that every record is in exactly one table.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import asyncpg
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.records_to_delete import RecordsToDelete
from aiokafka.structs import TopicPartition

from tests.support.helpers import (
    Env,
    Services,
    WorkerPool,
    assert_exact,
    eventually,
    make_segments,
    movement,
    send_raw,
    wait_drained,
)

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

PARTITION = 3


@dataclass(frozen=True)
class Result:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


async def cli(pool: WorkerPool, *args: str, url: str | None = None, **extra: str) -> Result:
    """`stock-ledger <args>` as the owner role, against the pool's topic and group (`extra`: more environment)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STOCK_LEDGER_")}
    env.update({"KAFKA_BOOTSTRAP_SERVERS": pool.services.kafka, "DATABASE_URL": url or pool.db.owner_url,
                "STOCK_LEDGER_TOPIC": pool.topic, "STOCK_LEDGER_GROUP_ID": pool.group,
                "STOCK_LEDGER_LOG_FORMAT": "json"} | extra)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "stock_ledger", *args, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return Result(proc.returncode, out.decode(), err.decode())


async def send_to(bootstrap: str, topic: str, partition: int, count: int, sku: str = "SKU-P") -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True, acks="all")
    await producer.start()
    try:
        for _ in range(count):
            await producer.send_and_wait(topic, json.dumps(movement(sku, qty=1)).encode(), key=sku.encode(),
                                         partition=partition)
    finally:
        await producer.stop()


async def stored(db: Env, group: str, topic: str, partition: int) -> tuple[int | None, int]:
    conn = await asyncpg.connect(db.owner_url)
    try:
        row = await conn.fetchrow("SELECT next_offset, epoch FROM consumer_offsets WHERE group_id = $1 AND "
                                  "topic = $2 AND partition = $3", group, topic, partition)
    finally:
        await conn.close()
    assert row is not None
    return row["next_offset"], row["epoch"]


async def drain_and_stop(services: Services, database: Env, topic: str, workers: WorkerPool) -> None:
    worker = workers.start()
    await wait_drained(services, database, topic, workers.group, 60, workers)
    worker.signal(__import__("signal").SIGTERM)
    assert worker.wait(30) == 0
    # The group empties once the coordinator processed the LeaveGroup.
    await eventually(lambda: _group_empty(services, workers.group), 20, "the group to have no members")


async def _group_empty(services: Services, group: str) -> bool:
    admin = AIOKafkaAdminClient(bootstrap_servers=services.kafka)
    await admin.start()
    try:
        responses = await admin.describe_consumer_groups([group])
    finally:
        await admin.close()
    return all(not g["members"] for r in responses for g in r.to_object()["groups"])


async def _operator_waits(database: Env) -> bool:
    """An operator command's session waits for a lock (asked from a session of its own: pg_stat_activity is a
    snapshot per transaction)."""
    conn = await asyncpg.connect(database.owner_url)
    try:
        return bool(await conn.fetchval("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                        "AND application_name = 'stock-ledger-operator'"))
    finally:
        await conn.close()


async def _applied_offsets(database: Env) -> list[int]:
    """The Kafka offsets of partition PARTITION that the ledger holds, in order."""
    conn = await asyncpg.connect(database.owner_url)
    try:
        return [r[0] for r in await conn.fetch(
            "SELECT kafka_offset FROM stock_movements WHERE kafka_partition = $1 ORDER BY 1", PARTITION)]
    finally:
        await conn.close()


class TestOffsets:
    """`offsets show` and `offsets set`: the way out of a hole in the log, and of a deliberate skip."""

    async def test_a_retention_hole_is_shown_and_skipped_with_an_acknowledged_gap(
        self, services: Services, database: Env, topic: str, workers: WorkerPool,
    ) -> None:
        """1. 10 records on partition 3 are applied; the worker stops (offset 10).
        2. 10 more arrive and the first 5 of them are deleted (retention): log start 15 > stored offset 10.
        3. `offsets show` reports the hole on partition 3 only, with log start/end and lag.
        4. `offsets set --to-log-start --note` moves partition 3 to 15, bumps its epoch, and records the gap
           [10, 14] as acknowledged by the database user with the note and reason operator_skip.
        5. A worker then applies offsets 15..19: the ledger holds 15 rows, none of 10..14."""
        await send_to(services.kafka, topic, PARTITION, 10)
        await drain_and_stop(services, database, topic, workers)
        await send_to(services.kafka, topic, PARTITION, 10)
        admin = AIOKafkaAdminClient(bootstrap_servers=services.kafka)
        await admin.start()
        try:
            await admin.delete_records({TopicPartition(topic, PARTITION): RecordsToDelete(before_offset=15)})
        finally:
            await admin.close()

        shown = await cli(workers, "offsets", "show", "--json")
        assert shown.code == 0, shown.err
        rows = {r["partition"]: r for r in shown.json()["partitions"]}
        assert len(rows) == 24
        hole = rows[PARTITION]
        assert (hole["next_offset"], hole["log_start"], hole["log_end"], hole["lag"]) == (10, 15, 20, 10)
        assert "10..14" in hole["gap"]
        assert [p for p, r in rows.items() if r["gap"]] == [PARTITION]
        assert shown.json()["members"] == []
        text = await cli(workers, "offsets", "show")
        assert text.code == 0
        assert "records 10..14 were deleted" in text.out

        _, epoch = await stored(database, workers.group, topic, PARTITION)
        moved = await cli(workers, "offsets", "set", "--partition", str(PARTITION), "--to-log-start",
                          "--note", "INC-42 retention hole", "--json")
        assert moved.code == 0, moved.err
        change = moved.json()
        assert (change["next_offset_before"], change["next_offset_after"]) == (10, 15)
        assert change["epoch_after"] == epoch + 1
        assert await stored(database, workers.group, topic, PARTITION) == (15, epoch + 1)
        conn = await asyncpg.connect(database.owner_url)
        try:
            gap = await conn.fetchrow("SELECT *, current_user AS me FROM ledger_gaps")
        finally:
            await conn.close()
        assert gap is not None
        assert (gap["partition"], gap["first_offset"], gap["last_offset"]) == (PARTITION, 10, 14)
        assert (gap["reason"], gap["note"], gap["acknowledged_by"]) == ("operator_skip", "INC-42 retention hole",
                                                                       gap["me"])
        assert gap["acknowledged_at"] is not None
        assert change["gap"]["id"] == gap["id"]

        workers.start()
        await wait_drained(services, database, topic, workers.group, 60, workers)
        assert await _applied_offsets(database) == [*range(10), *range(15, 20)]

    async def test_moving_back_over_applied_rows_is_refused(
        self, services: Services, database: Env, topic: str, workers: WorkerPool,
    ) -> None:
        """Offsets 0..9 are applied: moving to 5 would apply 5..9 twice, so it is refused (exit 1, the message
        names the lowest allowed offset) and nothing changes; a skip forward without --note is refused too."""
        await send_to(services.kafka, topic, PARTITION, 10)
        await drain_and_stop(services, database, topic, workers)
        before = await stored(database, workers.group, topic, PARTITION)

        refused = await cli(workers, "offsets", "set", "--partition", str(PARTITION), "--offset", "5")
        assert refused.code == 1
        assert "would be applied twice" in refused.err
        assert "lowest allowed is 10" in refused.err
        assert await stored(database, workers.group, topic, PARTITION) == before

        await send_to(services.kafka, topic, PARTITION, 5)
        unexplained = await cli(workers, "offsets", "set", "--partition", str(PARTITION), "--offset", "12")
        assert unexplained.code == 2
        assert "--note" in unexplained.err
        dry = await cli(workers, "offsets", "set", "--partition", str(PARTITION), "--offset", "12", "--note", "x",
                        "--dry-run")
        assert dry.code == 0, dry.err
        assert "would move" in dry.out
        assert await stored(database, workers.group, topic, PARTITION) == before

    async def test_to_timestamp_skips_what_came_before_it(
        self, services: Services, database: Env, topic: str, workers: WorkerPool,
    ) -> None:
        """Nothing applied yet; 5 records, then T, then 5 more. `--to-timestamp T` moves partition 3 to offset 5
        (the first record at or after T) and records [0, 4] as an acknowledged skip; a worker then applies only
        5..9. A time past the last record means the log end."""
        await send_to(services.kafka, topic, PARTITION, 5)
        await asyncio.sleep(1.5)
        cut = datetime.now(UTC)
        await asyncio.sleep(0.5)
        await send_to(services.kafka, topic, PARTITION, 5)
        future = await cli(workers, "offsets", "set", "--partition", str(PARTITION), "--to-timestamp",
                           "2999-01-01T00:00:00Z", "--note", "x", "--dry-run", "--json")
        assert future.code == 0, future.err
        assert future.json()["next_offset_after"] == 10
        moved = await cli(workers, "offsets", "set", "--partition", str(PARTITION), "--to-timestamp",
                          cut.isoformat(), "--note", "replay from the cut-over", "--json")
        assert moved.code == 0, moved.err
        assert (moved.json()["next_offset_before"], moved.json()["next_offset_after"]) == (None, 5)
        assert (moved.json()["gap"]["first_offset"], moved.json()["gap"]["last_offset"]) == (0, 4)
        workers.start()
        await wait_drained(services, database, topic, workers.group, 60, workers)
        assert await _applied_offsets(database) == [5, 6, 7, 8, 9]

    async def test_live_workers_block_the_move_unless_forced_and_are_then_fenced(
        self, services: Services, database: Env, topic: str, workers: WorkerPool,
    ) -> None:
        """With a worker in the group, `offsets set` refuses (exit 1, naming the member). With --force it moves
        the offset and bumps the epoch: the running worker's next batch on that partition is fenced (nothing of it
        is written), the worker exits to claim again, and after a restart the ledger is exact: every record once."""
        await send_to(services.kafka, topic, PARTITION, 10)
        workers.start()
        await wait_drained(services, database, topic, workers.group, 60, workers)

        refused = await cli(workers, "offsets", "set", "--partition", str(PARTITION), "--offset", "10")
        assert refused.code == 1
        assert "live member(s)" in refused.err
        assert "--force" in refused.err

        next_offset, epoch = await stored(database, workers.group, topic, PARTITION)
        assert next_offset == 10
        forced = await cli(workers, "offsets", "set", "--partition", str(PARTITION), "--offset", "10",
                           "--force", "--json")
        assert forced.code == 0, forced.err
        assert forced.json()["epoch_after"] == epoch + 1
        assert forced.json()["live_members_fenced"] == 1

        # Its next batch on the partition fails the compare-and-set; the worker stops writing it and, as the
        # partition stays assigned to it, exits to rejoin with a fresh claim (Kubernetes restarts the pod).
        await send_to(services.kafka, topic, PARTITION, 6)
        fenced = workers.started[0]
        await eventually(lambda: '"batch.fenced"' in fenced.log_text(), 30, "the worker to be fenced", workers)
        await eventually(lambda: not fenced.alive(), 60, "the fenced worker to exit", workers)
        workers.start()
        await wait_drained(services, database, topic, workers.group, 90, workers)
        await assert_exact(services, database, topic, workers.group, rows=16, pool=workers)


    async def test_a_group_that_does_not_own_the_ledger_is_refused(
        self, services: Services, database: Env, topic: str, workers: WorkerPool,
    ) -> None:
        """The workers' group owns the ledger. `offsets set` with another group id (the default, a typo) is
        refused (exit 1, naming both groups and STOCK_LEDGER_GROUP_ID), writes no row for that group, and a worker
        of the owning group still starts and applies what arrives."""
        await send_to(services.kafka, topic, PARTITION, 5)
        await drain_and_stop(services, database, topic, workers)
        typo = await cli(workers, "offsets", "set", "--partition", str(PARTITION), "--to-log-end", "--note", "x",
                         STOCK_LEDGER_GROUP_ID="stock-ledger")
        assert typo.code == 1, typo.out
        assert f"holds the ledger of consumer group '{workers.group}', not 'stock-ledger'" in typo.err
        assert "STOCK_LEDGER_GROUP_ID" in typo.err
        conn = await asyncpg.connect(database.owner_url)
        try:
            groups = [r[0] for r in await conn.fetch("SELECT DISTINCT group_id FROM consumer_offsets")]
        finally:
            await conn.close()
        assert groups == [workers.group]
        await send_to(services.kafka, topic, PARTITION, 3)
        workers.start()
        await wait_drained(services, database, topic, workers.group, 60, workers)
        await assert_exact(services, database, topic, workers.group, rows=8, pool=workers)

    async def test_several_partitions_to_the_log_end_show_the_plan_first(
        self, services: Services, database: Env, topic: str, workers: WorkerPool,
    ) -> None:
        """Partitions 1, 2 and 5 hold 4, 5 and 6 records, never claimed. `--partition 1,2 --partition 5
        --to-log-end --dry-run` prints the plan (one row each: before, after, records skipped) and changes
        nothing; the real run prints the plan, then one `moved` line and one acknowledged gap per partition; the
        stored offsets are the log ends, and a worker then applies nothing of them. --json of several partitions
        is {"changes": [...]}; one refused partition (an offset outside its log) moves none."""
        for p, n in ((1, 4), (2, 5), (5, 6)):
            await send_to(services.kafka, topic, p, n)
        dry = await cli(workers, "offsets", "set", "--partition", "1,2", "--partition", "5", "--to-log-end",
                        "--note", "INC-7 skip", "--dry-run")
        assert dry.code == 0, dry.err
        lines = dry.out.splitlines()
        assert lines[0].startswith("plan (dry run: nothing changes):")
        assert [line.split()[:6] for line in lines[2:5]] == [["1", "-", "4", "0", "4", "4"],
                                                             ["2", "-", "5", "0", "5", "5"],
                                                             ["5", "-", "6", "0", "6", "6"]]
        assert sum("would move" in line for line in lines) == 3
        conn = await asyncpg.connect(database.owner_url)
        try:
            assert await conn.fetchval("SELECT count(*) FROM consumer_offsets") == 0
            assert await conn.fetchval("SELECT count(*) FROM ledger_gaps") == 0
        finally:
            await conn.close()

        outside = await cli(workers, "offsets", "set", "--partition", "1,2", "--offset", "5", "--note", "x")
        assert outside.code == 1
        assert "outside the log of partition 1" in outside.err

        moved = await cli(workers, "offsets", "set", "--partition", "1,2", "--partition", "5", "--to-log-end",
                          "--note", "INC-7 skip")
        assert moved.code == 0, moved.err
        lines = moved.out.splitlines()
        assert lines[0].startswith("plan: ")
        assert lines.index(next(x for x in lines if x.startswith("moved"))) > 4  # the plan comes first
        assert sum(x.startswith("moved") for x in lines) == 3
        assert sum(x.startswith("recorded gap") for x in lines) == 3
        for p, n in ((1, 4), (2, 5), (5, 6)):
            assert await stored(database, workers.group, topic, p) == (n, 1)
        conn = await asyncpg.connect(database.owner_url)
        try:
            gaps = [tuple(r) for r in await conn.fetch(
                "SELECT partition, first_offset, last_offset, acknowledged_at IS NOT NULL FROM ledger_gaps "
                "ORDER BY partition")]
        finally:
            await conn.close()
        assert gaps == [(1, 0, 3, True), (2, 0, 4, True), (5, 0, 5, True)]

        again = await cli(workers, "offsets", "set", "--partition", "1", "--partition", "2", "--to-log-end",
                          "--json")
        assert again.code == 0, again.err
        assert [(c["partition"], c["next_offset_after"], c["gap"]) for c in again.json()["changes"]] == [
            (1, 4, None), (2, 5, None)]
        workers.start()
        await wait_drained(services, database, topic, workers.group, 60, workers)
        conn = await asyncpg.connect(database.owner_url)
        try:
            assert await conn.fetchval("SELECT count(*) FROM stock_movements") == 0
        finally:
            await conn.close()

    async def test_a_claim_racing_a_move_on_a_partition_never_claimed_waits_for_it(
        self, services: Services, database: Env, topic: str, workers: WorkerPool,
    ) -> None:
        """Partition 3 holds 10 records and was never claimed. A claim and a first batch (offsets 0..4, stored
        offset 5) run in one open transaction, as the worker does, while `offsets set --offset 2` runs: the
        command must wait for it (it cannot lock a row that does not exist yet unless it inserts one), then see
        the batch and refuse (5 is the lowest allowed). Without the lock it checked the floor of an empty
        partition (0), and its move then rewound the committed batch to 2: records 2..4 would be applied twice."""
        await send_to(services.kafka, topic, PARTITION, 10)
        claim = await asyncpg.connect(database.owner_url)
        try:
            await make_segments(claim, [PARTITION])  # as the worker does before its batch
            tx = claim.transaction()
            await tx.start()
            await claim.execute(
                "INSERT INTO consumer_offsets (group_id, topic, partition, epoch, generation, member_id, claimed_at) "
                "VALUES ($1, $2, $3, 1, 1, 'worker', now())", workers.group, topic, PARTITION)
            running = asyncio.ensure_future(cli(workers, "offsets", "set", "--partition", str(PARTITION),
                                                "--offset", "2", "--note", "x",
                                                STOCK_LEDGER_LOCK_TIMEOUT_MS="60000"))

            await eventually(lambda: running.done() or _operator_waits(database), 30, "offsets set to wait")
            for offset in range(5):
                await claim.execute(
                    "INSERT INTO stock_movements (movement_id, warehouse_id, sku, qty, kind, occurred_at, kafka_topic, "
                    "kafka_partition, kafka_offset) VALUES (gen_random_uuid(), 'WH-1', 'SKU-1', 1, 'receipt', now(), "
                    "$1, $2, $3)", topic, PARTITION, offset)
            await claim.execute("UPDATE consumer_offsets SET next_offset = 5 WHERE group_id = $1 AND partition = $2",
                                workers.group, PARTITION)
            await tx.commit()
            refused = await running
        finally:
            await claim.close()
        assert refused.code == 1, refused.out
        assert "lowest allowed is 5" in refused.err
        assert await stored(database, workers.group, topic, PARTITION) == (5, 1)


class TestRejected:
    """`rejected list|show|replay`: quarantined records can be read and, once valid, applied exactly once."""

    async def _quarantine(self, services: Services, database: Env, topic: str, workers: WorkerPool,
                          ) -> tuple[list[dict[str, object]], int]:
        """Good movements applied, then 6 of them moved back to quarantine as an older parser would have left
        them (stock levels corrected to match), plus 2 records that are bad under any parser and one upstream
        resend. Returns the good movements and the number of records that stay bad."""
        good = [movement(f"SKU-{i % 3}", qty=i + 1) for i in range(12)]
        resent = good[0]
        records: list[tuple[bytes | None, bytes | None]] = [
            (str(m["sku"]).encode(), json.dumps(m).encode()) for m in good]
        records += [(b"SKU-0", b"{not json"), (b"SKU-0", json.dumps(movement("SKU-0", qty=0)).encode()),
                    (str(resent["sku"]).encode(), json.dumps(resent).encode())]
        await send_raw(services.kafka, topic, records)
        await drain_and_stop(services, database, topic, workers)
        conn = await asyncpg.connect(database.owner_url)
        try:
            async with conn.transaction():
                moved = await conn.fetch("""
                    DELETE FROM stock_movements WHERE movement_id = ANY($1::uuid[])
                    RETURNING kafka_topic, kafka_partition, kafka_offset, kafka_timestamp, movement_id,
                              warehouse_id, sku, qty""", [str(m["movement_id"]) for m in good[6:]])
                for r in moved:
                    value = json.dumps(next(m for m in good if m["movement_id"] == str(r["movement_id"]))).encode()
                    await conn.execute("""
                        INSERT INTO rejected_movements (kafka_topic, kafka_partition, kafka_offset, kafka_timestamp,
                                                        key, value, reason_code, reason, movement_id)
                        VALUES ($1, $2, $3, $4, $5, $6, 'invalid_field', 'rejected by an older parser', $7)""",
                        r["kafka_topic"], r["kafka_partition"], r["kafka_offset"], r["kafka_timestamp"],
                        r["sku"].encode(), value, r["movement_id"])
                    await conn.execute("UPDATE stock_levels SET on_hand = on_hand - $3 WHERE warehouse_id = $1 "
                                       "AND sku = $2", r["warehouse_id"], r["sku"], r["qty"])
        finally:
            await conn.close()
        assert len(moved) == 6
        await assert_exact(services, database, topic, workers.group, rows=6, rejected=9)
        return good, 3

    async def test_list_and_show(self, services: Services, database: Env, topic: str, workers: WorkerPool) -> None:
        """`list` filters by reason and age and prints ids; `show ID` prints the raw bytes and the reason;
        an unknown id is an error that says where to look."""
        await self._quarantine(services, database, topic, workers)
        listed = await cli(workers, "rejected", "list", "--json")
        assert listed.code == 0, listed.err
        rows = listed.json()["rejected"]
        assert len(rows) == 9
        assert {r["reason_code"] for r in rows} == {"invalid_json", "invalid_field", "duplicate_movement_id"}
        only = await cli(workers, "rejected", "list", "--reason", "invalid_json", "--since", "1h", "--json")
        assert [r["reason_code"] for r in only.json()["rejected"]] == ["invalid_json"]
        future = await cli(workers, "rejected", "list", "--since", "2999-01-01T00:00:00Z", "--json")
        assert future.json()["rejected"] == []
        text = await cli(workers, "rejected", "list")
        assert "(9 row(s))" in text.out

        bad_id = only.json()["rejected"][0]["id"]
        shown = await cli(workers, "rejected", "show", str(bad_id), "--json")
        assert shown.code == 0, shown.err
        assert shown.json()["value"] == "{not json"
        assert shown.json()["key"] == "SKU-0"
        missing = await cli(workers, "rejected", "show", "999999")
        assert missing.code == 1
        assert "rejected list" in missing.err

    async def test_replay_applies_now_valid_records_once_and_keeps_the_rest(
        self, services: Services, database: Env, topic: str, workers: WorkerPool,
    ) -> None:
        """1. --dry-run reports 6 to apply and changes nothing.
        2. Two replays run at once, one row per transaction: together they apply each of the 6 exactly once.
        3. The ledger is exact again: 12 movements at their original coordinates, stock levels = Σ movements,
           3 rows still quarantined (2 bad, 1 resend whose movement_id is in the ledger), each with the attempt
           recorded."""
        _, bad = await self._quarantine(services, database, topic, workers)
        dry = await cli(workers, "rejected", "replay", "--dry-run", "--json")
        assert dry.code == 0, dry.err
        assert dry.json() == {"examined": 9, "applied": 6, "dry_run": True,
                              "still_rejected": {"invalid_json": 1, "invalid_field": 1, "duplicate_movement_id": 1}}
        await assert_exact(services, database, topic, workers.group, rows=6, rejected=9)

        first, second = await asyncio.gather(
            cli(workers, "rejected", "replay", "--batch-size", "1", "--json"),
            cli(workers, "rejected", "replay", "--batch-size", "1", "--json"))
        assert first.code == second.code == 0, first.err + second.err
        assert first.json()["applied"] + second.json()["applied"] == 6
        await assert_exact(services, database, topic, workers.group, rows=12, rejected=bad)
        conn = await asyncpg.connect(database.owner_url)
        try:
            attempts = await conn.fetch("SELECT reason_code, replay_attempts, last_replay_at, last_replay_reason "
                                        "FROM rejected_movements")
        finally:
            await conn.close()
        assert all(a["replay_attempts"] >= 1 and a["last_replay_at"] is not None for a in attempts)
        resend = next(a for a in attempts if a["reason_code"] == "duplicate_movement_id")
        assert "already in the ledger" in resend["last_replay_reason"]

        again = await cli(workers, "rejected", "replay", "--json")
        assert again.json()["applied"] == 0
        await assert_exact(services, database, topic, workers.group, rows=12, rejected=bad)

    async def test_the_worker_role_cannot_replay(
        self, services: Services, database: Env, topic: str, workers: WorkerPool,
    ) -> None:
        """Replay deletes quarantine rows: only the owner may; the worker role gets a permission error (exit 1)."""
        await self._quarantine(services, database, topic, workers)
        denied = await cli(workers, "rejected", "replay", url=database.worker_url)
        assert denied.code == 1
        assert "permission denied" in denied.err
        await assert_exact(services, database, topic, workers.group, rows=6, rejected=9)

