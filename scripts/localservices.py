"""The local services harness the tests and the benches share: the project's own Kafka and PostgreSQL (started by
scripts/kafka.sh and scripts/postgres.sh), the worker's least-privileged role, URLs and free ports.

Imported as `scripts.localservices` by the tests (the repository root is on their path) and as `localservices` by
the scripts beside it. The tests keep their own, independent check of the ledger (tests/helpers.py).
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg

ROOT = Path(__file__).resolve().parents[1]
WORKER_ROLE = "stock_ledger_worker"
WORKER_PASSWORD = os.environ.get("STOCK_LEDGER_WORKER_PASSWORD", "stock_ledger_worker")


def script(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run scripts/<name> for the local services (never for endpoints configured by the environment)."""
    env = {k: v for k, v in os.environ.items() if k not in {"KAFKA_BOOTSTRAP_SERVERS", "DATABASE_URL"}}
    return subprocess.run(["bash", str(ROOT / "scripts" / name), *args], check=False, capture_output=True,
                          text=True, timeout=600, env=env)


def local_kafka() -> str:
    """The bootstrap address of scripts/kafka.sh's broker (KAFKA_PORT: a second broker of one's own)."""
    return f"127.0.0.1:{os.environ.get('KAFKA_PORT', '9092')}"


def url_for(admin_url: str, database: str, user: str | None = None, password: str | None = None) -> str:
    """`admin_url` pointed at another database, optionally as another user."""
    parts = urlsplit(admin_url)
    netloc = parts.netloc
    if user is not None:
        netloc = f"{user}:{password}@{netloc.rsplit('@', 1)[-1]}"
    return urlunsplit((parts.scheme, netloc, f"/{database}", parts.query, parts.fragment))


async def ensure_worker_role(admin_url: str, password: str = WORKER_PASSWORD) -> str:
    """The LOGIN role the workers run as: a member of stock_ledger_app, which migrations grant exactly what the
    worker needs. Idempotent, and safe when several processes create it at once."""
    conn = await asyncpg.connect(admin_url)
    try:
        await conn.execute("""
            DO $$ BEGIN
              IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'stock_ledger_app') THEN
                CREATE ROLE stock_ledger_app NOLOGIN; END IF;
              IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'stock_ledger_worker') THEN
                CREATE ROLE stock_ledger_worker LOGIN; END IF;
            EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
            END $$""")
        await conn.execute(f"ALTER ROLE {WORKER_ROLE} PASSWORD '{password}'")
        await conn.execute(f"GRANT stock_ledger_app TO {WORKER_ROLE}")
    finally:
        await conn.close()
    return WORKER_ROLE


async def create_migrated_database(admin_url: str, name: str) -> str:
    """A new database `name`, migrated as the owner, with the worker role ready; its owner URL."""
    from stock_ledger.migrate import find_migrations_dir, migrate  # noqa: PLC0415 - keep this module light

    await ensure_worker_role(admin_url)
    admin = await asyncpg.connect(admin_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    owner_url = url_for(admin_url, name)
    await migrate(owner_url, find_migrations_dir(None))
    return owner_url


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
