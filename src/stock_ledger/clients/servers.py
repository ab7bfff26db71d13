"""Which PostgreSQL server a session reached, and whether it can take our writes.

A multi-host DATABASE_URL (`…@host1,host2/db?target_session_attrs=read-write`) lets a reconnect land on another
server after a failover; a restore or a lagging standby promoted can also put the same address back in time. Which
server answered is logged when it changes (its address, and where the role can read them the cluster's system
identifier and timeline: a promoted standby keeps the identifier and starts a new timeline). A server in recovery,
or one that makes every transaction read-only, is refused as a transient fault: the session is dropped and the
reconnect tries the next host, until the primary answers. How a pooler in between shares server sessions is
checked at start against STOCK_LEDGER_DATABASE_POOLING (`check_pooling`): per transaction only where the setting
says so, per statement never.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal

import asyncpg
import structlog

from stock_ledger.clients.database import PID
from stock_ledger.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from stock_ledger.config import DatabasePooling

log = structlog.get_logger(__name__)

_WHERE: Final = """
SELECT host(inet_server_addr()) AS host, inet_server_port() AS port, pg_is_in_recovery() AS recovery,
       current_setting('transaction_read_only') = 'on' AS read_only
"""
# pg_control_* may be revoked from ordinary roles on managed services: then only the address is known.
_CLUSTER: Final = """
SELECT (SELECT system_identifier FROM pg_control_system()) AS system_identifier,
       (SELECT timeline_id FROM pg_control_checkpoint()) AS timeline
