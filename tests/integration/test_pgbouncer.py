"""PgBouncer between the workers and PostgreSQL: Debian's 1.18 with its default configuration (scripts/pgbouncer.sh),
the workers as `stock-ledger run` processes connecting through it, the checks made directly on PostgreSQL.

Session mode, and transaction mode with STOCK_LEDGER_DATABASE_POOLING=transaction, work with every protection intact
(the timeouts, zombie termination by the backend's own pid, a crash mid-COPY, the monitor lease), each proven by the
same tests in both modes; transaction mode without the setting, and statement mode, are refused at start; a startup
parameter the pooler refuses is a configuration error. See docs/pgbouncer.md."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from stock_ledger.clients.database import session_name
from tests.support.helpers import (
    Env,
    Services,
    WorkerPool,
    assert_exact,
    closings_off,
    eventually,
    process_state,
    wait_drained,
)
from tests.support.services import WorkerProcess, produce, script

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]
MODES = ("session", "transaction", "statement")


@pytest.fixture(scope="module")
def poolers(services: Services) -> dict[str, int]:
    """pool mode -> the port of a PgBouncer in that mode in front of the tests' PostgreSQL (left running: the
    script is idempotent, and other test runs may be using it)."""
    if services.root is None:
        pytest.skip(f"PgBouncer is put in front of scripts/postgres.sh's PostgreSQL; services came from "
                    f"{services.origin}")
    ports = {}
    for mode in MODES:
        started = script("pgbouncer.sh", "start", "--mode", mode)
        assert started.returncode == 0, started.stderr
        url = script("pgbouncer.sh", "url", "--mode", mode)
        ports[mode] = int(urlsplit(url.stdout.strip()).port or 0)
    return ports


def through(db: Env, poolers: dict[str, int], mode: str) -> dict[str, str]:
    """A worker's environment to connect through the pooler in `mode`, saying so where it is transaction mode."""
    env = {"DATABASE_URL": via(db.worker_url, poolers[mode])}
    if mode == "transaction":
        env["STOCK_LEDGER_DATABASE_POOLING"] = "transaction"
    return env


def via(url: str, port: int, query: str = "") -> str:
    """`url` through the pooler listening on `port` of 127.0.0.1."""
    parts = urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    return urlunsplit((parts.scheme, f"{userinfo}@127.0.0.1:{port}", parts.path, query or parts.query, ""))


async def backends(db: Env, group: str, state: str | None = None) -> list[asyncpg.Record]:
    """The PostgreSQL backends of the group's worker sessions (as the server sees them, directly)."""
    conn = await asyncpg.connect(db.owner_url)
    try:
        return await conn.fetch(
            "SELECT pid, state, wait_event_type, wait_event, query FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = $1 AND ($2::text IS NULL OR state = $2)",
            session_name(group), state)
    finally:
        await conn.close()


POOLED = ("session", "transaction")


