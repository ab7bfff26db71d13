"""The database changes under running workers: a planned switchover, a lossy failover, a restore of an earlier state.

Each on real PostgreSQL (the pair of `scripts/postgres.sh ha`, or the shared cluster for the restore), with real
`stock-ledger run` processes that are never restarted, and each ends exact: every produced coordinate in exactly one
of stock_movements / rejected_movements, stock_levels equal to the movements, nothing twice, every stored offset at
the log end. Where the database went back in time, the workers must also say so
(`stock_ledger_offset_mismatches_total{direction="behind"}` and the `batch.offset_mismatch` error event).
"""

from __future__ import annotations

import asyncio
import io
import re
from typing import TYPE_CHECKING

import asyncpg
import pytest

from stock_ledger.config import load_settings
from tests.support.helpers import (
    Env,
    Services,
    SteadyLoad,
    WorkerPool,
    assert_exact,
    closings_off,
    end_offsets,
    eventually,
    ledger_state,
    stored_offsets,
    wait_drained,
)
from tests.support.services import produce

if TYPE_CHECKING:
    from collections.abc import Callable

    from tests.chaos.conftest import Pair

pytestmark = [pytest.mark.integration, pytest.mark.chaos, pytest.mark.asyncio]

# A lost session is noticed and a stuck lock given up quickly, so the outage is what the test measures.
FAST = {"STOCK_LEDGER_SESSION_TIMEOUT_MS": "4000", "STOCK_LEDGER_LOCK_TIMEOUT_MS": "1000",
        "STOCK_LEDGER_IDLE_IN_TRANSACTION_TIMEOUT_MS": "5000"}
MISMATCHES = "stock_ledger_offset_mismatches_total"
# A restore puts back every table but the migrations' own bookkeeping: the whole ledger state of time T, whatever
# tables the migrations have added (rows, quarantine, levels, offsets, gaps, audit trails). stock_movements as one
# table (its segments are its storage), and not movement_ids: stock_movements' triggers empty it with the TRUNCATE
# and fill it again with the rows.
_LEDGER_TABLES = """SELECT relname FROM pg_class WHERE relnamespace = 'public'::regnamespace AND relkind IN ('r', 'p')
    AND NOT relispartition AND relname NOT IN ('schema_migrations', 'movement_ids') ORDER BY relname"""
# (table, the table its foreign key references): a restore loads the referenced table first, as pg_restore does.
_REFERENCES = """SELECT conrelid::regclass::text, confrelid::regclass::text FROM pg_constraint
    WHERE contype = 'f' AND connamespace = 'public'::regnamespace AND conrelid <> confrelid"""
# Closings are taken every second, so the state put back holds some and the workers take more over it.
CLOSING_EVERY_SECOND = {"STOCK_LEDGER_CLOSING_SECONDS": "1"}


async def stored_total(db: Env, group: str, topic: str) -> int:
    conn = await asyncpg.connect(db.owner_url)
    try:
        return sum(o or 0 for o in (await stored_offsets(conn, group, topic)).values())
    finally:
        await conn.close()


def rewinds_seen(pool: WorkerPool) -> tuple[float, list[str]]:
    """What the workers said about a database behind them: the metric summed, the workers that logged the event."""
    metric = sum(w.metric(MISMATCHES, {"direction": "behind"}) or 0 for w in pool.started)
    logged = [w.log.name for w in pool.started if '"batch.offset_mismatch"' in w.log_text()]
    print(f"rewinds seen: {MISMATCHES}{{direction=behind}} summed {metric}; batch.offset_mismatch logged by {logged}")
    return metric, logged


async def print_holdings(services: Services, db: Env, topic: str, group: str, what: str) -> None:
    """One line on stdout (shown with a failure): how much of the topic the ledger holds."""
    s = await ledger_state(services, db, topic, group)
    missing = s.produced - s.rows - s.rejected
    print(f"{what}: {s.produced} produced, {s.rows} applied, {s.rejected} rejected, {missing} in neither table, "
          f"{len(s.gaps)} partitions with a gap")


