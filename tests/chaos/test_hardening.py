"""Conditions of the log and of the group that no record shows: holes, compaction, zombies frozen inside COPY,
a second group. Each on the real broker and database, through `stock-ledger run`, `verify` and `gaps` only."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import time
import uuid

import asyncpg
import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.records_to_delete import RecordsToDelete

from tests.support.helpers import (
    Env,
    Services,
    WorkerPool,
    assert_exact,
    end_offsets,
    eventually,
    process_state,
    stored_offsets,
    wait_drained,
)
from tests.support.services import produce, set_topic_config

pytestmark = [pytest.mark.integration, pytest.mark.chaos, pytest.mark.asyncio]
HOLED = range(6)  # the partitions whose unapplied records are deleted


async def delete_before(bootstrap: str, topic: str, before: dict[int, int]) -> None:
    """Move each partition's log start forward, as retention or kafka-delete-records does."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.delete_records({TopicPartition(topic, p): RecordsToDelete(o) for p, o in before.items()})
    finally:
        await admin.close()


def cli(workers: WorkerPool, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = workers.env(DATABASE_URL=url, STOCK_LEDGER_LOG_FORMAT="json")
    return subprocess.run([sys.executable, "-m", "stock_ledger", *args], env=env, capture_output=True, text=True,
                          timeout=180, check=False)


async def stored_now(db: Env, group: str, topic: str) -> dict[int, int | None]:
    conn = await asyncpg.connect(db.owner_url)
    try:
        return await stored_offsets(conn, group, topic)
    finally:
        await conn.close()


async def drained_then_holed(services: Services, database: Env, topic: str, workers: WorkerPool) -> dict[int, int]:
    """2,400 movements applied, the worker stopped, 2,400 more produced, then the first 5 unapplied records of
    partitions 0-5 deleted. Returns the stored offset (= first missing offset) of each holed partition."""
    await produce(services.kafka, topic, 2_400, seed=31, show_progress=False)
    first = workers.start()
    await wait_drained(services, database, topic, workers.group, 120, workers)
    first.signal(signal.SIGTERM)
    assert first.wait(30) == 0
    stored = await stored_now(database, workers.group, topic)
    await produce(services.kafka, topic, 2_400, seed=32, show_progress=False)
    ends = await end_offsets(services.kafka, topic)
    assert all(ends[p] > stored[p] + 5 for p in HOLED), (ends, stored)
    await delete_before(services.kafka, topic, {p: stored[p] + 5 for p in HOLED})
    return {p: stored[p] for p in HOLED}


async def test_a_retention_hole_halts_its_partition_and_says_so_everywhere(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """STOCK_LEDGER_ON_GAP=halt (the default): records the ledger never applied were deleted from partitions 0-5.
    The worker applies every other partition, keeps 0-5 paused at their stored offset, and says so: /readyz is 503
    naming the hole, stock_ledger_partition_gap_messages is 5 for each, an error log names the range and what to do,
    and `stock-ledger verify` fails naming the hole (it never prints a clean report over lost movements)."""
    holes = await drained_then_holed(services, database, topic, workers)
    worker = workers.start()

    async def others_drained() -> bool:
        stored, ends = await stored_now(database, workers.group, topic), await end_offsets(services.kafka, topic)
        return all(stored.get(p) == e for p, e in ends.items() if p not in holes)

    await eventually(others_drained, 120, "the partitions without a hole to drain", workers)
    await eventually(lambda: all(worker.metric("stock_ledger_partition_gap_messages", {"partition": str(p)}) == 5
                                 for p in holes), 30, "the gap gauge of each holed partition", workers)
    status, body = worker.get("/readyz")
    assert status == 503
    assert "halted on a hole in the log" in body
    assert f"partition 0: offsets {holes[0]}-{holes[0] + 4} (5 records) were deleted" in body
    assert '"gap.halted"' in worker.log_text()
    now = await stored_now(database, workers.group, topic)
    assert {p: now[p] for p in holes} == holes  # nothing moved past a hole
    done = cli(workers, database.owner_url, "verify")
    assert done.returncode == 1, done.stdout
    assert re.search(r"stored offsets >= log start +FAIL +records deleted before they were applied: p0", done.stdout), (
        done.stdout)
    assert worker.alive()
    workers.assert_no_tracebacks()


async def test_a_recorded_hole_is_moved_past_in_one_transaction_and_verify_fails_until_acknowledged(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """STOCK_LEDGER_ON_GAP=record: the worker writes each hole to ledger_gaps with its exact range, moves past it and
    drains everything still in the log, exactly once. `verify` exits 1 while a gap is unacknowledged;
    `stock-ledger gaps list` shows them; after `gaps ack ID --note` for each, `verify` exits 0."""
    holes = await drained_then_holed(services, database, topic, workers)
    workers.start(STOCK_LEDGER_ON_GAP="record")
    await wait_drained(services, database, topic, workers.group, 120, workers)
    # Every record still in the log in exactly one table; of the 4,800 produced, only the 30 deleted are missing.
    state = await assert_exact(services, database, topic, workers.group, rows=4_800 - 5 * len(holes), pool=workers)
    conn = await asyncpg.connect(database.owner_url)
    try:
        gaps = {r["partition"]: (r["id"], r["first_offset"], r["last_offset"], r["reason"]) for r in await conn.fetch(
            "SELECT * FROM ledger_gaps WHERE group_id = $1 AND topic = $2", workers.group, topic)}
    finally:
        await conn.close()
    assert {p: g[1:] for p, g in gaps.items()} == {p: (o, o + 4, "below_log_start") for p, o in holes.items()}

    done = cli(workers, database.owner_url, "verify")
    assert done.returncode == 1
    assert re.search(r"no unacknowledged gap \(ledger_gaps\) +FAIL", done.stdout), done.stdout
    listed = cli(workers, database.owner_url, "gaps", "list")
    assert listed.returncode == 0
    assert listed.stdout.count("UNACKNOWLEDGED") == len(holes)
    for gap_id, *_ in gaps.values():
        acked = cli(workers, database.owner_url, "gaps", "ack", str(gap_id), "--note", "counted bins 3-7 by hand")
        assert acked.returncode == 0, acked.stderr
    assert cli(workers, database.owner_url, "gaps", "ack", str(gap_id), "--note", "again").returncode == 1
    done = cli(workers, database.owner_url, "verify")
    assert done.returncode == 0, done.stdout
    assert done.stdout.strip().splitlines()[-1] == f"{state.rows}|{state.rows}"
    workers.assert_no_tracebacks()


async def test_a_hole_that_opens_while_the_worker_runs_is_caught_by_the_fetch(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """The worker holds its partitions (a long session) and is frozen; meanwhile records are produced and the first
    unapplied ones of partitions 0-5 are deleted. Thawed, its fetch falls below the log start: the broker's
    OFFSET_OUT_OF_RANGE never resets the position silently; the partitions are claimed again and halted."""
    await produce(services.kafka, topic, 2_400, seed=41, show_progress=False)
    worker = workers.start(STOCK_LEDGER_SESSION_TIMEOUT_MS="45000", STOCK_LEDGER_REBALANCE_TIMEOUT_MS="60000")
    await wait_drained(services, database, topic, workers.group, 120, workers)
    stored = await stored_now(database, workers.group, topic)

    def frozen() -> bool:
        worker.signal(signal.SIGSTOP)  # again if the first one has not taken effect yet
        return process_state(worker.pid) == "T"

    await eventually(frozen, 10, "the worker to be frozen", workers)
    # A fetch the worker had in flight when it froze is answered by the broker all the same, into the socket: wait
    # past its long poll (the worker's fetch_max_wait_ms, 200 ms) so it is answered empty, not with the records
    # produced below before they are deleted (the worker then applies them, rightly, and sees no hole; seen once).
    await asyncio.sleep(1)
    try:
        await produce(services.kafka, topic, 2_400, seed=42, show_progress=False)
        await delete_before(services.kafka, topic, {p: stored[p] + 5 for p in HOLED})
    finally:
        worker.signal(signal.SIGCONT)
    await eventually(lambda: '"gap.halted"' in worker.log_text(), 60, "the hole to be found", workers)
    assert '"claim.reexamine"' in worker.log_text()
    after = await stored_now(database, workers.group, topic)
    assert {p: after[p] for p in HOLED} == {p: stored[p] for p in HOLED}
    workers.assert_no_tracebacks()


async def test_a_compacted_topic_is_refused_at_start(services: Services, database: Env, workers: WorkerPool) -> None:
    """Compaction deletes a SKU's movements before they are applied: the worker exits 1 and says what to change."""
    name = f"warehouse.movements.compacted-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=services.kafka)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, 3, 1, topic_configs={"cleanup.policy": "compact"})])
    finally:
        await admin.close()
    worker = workers.start(STOCK_LEDGER_TOPIC=name)
    assert worker.wait(60) == 1
    assert "cleanup.policy=compact" in worker.log_text()
    assert "cleanup.policy=delete" in worker.log_text()


async def test_compaction_switched_on_while_running_halts_the_worker(
    services: Services, database: Env, workers: WorkerPool,
) -> None:
    """The topic starts with cleanup.policy=delete, the worker applies what is there, then an operator switches
    compaction on: the worker halts within its check interval, STOCK_LEDGER_COMPACTION_CHECK_SECONDS (exit 1,
    naming the policy and the fix) instead of applying a log that compaction is deleting movements from. The
    invariant checks' hourly interval (the advice for large ledgers) does not slow it down (issue 38, item 10)."""
    name = f"warehouse.movements.compacted-later-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=services.kafka)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, 3, 1)])
        await produce(services.kafka, name, 300, seed=53, show_progress=False)
        worker = workers.start(STOCK_LEDGER_TOPIC=name, STOCK_LEDGER_INVARIANT_REFRESH_SECONDS="3600",
                               STOCK_LEDGER_COMPACTION_CHECK_SECONDS="1")
        await wait_drained(services, database, name, workers.group, 60, pool=workers)
        assert worker.alive()
        await set_topic_config(admin, name, {"cleanup.policy": "compact"})
        switched = time.monotonic()
        try:
            assert worker.wait(30) == 1
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the worker still runs 30 s after compaction was switched on; its log ends:\n"
                                 f"{worker.log_tail(40)}") from None
    finally:
        await admin.close()
    assert time.monotonic() - switched < 30
    assert "cleanup.policy=compact" in worker.log_text()
    assert "cleanup.policy=delete" in worker.log_text()
    await assert_exact(services, database, name, workers.group, rows=300)


async def test_a_read_only_server_is_waited_out_never_crash_looped(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """The worker's sessions are ended and every new one is read-only (as on a standby a failover left in the URL,
    or `default_transaction_read_only`): the worker keeps running, writes nothing, says why, and resumes by itself
    once the server takes writes again; the ledger is exact."""
    await produce(services.kafka, topic, 300, seed=57, show_progress=False)
    worker = workers.start(STOCK_LEDGER_RETRY_DEADLINE_SECONDS="0")
    await wait_drained(services, database, topic, workers.group, 60, pool=workers)
    owner = await asyncpg.connect(database.owner_url)
    try:
        await owner.execute(f'ALTER DATABASE "{database.name}" SET default_transaction_read_only = on')
        await owner.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                            "WHERE datname = current_database() AND usename <> current_user")
        await produce(services.kafka, topic, 300, seed=58, show_progress=False)
        await eventually(lambda: "makes every transaction read-only" in worker.log_text(), 30,
                         "the worker to say the server is read-only", workers)
        await asyncio.sleep(3)
        assert worker.alive()
        assert sum((await stored_offsets(owner, workers.group, topic)).values()) == 300  # nothing written
        await owner.execute(f'ALTER DATABASE "{database.name}" RESET default_transaction_read_only')
    finally:
        await owner.close()
    await wait_drained(services, database, topic, workers.group, 60, pool=workers)
    await assert_exact(services, database, topic, workers.group, rows=600, pool=workers)
    assert worker.alive()
    workers.assert_no_tracebacks()


async def test_a_worker_frozen_inside_copy_cannot_stall_the_new_owner(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """Worker A freezes (SIGSTOP) in the middle of its movements' COPY: the server waits for data and ignores
    statement_timeout and idle_in_transaction_session_timeout, so A's offset row locks would be held forever.
    Worker B is assigned A's partitions after A's session expires; its claim waits on those locks, terminates A's
    session (same service, same group: a zombie), and B drains the backlog within seconds, exactly once."""
    await produce(services.kafka, topic, 30_000, seed=51, show_progress=False)
    fast = {"STOCK_LEDGER_SESSION_TIMEOUT_MS": "4000", "STOCK_LEDGER_LOCK_TIMEOUT_MS": "2000",
            "STOCK_LEDGER_BATCH_MAX_RECORDS": "2000"}
    a = workers.start(**fast, STOCK_LEDGER_FAULT="during_copy@3:stop")
    await eventually(lambda: process_state(a.pid) == "T", 60, "worker A to freeze inside COPY", workers)
    conn = await asyncpg.connect(database.owner_url)
    try:
        waiting = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'COPY%' "
            "AND state = 'active' AND wait_event = 'ClientRead'")
    finally:
        await conn.close()
    assert waiting == 1, "A's backend is not waiting for COPY data"
    started = time.monotonic()
    b = workers.start(**fast)
    await wait_drained(services, database, topic, workers.group, 60, workers)
    assert time.monotonic() - started < 45, "B was held up by the frozen zombie"
    assert '"claim.zombies_terminated"' in b.log_text()
    a.kill()
    await assert_exact(services, database, topic, workers.group, rows=30_000, pool=workers)


async def test_a_second_consumer_group_on_the_same_database_is_refused(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """One database holds one group's ledger (movement_id and coordinates are unique across it): a worker of
    another group exits 1 naming both groups, and writes nothing."""
    await produce(services.kafka, topic, 500, seed=61, show_progress=False)
    workers.start()
    await wait_drained(services, database, topic, workers.group, 60, workers)
    other = workers.start(STOCK_LEDGER_GROUP_ID="stock-ledger-other")
    assert other.wait(60) == 1
    assert f"holds the ledger of consumer group '{workers.group}', not 'stock-ledger-other'" in other.log_text()
    await assert_exact(services, database, topic, workers.group, rows=500, pool=workers)
    await asyncio.sleep(0)


async def test_a_claim_delayed_across_a_rebalance_never_fences_the_new_owner(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """Worker A reads its group generation for a claim and freezes before sending it. Its session expires, B joins,
    is assigned everything under a newer generation and claims it. A thaws and sends its old claim: it takes
    nothing (claim.superseded); B is never fenced, and the ledger ends exact."""
    await produce(services.kafka, topic, 20_000, seed=71, show_progress=False)
    fast = {"STOCK_LEDGER_SESSION_TIMEOUT_MS": "4000"}
    a = workers.start(**fast, STOCK_LEDGER_FAULT="before_claim:stop")
    await eventually(lambda: process_state(a.pid) == "T", 60, "worker A to freeze before its claim", workers)
    b = workers.start(**fast)
    await eventually(lambda: b.metric("stock_ledger_assigned_partitions") == 24, 60, "B to claim all 24", workers)
    a.signal(signal.SIGCONT)
    await eventually(lambda: '"claim.superseded"' in a.log_text(), 60, "A's stale claim to be refused", workers)
    await wait_drained(services, database, topic, workers.group, 120, workers)
    assert b.metric("stock_ledger_batches_fenced_total") == 0, workers.logs_tail()
    await assert_exact(services, database, topic, workers.group, rows=20_000, pool=workers)
    workers.assert_no_tracebacks()