async def server_sessions_as_a_new_client_finds_them(db: Env, port: int) -> list[asyncpg.Record]:
    """What a new client of the workers' pool finds set on each server connection the pool holds for this database:
    as many clients as there are server connections (and one more) each hold one in an open transaction."""
    conn = await asyncpg.connect(db.owner_url)
    try:
        held = await conn.fetchval("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                                   "AND usename = 'stock_ledger_worker'")
    finally:
        await conn.close()
    clients = [await asyncpg.connect(via(db.worker_url, port), statement_cache_size=0) for _ in range(held + 1)]
    try:
        for client in clients:
            await client.execute("BEGIN")
        return [await c.fetchrow("SELECT pg_backend_pid() AS pid, current_setting('lock_timeout') AS lock_timeout, "
                                 "current_setting('idle_in_transaction_session_timeout') AS idle, "
                                 "current_setting('search_path') AS search_path") for c in clients]
    finally:
        for client in clients:
            client.terminate()


@pytest.mark.parametrize("mode", POOLED)
async def test_through_the_pooler_the_worker_drains_exactly_under_its_lock_timeout(
    services: Services, database: Env, topic: str, workers: WorkerPool, poolers: dict[str, int], mode: str,
) -> None:
    """The worker connects through PgBouncer's default session-mode pool (the old worker could not: every connect
    was refused for its lock_timeout startup parameter, and retried), or its transaction-mode pool. lock_timeout is
    in force on its claim: while a test session (not the group's, so no zombie to terminate) holds consumer_offsets
    in SHARE mode, the worker's claim is seen waiting on the lock directly in pg_stat_activity, then cancelled by
    lock_timeout (1 s) and retried. Released, the worker drains 3,000 movements exactly once. In transaction mode
    nothing the worker set stays behind for the next client: stopped, every server connection of the pool shows
    the server's defaults (lock_timeout, idle_in_transaction_session_timeout, search_path)."""
    await produce(services.kafka, topic, 3_000, seed=311, show_progress=False)
    blocker = await asyncpg.connect(database.owner_url)
    try:
        await blocker.execute("BEGIN; LOCK TABLE consumer_offsets IN SHARE MODE")
        worker = workers.start(**through(database, poolers, mode), STOCK_LEDGER_LOCK_TIMEOUT_MS="1000")

        async def claim_waits_on_the_lock() -> bool:
            return any(b["wait_event_type"] == "Lock" and "consumer_offsets" in b["query"]
                       for b in await backends(database, workers.group))

        await eventually(claim_waits_on_the_lock, 60, "the worker's claim to wait on the lock", workers)
        await eventually(lambda: "canceling statement due to lock timeout" in worker.log_text(), 15,
                         "lock_timeout to cancel the claim", workers)
        assert '"claim.retry"' in worker.log_text()
        assert worker.alive()
    finally:
        await blocker.close()
    await wait_drained(services, database, topic, workers.group, 120, workers)
    await assert_exact(services, database, topic, workers.group, rows=3_000, pool=workers)
    workers.assert_no_tracebacks()
    if mode == "transaction":
        worker.signal(signal.SIGTERM)
        assert worker.wait(30) == 0
        found = await server_sessions_as_a_new_client_finds_them(database, poolers[mode])
        assert len({r["pid"] for r in found}) > 1, found
        assert {(r["lock_timeout"], r["idle"], r["search_path"]) for r in found} == {("0", "0", '"$user", public')}


@pytest.mark.parametrize("mode", POOLED)
async def test_through_the_pooler_a_worker_frozen_in_its_transaction_loses_it_at_the_idle_timeout(
    services: Services, database: Env, topic: str, workers: WorkerPool, poolers: dict[str, int], mode: str,
) -> None:
    """idle_in_transaction_session_timeout is in force on the worker's transaction behind the pooler (set for the
    session in session mode, by the transaction itself in transaction mode): the worker, frozen (SIGSTOP) before its
    third commit, shows in pg_stat_activity as `idle in transaction`; with no other worker to claim anything, the
    server itself ends that backend within its 2 s timeout (not 0, as when it was sent as a startup parameter and
    dropped). Thawed, the worker reconnects through the pooler and drains exactly."""
    await produce(services.kafka, topic, 6_000, seed=312, show_progress=False)
    worker = workers.start(**through(database, poolers, mode),
                           STOCK_LEDGER_IDLE_IN_TRANSACTION_TIMEOUT_MS="2000", STOCK_LEDGER_BATCH_MAX_RECORDS="1000",
                           STOCK_LEDGER_FAULT="before_commit@3:stop")
    await eventually(lambda: process_state(worker.pid) == "T", 60, "the worker to freeze before a commit", workers)
    frozen_at = time.monotonic()
    idle = await backends(database, workers.group, "idle in transaction")
    assert len(idle) == 1, idle

    async def session_ended() -> bool:
        return not await backends(database, workers.group, "idle in transaction")

    await eventually(session_ended, 15, "the server to end the frozen session", workers)
    assert time.monotonic() - frozen_at < 10
    worker.signal(signal.SIGCONT)
    await wait_drained(services, database, topic, workers.group, 120, workers)
    await assert_exact(services, database, topic, workers.group, rows=6_000, pool=workers)


@pytest.mark.chaos
@pytest.mark.parametrize("mode", POOLED)
@pytest.mark.parametrize(("fault", "where"), [("before_commit@3:stop", "idle in transaction"),
                                              ("during_copy@3:stop", "active")], ids=["in-transaction", "in-copy"])
async def test_a_worker_frozen_behind_the_pooler_is_terminated_by_the_next_owners_claim(
    services: Services, database: Env, topic: str, workers: WorkerPool, poolers: dict[str, int], fault: str,
    where: str, mode: str,
) -> None:
    """Both workers through the pooler. A freezes (SIGSTOP) inside its batch transaction, before COMMIT or in the
    middle of its COPY (where the server's own timeouts do not reach it), holding its partitions' offset rows; the
    server's idle-in-transaction timeout is set out of reach (10 min). B is assigned A's partitions once A's Kafka
    session expires; its claim waits on those rows, finds A's backend among its blockers by the backend's own pid
    (pg_backend_pid(), asked inside the claim's transaction: behind the pooler get_server_pid() is a made-up number,
    and in transaction mode the backend is whichever the transaction got) and by the group's application_name (which
    PgBouncer sets on whichever server connection A's transaction holds), terminates it, and drains the backlog
    within seconds, exactly once."""
    await produce(services.kafka, topic, 20_000, seed=313, show_progress=False)
    fast = {**through(database, poolers, mode), "STOCK_LEDGER_SESSION_TIMEOUT_MS": "4000",
            "STOCK_LEDGER_LOCK_TIMEOUT_MS": "2000", "STOCK_LEDGER_BATCH_MAX_RECORDS": "2000",
            "STOCK_LEDGER_IDLE_IN_TRANSACTION_TIMEOUT_MS": "600000"}
    a = workers.start(**fast, STOCK_LEDGER_FAULT=fault)
    await eventually(lambda: process_state(a.pid) == "T", 60, "worker A to freeze inside its transaction", workers)
    frozen = await backends(database, workers.group, where)
    assert len(frozen) == 1, frozen
    if where == "active":
        assert frozen[0]["query"].startswith("COPY"), frozen
        assert frozen[0]["wait_event"] == "ClientRead", frozen
    started = time.monotonic()
    b = workers.start(**fast)
    await wait_drained(services, database, topic, workers.group, 60, workers)
    assert time.monotonic() - started < 45, "B was held up by the frozen zombie"
    assert '"claim.zombies_terminated"' in b.log_text()
    assert str(frozen[0]["pid"]) in next(line for line in b.log_text().splitlines() if "zombies_terminated" in line)
    a.kill()
    await assert_exact(services, database, topic, workers.group, rows=20_000, pool=workers)


@pytest.mark.chaos
@pytest.mark.parametrize("mode", POOLED)
async def test_a_worker_killed_inside_its_copy_behind_the_pooler_costs_nothing(
    services: Services, database: Env, topic: str, workers: WorkerPool, poolers: dict[str, int], mode: str,
) -> None:
    """Both workers through the pooler. A is killed (SIGKILL) in the middle of its third COPY, its server connection
    busy inside the batch transaction: PgBouncer drops that server connection with the client, so PostgreSQL rolls
    the transaction back and frees its rows. B is assigned A's partitions, claims them at the offsets A last
    committed and drains 20,000 movements exactly once; in transaction mode no prepared statement of one client
    collides with another's on a shared server connection (none is named); nothing is logged as a stack trace."""
    await produce(services.kafka, topic, 20_000, seed=315, show_progress=False)
    fast = {**through(database, poolers, mode), "STOCK_LEDGER_SESSION_TIMEOUT_MS": "4000",
            "STOCK_LEDGER_BATCH_MAX_RECORDS": "2000"}
    a = workers.start(**fast, STOCK_LEDGER_FAULT="during_copy@3:kill")
    # B joins once A holds partitions: started together on a loaded host, B could drain all before A's third COPY.
    await eventually(lambda: (a.metric("stock_ledger_assigned_partitions") or 0) > 0 or not a.alive(), 60,
                     "A to claim partitions", workers)
    b = workers.start(**fast)
    assert a.wait(60) == -signal.SIGKILL, a.log_tail(20)
    await wait_drained(services, database, topic, workers.group, 90, workers)
    await assert_exact(services, database, topic, workers.group, rows=20_000, pool=workers)
    assert "prepared statement" not in b.log_text()
    workers.assert_no_tracebacks()


async def assert_lease(db: Env, group: str, term: int, holder: WorkerProcess) -> None:
    """The group's row of monitor_leases: live, in `term`, held by `holder`'s process."""
    conn = await asyncpg.connect(db.owner_url)
    try:
        row = await conn.fetchrow("SELECT holder, term, expires_at > now() AS live FROM monitor_leases "
                                  "WHERE group_id = $1", group)
    finally:
        await conn.close()
    assert row is not None
    assert (row["live"], row["term"]) == (True, term), row
    assert f"/{holder.pid}/" in row["holder"], row


async def test_behind_the_transaction_pooler_one_pod_leads_the_monitors_by_a_lease_that_expires(
    database: Env, workers: WorkerPool, poolers: dict[str, int],
) -> None:
    """Two workers through the transaction pooler, where an advisory lock would belong to whichever client next
    got its server connection: the lease is the group's row in monitor_leases (the position refresh is 1 s, so it
    lasts 10 s past the leader's last renewal).
    1. Exactly one pod exports stock_ledger_monitor_leader 1, and the row names its process, term 1.
    2. Frozen (SIGSTOP), the leader stops renewing: once the lease expired the other pod takes it (term 2) and
       leads; thawed, the former leader finds it gone and exports 0.
    3. Stopped (SIGTERM), the new leader hands the lease over: the first pod leads again (term 3) within a few
       seconds, long before the lease would have expired.
    Meanwhile each leader's monitor reads through the pooler too: its ledger checks run and no refresh fails."""
    pool = [workers.start(**through(database, poolers, "transaction")) for _ in range(2)]

    def leaders() -> list:
        return [w for w in pool if w.alive() and w.metric("stock_ledger_monitor_leader") == 1]

    await eventually(lambda: len(leaders()) == 1 and all(w.metric("stock_ledger_monitor_leader") is not None
                                                         for w in pool), 60, "one monitor leader", workers)
    [leader] = leaders()
    [other] = [w for w in pool if w is not leader]
    await assert_lease(database, workers.group, 1, leader)
    leader.signal(signal.SIGSTOP)
    try:
        await eventually(lambda: other.metric("stock_ledger_monitor_leader") == 1, 45,
                         "the other pod to take the expired lease from the frozen leader", workers)
    finally:
        leader.signal(signal.SIGCONT)
    await assert_lease(database, workers.group, 2, other)
    await eventually(lambda: leader.metric("stock_ledger_monitor_leader") == 0, 30,
                     "the thawed former leader to export 0", workers)
    assert leaders() == [other]
    other.signal(signal.SIGTERM)
    stopped = time.monotonic()
    await eventually(lambda: leader.metric("stock_ledger_monitor_leader") == 1, 30,
                     "the first pod to lead again once the other handed the lease over", workers)
    assert time.monotonic() - stopped < 6, "the lease was not handed over: it expired"
    assert other.wait(30) == 0
    await assert_lease(database, workers.group, 3, leader)
    workers.assert_no_tracebacks()
    assert '"invariants.checked"' in leader.log_text()  # as the first leader: the ledger checks ran
    for w in pool:
        # A refresh in flight when the leader was frozen outlives its deadline on the thaw: that one may fail, with
        # a timeout. Any other failure (a pooler error, a prepared statement) fails the test.
        lines = [json.loads(line) for line in w.log_text().splitlines() if '"metrics.refresh_failed"' in line]
        failed = [e for e in lines if not (w is leader and str(e.get("error", "")).startswith("TimeoutError"))]
        assert not failed, failed
        assert '"monitor.lease_check_failed"' not in w.log_text()


async def test_behind_the_transaction_pooler_the_monitor_takes_exact_closings_and_keeps_its_brins_summarized(
    services: Services, database: Env, topic: str, workers: WorkerPool, poolers: dict[str, int],
) -> None:
    """The monitor's closings (a REPEATABLE READ transaction that locks ledger_closings) and its summarizing pass (a
    SECURITY DEFINER function that locks each table NOWAIT) through the transaction pooler, every second while 3,000
    movements arrive: closings are taken, each holds exactly the movements below its cut, no BRIN range is left
    unchecked (stock_ledger_brin_ranges_behind 0 once drained) and no refresh failed."""
    worker = workers.start(**through(database, poolers, "transaction"), STOCK_LEDGER_CLOSING_SECONDS="1")
    await produce(services.kafka, topic, 3_000, seed=312, show_progress=False)
    await wait_drained(services, database, topic, workers.group, 120, workers)
    await assert_exact(services, database, topic, workers.group, rows=3_000, pool=workers)
    taken = worker.log_text().count('"closing.taken"')
    await eventually(lambda: worker.log_text().count('"closing.taken"') > taken + 1, 30,
                     "closings after the drain", workers)
    await eventually(lambda: worker.metric("stock_ledger_brin_ranges_behind") == 0, 30, "the BRINs summarized",
                     workers)
    assert not await closings_off(database.owner_url)
    assert '"metrics.refresh_failed"' not in worker.log_text()
    workers.assert_no_tracebacks()


@pytest.mark.parametrize(("mode", "pooling", "says"), [
    ("transaction", None, "STOCK_LEDGER_DATABASE_POOLING=transaction"),
    ("statement", None, "statement pool_mode"),
    ("statement", "transaction", "statement pool_mode"),
])
async def test_pooling_the_setting_does_not_allow_is_refused_at_start(
    services: Services, database: Env, topic: str, workers: WorkerPool, poolers: dict[str, int], mode: str,
    pooling: str | None, says: str,
) -> None:
    """Behind PgBouncer in transaction mode without STOCK_LEDGER_DATABASE_POOLING=transaction the worker would run as
    on a session of its own (its advisory-lock lease held by whoever gets the server connection, SET leaking to
    other clients, prepared statements colliding); in statement mode no batch transaction can run at all, whatever
    the setting. The worker exits 2 at start, says which pool_mode or setting to use, and writes nothing."""
    await produce(services.kafka, topic, 100, seed=314, show_progress=False)
    env = {"DATABASE_URL": via(database.worker_url, poolers[mode])}
    worker = workers.start(**env, **({"STOCK_LEDGER_DATABASE_POOLING": pooling} if pooling else {}))
    assert worker.wait(60) == 2, worker.log_tail(20)
    assert says in worker.log_text()
    assert "pool_mode = session" in worker.log_text()
    assert "Traceback" not in worker.log_text()
    conn = await asyncpg.connect(database.owner_url)
    try:
        assert await conn.fetchval("SELECT count(*) FROM consumer_offsets") == 0
    finally:
        await conn.close()


async def test_a_startup_parameter_the_pooler_refuses_is_a_configuration_error(
    database: Env, workers: WorkerPool, poolers: dict[str, int],
) -> None:
    """A query parameter in DATABASE_URL becomes a startup parameter; PgBouncer refuses one it does not know. The
    worker exits 2 at once (not retried as a lost connection), naming the parameter and the fix."""
    worker = workers.start(DATABASE_URL=via(database.worker_url, poolers["session"], "search_path=public"))
    assert worker.wait(30) == 2, worker.log_tail(20)
    text = worker.log_text()
    assert "unsupported startup parameter: search_path" in text
    assert "ignore_startup_parameters" in text
    assert '"startup.retry"' not in text
    await asyncio.sleep(0)