def assert_never_restarted(pool: WorkerPool, count: int) -> None:
    assert len(pool.started) == count, f"{len(pool.started)} workers were started, not {count}"
    assert all(w.alive() for w in pool.started), f"a worker exited:\n{pool.logs_tail()}"


def script_result(out: str) -> dict[str, str]:
    """The `key=value` line that `ha switchover` / `ha failover` print on stdout."""
    return dict(re.findall(r"(\w+)=(\S+)", out))


async def settled(db: Env, group: str, topic: str, members: int) -> dict[int, int] | None:
    """The epochs of all 24 partitions once claimed by `members` workers and unchanged for 2 s (the group has stopped
    rebalancing), else None."""
    query = ("SELECT partition, epoch, member_id FROM consumer_offsets WHERE group_id = $1 AND topic = $2 "
             "ORDER BY partition")
    try:
        conn = await asyncpg.connect(db.owner_url)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
        return None
    try:
        first = await conn.fetch(query, group, topic)
        await asyncio.sleep(2)
        again = await conn.fetch(query, group, topic)
    finally:
        await conn.close()
    stable = len(again) == 24 and len({r[2] for r in again}) == members and first == again
    return {r[0]: r[1] for r in again} if stable else None


async def wait_settled(db: Env, group: str, topic: str, pool: WorkerPool) -> dict[int, int]:
    """Until the pool's workers hold every partition and no rebalance is under way: the epochs."""
    epochs: dict[int, int] = {}

    async def done() -> bool:
        nonlocal epochs
        epochs = await settled(db, group, topic, len(pool.started)) or {}
        return bool(epochs)

    await eventually(done, 60, f"{len(pool.started)} workers to hold the 24 partitions", pool)
    return epochs


# ------------------------------------------------------------------------------------------ the scripts themselves

def roles_of(report: str) -> dict[int, str]:
    """port -> role, from `ha status`."""
    return {int(line.split()[1]): line.split()[2] for line in report.splitlines() if not line.startswith("pair:")}


async def test_the_pair_reports_its_roles_gives_urls_the_worker_accepts_and_switches_over(ha_pair: Pair,
                                                                                          ha_database: Env) -> None:
    """The pair the other tests rely on does what its commands say, with no worker involved.

    1. `ha status` after `ha start`: one node primary, the other a standby streaming from it; `pair: healthy`.
    2. `ha url` / `ha worker-url` are multi-host read-write URLs the worker's configuration accepts, and a session
       opened with one lands on the primary.
    3. `ha switchover` swaps the roles: what was committed before it is on the new primary, the old primary streams
       from it, and the pair is healthy.
    """
    code, report = ha_pair.status()
    assert code == 0, report
    assert report.endswith("pair: healthy"), report
    roles = roles_of(report)
    assert sorted(roles.values()) == ["primary", "standby"], report
    primary = next(p for p, r in roles.items() if r == "primary")
    standby = next(p for p, r in roles.items() if r == "standby")
    assert f"streaming from port {primary}" in report, report

    for url in (ha_pair.owner_url, ha_pair.worker_url):
        assert url.endswith("@127.0.0.1:5441,127.0.0.1:5442/stock_ledger?target_session_attrs=read-write"), url
    settings = load_settings({"DATABASE_URL": ha_pair.worker_url, "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:9092"})
    assert settings.require_database_url() == ha_pair.worker_url
    assert await server_port(ha_database.worker_url) == primary

    conn = await asyncpg.connect(ha_database.owner_url)
    try:
        await conn.execute("CREATE TABLE probe (id int PRIMARY KEY)")
        await conn.execute("INSERT INTO probe SELECT generate_series(1, 100)")
    finally:
        await conn.close()
    result = script_result(await asyncio.to_thread(ha_pair.run, "switchover"))
    assert int(result["port"]) == standby, result
    assert await server_port(ha_database.worker_url) == standby
    assert await fetch_one(ha_database.owner_url, "SELECT count(*) FROM probe") == 100
    code, report = ha_pair.status()
    assert code == 0, report
    assert roles_of(report) == {primary: "standby", standby: "primary"}, report


