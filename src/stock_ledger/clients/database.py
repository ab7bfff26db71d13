"""Every PostgreSQL session the project opens, made here and nowhere else.

Each one refuses a DATABASE_URL weaker than STOCK_LEDGER_DATABASE_SSLMODE_MIN, turns a failed connect (and a pooler
refusing a startup parameter) into one line saying the cause and the fix (dberrors.explain), pins its search_path,
runs the schema guard (schemaguard.py) for owner and operator sessions, and only then sets its session settings.
Every statement here names its functions with pg_catalog: one that runs before the guard has looked (or in a session
that is only pinned) must not resolve to an object a less-privileged role planted in `public`:

    worker_session    the worker's own: its timeouts, an application_name that names the group (zombie detection)
    operator_session  the owner role's operator commands (`offsets`, `rejected`, `repair`, `gaps`)
    reader_session    the read-only commands (`stock show`, `movements`): read-only and without JIT
    migration_session `migrate`, given the URL it already checked
    pool              a small lazily-opened pool (the monitor's metrics and checks)
`connect_database` underlies the first three, for a session of another name.

Behind a pooler that shares server sessions per transaction (STOCK_LEDGER_DATABASE_POOLING=transaction, PgBouncer's
transaction mode) a client connection is no session of its own: the worker's sessions, the pool and the pooling
probe are then opened `shared` (no prepared statements, nothing SET for the session), and each worker transaction
sets its settings for itself as its first statement (`in_transaction`). The other commands need a session of their
own and refuse (`require_own_session`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import weakref
from typing import TYPE_CHECKING, Any, Final, Literal

import asyncpg
import structlog

from stock_ledger.clients import schemaguard
from stock_ledger.clients.dberrors import connect_error
from stock_ledger.config import SSLMODES, url_sslmode
from stock_ledger.errors import ConfigError, StockLedgerError

if TYPE_CHECKING:
    import asyncio
    from collections.abc import AsyncIterator, Mapping

    from stock_ledger.config import Settings

log = structlog.get_logger(__name__)

# What a session checks of the schema before its first statement of ours (schemaguard.py): "secure" pins the
# search_path and refuses planted objects and untrusted creators; "planted" only the objects (`migrate`, whose
# migration 0009 takes CREATE away); "pin" only pins (the worker: its role is the untrusted one).
Guard = Literal["secure", "planted", "pin"]


def check_sslmode(settings: Settings, environ: Mapping[str, str] = os.environ) -> str:
    """DATABASE_URL, after refusing one whose effective sslmode is below STOCK_LEDGER_DATABASE_SSLMODE_MIN."""
    url = settings.require_database_url()
    mode = url_sslmode(url, environ)
    if SSLMODES.index(mode) < SSLMODES.index(settings.database_sslmode_min):
        raise ConfigError(f"DATABASE_URL uses sslmode={mode}, weaker than STOCK_LEDGER_DATABASE_SSLMODE_MIN="
                          f"{settings.database_sslmode_min}")
    return url


def session_settings(settings: Settings) -> dict[str, str]:
    """Settings of a worker session: timeouts that keep a frozen peer from blocking the group forever."""
    return {
        # A claim waiting on a zombie's row lock gives up (and retries) instead of stalling the rebalance.
        "lock_timeout": str(settings.lock_timeout_ms),
        # A worker frozen inside its transaction loses its session, so its row locks are released.
        "idle_in_transaction_session_timeout": str(settings.idle_in_transaction_timeout_ms),
        # Detect a peer that vanished without a FIN (a node lost) within about a minute.
        "tcp_keepalives_idle": "30", "tcp_keepalives_interval": "10", "tcp_keepalives_count": "3",
    }


# Read-only at the session too: with an owner's DATABASE_URL these commands still cannot write. No JIT: on a
# 20M-movement ledger it spent 1.5-2.4 s compiling each 4-9 s scan, and the scans took as long without it
# (`python -m scripts.bench signals explain`, docs/performance.md): CPU for nothing on a shared server.
READER_SESSION: Final = {"default_transaction_read_only": "on", "jit": "off"}

# Session settings are SET after connecting, never sent as startup parameters: PgBouncer (1.18, by default) refuses
# every startup parameter but a few it tracks itself, application_name among them, and with
# ignore_startup_parameters it accepts the others only to drop them silently. One round trip sets them all and asks
# for the backend's own process id, which behind a pooler is not the one the server's BackendKeyData gave the
# client (`Connection.get_server_pid()` is then a number the pooler made up).
# Qualified (issue 38): a `public.count(text)` aggregate is an exact match for count(set_config(...)) and beats
# pg_catalog's count("any") whatever the search_path; its final function would run even over no row. Two-argument
# unnest exists only as the unqualified FROM-clause shorthand, hence ROWS FROM with two qualified calls.
_SET_SESSION: Final = """
SELECT pg_catalog.pg_backend_pid(), pg_catalog.count(pg_catalog.set_config(s.name, s.value, false))
  FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.text[]), pg_catalog.unnest($2::pg_catalog.text[])) AS s(name, value)
