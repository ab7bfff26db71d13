"""Apply migrations/*.sql in order, once each, safely when several pods run it at once.

Patient where Kubernetes needs it (the database may come up after the Job), careful where the workers need it
(DDL never queues behind a running batch for longer than lock_timeout).

The migrations grant to two NOLOGIN roles, written in them by their default names; `migrate` writes the names
STOCK_LEDGER_APP_ROLE and STOCK_LEDGER_READER_ROLE give in their place (`Roles`), so several ledgers on one
cluster (where role names are global) can each have their own. A migration's checksum is still that of its file.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

import asyncpg
import structlog

from stock_ledger.clients.database import migration_session, try_lock
from stock_ledger.clients.dberrors import explain
from stock_ledger.errors import (
    ConfigError,
    DatabaseError,
    LedgerIntegrityError,
    StockLedgerError,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

log = structlog.get_logger(__name__)

# Raise this when a migration is added: the worker refuses to run against an older schema.
SCHEMA_VERSION: Final = 17
# pg_advisory_lock key: "stock-ledger migrate" as a stable 63-bit number.
_LOCK_KEY: Final = int.from_bytes(hashlib.sha256(b"stock-ledger migrate").digest()[:8], "big") >> 1
_FILE: Final = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")
_ONLINE: Final = "-- stock-ledger: online\n"
_STEP: Final = re.compile(r"^-- step: *(\S+) *$", re.MULTILINE)

_BOOKKEEPING: Final = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    checksum   text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""


@dataclass(frozen=True, slots=True)
class Roles:
    """The NOLOGIN roles the migrations grant to: `app` what a worker may do, `reader` SELECT on every table.

    The migrations name them by their defaults, as identifiers (`GRANT ... TO stock_ledger_app`) and inside
    literals (`rolname = 'stock_ledger_app'`); `apply` writes the configured names there: quoted as identifiers,
    bare inside literals. The names are lower-case letters, digits and underscores (config._ROLE), so neither
    spelling can change what the SQL around them says."""

    app: str = "stock_ledger_app"
    reader: str = "stock_ledger_reader"

    def apply(self, sql: str) -> str:
        """`sql` with the default role names replaced by these (unchanged where they are the defaults)."""
        names = {DEFAULT_ROLES.app: self.app, DEFAULT_ROLES.reader: self.reader}

        def replace(m: re.Match[str]) -> str:
            name = names[m.group("name")]
            if name == m.group("name"):
                return m.group(0)
            return f"'{name}'" if m.group("quote") else f'"{name}"'

        return _ROLE_NAMES.sub(replace, sql)


DEFAULT_ROLES: Final = Roles()
# A default role name standing alone (not part of a longer identifier), perhaps inside a literal.
_ROLE_NAMES: Final = re.compile(r"(?<![\w$'])(?P<quote>'?)(?P<name>stock_ledger_app|stock_ledger_reader)(?P=quote)"
                                r"(?![\w$'])")


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()

    @property
    def online(self) -> bool:
        """Marked `-- stock-ledger: online` on its first line: its `-- step: NAME` sections run as transactions of
        their own (one copies a table while the workers write), each safe to run again."""
        return self.sql.startswith(_ONLINE)

    def steps(self) -> list[tuple[str, str]]:
        """(name, SQL) of each `-- step:` section, in order."""
        parts = _STEP.split(self.sql)[1:]
        return [(parts[i].strip(), parts[i + 1]) for i in range(0, len(parts), 2)]


def find_migrations_dir(configured: str | None) -> Path:
    candidates = [Path(configured)] if configured else []
    # A source checkout or editable install: <repo>/src/stock_ledger/migrate.py -> <repo>/migrations
    candidates += [Path(__file__).resolve().parents[2] / "migrations", Path.cwd() / "migrations"]
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    raise ConfigError(
        "migrations directory not found: set STOCK_LEDGER_MIGRATIONS_DIR "
        f"(looked in {', '.join(str(c) for c in candidates)})"
    )


def load_migrations(directory: Path) -> list[Migration]:
    migrations = []
    for path in sorted(directory.iterdir()):
        match = _FILE.match(path.name)
        if match:
            migrations.append(Migration(int(match.group(1)), path.name, path.read_text(encoding="utf-8")))
    if not migrations or migrations[-1].version != SCHEMA_VERSION:
        raise ConfigError(f"{directory} does not hold migrations up to version {SCHEMA_VERSION}")
    return migrations


@dataclass(frozen=True, slots=True)
class MigrateOptions:
    """How patient `migrate` is (STOCK_LEDGER_MIGRATE_* variables; docs/configuration.md)."""

    deadline_seconds: float = 240.0
    lock_timeout_ms: int = 2_000
    statement_timeout_ms: int = 600_000


# Refused connections, a server still starting or shutting down, a name that does not resolve yet (a Service
# whose pods are not up): wait (the session raises DatabaseUnreachableError, an OSError, for each of these). A wrong
# password or database name will not fix itself: the session raises a fatal error at once.
_DB_NOT_UP: Final = (OSError, asyncpg.PostgresConnectionError, asyncpg.TooManyConnectionsError)


async def _connect(database_url: str, options: MigrateOptions, started: float) -> asyncpg.Connection:
    attempt = 0
    while True:
        try:
            return await migration_session(database_url)
        except _DB_NOT_UP as exc:
            attempt += 1
            waited = time.monotonic() - started
            cause = str(exc) if isinstance(exc, StockLedgerError) else (
                explain(exc, database_url, "migrate") or f"{type(exc).__name__}: {exc}")
            if waited > options.deadline_seconds:
                raise DatabaseError(
                    f"the database did not accept connections within {options.deadline_seconds:g}s "
                    f"(STOCK_LEDGER_MIGRATE_DEADLINE_SECONDS); last error: {cause}. "
                    "Check DATABASE_URL's host and port and that PostgreSQL is up"
                ) from exc
            delay = _delay(attempt)
            raw = exc.__cause__ or exc  # what the driver saw; the line that explains it comes once, at the end
            log.info("migration.waiting_for_database", attempt=attempt, waited_seconds=round(waited, 1),
                     deadline_seconds=options.deadline_seconds, retry_in_seconds=round(delay, 1),
                     error=f"{type(raw).__name__}: {raw}")
            await asyncio.sleep(delay)


def _delay(attempt: int) -> float:
    """Exponential backoff with jitter, 0.25 s doubling up to 5 s."""
    return float(min(5.0, 0.25 * 2 ** min(attempt, 5)) * random.uniform(0.5, 1.0))  # noqa: S311 - jitter only


async def _take_lock(conn: asyncpg.Connection, options: MigrateOptions, started: float) -> None:
    """The session-level advisory lock: a second pod waits (with progress) and then finds everything applied."""
    attempt = 0
    while not await try_lock(conn, _LOCK_KEY):
        attempt += 1
        waited = time.monotonic() - started
        if waited > options.deadline_seconds:
            raise StockLedgerError(
                f"another `stock-ledger migrate` held the migration lock for more than {options.deadline_seconds:g}s "
                "(STOCK_LEDGER_MIGRATE_DEADLINE_SECONDS); find it with "
                "SELECT pid, application_name, state FROM pg_stat_activity WHERE pid IN "
                "(SELECT pid FROM pg_locks WHERE locktype = 'advisory')"
            )
        if attempt == 1 or attempt % 10 == 0:
            log.info("migration.waiting_for_lock", attempt=attempt, waited_seconds=round(waited, 1))
        await asyncio.sleep(1)


# Who, besides the owner, holds a privilege on a table: whichever names its migration was applied with.
_GRANTEES: Final = """
SELECT a.privilege_type, pg_catalog.pg_get_userbyid(a.grantee) AS role
  FROM pg_catalog.pg_class AS c, pg_catalog.aclexplode(c.relacl) AS a
 WHERE c.oid OPERATOR(pg_catalog.=) pg_catalog.to_regclass('public.consumer_offsets')
   AND a.grantee OPERATOR(pg_catalog.<>) c.relowner
