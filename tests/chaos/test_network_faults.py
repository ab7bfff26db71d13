"""Network faults between the workers and PostgreSQL, with workers draining: a blackhole, connection resets, 200 ms
of latency and a refused path, each put in and taken out by toxiproxy (tests/support/toxiproxy.py).

Two real `stock-ledger run` processes reach PostgreSQL only through the proxy (their DATABASE_URL is routed through
it: the batch session, claims, the monitor's lease and pool alike); the test's own checks go to PostgreSQL directly.
One fleet and one topic serve the four phases in turn, so each phase starts from whatever the one before left,
sessions and all. In each phase movements arrive at a steady rate, both workers hold partitions and the ledger is
seen advancing; the fault is put in for HOLD seconds, during which the workers must show they noticed it (/readyz:
"PostgreSQL not connected", for the faults that stop every commit) or keep applying (latency); the fault is taken
out; then
  - the ledger has applied everything produced before the fault's end within RECOVERY seconds (each phase's times
    are printed: `pytest -s` shows them);
  - the producer stops and the ledger is exact by the independent check (assert_exact): every movement once, in one
    table, levels equal to the movements, every stored offset at the log end;
  - both workers are the processes (PIDs) that started, still running: no restart was needed;
and at the end no worker has logged a stack trace.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import asyncpg
import pytest

from tests.support.helpers import (
    Env,
    Services,
    WorkerPool,
    assert_exact,
    end_offsets,
    eventually,
    stored_offsets,
    wait_drained,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

    from tests.support.helpers import SteadyLoad
    from tests.support.services import WorkerProcess
    from tests.support.toxiproxy import Proxy, Stream

pytestmark = [pytest.mark.integration, pytest.mark.chaos, pytest.mark.asyncio]

# A stuck lock is given up quickly and a statement unanswered for 2 s is given up by the worker itself
# (STOCK_LEDGER_DATABASE_REPLY_TIMEOUT_MS), so the outage is what the test measures. The server's
# idle_in_transaction_session_timeout keeps its default (15 s), longer than HOLD, on purpose: when the server ends a
# blackholed session, toxiproxy passes its close on to the worker, which a real blackhole would not (the FIN is lost
# with everything else); with 5 s the server would rescue a worker caught inside a transaction, and hide whether the
# worker notices by itself.
NET = {"STOCK_LEDGER_SESSION_TIMEOUT_MS": "4000", "STOCK_LEDGER_LOCK_TIMEOUT_MS": "1000",
       "STOCK_LEDGER_DATABASE_REPLY_TIMEOUT_MS": "2000"}
RATE = 500  # movements per second while a phase runs
HOLD = 10.0  # seconds each fault lasts
SETTLE = 1.5  # seconds after a fault starts by which a commit already under way has finished
RECOVERY = 15.0  # seconds from a fault's end by which everything produced before it is applied
NOT_CONNECTED = "PostgreSQL not connected"  # /readyz's answer while the worker has no working session


@dataclass(frozen=True)
class Fault:
    """One phase's fault: toxics to add (name, type, stream, attributes), or the proxy disabled (`refuse`).
    `stalls`: no commit can get through while it lasts."""

    name: str
    toxics: tuple[tuple[str, str, Stream, dict[str, int]], ...] = ()
    refuse: bool = False
    stalls: bool = True

    def begin(self, proxy: Proxy) -> None:
        for name, kind, stream, attributes in self.toxics:
            proxy.add(name, kind, stream, **attributes)
        if self.refuse:
            proxy.enable(enabled=False)


FAULTS = (
    # Every byte dropped both ways, connections left open: the client's kernel sees nothing wrong (the proxy's
    # kernel acknowledges every segment), so only the worker itself can notice that no reply comes.
    Fault("blackhole", (("blackhole-up", "timeout", "upstream", {"timeout": 0}),
                        ("blackhole-down", "timeout", "downstream", {"timeout": 0}))),
    # Every connection reset on the next byte the worker sends; new ones on their startup message.
    Fault("resets", (("reset", "reset_peer", "upstream", {"timeout": 0}),)),
    # Every reply 200 ms late: slower, never stopped.
    Fault("latency", (("latency", "latency", "downstream", {"latency": 200}),), stalls=False),
    # The listener closed with every connection through it: each connect is refused.
    Fault("refused", refuse=True),
)


@dataclass
class Phase:
    """What one phase measured (printed, and shown with a failure)."""

    fault: str
    noticed: dict[int, float] = field(default_factory=dict)  # pid -> seconds from the fault's start to NotReady
    applied_during: int = 0  # movements committed between SETTLE and the fault's end
    probe_seconds: float | None = None  # one round trip through the proxy while the fault lasted
    first_commit: float | None = None  # seconds from the fault's end to the first commit after it
    recovery: float | None = None  # seconds from the fault's end until all produced before it is applied

    def describe(self) -> str:
        noticed = ", ".join(f"pid {p}: {s:.1f} s" for p, s in sorted(self.noticed.items())) or "-"
        probe = f"{self.probe_seconds:.3f} s" if self.probe_seconds is not None else "-"
        return (f"{self.fault}: NotReady after [{noticed}]; {self.applied_during} applied during the fault; "
                f"probe round trip {probe}; first commit {_seconds(self.first_commit)} and caught up "
                f"{_seconds(self.recovery)} after its end")


def _seconds(value: float | None) -> str:
    return f"{value:.1f} s" if value is not None else "never"


@pytest.fixture
def proxied_workers(services: Services, database: Env, topic: str, tmp_path: Path,
                    postgres_proxy: Proxy) -> Iterator[WorkerPool]:
    """`stock-ledger run` processes whose DATABASE_URL goes through the proxy; every one still alive is killed at
    the end."""
    routed = dataclasses.replace(database, worker_url=postgres_proxy.route(database.worker_url))
    pool = WorkerPool(services, routed, topic, group=f"stock-ledger-net-{uuid.uuid4().hex[:8]}", logs=tmp_path)
    yield pool
    pool.kill_all()


async def stored_total(db: Env, group: str, topic: str) -> int:
    conn = await asyncpg.connect(db.owner_url)
    try:
        return sum(o or 0 for o in (await stored_offsets(conn, group, topic)).values())
    finally:
        await conn.close()


async def applied_up_to(db: Env, group: str, topic: str, ends: dict[int, int]) -> bool:
    conn = await asyncpg.connect(db.owner_url)
    try:
        stored = await stored_offsets(conn, group, topic)
    finally:
        await conn.close()
    return all((stored.get(p) or 0) >= end for p, end in ends.items())


async def round_trip(url: str) -> float:
    """Seconds one simple query takes on an open session to `url` (the connect is not timed)."""
    conn = await asyncpg.connect(url, timeout=10)
    try:
        started = time.monotonic()
        await conn.execute("SELECT 1")
        return time.monotonic() - started
    finally:
        await conn.close()


async def watch_readiness(workers: list[WorkerProcess], phase: Phase, started: float, until: float) -> None:
    """Poll each worker's /readyz until `until`; note when each first answered that it has no working session."""
    while time.monotonic() < until:
        for w in workers:
            if w.pid not in phase.noticed:
                code, body = await asyncio.to_thread(w.get, "/readyz", 1)
                if code == 503 and NOT_CONNECTED in body:
                    phase.noticed[w.pid] = time.monotonic() - started
        await asyncio.sleep(0.2)


