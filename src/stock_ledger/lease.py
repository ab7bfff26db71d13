"""One pod of a group runs the monitors: a PostgreSQL advisory lock is the lease.

The lag/drift timer and the ledger scans cost the same whatever the replica count, so they run on one pod (the
leader), chosen by `pg_try_advisory_lock` on a session held for the purpose: the lease lasts exactly as long as
that session. A leader that dies or loses its session frees the lease at once and another pod takes it on its next
tick. The leader touches the session on every tick, and the session carries `idle_session_timeout`: a leader that
is frozen (SIGSTOP, a long pause) stops touching it, so the server ends the session and another pod takes over
within that timeout, instead of the lag metrics going silent with the frozen pod. The lease is taken on the
primary only: after a failover the session dies with the old primary and the lease is taken again on the new one.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import TYPE_CHECKING

import structlog

from stock_ledger.servers import writable_server

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    import asyncpg

log = structlog.get_logger(__name__)


def lease_key(group_id: str, topic: str) -> int:
    """A stable 63-bit advisory lock key per (group, topic)."""
    digest = hashlib.sha256(f"stock-ledger monitor {group_id} {topic}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class Lease:
    def __init__(self, connect: Callable[[], Awaitable[asyncpg.Connection]], key: int, idle_timeout: float) -> None:
        self._connect = connect
        self._key = key
        self._idle_timeout_ms = max(1_000, int(idle_timeout * 1000))
        self._conn: asyncpg.Connection | None = None
        self._checking = asyncio.Lock()  # both monitor timers ask; one session, one answer
        self.held = False

    async def check(self) -> bool:
        """True while this pod leads; tries to take the lease when it does not."""
        async with self._checking:
            return await self._check()

    async def _check(self) -> bool:
        if self._conn is not None and self._conn.is_closed():
            self._conn = None
        if self._conn is None:
            if self.held:
                log.warning("monitor.lease_lost", detail="the session holding the lease closed")
            self.held = False
            conn = await self._connect()
            try:
                # Advisory locks work on a standby too: a lease taken there would make a second leader.
                await writable_server(conn)
                await conn.execute(f"SET idle_session_timeout = {self._idle_timeout_ms}")
            except BaseException:
                conn.terminate()
                raise
            self._conn = conn
        if self.held:
            await self._conn.execute("SELECT 1")  # the heartbeat a frozen leader stops sending
        else:
            self.held = bool(await self._conn.fetchval("SELECT pg_try_advisory_lock($1)", self._key))
            if self.held:
                log.info("monitor.lease_taken", detail="this pod runs the lag/drift timer and the ledger checks")
        return self.held

    async def close(self) -> None:
        self.held = False
        if self._conn is not None:
            await self._conn.close(timeout=2)  # ends the session: the lease passes to another pod
            self._conn = None