"""


class ReadOnlyServerError(ConnectionError):
    """The session reached a server that cannot take writes (a standby, or default_transaction_read_only): a
    connection-level fault, retried on a new session like a lost connection."""


@dataclass(frozen=True, slots=True)
class Server:
    address: str  # host:port as the server sees itself; "local" over a Unix socket
    system_identifier: int | None
    timeline: int | None

    def describe(self) -> dict[str, object]:
        return {"address": self.address, "system_identifier": self.system_identifier, "timeline": self.timeline}


async def writable_server(conn: asyncpg.Connection) -> Server:
    """The server this session reached; ReadOnlyServerError if it cannot take our writes."""
    row = await conn.fetchrow(_WHERE)
    assert row is not None  # noqa: S101 - a SELECT without FROM returns one row
    address = f"{row['host']}:{row['port']}" if row["host"] is not None else "local"
    if row["recovery"] or row["read_only"]:
        why = "is a standby (in recovery)" if row["recovery"] else "makes every transaction read-only"
        raise ReadOnlyServerError(
            f"the PostgreSQL server at {address} {why}: reconnecting until the primary answers (list every host in "
            "DATABASE_URL with target_session_attrs=read-write)")
    system_identifier = timeline = None
    with contextlib.suppress(asyncpg.InsufficientPrivilegeError):
        cluster = await conn.fetchrow(_CLUSTER)
        if cluster is not None:
            system_identifier, timeline = cluster["system_identifier"], cluster["timeline"]
    return Server(address, system_identifier, timeline)


# ------------------------------------------------------------------------------ pooling (issue 31)
_HOLDERS: Final = 3


@dataclass(frozen=True, slots=True)
class Shared:
    """What the probe saw: server sessions shared per `transaction` or per `statement`, and the evidence."""

    mode: Literal["transaction", "statement"]
    shown: str


async def _pid_in_transaction(conn: asyncpg.Connection) -> int:
    # Inside a transaction a pooler in transaction mode keeps one server connection for the statement's Parse and
    # its Bind (the probe's sessions have no statement cache: nothing named is left on a shared server).
    async with conn.transaction():
        return int(await conn.fetchval(PID))


async def transaction_pooling(connect: Callable[[], Awaitable[asyncpg.Connection]]) -> Shared | None:
    """How sessions from `connect` are shared per transaction or statement (PgBouncer's transaction or statement
    pool_mode), or None where each client connection is a session of its own.

    Why it is reliable: a PostgreSQL backend serves one client connection from its start to its end, directly and
    behind PgBouncer in session mode, so both signs below are impossible there: no false positive.
      1. A second client connection, opened while the first one is connected and idle, runs on the first one's
         backend: the pooler gave the first one's server connection away between its transactions.
      2. The first client connection's next transaction runs on another backend while the second one holds its
         server connection in an open transaction.
    In transaction mode PgBouncer hands out the server connection released last first (LIFO, the default
    server_round_robin = 0), so sign 1 shows with the first holder (checked against the real PgBouncer 1.18 in
    tests/integration/test_pgbouncer.py); with round robin a few holders take each idle server connection in turn
    until one of the signs shows. Statement mode refuses the first BEGIN, naming itself."""
    first = await connect()
    holders: list[asyncpg.Connection] = []
    try:
        shown = await _shared_backend(first, connect, holders)
        return None if shown is None else Shared("transaction", shown)
    except (asyncpg.ConnectionDoesNotExistError, asyncpg.ProtocolViolationError) as exc:
        if "pooling mode" in str(exc):  # PgBouncer: "transaction blocks not allowed in statement pooling mode"
            return Shared("statement", str(exc))
        raise
    finally:
        for conn in (*holders, first):
            conn.terminate()  # an open transaction goes with its session


async def _shared_backend(first: asyncpg.Connection, connect: Callable[[], Awaitable[asyncpg.Connection]],
                          holders: list[asyncpg.Connection]) -> str | None:
    mine = await _pid_in_transaction(first)
    for _ in range(_HOLDERS):
        holder = await connect()
        holders.append(holder)
        await holder.execute("BEGIN")  # held open until the probe ends: its server connection stays taken
        theirs = int(await holder.fetchval(PID))
        if theirs == mine:
            return f"a second client connection ran on the first one's backend (pid {mine}) while it was connected"
        now = await _pid_in_transaction(first)
        if now != mine:
            return f"one client connection ran its transactions on two backends (pid {mine}, then {now})"
    return None


async def check_pooling(connect: Callable[[], Awaitable[asyncpg.Connection]], pooling: DatabasePooling,
                        within: float = 15) -> None:
    """ConfigError if sessions from `connect` are shared in a way STOCK_LEDGER_DATABASE_POOLING (`pooling`) does
    not allow: per statement never (a batch is several statements in one transaction), per transaction only with
    `transaction`. A probe that cannot finish `within` seconds (a pooler whose pool is full) proves nothing either
    way: said, not refused."""
    try:
        shared = await asyncio.wait_for(transaction_pooling(connect), within)
    except TimeoutError:
        log.warning("startup.pooling_unknown", timeout_seconds=within, pooling=pooling,
                    detail="could not tell how DATABASE_URL's sessions are pooled; going on")
        return
    if shared is None:
        if pooling == "transaction":
            log.info("startup.pooling", shared=None, detail="each connection is a session of its own here; "
                     "STOCK_LEDGER_DATABASE_POOLING=transaction works on it too (a round trip more per transaction)")
        return
    if shared.mode == "statement":
        raise ConfigError(
            f"DATABASE_URL leads to a connection pooler that runs each statement on any server session "
            f"({shared.shown}): PgBouncer in statement pool_mode, where a batch transaction (several statements, "
            "all or nothing) cannot run at all. Set pool_mode = transaction (with "
            "STOCK_LEDGER_DATABASE_POOLING=transaction) or pool_mode = session in pgbouncer.ini, or connect to "
            "PostgreSQL directly; see docs/pgbouncer.md")
    if pooling == "session":
        raise ConfigError(
            f"DATABASE_URL leads to a connection pooler that shares server sessions between clients "
            f"({shared.shown}): PgBouncer in transaction pool_mode, and STOCK_LEDGER_DATABASE_POOLING is session, "
            "under which stock-ledger needs a session of its own (its advisory-lock lease, lock_timeout and "
            "idle_in_transaction_session_timeout, prepared statements). Set STOCK_LEDGER_DATABASE_POOLING="
            "transaction (every guarantee holds there, see docs/pgbouncer.md), or pool_mode = session in "
            "pgbouncer.ini (or pool_mode=session on this database's line), or connect to PostgreSQL directly")
    log.info("startup.pooling", shared="transaction", shown=shared.shown,
             detail="STOCK_LEDGER_DATABASE_POOLING=transaction: settings per transaction, the monitor lease in a table")