"""
PID: Final = "SELECT pg_catalog.pg_backend_pid()"
# Typed: an untyped parameter would resolve to a planted `public.pg_try_advisory_lock(text)` (the string category
# wins for an unknown argument), and `migrate` takes this lock after a check that allows writers in public.
_TRY_LOCK: Final = "SELECT pg_catalog.pg_try_advisory_lock($1::pg_catalog.int8)"
_backend_pids: weakref.WeakKeyDictionary[asyncpg.Connection, int] = weakref.WeakKeyDictionary()
# A shared session's settings, set by each transaction for itself (set_config(..., true) is SET LOCAL: it ends with
# the transaction, so nothing leaks to the next client of the server connection). Qualified: it runs before the
# search_path is pinned.
_IN_TRANSACTION: Final = """
SELECT pg_catalog.pg_backend_pid(), pg_catalog.count(pg_catalog.set_config(name, value, true))
  FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.text[]), pg_catalog.unnest($2::pg_catalog.text[])) AS s(name, value)
"""
_per_transaction: weakref.WeakKeyDictionary[asyncpg.Connection, tuple[list[str], list[str]]] = (
    weakref.WeakKeyDictionary())


async def connect_database(  # noqa: PLR0913 - every caller sets a different one of these
    settings: Settings, *, application_name: str = "stock-ledger", connect_timeout: float = 10,
    session: Mapping[str, str] | None = None, statement_cache_size: int = 100, guard: bool = True,
    reply_timeout: float | None = None,
) -> asyncpg.Connection:
    """One session with the worker's timeouts (or `session`'s settings); with `guard` (default) the schema guard
    runs before anything else of ours, without it the search_path is only pinned (the worker's own sessions).
    `reply_timeout`: seconds any statement may go unanswered before it raises TimeoutError (None: for ever).
    Behind a transaction pooler (STOCK_LEDGER_DATABASE_POOLING=transaction) only the worker's own sessions open
    (`guard=False`), shared: see `in_transaction`."""
    if settings.database_pooling == "transaction":
        if guard:
            require_own_session(settings, application_name)
        return await _open_shared(check_sslmode(settings), application_name=application_name,
                                  connect_timeout=connect_timeout,
                                  settings=transaction_settings(settings) if session is None else session,
                                  reply_timeout=reply_timeout)
    return await _open(check_sslmode(settings), application_name=application_name, connect_timeout=connect_timeout,
                       session=session_settings(settings) if session is None else session,
                       statement_cache_size=statement_cache_size, guard="secure" if guard else "pin",
                       reply_timeout=reply_timeout)


async def worker_session(settings: Settings) -> asyncpg.Connection:
    """The worker's session; its application_name names the group, so a claim can tell a zombie of its own group
    among the sessions that block it (ledger.claims.Unblock). A statement unanswered for
    STOCK_LEDGER_DATABASE_REPLY_TIMEOUT_MS raises TimeoutError, which the worker retries on a new session: on a
    blackholed path (packets dropped, nothing closed) the reply never comes, the server's timeouts end only its own
    side, and TCP keepalives through a proxy are answered by the proxy, so nothing else would end the wait."""
    return await connect_database(settings, application_name=session_name(settings.group_id), guard=False,
                                  reply_timeout=settings.database_reply_timeout_ms / 1000)


async def operator_session(settings: Settings) -> asyncpg.Connection:
    """An operator command's session, as the owner role: the worker's timeouts (lock_timeout: a command never
    queues behind a frozen batch for long), the schema guard first."""
    return await connect_database(settings, application_name="stock-ledger-operator")


async def reader_session(settings: Settings) -> asyncpg.Connection:
    """A read-only command's session; guarded too: a read-only session of an operator is still one a planted
    object must not reach (schemaguard)."""
    return await connect_database(settings, application_name="stock-ledger-cli", session=READER_SESSION)


async def migration_session(url: str) -> asyncpg.Connection:
    """`migrate`'s session: no session settings (each migration sets its own timeouts), planted objects refused;
    that a role other than the owner may still CREATE in public is what migration 0009 fixes, so not refused."""
    return await _open(url, application_name="stock-ledger-migrate", connect_timeout=10, session={},
                       statement_cache_size=100, guard="planted")


async def _open(url: str, *, application_name: str, connect_timeout: float, session: Mapping[str, str],  # noqa: PLR0913
                statement_cache_size: int, guard: Guard, reply_timeout: float | None = None) -> asyncpg.Connection:
    conn = await _connect(url, application_name, connect_timeout, statement_cache_size, reply_timeout)
    try:
        # The guard first: nothing of ours runs before it has looked (its own statements are all qualified).
        await schemaguard.pin(conn)
        if guard != "pin":
            await schemaguard.check(conn, writers=guard == "secure")
        row = await conn.fetchrow(_SET_SESSION, list(session), list(session.values()))
    except BaseException:
        conn.terminate()
        raise
    assert row is not None  # noqa: S101 - an aggregate without GROUP BY returns one row
    _backend_pids[conn] = row[0]
    return conn


def transaction_settings(settings: Settings) -> dict[str, str]:
    """What a worker transaction sets for itself on a shared session: the timeouts and the pinned search_path (the
    TCP keepalives are PgBouncer's own, `tcp_keepalive`, on its connections to PostgreSQL)."""
    timeouts = {k: v for k, v in session_settings(settings).items() if not k.startswith("tcp_")}
    return {**timeouts, "search_path": schemaguard.SEARCH_PATH}


def require_own_session(settings: Settings, command: str) -> None:
    """ConfigError for a command that needs a session of its own when DATABASE_URL leads to a transaction pooler."""
    if settings.database_pooling == "transaction":
        raise ConfigError(
            f"{command} needs a database session of its own (session settings, prepared statements, the migration "
            "lock), and STOCK_LEDGER_DATABASE_POOLING=transaction says DATABASE_URL leads to a pooler that shares "
            "server sessions per transaction: run it with a DATABASE_URL of PostgreSQL itself (or of a pooler in "
            "session mode) and without STOCK_LEDGER_DATABASE_POOLING; only `stock-ledger run` works through a "
            "transaction pooler (docs/pgbouncer.md)")


async def _open_shared(url: str, *, application_name: str, connect_timeout: float,
                       settings: Mapping[str, str], reply_timeout: float | None) -> asyncpg.Connection:
    """A client connection to a transaction pooler: no statement cache (a named prepared statement lives on one
    server connection, which the next transaction may not get) and nothing SET for the session (it would land on
    whichever server connection ran it, for whichever client comes next). application_name is a startup parameter
    PgBouncer tracks: it sets it on each server connection it hands this client (checked on PgBouncer 1.18), which
    is what lets a claim tell this group's zombies by name (ledger.claims.Unblock)."""
    conn = await _connect(url, application_name, connect_timeout, 0, reply_timeout)
    _per_transaction[conn] = (list(settings), list(settings.values()))
    return conn


async def in_transaction(conn: asyncpg.Connection) -> int:
    """The first statement of each worker transaction: the process id of the backend running it (as
    pg_stat_activity and pg_blocking_pids name it). On a shared session it also sets the session's settings for
    this transaction (the backend is whichever server connection the pooler handed over for it); on a session of its
    own they are set already and the pid is known: no round trip."""
    shared = _per_transaction.get(conn)
    if shared is None:
        return await backend_pid(conn)
    return int(await conn.fetchval(_IN_TRANSACTION, *shared))


async def backend_pid(conn: asyncpg.Connection) -> int:
    """The process id of the server backend this session runs on (as pg_stat_activity and pg_blocking_pids name it),
    asked once per session: the connect already knows it."""
    pid = _backend_pids.get(conn)
    if pid is None:
        pid = _backend_pids[conn] = int(await conn.fetchval(PID))
    return pid


async def try_lock(conn: asyncpg.Connection, key: int) -> bool:
    """Take the session-level advisory lock `key` if it is free (held until released or the session ends)."""
    return bool(await conn.fetchval(_TRY_LOCK, key))


async def pool(settings: Settings, *, application_name: str, max_size: int = 1) -> asyncpg.Pool:
    """A small pool (metrics, checks) under the same sslmode rule; connections open lazily. Behind a transaction
    pooler: no statement cache, nothing SET, and nothing reset on release (RESET ALL, pg_advisory_unlock_all() and
    CLOSE ALL would run on whichever server connection the pooler picked)."""
    if settings.database_pooling == "transaction":
        return await asyncpg.create_pool(check_sslmode(settings), min_size=0, max_size=max_size, timeout=5,
                                         statement_cache_size=0, server_settings={"application_name": application_name},
                                         reset=_keep)
    # setup, not init: a released connection is RESET ALL, which would undo the pinned search_path. The setup is a
    # SET and calls nothing; asyncpg's reset (pg_advisory_unlock_all(), CLOSE ALL, UNLISTEN *, RESET ALL) calls only
    # a function whose signature pg_catalog, searched first, holds exactly.
    return await asyncpg.create_pool(check_sslmode(settings), min_size=0, max_size=max_size, timeout=5,
                                     server_settings={"application_name": application_name}, setup=schemaguard.pin)


async def _keep(_conn: asyncpg.Connection) -> None:
    """A shared session has nothing of its own to reset."""


def refused_startup_parameter(exc: BaseException) -> ConfigError | None:
    """A pooler (PgBouncer) refusing a startup parameter, as the configuration error it is; None for anything else.

    The refusal arrives as ProtocolViolationError (SQLSTATE 08P01, a connection exception), which would otherwise be
    retried as a lost connection: forever with STOCK_LEDGER_RETRY_DEADLINE_SECONDS=0."""
    if not isinstance(exc, asyncpg.ProtocolViolationError) or "unsupported startup parameter" not in str(exc):
        return None
    return ConfigError(
        f"the server refused a startup parameter ({exc}): DATABASE_URL leads to a connection pooler (PgBouncer) "
        "that accepts only the parameters it knows. stock-ledger sends application_name only; a parameter in "
        "DATABASE_URL's query string is sent as one too. Remove it from DATABASE_URL, or set "
        "ignore_startup_parameters = <that parameter> in pgbouncer.ini, or connect to PostgreSQL directly")


async def _connect(url: str, application_name: str, connect_timeout: float, statement_cache_size: int,
                   reply_timeout: float | None) -> asyncpg.Connection:
    try:
        # command_timeout bounds every statement on the session, BEGIN, COPY and COMMIT included; on expiry asyncpg
        # cancels the statement, and a cancel that cannot reach the server either ends the session (asyncpg 0.32).
        return await asyncpg.connect(url, timeout=connect_timeout, statement_cache_size=statement_cache_size,
                                     command_timeout=reply_timeout,
                                     server_settings={"application_name": application_name})
    except Exception as exc:
        problem = _database_problem(exc, url)
        if problem is None:
            raise
        raise problem from exc  # the driver's own exception stays the cause: a progress line names it


def _database_problem(exc: BaseException, url: str) -> StockLedgerError | None:
    """A failed connect as one clear line; None for anything else (a pooler's refusal, else dberrors.connect_error)."""
    return refused_startup_parameter(exc) or connect_error(exc, url)


def session_name(group_id: str) -> str:
    """The application_name of this group's sessions (PostgreSQL keeps 63 bytes of it)."""
    name = f"stock-ledger/{group_id}"
    if len(name.encode()) > 63:
        name = f"stock-ledger/{hashlib.sha256(group_id.encode()).hexdigest()[:32]}"
    return name


def quiet_lost_session_replies(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Event-loop exception handler: one line, no stack trace, for the reply future asyncpg orphans when the server
    ends a session in the middle of a statement (we were frozen and a claim terminated us, or the server
    restarted). The statement that waited on it already failed and was retried on a fresh session; asyncpg then
    fails the orphan with ConnectionDoesNotExistError and asyncio reports it as "never retrieved". Everything
    else goes to asyncio's default handler."""
    exc = context.get("exception")
    if isinstance(exc, asyncpg.ConnectionDoesNotExistError) and "future" in context and "task" not in context:
        log.info("db.orphaned_reply", error=f"{type(exc).__name__}: {exc}",
                 detail="a session the server closed mid-statement; that statement was already retried")
        return
    loop.default_exception_handler(context)


@contextlib.asynccontextmanager
async def transaction(conn: asyncpg.Connection, *, commit: bool) -> AsyncIterator[None]:
    """A transaction that a dry run rolls back once its effects are known (and any error rolls back)."""
    tx = conn.transaction()
    await tx.start()
    try:
        yield
    except BaseException:
        await tx.rollback()
        raise
    await (tx.commit() if commit else tx.rollback())