async def server_port(url: str) -> int:
    """The port of the server a session with `url` lands on (asserting it is a primary)."""
    conn = await asyncpg.connect(url)
    try:
        assert await conn.fetchval("SELECT pg_is_in_recovery()") is False
        return int(await conn.fetchval("SELECT current_setting('port')"))
    finally:
        await conn.close()


async def fetch_one(url: str, sql: str) -> object:
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetchval(sql)
    finally:
        await conn.close()


async def test_a_lossy_failover_really_loses_the_commits_made_after_the_cut(ha_pair: Pair, ha_database: Env) -> None:
    """`ha cut` and `ha failover --lossy` do what the lossy tests need, with no worker involved.

    1. Rows committed before `ha cut` reach the standby; rows committed (and acknowledged) after it do not.
    2. `ha failover --lossy` promotes the standby: the rows from before the cut are there, those committed after it
       on the old primary are not (commits truly lost), and it reports the WAL it lost.
    3. `ha status` says degraded (the old primary diverged, left stopped); `ha start` heals it into a healthy pair,
       the old primary now a standby of the new one.
    """
    roles = roles_of(ha_pair.status()[1])
    primary = next(p for p, r in roles.items() if r == "primary")
    standby = next(p for p, r in roles.items() if r == "standby")
    owner = await asyncpg.connect(ha_pair.node_url(primary, ha_database.name))
    replica = await asyncpg.connect(ha_pair.node_url(standby, ha_database.name))
    try:
        await owner.execute("CREATE TABLE probe (id int PRIMARY KEY)")
        await owner.execute("INSERT INTO probe SELECT generate_series(1, 100)")
        await eventually(lambda: _count(replica, "SELECT count(*) FROM probe"), 20, "the standby to replay 100 rows")
        await asyncio.to_thread(ha_pair.run, "cut")
        for i in range(101, 201):  # one commit each, all acknowledged by the primary
            await owner.execute("INSERT INTO probe VALUES ($1)", i)
        await asyncio.sleep(1)
        assert await replica.fetchval("SELECT count(*) FROM probe") == 100
    finally:
        await owner.close()
        await replica.close()

    result = script_result(await asyncio.to_thread(ha_pair.run, "failover", "--lossy", "--hold", "1"))
    assert int(result["port"]) == standby, result
    assert int(result["lost_wal_bytes"]) > 0, result
    assert await server_port(ha_database.owner_url) == standby
    assert await fetch_one(ha_database.owner_url, "SELECT count(*) FROM probe WHERE id <= 100") == 100
    lost = await fetch_one(ha_database.owner_url, "SELECT count(*) FROM probe WHERE id > 100")
    assert lost == 0, f"{lost} of the 100 rows committed after the cut survived the failover"

    code, report = ha_pair.status()
    assert code == 1, report
    assert f"{primary} diverged" in report, report
    assert "pair: degraded" in report, report
    await asyncio.to_thread(ha_pair.run, "start")
    code, report = ha_pair.status()
    assert code == 0, report
    assert f"{primary} standby streaming from port {standby}" in report, report


async def _count(conn: asyncpg.Connection, sql: str, want: int = 100) -> bool:
    try:
        return bool(await conn.fetchval(sql) == want)
    except asyncpg.UndefinedTableError:
        return False  # CREATE TABLE not replayed yet


# ------------------------------------------------------------------------------------------ with workers running

