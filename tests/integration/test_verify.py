"""`stock-ledger verify` on the real broker and database: it finds what is wrong, partition by partition, and keeps
its contract (a table, then the `rows|distinct` line last; exit 0 only if every check holds)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass

import asyncpg
import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.records_to_delete import RecordsToDelete
from aiokafka.structs import TopicPartition

from tests.integration.test_operate import cli, send_to
from tests.support.helpers import Env, Services, WorkerPool, end_offsets, wait_drained
from tests.support.services import produce

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(180)]


@dataclass
class Verified:
    code: int
    stdout: str
    stderr: str

    @property
    def last_line(self) -> str:
        return self.stdout.rstrip("\n").splitlines()[-1]

    def check(self, name: str) -> str:
        """The row of the table for one check: 'ok' or 'FAIL' followed by the detail."""
        for line in self.stdout.splitlines():
            if line.startswith(name + "  "):
                return line[len(name):].strip()
        raise AssertionError(f"no check {name!r} in:\n{self.stdout}")


async def run_verify(workers: WorkerPool, *args: str) -> Verified:
    env = workers.env()
    env["DATABASE_URL"] = workers.db.owner_url
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "stock_ledger", "verify", *args, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return Verified(proc.returncode or 0, out.decode(), err.decode())


async def drain(services: Services, database: Env, topic: str, workers: WorkerPool, count: int, seed: int = 1) -> None:
    await produce(services.kafka, topic, count, seed=seed, show_progress=False)
    w = workers.alive()[0] if workers.alive() else workers.start()
    await wait_drained(services, database, topic, workers.group, 60, workers)
    del w


def stop(workers: WorkerPool) -> None:
    for w in workers.alive():
        w.signal(signal.SIGTERM)
        assert w.wait(15) == 0


async def sql(database: Env, statement: str, *args: object) -> object:
    conn = await asyncpg.connect(database.owner_url)
    try:
        return await conn.fetchval(statement, *args)
    finally:
        await conn.close()


async def test_a_clean_ledger_passes_with_the_table_first_and_the_count_line_last(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """3,000 movements drained by a worker: verify exits 0, prints every check as ok, and its last stdout line is
    `3000|3000` (count(*) and count(DISTINCT source) of stock_movements); progress went to stderr."""
    await drain(services, database, topic, workers, 3_000)
    stop(workers)
    v = await run_verify(workers, "--expect", "3000")
    assert v.code == 0, v.stdout + v.stderr
    assert v.last_line == "3000|3000"
    assert v.stdout.splitlines()[0].startswith("check")
    assert "FAIL" not in v.stdout
    assert v.check("unique (topic, partition, offset)").startswith("ok")
    assert v.check("records in topic") == "ok      3000 committed records in 24 partitions"
    assert "verify:" in v.stderr


async def test_a_missing_row_a_row_in_both_tables_and_a_foreign_row_are_each_found(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """After a clean drain, three kinds of damage in three partitions: a deleted movement (a gap), a quarantined copy
    of an applied record (in both tables), a row at an offset the topic never had (not in topic). verify exits 1
    and names each partition and offset; the count line is still last."""
    await drain(services, database, topic, workers, 2_400)
    stop(workers)
    ends = await end_offsets(services.kafka, topic)
    p_gap, p_both, p_foreign = sorted(p for p, e in ends.items() if e >= 3)[:3]
    await sql(database, "DELETE FROM stock_movements WHERE kafka_topic = $1 AND kafka_partition = $2 "
                        "AND kafka_offset = 1", topic, p_gap)
    await sql(database, """INSERT INTO rejected_movements (kafka_topic, kafka_partition, kafka_offset, reason_code,
                           reason) VALUES ($1, $2, 2, 'invalid_json', 'test')""", topic, p_both)
    await sql(database, """INSERT INTO stock_movements (movement_id, warehouse_id, sku, qty, kind, occurred_at,
                           kafka_topic, kafka_partition, kafka_offset)
                           SELECT $4, warehouse_id, sku, qty, kind, occurred_at, kafka_topic, kafka_partition, $3
                             FROM stock_movements WHERE kafka_topic = $1 AND kafka_partition = $2 LIMIT 1""",
              topic, p_foreign, ends[p_foreign] + 1000, uuid.uuid4())
    v = await run_verify(workers)
    assert v.code == 1, v.stdout
    assert v.check("gaps (in topic, in neither table)") == f"FAIL    1 records: p{p_gap}: 1"
    assert v.check("in both tables") == f"FAIL    1 records: p{p_both}: 2"
    assert v.check("rows not in topic") == f"FAIL    1 records: p{p_foreign}: {ends[p_foreign] + 1000}"
    assert v.check("stock_levels = sum(movements)").startswith("FAIL")
    assert v.last_line == "2400|2400"  # one deleted, one foreign row added


async def test_without_the_unique_constraint_a_duplicate_row_shows_in_the_count_line(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """The backstop constraint dropped and one movement copied at its own coordinates: verify says the constraint
    is missing, counts distinct sources for real (the line reads `1201|1200`) and reports the repeated offset."""
    await drain(services, database, topic, workers, 1_200)
    stop(workers)
    conn = await asyncpg.connect(database.owner_url)
    try:
        await conn.execute("ALTER TABLE stock_movements DROP CONSTRAINT stock_movements_coordinates_key")
        row = await conn.fetchrow("SELECT kafka_partition, kafka_offset FROM stock_movements LIMIT 1")
        await conn.execute("""INSERT INTO stock_movements (movement_id, warehouse_id, sku, qty, kind, occurred_at,
                              kafka_topic, kafka_partition, kafka_offset)
                              SELECT $4, warehouse_id, sku, qty, kind, occurred_at, kafka_topic, kafka_partition,
                                     kafka_offset FROM stock_movements
                               WHERE kafka_topic = $1 AND kafka_partition = $2 AND kafka_offset = $3""",
                           topic, row[0], row[1], uuid.uuid4())
    finally:
        await conn.close()
    v = await run_verify(workers)
    assert v.code == 1
    assert v.last_line == "1201|1200"
    assert v.check("unique (topic, partition, offset)").startswith("FAIL")
    assert v.check("rows vs distinct coordinates") == "FAIL    1201 rows, 1200 distinct sources"
    assert v.check("in both tables") == f"FAIL    1 records: p{row[0]}: {row[1]}"


async def test_partition_checks_only_the_named_partitions(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """A gap in one partition: `--partition` of two others passes and counts only their rows; naming the damaged
    one (in a comma list) fails; a partition the topic does not have is a usage error (exit 2)."""
    await drain(services, database, topic, workers, 2_400)
    stop(workers)
    ends = await end_offsets(services.kafka, topic)
    damaged, a, b = sorted(p for p, e in ends.items() if e > 0)[:3]
    await sql(database, "DELETE FROM stock_movements WHERE kafka_topic = $1 AND kafka_partition = $2 "
                        "AND kafka_offset = 0", topic, damaged)

    clean = await run_verify(workers, "--partition", str(a), "--partition", str(b))
    assert clean.code == 0, clean.stdout
    assert clean.last_line == f"{ends[a] + ends[b]}|{ends[a] + ends[b]}"
    assert clean.check("records in topic").endswith("in 2 partitions")
    assert clean.check("stock_levels = sum(movements)").startswith("ok      not checked")

    broken = await run_verify(workers, "--partition", f"{a},{damaged}")
    assert broken.code == 1
    assert broken.check("gaps (in topic, in neither table)") == f"FAIL    1 records: p{damaged}: 0"

    unknown = await run_verify(workers, "--partition", "99")
    assert unknown.code == 2
    assert "--partition 99" in unknown.stderr


async def test_since_checks_only_what_was_applied_since_then(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """1,200 movements applied "two days ago" (applied_at moved back), one of them then deleted; 600 more applied
    now. `--since 1h` passes (the old damage is out of its scope) and counts the 600; a full verify fails on the old
    gap; deleting a recent row makes `--since 1h` fail too."""
    await drain(services, database, topic, workers, 1_200, seed=1)
    await sql(database, "UPDATE stock_movements SET applied_at = applied_at - interval '2 days'")
    await sql(database, "UPDATE rejected_movements SET rejected_at = rejected_at - interval '2 days'")
    old = await sql(database, "SELECT kafka_partition FROM stock_movements WHERE kafka_offset = 0 LIMIT 1")
    await sql(database, "DELETE FROM stock_movements WHERE kafka_topic = $1 AND kafka_partition = $2 "
                        "AND kafka_offset = 0", topic, old)
    await drain(services, database, topic, workers, 600, seed=2)
    stop(workers)

    recent = await run_verify(workers, "--since", "1h")
    assert recent.code == 0, recent.stdout
    assert recent.last_line == "600|600"
    full = await run_verify(workers)
    assert full.code == 1
    assert full.check("gaps (in topic, in neither table)") == f"FAIL    1 records: p{old}: 0"

    row = await asyncpg.connect(database.owner_url)
    try:
        p, o = await row.fetchrow("SELECT kafka_partition, max(kafka_offset) FROM stock_movements "
                                  "WHERE applied_at > now() - interval '1 hour' GROUP BY 1 HAVING count(*) >= 2 "
                                  "LIMIT 1")
        await row.execute("DELETE FROM stock_movements WHERE kafka_topic = $1 AND kafka_partition = $2 "
                          "AND kafka_offset = $3", topic, p, o)
    finally:
        await row.close()
    again = await run_verify(workers, "--since", "1h")
    assert again.code == 1
    assert again.check("gaps (in topic, in neither table)") == f"FAIL    1 records: p{p}: {o}"


async def test_a_retention_hole_and_an_open_gap_fail_until_acknowledged(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """The worker applies 1,200 movements and stops; 1,200 more arrive and retention deletes them all before any
    is applied (the log start moves to the log end): verify fails naming the partitions whose stored offset is
    below the log start. A ledger_gaps row left unacknowledged fails verify too, until acknowledged."""
    await drain(services, database, topic, workers, 1_200)
    stop(workers)
    await produce(services.kafka, topic, 1_200, seed=2, show_progress=False)
    ends = await end_offsets(services.kafka, topic)
    admin = AIOKafkaAdminClient(bootstrap_servers=services.kafka)
    await admin.start()
    try:
        await admin.delete_records({TopicPartition(topic, p): RecordsToDelete(before_offset=e)
                                    for p, e in ends.items()}, timeout_ms=10_000)
    finally:
        await admin.close()
    v = await run_verify(workers)
    assert v.code == 1
    assert v.check("stored offsets >= log start").startswith("FAIL    records deleted before they were applied: p")

    await sql(database, """INSERT INTO ledger_gaps (group_id, topic, partition, first_offset, last_offset, reason)
                           VALUES ($1, $2, 0, 10, 19, 'retention')""", workers.group, topic)
    gap = await run_verify(workers)
    assert gap.check("no unacknowledged gap (ledger_gaps)").startswith("FAIL    1 open: p0 10-19 (retention)")
    acknowledged = await cli(workers, "gaps", "ack", str(await sql(database, "SELECT id FROM ledger_gaps")),
                             "--note", "reconciled by hand")
    assert acknowledged.code == 0, acknowledged.err
    acked = await run_verify(workers)
    assert acked.check("no unacknowledged gap (ledger_gaps)") == "ok      none"


async def test_records_skipped_with_an_acknowledged_gap_are_reported_not_failed(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """The issue's scenario through the CLI. 10 records of partition 2 are applied; the worker stops; 60 more
    arrive and `offsets set --partition 2 --offset 61 --note ...` skips 10..60 (51 records, which stay in the
    topic), recording an acknowledged gap; a worker applies the rest. verify exits 0: no gap, and the row
    "acknowledged gap p2: 10-60 by <owner>, note: ..." names the range. The same range unacknowledged (a gap
    recorded but not yet reconciled) fails: its 51 records are missing again, and the open gap is named."""
    await send_to(services.kafka, topic, 2, 10)
    await drain(services, database, topic, workers, 0)
    stop(workers)
    await send_to(services.kafka, topic, 2, 60)
    moved = await cli(workers, "offsets", "set", "--partition", "2", "--offset", "61", "--note", "INC-9 skip")
    assert moved.code == 0, moved.err
    workers.start()
    await wait_drained(services, database, topic, workers.group, 60, workers)
    owner = await sql(database, "SELECT current_user")

    v = await run_verify(workers)
    assert v.code == 0, v.stdout
    assert v.check("gaps (in topic, in neither table)") == "ok      none"
    assert v.check("acknowledged gaps (skipped on purpose)") == (
        f"ok      51 records in the topic: acknowledged gap p2: 10-60 by {owner}, note: INC-9 skip (51 records)")

    await sql(database, "UPDATE ledger_gaps SET acknowledged_at = NULL, acknowledged_by = NULL")
    unacked = await run_verify(workers)
    assert unacked.code == 1
    assert unacked.check("gaps (in topic, in neither table)") == "FAIL    51 records: p2: 10-60"
    assert unacked.check("acknowledged gaps (skipped on purpose)") == "ok      none"
    assert unacked.check("no unacknowledged gap (ledger_gaps)").startswith("FAIL    1 open: p2 10-60 (operator_skip)")


async def test_json_output_carries_the_same_checks_and_each_partitions_findings(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """`verify --json` after one deleted movement: one JSON document on stdout with ok false, the same check names
    and results as the table, and the gap as offsets [1, 1] of its partition (others clean); same exit code 1."""
    import json  # noqa: PLC0415

    await drain(services, database, topic, workers, 1_200)
    stop(workers)
    ends = await end_offsets(services.kafka, topic)
    p_gap = min(p for p, e in ends.items() if e >= 3)
    await sql(database, "DELETE FROM stock_movements WHERE kafka_topic = $1 AND kafka_partition = $2 "
                        "AND kafka_offset = 1", topic, p_gap)
    text, machine = await run_verify(workers), await run_verify(workers, "--json")
    assert (text.code, machine.code) == (1, 1)
    document = json.loads(machine.stdout)
    assert document["ok"] is False
    assert document["rows"] == 1_199
    rows = {line.split("  ")[0] for line in text.stdout.splitlines()[2:-1]}
    assert {c["name"] for c in document["checks"]} == rows
    gaps = next(c for c in document["checks"] if c["name"] == "gaps (in topic, in neither table)")
    assert gaps["ok"] is False
    assert gaps["detail"] == text.check("gaps (in topic, in neither table)").removeprefix("FAIL").strip()
    by_partition = {p["partition"]: p for p in document["partitions"]}
    assert len(by_partition) == 24
    assert by_partition[p_gap]["missing"] == {"offsets": 1, "runs": 1, "sample": [[1, 1]]}
    assert all(not p["missing"]["offsets"] for n, p in by_partition.items() if n != p_gap)
