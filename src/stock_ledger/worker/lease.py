"""One pod of a group runs the monitors: a PostgreSQL advisory lock is the lease (`Lease`), or, behind a pooler that
shares server sessions per transaction, a row of `monitor_leases` with a term and an expiry (`TableLease`).

The lag/drift timer and the ledger scans cost the same whatever the replica count, so they run on one pod (the
leader), chosen by `pg_try_advisory_lock` on a session held for the purpose: the lease lasts exactly as long as
that session. A leader that dies or loses its session frees the lease at once and another pod takes it on its next
tick. The leader touches the session on every tick, and the session carries `idle_session_timeout`: a leader that
is frozen (SIGSTOP, a long pause) stops touching it, so the server ends the session and another pod takes over
within that timeout, instead of the lag metrics going silent with the frozen pod. The lease is taken on the
primary only: after a failover the session dies with the old primary and the lease is taken again on the new one.

Behind a transaction pooler a session-level advisory lock belongs to whichever client next gets the server
connection it was taken on (two leaders, or none), and no session of ours can idle out: so the lease is a row per
(group, topic) in `monitor_leases`, held by one process (`holder`) until `expires_at`, which the leader pushes forward
on every tick (the same timeout as above). Another pod takes it only once it expired, and the term grows with each
new holder. Time is the server's, one clock for every pod. A leader stopped gracefully hands it over at once; one
killed holds it until it expires; one frozen finds it gone when it thaws (its next tick renews nothing). A standby
refuses the write, so this lease too is taken on the primary only.

Each time this pod takes the lease a new term begins (`term`). A refresh may outlast a term (an invariant check
may run for up to an hour): the monitor exports its results only if the term it began in is still this pod's
(`holds`), so a pod that lost the lease and took it again never exports what it read as a former leader.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import uuid
from typing import TYPE_CHECKING, Final

import structlog

from stock_ledger.clients.database import try_lock
from stock_ledger.clients.servers import writable_server

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
        self.term = 0  # how many times this pod took the lease; the current term while `held`

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
            self.held = await try_lock(self._conn, self._key)
            if self.held:
                self.term += 1
                log.info("monitor.lease_taken", term=self.term,
                         detail="this pod runs the lag/drift timer and the ledger checks")
        return self.held

    def holds(self, term: int) -> bool:
        """Whether this pod still leads in `term`, as far as it knows without asking the server: the lease taken in
        that term, not lost or taken again since (the timers' checks keep this current), its session still open."""
        return self.held and self.term == term and self._conn is not None and not self._conn.is_closed()

    async def close(self) -> None:
        self.held = False
        if self._conn is not None:
            await self._conn.close(timeout=2)  # ends the session: the lease passes to another pod
            self._conn = None


# One statement takes, renews or fails to take the lease: the row moves to us only if it is ours already or expired.
_HOLD: Final = """
INSERT INTO monitor_leases AS l (group_id, topic, holder, term, expires_at)
VALUES ($1, $2, $3, 1, now() + $4::int * interval '1 millisecond')
ON CONFLICT (group_id, topic) DO UPDATE
   SET holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at,
       term = l.term + CASE WHEN l.holder = EXCLUDED.holder THEN 0 ELSE 1 END
 WHERE l.holder = EXCLUDED.holder OR l.expires_at < now()
RETURNING term
"""
_RELEASE: Final = """
UPDATE monitor_leases SET expires_at = now() - interval '1 millisecond'
 WHERE group_id = $1 AND topic = $2 AND holder = $3
"""


class TableLease:
    """The lease as a row of monitor_leases (see the module docstring); the same interface as `Lease`."""

    def __init__(self, connect: Callable[[], Awaitable[asyncpg.Connection]], group_id: str, topic: str,
                 ttl: float) -> None:
        self._connect = connect
        self._key = (group_id, topic)
        self._ttl_ms = max(1_000, int(ttl * 1000))
        self.holder = f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"
        self._conn: asyncpg.Connection | None = None
        self._checking = asyncio.Lock()
        self.held = False
        self.term = 0  # the server's term of the lease while `held` (it grows with each new holder)

    async def check(self) -> bool:
        """True while this pod leads: renews the lease it holds, or takes it once expired."""
        async with self._checking:
            if self._conn is not None and self._conn.is_closed():
                self._conn = None
            if self._conn is None:
                self._conn = await self._connect()
            was, self.held = self.held, False  # until the server says otherwise: a failed renewal leads nobody
            term = await self._conn.fetchval(_HOLD, *self._key, self.holder, self._ttl_ms)
            if term is not None and not was:
                log.info("monitor.lease_taken", term=term,
                         detail="this pod runs the lag/drift timer and the ledger checks")
            elif term is None and was:
                log.warning("monitor.lease_lost", detail="it expired and another pod holds it")
            self.held = term is not None
            if term is not None:
                self.term = int(term)
            return self.held

    def holds(self, term: int) -> bool:
        """Whether this pod still leads in `term` as of its last renewal (see `Lease.holds`)."""
        return self.held and self.term == term and self._conn is not None and not self._conn.is_closed()

    async def close(self) -> None:
        """Hand the lease over at once (else the next pod waits for it to expire), and close the session."""
        held, self.held = self.held, False
        if self._conn is None:
            return
        try:
            if held:
                await self._conn.execute(_RELEASE, *self._key, self.holder)
        finally:
            await self._conn.close(timeout=2)
            self._conn = None