async def test_planned_switchovers_with_workers_running_lose_nothing(
    services: Services, ha_pair: Pair, ha_services: Services, ha_database: Env, topic: str, ha_workers: WorkerPool,
    steady: Callable[[str, str, int, int], SteadyLoad],
) -> None:
    """Two workers apply movements at a steady 1,000/s through the multi-host URL. Mid-stream the primary is switched
    over (stopped cleanly, the standby promoted, the old primary re-attached as its standby), the workers write to
    the new primary, and it is switched back. The workers ride it out without a restart; the ledger is exact, and no
    worker saw a database behind it (a planned switchover loses no commit)."""
    group = ha_workers.group
    load = steady(services.kafka, topic, 1_000, 51)
    ha_workers.start(**FAST)
    ha_workers.start(**FAST)
    await eventually(lambda: _at_least(ha_database, group, topic, 1_000), 60, "1,000 applied", ha_workers)
    first = script_result(await asyncio.to_thread(ha_pair.run, "switchover"))
    before = await stored_total(ha_database, group, topic)
    await eventually(lambda: _at_least(ha_database, group, topic, before + 1_000), 60,
                     "1,000 more applied on the new primary", ha_workers)
    second = script_result(await asyncio.to_thread(ha_pair.run, "switchover"))
    assert first["primary"] != second["primary"], (first, second)
    assert load.running(), "the producer stopped before the second switchover: the workers were not under load"
    total = await load.finish(after=2)
    await wait_drained(ha_services, ha_database, topic, group, 120, ha_workers)
    await print_holdings(ha_services, ha_database, topic, group, "switchover")
    await assert_exact(ha_services, ha_database, topic, group, rows=total, pool=ha_workers)
    assert_never_restarted(ha_workers, 2)
    metric, logged = rewinds_seen(ha_workers)
    assert metric == 0, f"a planned switchover looked like a rewind: {MISMATCHES} = {metric}"
    assert not logged, f"a planned switchover looked like a rewind: batch.offset_mismatch in {logged}"
    ha_workers.assert_no_tracebacks()
    code, report = ha_pair.status()
    assert code == 0, report


async def _epochs_are(url: str, group: str, epochs: dict[int, int]) -> bool:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch("SELECT partition, epoch FROM consumer_offsets WHERE group_id = $1", group)
    finally:
        await conn.close()
    return {r[0]: r[1] for r in rows} == epochs


async def _at_least(db: Env, group: str, topic: str, n: int) -> bool:
    try:
        return await stored_total(db, group, topic) >= n
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
        return False  # the primary is changing under us


async def test_a_lossy_failover_with_workers_running_ends_exact_and_is_reported(
    services: Services, ha_pair: Pair, ha_services: Services, ha_database: Env, topic: str, ha_workers: WorkerPool,
    steady: Callable[[str, str, int, int], SteadyLoad],
) -> None:
    """The issue's repro. Two workers apply movements at a steady 1,000/s through the multi-host URL. The standby stops
    receiving WAL, the primary keeps committing batches for 3.5 s, then dies (kill -9) and the standby is promoted:
    the new primary's ledger is seconds behind what the workers committed. The workers keep running (no restart),
    find the stored offsets behind what they expect, say so (metric and error event), and re-apply the lost range
    from Kafka: the ledger ends exact.

    Fails on a worker that writes past the rewound offsets: the lost range is then a gap for good."""
    group = ha_workers.group
    load = steady(services.kafka, topic, 1_000, 52)
    ha_workers.start(**FAST)
    ha_workers.start(**FAST)
    # The claims reach the standby before the cut: what the failover loses is batches, under the same epochs.
    epochs = await wait_settled(ha_database, group, topic, ha_workers)
    standby = next(p for p, r in roles_of(ha_pair.status()[1]).items() if r == "standby")
    replica = ha_pair.node_url(standby, ha_database.name)
    await eventually(lambda: _epochs_are(replica, group, epochs), 20, "the claims on the standby", ha_workers)
    settled_at = await stored_total(ha_database, group, topic)
    await eventually(lambda: _at_least(ha_database, group, topic, settled_at + 1_000), 60, "1,000 applied",
                     ha_workers)
    result = script_result(await asyncio.to_thread(ha_pair.run, "failover", "--lossy", "--hold", "3.5"))
    assert int(result["lost_wal_bytes"]) > 0, result
    assert load.running(), "the producer stopped before the failover: the old primary was not under load"
    total = await load.finish(after=3)
    await wait_drained(ha_services, ha_database, topic, group, 120, ha_workers)
    await print_holdings(ha_services, ha_database, topic, group, "lossy failover")
    await assert_exact(ha_services, ha_database, topic, group, rows=total, pool=ha_workers)
    assert_never_restarted(ha_workers, 2)
    metric, logged = rewinds_seen(ha_workers)
    assert metric > 0, f'no worker counted the rewind ({MISMATCHES}{{direction="behind"}} = {metric})'
    assert logged, "no worker logged batch.offset_mismatch"
    ha_workers.assert_no_tracebacks()


