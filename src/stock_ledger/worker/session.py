"""The worker's one database session: opened and checked before it writes, reopened after a fault.

The main loop is the only writer, and every statement it runs (claims, batches, the idle offset check) goes through
`Session.get`. A new session is checked before it is handed out (the `check` callback: a server that takes writes,
the stored offsets where this worker left them, consumer.claims.Claimer.check_session). `ok` is what readiness
reports: a session is open and no fault has been seen on it since.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    import asyncpg

    from stock_ledger.metrics import Metrics

# One logger name for the worker's events, whichever of its modules logs them.
log = structlog.get_logger("stock_ledger.worker")


class Session:
    def __init__(self, connect: Callable[[], Awaitable[asyncpg.Connection]],
                 check: Callable[[asyncpg.Connection], Awaitable[None]], metrics: Metrics) -> None:
        self._connect = connect
        self._check = check
        self._metrics = metrics
        self._conn: asyncpg.Connection | None = None

    @property
    def ok(self) -> bool:
        """A session is open and no fault was seen on it since (readiness: "PostgreSQL not connected" otherwise)."""
        return self._conn is not None

    @property
    def current(self) -> asyncpg.Connection | None:
        """The session as it is, without connecting."""
        return self._conn

    @property
    def fresh(self) -> bool:
        """The next `get` opens a new session (which checks itself)."""
        return self._conn is None or self._conn.is_closed()

    async def get(self) -> asyncpg.Connection:
        """The session, opened (and checked) if need be. One the server closed under us while idle (terminated,
        restarted, an idle timeout) counts as a database retry, since no statement of ours saw the fault."""
        if self._conn is not None and self._conn.is_closed():
            self._metrics.retries.labels("database").inc()
            log.info("db.reconnect", reason="the server closed our session while it was idle")
            self._conn = None
        if self._conn is None:
            self._conn = await self._open()
        return self._conn

    def broken(self) -> None:
        """A database fault: the session may be half-dead (killed while we were frozen mid-statement); the next
        `get` starts afresh."""
        if self._conn is not None:
            self._conn.terminate()
            self._conn = None

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close(timeout=2)
            self._conn = None

    async def _open(self) -> asyncpg.Connection:
        conn = await self._connect()
        try:
            await self._check(conn)
        except BaseException:
            conn.terminate()
            raise
        return conn
