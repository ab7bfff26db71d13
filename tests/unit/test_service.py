"""The worker's lifecycle pieces that need no services: signal handling (as uvicorn's handle_exit), liveness and
readiness. The guarantee itself is tested on the real services (tests/chaos, tests/integration)."""

from __future__ import annotations

import asyncio
import gc
import signal
from collections.abc import Callable

import asyncpg
import pytest
from structlog.testing import capture_logs

from stock_ledger.clients.database import quiet_lost_session_replies
from stock_ledger.worker import Worker

pytestmark = pytest.mark.asyncio


class TestHandleExit:
    async def test_the_first_signal_drains_then_cancels_after_grace(self, make: Callable[..., Worker]) -> None:
        """1. SIGTERM: stop is requested, the main task keeps running (it finishes its batch).
        2. If it is still running when the grace period ends, it is cancelled."""
        w = make(shutdown_grace_seconds=0.2)
        w._main = asyncio.create_task(asyncio.sleep(30))
        w.handle_exit(signal.SIGTERM)
        assert w.stopping.is_set()
        await asyncio.sleep(0.05)
        assert not w._main.done()
        await asyncio.sleep(0.3)
        assert w._main.cancelled()

    async def test_a_second_signal_exits_at_once(self, make: Callable[..., Worker]) -> None:
        """1. SIGTERM starts the drain (grace 60 s). 2. SIGINT: the main task is cancelled now."""
        w = make(shutdown_grace_seconds=60)
        w._main = asyncio.create_task(asyncio.sleep(30))
        w.handle_exit(signal.SIGTERM)
        w.handle_exit(signal.SIGINT)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert w._main.cancelled()

    async def test_a_drain_that_finishes_in_time_is_not_cancelled(self, make: Callable[..., Worker]) -> None:
        w = make(shutdown_grace_seconds=0.2)
        w._main = asyncio.create_task(w.stopping.wait())
        w.handle_exit(signal.SIGTERM)
        await asyncio.sleep(0.3)
        assert w._main.done()
        assert not w._main.cancelled()


class TestHealth:
    async def test_not_ready_before_the_database_and_the_group(self, make: Callable[..., Worker]) -> None:
        w = make()
        assert await w.readiness() == (False, "PostgreSQL not connected")
        await w.session.get()
        assert await w.readiness() == (False, "not yet a member of the consumer group")

    async def test_a_retried_fault_keeps_the_worker_live_but_not_ready(self, make: Callable[..., Worker]) -> None:
        """A transient database fault: /healthz stays 200 (the loop retries, alive), /readyz turns 503."""
        w = make(stall_seconds=1)
        await w.session.get()
        w.assignment.assigned([0])
        w.assignment.claimed(w.assignment.begin_claim(), {0: (1, 0)})
        assert (await w.readiness())[0]
        w._last_progress -= 5
        assert not (await w.liveness())[0]
        w._on_fault("database", ConnectionResetError())
        assert (await w.liveness())[0]
        assert await w.readiness() == (False, "PostgreSQL not connected")


    async def test_the_ready_gauge_follows_readiness_when_the_database_comes_back(
        self, make: Callable[..., Worker]) -> None:
        """Ready, then a database fault (not ready), then the session is back (`Session.get`): stock_ledger_ready is
        what /readyz says at every step, without a claim in between (a gauge set only on claims stayed 0)."""
        w = make()
        gauge = lambda: w.metrics.registry.get_sample_value("stock_ledger_ready")  # noqa: E731
        assert gauge() == 0
        await w.session.get()
        w.assignment.assigned([0])
        w.assignment.claimed(w.assignment.begin_claim(), {0: (1, 0)})
        assert (await w.readiness())[0]
        assert gauge() == 1
        w._on_fault("database", ConnectionResetError())
        assert not (await w.readiness())[0]
        assert gauge() == 0
        await w.session.get()
        assert (await w.readiness())[0]
        assert gauge() == 1


class TestLostSessionReplies:
    """asyncpg orphans a reply future when the server ends a session mid-statement (a frozen worker whose session
    a claim terminated); asyncio then reports it with a stack trace although the statement was already retried."""

    @staticmethod
    def _orphan(loop: asyncio.AbstractEventLoop, exc: BaseException) -> None:
        future = loop.create_future()
        future.set_exception(exc)
        del future  # never retrieved: asyncio reports it when the future is collected

    async def test_an_orphaned_reply_of_a_closed_session_is_one_line(self) -> None:
        loop = asyncio.get_running_loop()
        default: list[dict[str, object]] = []
        previous = loop.get_exception_handler()
        loop.set_exception_handler(quiet_lost_session_replies)
        try:
            with capture_logs() as logs, pytest.MonkeyPatch.context() as mp:
                mp.setattr(loop, "default_exception_handler", default.append)
                lost = asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation")
                self._orphan(loop, lost)
                self._orphan(loop, RuntimeError("a real bug"))
                gc.collect()
                await asyncio.sleep(0)
        finally:
            loop.set_exception_handler(previous)
        assert [e["event"] for e in logs] == ["db.orphaned_reply"]
        assert "exc_info" not in logs[0]
        assert "exception" not in logs[0]
        # Anything else still reaches asyncio's own handler, stack trace and all.
        assert [type(c["exception"]).__name__ for c in default] == ["RuntimeError"]
