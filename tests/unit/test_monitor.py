"""The monitor exports a refresh's results only in the lease term it began in (issue 38, item 7).

An invariant check may run for up to an hour. If the pod loses the lease meanwhile and takes it again (a new
term: `stock_ledger_monitor_leader` is 1 again, and another pod may have led in between), what the check read
belongs to the earlier term and must not be exported as current. The lease and the refresh are driven by hand
here: a fake lease session (the server's side of the advisory lock) and a refresh that waits until released.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest
from prometheus_client import CollectorRegistry

from stock_ledger.audit.invariants import Checked
from stock_ledger.config import Settings
from stock_ledger.metrics import Metrics
from stock_ledger.worker.monitor import PositionMonitor

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

pytestmark = pytest.mark.asyncio


class _LeaseSession:
    """The lease's session: a writable primary that grants the advisory lock; `end()` is the server ending it (the
    idle timeout of a frozen leader, a failover)."""

    def __init__(self) -> None:
        self.closed = False

    async def fetchrow(self, _query: str, *_args: Any) -> dict[str, Any] | None:
        # clients.servers.writable_server: the server this session reached, then (None) no cluster details.
        return {"host": None, "port": None, "recovery": False, "read_only": False} if "recovery" in _query else None

    async def execute(self, _query: str, *_args: Any) -> str:
        return "SET"

    async def fetchval(self, _query: str, *_args: Any) -> bool:
        return True  # pg_try_advisory_lock: free

    def is_closed(self) -> bool:
        return self.closed

    def end(self) -> None:
        self.closed = True

    def terminate(self) -> None:
        self.closed = True

    async def close(self, timeout: float = 0) -> None:
        del timeout
        self.closed = True


@dataclass
class _Gate:
    """A refresh that reads until released."""

    entered: asyncio.Event
    release: asyncio.Event

    async def wait(self) -> None:
        self.entered.set()
        await self.release.wait()


class _SlowChecks:
    """Invariants whose check finds 7 missing records and 3 level mismatches, once released."""

    def __init__(self, gate: _Gate) -> None:
        self.gate = gate

    async def check(self, _conn: object, **_kwargs: object) -> Checked:
        await self.gate.wait()
        return Checked("incremental", coordinates_unique=False, partitions_ahead=2, level_mismatches=3,
                       rows_checked=10, seconds=0.1, missing_records=7)


class _Pool:
    def __init__(self, gate: _Gate) -> None:
        self.gate = gate

    @contextlib.asynccontextmanager
    async def acquire(self) -> AsyncIterator[object]:
        yield object()

    async def fetchrow(self, _query: str) -> dict[str, int]:
        await self.gate.wait()  # the negative-stock read
        return {"levels": 4, "units": 40}


@dataclass
class _Harness:
    monitor: PositionMonitor
    metrics: Metrics
    sessions: list[_LeaseSession]
    gate: _Gate

    def value(self, name: str) -> float | None:
        return self.metrics.registry.get_sample_value(name)


@pytest.fixture
def harness() -> _Harness:
    sessions: list[_LeaseSession] = []

    async def connect() -> _LeaseSession:
        sessions.append(_LeaseSession())
        return sessions[-1]

    metrics = Metrics(CollectorRegistry())
    monitor = PositionMonitor(Settings(), metrics, connect)  # type: ignore[arg-type]
    gate = _Gate(asyncio.Event(), asyncio.Event())
    monitor._pool = _Pool(gate)  # type: ignore[assignment]
    monitor._records = object()  # type: ignore[assignment]
    monitor._checks = _SlowChecks(gate)  # type: ignore[assignment]
    return _Harness(monitor, metrics, sessions, gate)


async def _lose_and_retake(h: _Harness) -> None:
    """The server ends the lease session; the next check (the position timer's, every few seconds) finds it closed,
    connects again and takes the free lease: a new term, and leading again."""
    h.sessions[-1].end()
    leads = await h.monitor._lease.check()
    h.metrics.lead(leading=leads)
    assert leads


async def _lose(h: _Harness) -> None:
    h.sessions[-1].end()


async def _keep(_h: _Harness) -> None:
    pass


REFRESHES = {
    "invariants": ("_invariants", "stock_ledger_ledger_missing_records", 7),
    "negative stock": ("_negative_stock", "stock_ledger_negative_stock_levels", 4),
}


async def _run_one_refresh(h: _Harness, refresh: str, meanwhile: Callable[[_Harness], Awaitable[None]]) -> None:
    """The timer takes the lease (term 1) and starts the refresh; while it reads, `meanwhile` happens; then the
    refresh returns and the timer decides whether to export."""
    exported = asyncio.Event()
    timer = asyncio.create_task(h.monitor._every(3_600, getattr(h.monitor, refresh), limit_seconds=3_600))
    original_sleep = asyncio.sleep

    async def after_refresh(delay: float, *args: Any) -> Any:
        if delay != 3_600:
            return await original_sleep(delay, *args)
        exported.set()  # the timer's sleep after its refresh: the export (or not) is done; it stays here
        await asyncio.Event().wait()
        return None

    try:
        await asyncio.wait_for(h.gate.entered.wait(), 5)
        assert h.value("stock_ledger_monitor_leader") == 1
        await meanwhile(h)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(asyncio, "sleep", after_refresh)
            h.gate.release.set()
            await asyncio.wait_for(exported.wait(), 5)
    finally:
        timer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await timer


@pytest.mark.parametrize("refresh", REFRESHES, ids=str)
async def test_a_refresh_begun_in_an_earlier_term_exports_nothing(harness: _Harness, refresh: str) -> None:
    """1. The pod takes the lease (term 1, leading) and a refresh starts reading.
    2. The lease session ends and the pod takes the lease again (term 2): monitor_leader is 1 throughout.
    3. The refresh returns: nothing of it is exported; the leader's gauges keep their defaults until a refresh of
       term 2 reports."""
    method, gauge, _ = REFRESHES[refresh]
    await _run_one_refresh(harness, method, _lose_and_retake)
    assert harness.value("stock_ledger_monitor_leader") == 1
    assert harness.value(gauge) == 0
    assert harness.value("stock_ledger_ledger_stock_level_mismatches") == 0
    assert harness.value("stock_ledger_ledger_coordinates_unique") == 1
    assert len(harness.sessions) == 2


@pytest.mark.parametrize("refresh", REFRESHES, ids=str)
async def test_a_refresh_whose_lease_was_lost_exports_nothing(harness: _Harness, refresh: str) -> None:
    """The lease session ends while the refresh reads and nobody has looked yet (monitor_leader still 1): the
    refresh's results are not exported either."""
    method, gauge, _ = REFRESHES[refresh]
    await _run_one_refresh(harness, method, _lose)
    assert harness.value(gauge) == 0


@pytest.mark.parametrize("refresh", REFRESHES, ids=str)
async def test_a_refresh_within_one_term_is_exported(harness: _Harness, refresh: str) -> None:
    """Control: the lease held throughout, the refresh's results are exported."""
    method, gauge, value = REFRESHES[refresh]
    await _run_one_refresh(harness, method, _keep)
    assert harness.value(gauge) == value
    if refresh == "invariants":
        assert harness.value("stock_ledger_ledger_stock_level_mismatches") == 3
        assert harness.value("stock_ledger_ledger_coordinates_unique") == 0
