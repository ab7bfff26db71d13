"""Apply migrations/*.sql in order, once each, safely when several pods run it at once.

Patient where Kubernetes needs it (the database may come up after the Job), careful where the workers need it
(DDL never queues behind a running batch for longer than lock_timeout).
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import asyncpg
import structlog

from stock_ledger import schemaguard
from stock_ledger.clients import refused_startup_parameter
from stock_ledger.dberrors import explain
from stock_ledger.errors import (
    ConfigError,
    ConnectionSecurityError,
    DatabaseError,
    LedgerIntegrityError,
    StockLedgerError,
)

log = structlog.get_logger(__name__)

# Raise this when a migration is added: the worker refuses to run against an older schema.
SCHEMA_VERSION: Final = 9
# pg_advisory_lock key: "stock-ledger migrate" as a stable 63-bit number.
_LOCK_KEY: Final = int.from_bytes(hashlib.sha256(b"stock-ledger migrate").digest()[:8], "big") >> 1
_FILE: Final = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")

_BOOKKEEPING: Final = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    checksum   text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


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
# whose pods are not up): wait. A wrong password or database name will not fix itself: fail at once.
_DB_NOT_UP: Final = (OSError, asyncpg.CannotConnectNowError, asyncpg.PostgresConnectionError,
                     asyncpg.TooManyConnectionsError)


async def _connect(database_url: str, options: MigrateOptions, started: float) -> asyncpg.Connection:
    attempt = 0
    while True:
        try:
            conn = await asyncpg.connect(database_url, timeout=10)
        except (asyncpg.InvalidAuthorizationSpecificationError, asyncpg.InvalidCatalogNameError) as exc:
            problem = ConnectionSecurityError if isinstance(exc, asyncpg.InvalidAuthorizationSpecificationError) \
                else DatabaseError
            raise problem(explain(exc, database_url, "migrate")) from None
        except _DB_NOT_UP as exc:
            refused = refused_startup_parameter(exc)
            if refused is not None:
                raise refused from None
            attempt += 1
            waited = time.monotonic() - started
            if waited > options.deadline_seconds:
                raise DatabaseError(
                    f"the database did not accept connections within {options.deadline_seconds:g}s "
                    f"(STOCK_LEDGER_MIGRATE_DEADLINE_SECONDS); last error: "
                    f"{explain(exc, database_url, 'migrate') or f'{type(exc).__name__}: {exc}'}. "
                    "Check DATABASE_URL's host and port and that PostgreSQL is up"
                ) from exc
            delay = _delay(attempt)
            log.info("migration.waiting_for_database", attempt=attempt, waited_seconds=round(waited, 1),
                     deadline_seconds=options.deadline_seconds, retry_in_seconds=round(delay, 1),
                     error=f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(delay)
            continue
        try:
            # Pinned search_path, and no migration runs objects a less-privileged role planted (schemaguard.py);
            # that a role other than the owner may still CREATE in public is what 0009 fixes, so not refused here.
            await schemaguard.pin(conn)
            await schemaguard.check(conn, writers=False)
        except BaseException:
            await conn.close()
            raise
        return conn


def _delay(attempt: int) -> float:
    """Exponential backoff with jitter, 0.25 s doubling up to 5 s."""
    return float(min(5.0, 0.25 * 2 ** min(attempt, 5)) * random.uniform(0.5, 1.0))  # noqa: S311 - jitter only


async def _take_lock(conn: asyncpg.Connection, options: MigrateOptions, started: float) -> None:
    """The session-level advisory lock: a second pod waits (with progress) and then finds everything applied."""
    attempt = 0
    while not await conn.fetchval("SELECT pg_try_advisory_lock($1)", _LOCK_KEY):
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


async def _apply_one(conn: asyncpg.Connection, m: Migration, options: MigrateOptions, started: float) -> None:
    """One migration in one transaction, its DDL under lock_timeout and statement_timeout.

    DDL takes strong table locks. Waiting for one behind a worker's open batch transaction would queue every later
    worker statement on that table behind ours (PostgreSQL grants locks in arrival order): the whole fleet would
    stall for as long as we wait. So wait at most lock_timeout, give the lock back, and try again.
    """
    attempt = 0
    while True:
        attempt += 1
        try:
            async with conn.transaction():
                await conn.execute(f"SET LOCAL lock_timeout = {int(options.lock_timeout_ms)}")
                await conn.execute(f"SET LOCAL statement_timeout = {int(options.statement_timeout_ms)}")
                await conn.execute(m.sql)
                await conn.execute(
                    "INSERT INTO schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
                    m.version, m.name, m.checksum,
                )
        except asyncpg.LockNotAvailableError as exc:
            waited = time.monotonic() - started
            if waited > options.deadline_seconds:
                raise StockLedgerError(
                    f"migration {m.name} could not get its locks within {options.deadline_seconds:g}s "
                    f"(STOCK_LEDGER_MIGRATE_DEADLINE_SECONDS; each try waits STOCK_LEDGER_MIGRATE_LOCK_TIMEOUT_MS="
                    f"{options.lock_timeout_ms}): a long transaction holds them; find it in pg_stat_activity "
                    "(state 'idle in transaction' or a long query) and end it, then run migrate again"
                ) from exc
            delay = _delay(attempt)
            log.info("migration.lock_timeout", migration=m.name, attempt=attempt, waited_seconds=round(waited, 1),
                     lock_timeout_ms=options.lock_timeout_ms, retry_in_seconds=round(delay, 1), error=str(exc))
            await asyncio.sleep(delay)
        else:
            return


async def migrate(database_url: str, directory: Path, options: MigrateOptions | None = None) -> list[str]:
    """Apply pending migrations; return the names applied. Each runs in its own transaction.

    Waits for the database (bounded by options.deadline_seconds), then for the migration lock, and retries a
    migration whose DDL hit lock_timeout, logging a progress line for each wait.
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
        for m in migrations:
            if m.version in done:
                if done[m.version] != m.checksum:
                    raise LedgerIntegrityError(
                        f"migration {m.name} was changed after it was applied; add a new migration instead"
                    )
                continue
            log.info("migration.apply", migration=m.name)
            await _apply_one(conn, m, options, started)
            applied_now.append(m.name)
        await conn.execute("SELECT pg_advisory_unlock($1)", _LOCK_KEY)
    finally:
        await conn.close()
    log.info("migration.done", applied=applied_now, schema_version=SCHEMA_VERSION)
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