async def run_phase(fault: Fault, proxy: Proxy, pool: WorkerPool, workers: list[WorkerProcess], db: Env,
                    kafka: str) -> Phase:
    """Fault in for HOLD seconds under load, then out; returns what was measured (the load is the caller's)."""
    group, topic = pool.group, pool.topic
    phase = Phase(fault.name)
    fault.begin(proxy)
    started = time.monotonic()
    watching = asyncio.create_task(watch_readiness(workers, phase, started, started + HOLD))
    try:
        await asyncio.sleep(SETTLE)
        before = await stored_total(db, group, topic)
        if not fault.stalls:  # the fault is there: a round trip through the proxy takes its latency
            phase.probe_seconds = await round_trip(proxy.route(db.owner_url))
        await watching
        phase.applied_during = await stored_total(db, group, topic) - before
    finally:
        watching.cancel()
        proxy.heal()
    ended = time.monotonic()
    at_end = await stored_total(db, group, topic)
    ends = await end_offsets(kafka, topic)
    deadline = ended + RECOVERY
    while time.monotonic() < deadline:
        if phase.first_commit is None and await stored_total(db, group, topic) > at_end:
            phase.first_commit = time.monotonic() - ended
        if await applied_up_to(db, group, topic, ends):
            phase.recovery = time.monotonic() - ended
            if phase.first_commit is None:
                phase.first_commit = phase.recovery
            break
        await asyncio.sleep(0.1)
    return phase