"""


async def _check_roles(conn: asyncpg.Connection, roles: Roles, applied: set[int]) -> None:
    """Refuse role names other than those this database's ledger was migrated with (read from the grants 0002 and
    0004 made): the next migration would grant to roles the older ones never did, and workers in either role would
    lack part of what they need."""
    if not applied & {2, 4}:
        return
    grants: dict[str, set[str]] = {}
    for r in await conn.fetch(_GRANTEES):
        grants.setdefault(r["privilege_type"], set()).add(r["role"])
    for applied_in, privilege, name, variable in ((2, "INSERT", roles.app, "STOCK_LEDGER_APP_ROLE"),
                                                  (4, "SELECT", roles.reader, "STOCK_LEDGER_READER_ROLE")):
        holders = grants.get(privilege, set())
        if applied_in in applied and name not in holders:
            found = ", ".join(sorted(holders - ({roles.app} if privilege == "SELECT" else set()))) or "no role"
            raise ConfigError(
                f"{variable}={name}, but this database's ledger was migrated with other role names ({privilege} on "
                f"consumer_offsets is granted to {found}): the names are fixed when a ledger is first migrated. Run "
                f"`stock-ledger migrate` with {variable} set to the role this ledger uses (docs/security.md, "
                '"Several ledgers on one cluster")')


async def _apply_one(conn: asyncpg.Connection, m: Migration, options: MigrateOptions, started: float,
                     roles: Roles) -> None:
    """One migration in one transaction, its DDL under lock_timeout and statement_timeout.

    DDL takes strong table locks. Waiting for one behind a worker's open batch transaction would queue every later
    worker statement on that table behind ours (PostgreSQL grants locks in arrival order): the whole fleet would
    stall for as long as we wait. So wait at most lock_timeout, give the lock back, and try again.
    """
    if m.online:
        await _apply_online(conn, m, options, roles)
        return

    async def whole() -> None:
        async with conn.transaction():
            await conn.execute(f"SET LOCAL lock_timeout = {int(options.lock_timeout_ms)}")
            await conn.execute(f"SET LOCAL statement_timeout = {int(options.statement_timeout_ms)}")
            await conn.execute(roles.apply(m.sql))
            await _record(conn, m)

    await _patiently(whole, m.name, options, started)


async def _record(conn: asyncpg.Connection, m: Migration) -> None:
    await conn.execute("INSERT INTO schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
                       m.version, m.name, m.checksum)


async def _apply_online(conn: asyncpg.Connection, m: Migration, options: MigrateOptions,
                        roles: Roles) -> None:
    """Each step in its own transaction (a step that commits as it goes, a CALL, in as many as it needs), each
    waiting at most lock_timeout for a lock and tried again like a whole migration; no statement_timeout (a copy of
    a large table takes minutes: it shows its progress instead). Recorded as applied after the last step."""

    def progress(_conn: object, message: asyncpg.PostgresLogMessage) -> None:
        log.info("migration.progress", migration=m.name, detail=message.message)

    conn.add_log_listener(progress)
    try:
        await conn.execute(f"SET lock_timeout = {int(options.lock_timeout_ms)}")
        await conn.execute("SET statement_timeout = 0")
        for name, sql in m.steps():
            log.info("migration.step", migration=m.name, step=name)
            step_started = time.monotonic()

            async def run(sql: str = sql) -> None:
                await conn.execute(roles.apply(sql))

            await _patiently(run, f"{m.name} (step {name})", options, step_started)
            log.info("migration.step_done", migration=m.name, step=name,
                     seconds=round(time.monotonic() - step_started, 1))
        await _record(conn, m)
    finally:
        conn.remove_log_listener(progress)
        await conn.execute("RESET lock_timeout; RESET statement_timeout")


async def _patiently(attempt_once: Callable[[], Awaitable[None]], what: str, options: MigrateOptions,
                     started: float) -> None:
    """Run `attempt_once` until it gets its locks (each try waits at most lock_timeout), or the deadline passes."""
    attempt = 0
    while True:
        attempt += 1
        try:
            await attempt_once()
        except asyncpg.LockNotAvailableError as exc:
            waited = time.monotonic() - started
            if waited > options.deadline_seconds:
                raise StockLedgerError(
                    f"migration {what} could not get its locks within {options.deadline_seconds:g}s "
                    f"(STOCK_LEDGER_MIGRATE_DEADLINE_SECONDS; each try waits STOCK_LEDGER_MIGRATE_LOCK_TIMEOUT_MS="
                    f"{options.lock_timeout_ms}): a long transaction holds them; find it in pg_stat_activity "
                    "(state 'idle in transaction' or a long query) and end it, then run migrate again"
                ) from exc
            delay = _delay(attempt)
            log.info("migration.lock_timeout", migration=what, attempt=attempt, waited_seconds=round(waited, 1),
                     lock_timeout_ms=options.lock_timeout_ms, retry_in_seconds=round(delay, 1), error=str(exc))
            await asyncio.sleep(delay)
        else:
            return


async def migrate(database_url: str, directory: Path, options: MigrateOptions | None = None,
                  roles: Roles = DEFAULT_ROLES) -> list[str]:
    """Apply pending migrations, granting to `roles`; return the names applied. Each runs in its own transaction.

    Waits for the database (bounded by options.deadline_seconds), then for the migration lock, and retries a
    migration whose DDL hit lock_timeout, logging a progress line for each wait. Refuses role names other than
    those the database was migrated with.
    """
    options = options or MigrateOptions()
    migrations = load_migrations(directory)
    started = time.monotonic()
    conn = await _connect(database_url, options, started)
    applied_now: list[str] = []
    try:
        await _take_lock(conn, options, started)
        await conn.execute(_BOOKKEEPING)
        rows = await conn.fetch("SELECT version, checksum FROM schema_migrations")
        done = {r["version"]: r["checksum"] for r in rows}
        await _check_roles(conn, roles, set(done))
        for m in migrations:
            if m.version in done:
                if done[m.version] != m.checksum:
                    raise LedgerIntegrityError(
                        f"migration {m.name} was changed after it was applied; add a new migration instead"
                    )
                continue
            log.info("migration.apply", migration=m.name)
            await _apply_one(conn, m, options, started, roles)
            applied_now.append(m.name)
        await conn.execute("SELECT pg_catalog.pg_advisory_unlock($1::pg_catalog.int8)", _LOCK_KEY)
    finally:
        await conn.close()
    log.info("migration.done", applied=applied_now, schema_version=SCHEMA_VERSION, app_role=roles.app,
             reader_role=roles.reader)
    return applied_now


async def check_schema(conn: asyncpg.Connection) -> None:
    """Refuse to run the worker against a database that `stock-ledger migrate` has not prepared."""
    try:
        version = await conn.fetchval("SELECT max(version) FROM schema_migrations")
    except asyncpg.UndefinedTableError:
        version = None
    if version is None or version < SCHEMA_VERSION:
        raise ConfigError(
            f"database schema is at version {version}, the worker needs {SCHEMA_VERSION}: "
            "run `stock-ledger migrate` with the owner's DATABASE_URL first"
        )