async def _drained(services: Services, db: Env, topic: str, group: str, pool: WorkerPool) -> bool:
    """Every stored offset at its log end; a worker that exited fails at once (no restart is part of the claim)."""
    assert all(w.alive() for w in pool.started), f"a worker exited:\n{pool.logs_tail()}"
    ends = await end_offsets(services.kafka, topic)
    try:
        conn = await asyncpg.connect(db.owner_url)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
        return False
    try:
        stored = await stored_offsets(conn, group, topic)
    finally:
        await conn.close()
    return all((stored.get(p) or 0) >= e for p, e in ends.items())


async def test_a_lossy_failover_that_also_loses_a_rebalance_ends_exact_and_is_reported(
    services: Services, ha_pair: Pair, ha_services: Services, ha_database: Env, topic: str, ha_workers: WorkerPool,
    steady: Callable[[str, str, int, int], SteadyLoad],
) -> None:
    """Beyond the issue's repro: the rewind crosses a claim. One worker applies a steady 1,000/s; replication is cut;
    a second worker joins, so the group rebalances and every partition is claimed again (new epochs), on the old
    primary only; it commits for a while, dies (kill -9), and the standby is promoted. The new primary holds older
    epochs AND older offsets than the workers: not another worker's claim (epochs never go back by themselves) but
    the database gone back in time. The workers keep running (no restart), say so, re-apply from Kafka: exact.

    Fails on a worker that reads the older epoch as a fence by someone else and exits, or writes past the rewind."""
    group = ha_workers.group
    load = steady(services.kafka, topic, 1_000, 54)
    ha_workers.start(**FAST)
    epochs = await wait_settled(ha_database, group, topic, ha_workers)
    settled_at = await stored_total(ha_database, group, topic)
    await eventually(lambda: _at_least(ha_database, group, topic, settled_at + 1_000), 60, "1,000 applied",
                     ha_workers)
    await asyncio.to_thread(ha_pair.run, "cut")
    ha_workers.start(**FAST)
    moved = await wait_settled(ha_database, group, topic, ha_workers)
    assert all(moved[p] > e for p, e in epochs.items()), "the second worker's claims did not bump every epoch"
    result = script_result(await asyncio.to_thread(ha_pair.run, "failover", "--lossy", "--hold", "2"))
    assert int(result["lost_wal_bytes"]) > 0, result
    assert load.running(), "the producer stopped before the failover: the old primary was not under load"
    total = await load.finish(after=3)
    await eventually(lambda: _drained(ha_services, ha_database, topic, group, ha_workers), 120, "drained", ha_workers)
    await print_holdings(ha_services, ha_database, topic, group, "lossy failover across a rebalance")
    await assert_exact(ha_services, ha_database, topic, group, rows=total, pool=ha_workers)
    assert_never_restarted(ha_workers, 2)
    metric, logged = rewinds_seen(ha_workers)
    assert metric > 0, f'no worker counted the rewind ({MISMATCHES}{{direction="behind"}} = {metric})'
    assert logged, "no worker logged batch.offset_mismatch"
    ha_workers.assert_no_tracebacks()


# ------------------------------------------------------------------------------------------ restore (shared cluster)

Snapshot = dict[str, tuple[list[str], bytes]]


def _referenced_first(tables: list[str], references: list[tuple[str, str]]) -> list[str]:
    ordered: list[str] = []

    def visit(table: str) -> None:
        if table not in ordered:
            for referenced in sorted(r for t, r in references if t == table and r in tables):
                visit(referenced)
            ordered.append(table)
    for table in tables:
        visit(table)
    return ordered


