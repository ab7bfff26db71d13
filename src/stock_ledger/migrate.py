"""Apply migrations/*.sql in order, once each, safely when several pods run it at once."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import asyncpg
import structlog

from stock_ledger.errors import ConfigError, LedgerIntegrityError

log = structlog.get_logger(__name__)

# Raise this when a migration is added: the worker refuses to run against an older schema.
SCHEMA_VERSION: Final = 5
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


async def migrate(database_url: str, directory: Path) -> list[str]:
    """Apply pending migrations; return the names applied. Each runs in its own transaction."""
    migrations = load_migrations(directory)
    conn = await asyncpg.connect(database_url)
    applied_now: list[str] = []
    try:
        # Session-level lock: a second pod waits here, then finds everything applied.
        await conn.execute("SELECT pg_advisory_lock($1)", _LOCK_KEY)
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
            async with conn.transaction():
                await conn.execute(m.sql)
                await conn.execute(
                    "INSERT INTO schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
                    m.version, m.name, m.checksum,
                )
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
