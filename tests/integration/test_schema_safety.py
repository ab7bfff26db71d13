"""The worker's credential cannot become the owner's, on PostgreSQL 14 defaults too (issue 32, item 7).

Where PUBLIC may CREATE in schema public (PostgreSQL 14 and older, and databases upgraded from them), the worker
role can create `public.||(text, name)`: an owner's `'operator:' || current_user` (offsets set) resolves to it
before pg_catalog's, whatever the search_path order, and runs it with the owner's privileges. Emulated here on the
real server with `GRANT CREATE ON SCHEMA public TO PUBLIC`.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
import pytest_asyncio
from scripts.localservices import WORKER_PASSWORD

from stock_ledger.clients import connect_database, connect_worker
from stock_ledger.config import load_settings
from stock_ledger.migrate import migrate
from tests.helpers import Env, Services, insert_foreign_row, scratch_database

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]

# What the worker plants: deletes every movement and hands DELETE/TRUNCATE to the app role when an owner runs it.
HIJACK = """
CREATE FUNCTION public.hijack(a text, b name) RETURNS text LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM stock_movements;
    EXECUTE 'GRANT DELETE, TRUNCATE ON stock_movements TO stock_ledger_app';
    RETURN a || b::text;
END $$;
CREATE OPERATOR public.|| (LEFTARG = text, RIGHTARG = name, FUNCTION = public.hijack);
"""


async def _sql(url: str, statement: str, *args: object) -> object:
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetchval(statement, *args)
    finally:
        await conn.close()


async def _exec(url: str, statements: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(statements)
    finally:
        await conn.close()


async def _state(db: Env) -> tuple[int, bool]:
    """Movements left, and whether the app role got DELETE on them."""
    rows = await _sql(db.owner_url, "SELECT count(*) FROM stock_movements")
    delete = await _sql(db.owner_url, "SELECT has_table_privilege('stock_ledger_app', 'stock_movements', 'DELETE')")
    return int(rows), bool(delete)  # type: ignore[call-overload]


async def _cli(services: Services, topic: str, url: str, *args: str) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STOCK_LEDGER_")}
    env |= {"KAFKA_BOOTSTRAP_SERVERS": services.kafka, "DATABASE_URL": url, "STOCK_LEDGER_TOPIC": topic,
            "STOCK_LEDGER_GROUP_ID": "sl-schema-safety", "STOCK_LEDGER_LOG_FORMAT": "json"}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "stock_ledger", *args, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode or 0, out.decode() + err.decode()


async def _upgraded_with_a_planted_operator(db: Env, topic: str) -> None:
    """The database as one upgraded from PostgreSQL 14 before migration 0009: PUBLIC may CREATE in public, and the
    worker used that. Three movements are in the ledger."""
    for offset in range(3):
        # Partition 1: partition 0 stays movable to 0, so offsets set reaches its move (and the operator).
        await insert_foreign_row(db.owner_url, topic, 1, offset)
    await _sql(db.owner_url, "DELETE FROM schema_migrations WHERE version = 9")
    await _sql(db.owner_url, "GRANT CREATE ON SCHEMA public TO PUBLIC")
    await _exec(db.worker_url, HIJACK)


async def test_the_attack_is_real_without_the_guard(database: Env, topic: str) -> None:
    """Control: a plain owner session (no pinned search_path, no check) evaluating offsets set's expression runs
    the planted operator: the movements are gone and the grant is made (rolled back here)."""
    await _upgraded_with_a_planted_operator(database, topic)
    conn = await asyncpg.connect(database.owner_url)
    try:
        tx = conn.transaction()
        await tx.start()
        await conn.fetchval("SELECT 'operator:' || current_user")
        assert await conn.fetchval("SELECT count(*) FROM stock_movements") == 0
        assert await conn.fetchval("SELECT has_table_privilege('stock_ledger_app', 'stock_movements', 'DELETE')")
        await tx.rollback()
    finally:
        await conn.close()
    assert await _state(database) == (3, False)


async def test_owner_commands_refuse_a_planted_operator_and_migrate_fixes_the_schema(
    services: Services, database: Env, topic: str,
) -> None:
    """1. Upgraded database, operator planted by the worker (as above).
    2. offsets set, gaps list, rejected list, verify, stock show and migrate, as the owner: each exits 1 naming the
       planted operator and its owner; no movement is deleted, no privilege granted.
    3. The owner drops the operator and its function; migrate applies 0009; the worker can no longer CREATE in
       public, and the owner commands run again (exit 0) with the ledger intact."""
    await _upgraded_with_a_planted_operator(database, topic)
    for args in (("offsets", "set", "--partition", "0", "--offset", "0"), ("gaps", "list"), ("rejected", "list"),
                 ("verify",), ("stock", "show", "--warehouse", "WH-1"), ("migrate",)):
        code, out = await _cli(services, topic, database.owner_url, *args)
        assert await _state(database) == (3, False), f"{args} ran the planted operator:\n{out}"
        assert code == 1, f"{args}: exit {code}\n{out}"
        assert "operator ||(text,name) owned by stock_ledger_worker" in out, f"{args}:\n{out}"

    await _exec(database.owner_url, "DROP OPERATOR public.|| (text, name); DROP FUNCTION public.hijack(text, name)")
    code, out = await _cli(services, topic, database.owner_url, "migrate")
    assert code == 0, out
    assert "0009_schema_public.sql" in out
    assert not await _sql(database.worker_url, "SELECT has_schema_privilege('public', 'CREATE')")
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await _exec(database.worker_url, HIJACK)
    for args in (("offsets", "show"), ("gaps", "list"), ("rejected", "list")):
        code, out = await _cli(services, topic, database.owner_url, *args)
        assert code == 0, f"{args}: exit {code}\n{out}"
    assert await _state(database) == (3, False)


@pytest_asyncio.fixture
async def pg14_database(services: Services, worker_role: str) -> AsyncIterator[Env]:
    """A new database with PostgreSQL 14's default (PUBLIC may CREATE in public), not yet migrated."""
    async with scratch_database(services) as name:
        owner_url = services.url_for(name)
        await _sql(owner_url, "GRANT CREATE ON SCHEMA public TO PUBLIC")
        yield Env(owner_url, services.url_for(name, user=worker_role, password=WORKER_PASSWORD), name)