async def take_snapshot(owner_url: str) -> tuple[Snapshot, dict[int, int], int]:
    """The ledger's rows, levels, gaps and offsets of one instant (one REPEATABLE READ snapshot, binary COPY of every
    column that is not generated), the epochs it holds and the sum of its stored offsets."""
    conn = await asyncpg.connect(owner_url)
    snapshot: Snapshot = {}
    try:
        async with conn.transaction(isolation="repeatable_read", readonly=True):
            tables = _referenced_first([r[0] for r in await conn.fetch(_LEDGER_TABLES)],
                                       [(r[0], r[1]) for r in await conn.fetch(_REFERENCES)])
            assert {"stock_movements", "rejected_movements", "stock_levels", "consumer_offsets"} <= set(tables)
            for table in tables:
                columns = [r[0] for r in await conn.fetch(
                    "SELECT column_name FROM information_schema.columns WHERE table_schema = 'public' "
                    "AND table_name = $1 AND is_generated = 'NEVER' ORDER BY ordinal_position", table)]
                out = io.BytesIO()
                await conn.copy_from_query(f"SELECT {', '.join(columns)} FROM {table}", output=out, format="binary")
                snapshot[table] = (columns, out.getvalue())
            epochs = {r[0]: r[1] for r in await conn.fetch("SELECT partition, epoch FROM consumer_offsets")}
            stored = int(await conn.fetchval("SELECT coalesce(sum(next_offset), 0) FROM consumer_offsets"))
    finally:
        await conn.close()
    return snapshot, epochs, stored


async def restore(owner_url: str, snapshot: Snapshot) -> dict[int, int]:
    """Put the snapshot back in ONE transaction (TRUNCATE and reload, as the owner); returns the epochs the ledger
    held just before, read under the exclusive lock."""
    conn = await asyncpg.connect(owner_url)
    try:
        for attempt in range(3):
            try:
                async with conn.transaction():
                    # ledger_closings first: a closing being taken holds its lock on it before it reads any other
                    # table, so a restore that waited for it holding another would deadlock with it.
                    locks = sorted(snapshot, key=lambda table: (table != "ledger_closings", table))
                    await conn.execute(f"LOCK TABLE {', '.join(locks)} IN ACCESS EXCLUSIVE MODE")
                    tables = ", ".join(snapshot)
                    epochs = {r[0]: r[1] for r in await conn.fetch("SELECT partition, epoch FROM consumer_offsets")}
                    await conn.execute(f"TRUNCATE {tables}")
                    for table, (columns, data) in snapshot.items():
                        await conn.copy_to_table(table, source=io.BytesIO(data), columns=columns, format="binary")
            except asyncpg.DeadlockDetectedError:
                # The monitor summarizes the BRIN segment by segment, each lock held to its end: its order and the
                # LOCK's over the segments may cross. Nothing was restored; an operator would run it again.
                if attempt == 2:
                    raise
            else:
                return epochs
        raise AssertionError("unreachable")
    finally:
        await conn.close()


async def _closings_taken(db: Env) -> bool:
    conn = await asyncpg.connect(db.owner_url)
    try:
        return bool(await conn.fetchval("SELECT count(*) FROM ledger_closings"))
    finally:
        await conn.close()