async def test_a_blackhole_resets_latency_and_a_refused_path_end_exact_without_a_restart(
    services: Services, database: Env, topic: str, postgres_proxy: Proxy, proxied_workers: WorkerPool,
    steady: Callable[[str, str, int, int], SteadyLoad],
) -> None:
    """The four faults in turn, on one fleet of two workers and one topic (the module docstring has the schedule).

    Fails on a worker that never notices a blackholed session (it waits for a reply that cannot come: /readyz stays
    200 and nothing is retried until the blackhole ends), on one that exits or needs a restart to recover, on a
    recovery slower than RECOVERY seconds, and on any movement lost or applied twice."""
    pool, group = proxied_workers, proxied_workers.group
    workers = [pool.start(**NET), pool.start(**NET)]
    pids = [w.pid for w in workers]
    total = 0
    for seed, fault in enumerate(FAULTS, start=71):
        load = steady(services.kafka, topic, RATE, seed)
        # Each worker holds partitions (one without any would have nothing to notice) and is writing.
        await eventually(functools.partial(asyncio.to_thread, sharing, workers), 60,
                         f"both workers to hold partitions before the {fault.name}", pool)
        target = await stored_total(database, group, topic) + RATE
        await eventually(functools.partial(_at_least, database, group, topic, target), 60,
                         f"{RATE} movements applied before the {fault.name}", pool)
        phase = await run_phase(fault, postgres_proxy, pool, workers, database, services.kafka)
        print(phase.describe())
        assert load.running(), f"the producer stopped before the {fault.name} ended: the workers were not under load"
        total = await load.finish(after=1) + total
        context = f"{phase.describe()}\n{pool.logs_tail()}"
        if fault.stalls:
            assert phase.applied_during == 0, f"the {fault.name} did not stop the commits: {context}"
            assert sorted(phase.noticed) == sorted(pids), \
                f"a worker never reported the {fault.name} (/readyz {NOT_CONNECTED!r}): {context}"
        else:
            assert (phase.probe_seconds or 0) >= 0.2, f"the {fault.name} did not delay a round trip: {context}"
            assert phase.applied_during >= RATE, f"the workers stopped applying under {fault.name}: {context}"
        assert phase.recovery is not None, f"not caught up {RECOVERY} s after the {fault.name}'s end: {context}"
        await wait_drained(services, database, topic, group, 60, pool)
        await assert_exact(services, database, topic, group, rows=total, pool=pool)
        assert [w.pid for w in pool.started] == pids, f"a worker was started during the {fault.name}: {context}"
        assert all(w.alive() for w in workers), f"a worker exited during the {fault.name}: {context}"
    pool.assert_no_tracebacks()


def sharing(workers: list[WorkerProcess]) -> bool:
    """Every worker ready, each holding some of the 24 partitions, all of them held."""
    held = [w.metric("stock_ledger_assigned_partitions") or 0 for w in workers]
    return all(held) and sum(held) == 24 and all(w.ready() for w in workers)


async def _at_least(db: Env, group: str, topic: str, n: int) -> bool:
    return await stored_total(db, group, topic) >= n