async def test_migrating_a_pg14_default_database_takes_create_away(pg14_database: Env) -> None:
    """Migrations on a database where PUBLIC may CREATE in public: afterwards neither the worker role nor PUBLIC
    may, so the operator cannot be planted."""
    db = pg14_database
    assert await _sql(db.worker_url, "SELECT has_schema_privilege('public', 'CREATE')")
    await migrate(db.owner_url, ROOT / "migrations")
    assert not await _sql(db.worker_url, "SELECT has_schema_privilege('public', 'CREATE')")
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await _exec(db.worker_url, HIJACK)


async def test_a_re_granted_create_is_refused_by_owner_sessions(database: Env) -> None:
    """After 0009 someone grants CREATE on public to PUBLIC again: an owner session refuses to start, naming PUBLIC
    and the REVOKE; the worker's own sessions still connect (they are what is defended against)."""
    await _sql(database.owner_url, "GRANT CREATE ON SCHEMA public TO PUBLIC")
    owner = load_settings({"DATABASE_URL": database.owner_url})
    with pytest.raises(Exception, match="PUBLIC may CREATE in schema public") as caught:
        await connect_database(owner)
    assert "REVOKE CREATE ON SCHEMA public FROM PUBLIC" in str(caught.value)
    worker = await connect_worker(load_settings({"DATABASE_URL": database.worker_url}))
    await worker.close()


async def test_every_session_pins_the_search_path(database: Env) -> None:
    """Owner, operator and worker sessions resolve names in pg_catalog first, then public, and never in a
    "$user" schema; an owner-created `public.now()` cannot shadow the built-in."""
    await _sql(database.owner_url, "CREATE FUNCTION public.now() RETURNS timestamptz LANGUAGE sql "
                                   "AS $$ SELECT '2000-01-01'::timestamptz $$")
    for connect, url in ((connect_database, database.owner_url), (connect_worker, database.worker_url)):
        conn = await connect(load_settings({"DATABASE_URL": url}))
        try:
            assert await conn.fetchval("SHOW search_path") == "public"
            assert await conn.fetchval("SELECT current_schemas(true)") == ["pg_catalog", "public"]
            assert (await conn.fetchval("SELECT now()")).year > 2000
        finally:
            await conn.close()