async def test_a_restore_of_an_earlier_state_with_workers_running_ends_exact_and_is_reported(
    services: Services, database: Env, topic: str, workers: WorkerPool,
    steady: Callable[[str, str, int, int], SteadyLoad],
) -> None:
    """Two workers apply movements at a steady 600/s. At T the ledger (rows, levels, gaps, offsets) is copied in one
    snapshot; 1,500 movements later it is put back in one transaction, same database, same epochs: the database
    went back in time under workers that hold their partitions. They keep running (no restart), find the stored
    offsets behind what they expect, say so (metric and error event), and re-apply from Kafka: the ledger ends exact.

    Fails on a worker that writes past the restored offsets: what was applied after T is then a gap for good."""
    group = workers.group
    workers.start(**FAST, **CLOSING_EVERY_SECOND)
    workers.start(**FAST, **CLOSING_EVERY_SECOND)
    load = steady(services.kafka, topic, 600, 53)
    epochs = await wait_settled(database, group, topic, workers)
    settled_at = await stored_total(database, group, topic)
    await eventually(lambda: _at_least(database, group, topic, settled_at + 1_000), 60, "1,000 applied", workers)
    await eventually(lambda: _closings_taken(database), 30, "a closing taken before T", workers)
    snapshot, at_t, stored_at_t = await take_snapshot(database.owner_url)
    await eventually(lambda: _at_least(database, group, topic, stored_at_t + 1_500), 60, "1,500 more applied",
                     workers)
    before_restore = await restore(database.owner_url, snapshot)
    assert before_restore == at_t == epochs, "the group rebalanced between T and the restore: not the same epochs"
    assert load.running(), "the producer stopped before the restore: the workers were not under load"
    total = await load.finish(after=3)
    await wait_drained(services, database, topic, group, 120, workers)
    await print_holdings(services, database, topic, group, "restore")
    await assert_exact(services, database, topic, group, rows=total, pool=workers)
    assert not await closings_off(database.owner_url), "a closing differs from the rows below its cut"
    assert_never_restarted(workers, 2)
    metric, logged = rewinds_seen(workers)
    assert metric > 0, f'no worker counted the rewind ({MISMATCHES}{{direction="behind"}} = {metric})'
    assert logged, "no worker logged batch.offset_mismatch"
    workers.assert_no_tracebacks()


async def test_a_lossy_failover_after_the_load_stopped_is_healed_without_another_record(
    services: Services, ha_pair: Pair, ha_services: Services, ha_database: Env, topic: str, ha_workers: WorkerPool,
) -> None:
    """No record arrives after the failover: a guard that only checks when a batch commits would leave the lost
    range missing until each partition's next record (for an idle SKU range, for days). A worker's new session
    compares the stored offsets with its own before anything else and claims the rewound partitions again, so the
    range is re-applied at once, with nothing more produced.

    Schedule: 2,000 movements applied and replicated; replication cut; 1,500 more applied on the primary only;
    the producer stops; the primary dies and the standby is promoted."""
    group = ha_workers.group
    await produce(services.kafka, topic, 2_000, seed=61, show_progress=False)
    ha_workers.start(**FAST)
    ha_workers.start(**FAST)
    epochs = await wait_settled(ha_database, group, topic, ha_workers)
    await wait_drained(ha_services, ha_database, topic, group, 60, ha_workers)
    standby = next(p for p, r in roles_of(ha_pair.status()[1]).items() if r == "standby")
    replica = ha_pair.node_url(standby, ha_database.name)
    await eventually(lambda: _epochs_are(replica, group, epochs), 20, "the claims on the standby", ha_workers)
    await eventually(lambda: _at_least_on(replica, group, topic, 2_000), 20, "2,000 on the standby", ha_workers)
    await asyncio.to_thread(ha_pair.run, "cut")
    await produce(services.kafka, topic, 1_500, seed=62, show_progress=False)
    await wait_drained(ha_services, ha_database, topic, group, 60, ha_workers)
    result = script_result(await asyncio.to_thread(ha_pair.run, "failover", "--lossy", "--hold", "0.5"))
    assert int(result["lost_wal_bytes"]) > 0, result
    await wait_drained(ha_services, ha_database, topic, group, 60, ha_workers)
    await assert_exact(ha_services, ha_database, topic, group, rows=3_500, pool=ha_workers)
    assert_never_restarted(ha_workers, 2)
    metric, _ = rewinds_seen(ha_workers)
    assert metric > 0, f'no worker counted the rewind ({MISMATCHES}{{direction="behind"}} = {metric})'
    assert any('"found_by": "session_check"' in w.log_text() for w in ha_workers.started), \
        "the rewind was not found by a new session's check"
    ha_workers.assert_no_tracebacks()


async def _at_least_on(url: str, group: str, topic: str, n: int) -> bool:
    try:
        conn = await asyncpg.connect(url)
    except (OSError, asyncpg.PostgresError):
        return False
    try:
        return int(await conn.fetchval("SELECT coalesce(sum(next_offset), 0) FROM consumer_offsets "
                                       "WHERE group_id = $1 AND topic = $2", group, topic)) >= n
    finally:
        await conn.close()
