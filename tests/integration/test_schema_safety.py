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
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import asyncpg
import pytest
import pytest_asyncio

from stock_ledger.clients.database import (
    connect_database,
    operator_session,
    pool,
    reader_session,
    worker_session,
)
from stock_ledger.config import Settings, load_settings
from stock_ledger.errors import DatabaseError
from stock_ledger.migrate import migrate
from tests.support.helpers import Env, Services, insert_foreign_row, scratch_database
from tests.support.services import WORKER_PASSWORD

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
    worker = await worker_session(load_settings({"DATABASE_URL": database.worker_url}))
    await worker.close()


async def test_every_session_pins_the_search_path(database: Env) -> None:
    """Owner, operator and worker sessions resolve names in pg_catalog first, then public, and never in a
    "$user" schema; an owner-created `public.now()` cannot shadow the built-in."""
    await _sql(database.owner_url, "CREATE FUNCTION public.now() RETURNS timestamptz LANGUAGE sql "
                                   "AS $$ SELECT '2000-01-01'::timestamptz $$")
    for connect, url in ((connect_database, database.owner_url), (worker_session, database.worker_url)):
        conn = await connect(load_settings({"DATABASE_URL": url}))
        try:
            assert await conn.fetchval("SHOW search_path") == "public"
            assert await conn.fetchval("SELECT current_schemas(true)") == ["pg_catalog", "public"]
            assert (await conn.fetchval("SELECT now()")).year > 2000
        finally:
            await conn.close()


# Issue 38, item 1: every name the statements a guarded session runs before or during its check (the session
# settings, the pinned search_path, the check itself), the pool's setup and reset, and migrate's lock could resolve
# to, planted by the worker role. Each body writes to a table only the owner may write, so a row there means
# the planted function ran with the owner's rights. The aggregate has a final function: it runs even over no row
# (migrate's session sets nothing).
PLANTED_EVERYWHERE = """
CREATE FUNCTION public.planted_ran(what text) RETURNS void LANGUAGE plpgsql AS $$
BEGIN INSERT INTO public.planted_trace VALUES (what); END $$;
CREATE FUNCTION public.count_step(s bigint, v text) RETURNS bigint LANGUAGE plpgsql AS $$
BEGIN PERFORM public.planted_ran('count(text) step'); RETURN s + 1; END $$;
CREATE FUNCTION public.count_final(s bigint) RETURNS bigint LANGUAGE plpgsql AS $$
BEGIN PERFORM public.planted_ran('count(text) final'); RETURN s; END $$;
CREATE AGGREGATE public.count(text) (SFUNC = public.count_step, STYPE = bigint, INITCOND = '0',
                                     FINALFUNC = public.count_final);
CREATE FUNCTION public.unnest(a text[], b text[]) RETURNS TABLE (name text, value text) LANGUAGE plpgsql AS $$
BEGIN PERFORM public.planted_ran('unnest(text[], text[])'); RETURN; END $$;
CREATE FUNCTION public.unnest(a text[]) RETURNS SETOF text LANGUAGE plpgsql AS $$
BEGIN PERFORM public.planted_ran('unnest(text[])'); RETURN; END $$;
CREATE FUNCTION public.set_config(a text, b text, c boolean) RETURNS text LANGUAGE plpgsql AS $$
BEGIN PERFORM public.planted_ran('set_config'); RETURN b; END $$;
CREATE FUNCTION public.pg_backend_pid() RETURNS integer LANGUAGE plpgsql AS $$
BEGIN PERFORM public.planted_ran('pg_backend_pid'); RETURN 0; END $$;
CREATE FUNCTION public.pg_try_advisory_lock(k text) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN PERFORM public.planted_ran('pg_try_advisory_lock(text)'); RETURN true; END $$;
CREATE FUNCTION public.pg_advisory_unlock(k text) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN PERFORM public.planted_ran('pg_advisory_unlock(text)'); RETURN true; END $$;
CREATE FUNCTION public.pg_advisory_unlock_all() RETURNS void LANGUAGE plpgsql AS $$
BEGIN PERFORM public.planted_ran('pg_advisory_unlock_all'); END $$;
CREATE FUNCTION public.aclexplode(a aclitem[]) RETURNS TABLE (grantor oid, grantee oid, privilege_type text,
                                                             is_grantable boolean) LANGUAGE plpgsql AS $$
BEGIN PERFORM public.planted_ran('aclexplode'); RETURN; END $$;
CREATE FUNCTION public.pg_get_userbyid(o oid) RETURNS name LANGUAGE plpgsql AS $$
BEGIN PERFORM public.planted_ran('pg_get_userbyid'); RETURN 'x'; END $$;
CREATE FUNCTION public.current_database() RETURNS name LANGUAGE plpgsql AS $$
BEGIN PERFORM public.planted_ran('current_database'); RETURN 'x'; END $$;
CREATE FUNCTION public.eq_oid(a oid, b oid) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN PERFORM public.planted_ran('=(oid, oid)'); RETURN a::bigint OPERATOR(pg_catalog.=) b::bigint; END $$;
CREATE OPERATOR public.= (LEFTARG = oid, RIGHTARG = oid, FUNCTION = public.eq_oid);
CREATE FUNCTION public.eq_name_text(a name, b text) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN PERFORM public.planted_ran('=(name, text)'); RETURN a::text OPERATOR(pg_catalog.=) b; END $$;
CREATE OPERATOR public.= (LEFTARG = name, RIGHTARG = text, FUNCTION = public.eq_name_text);
"""


async def _planted_ran(db: Env) -> list[str]:
    """What the planted functions left behind (read as the owner, every name qualified)."""
    conn = await asyncpg.connect(db.owner_url)
    try:
        return [r[0] for r in await conn.fetch("SELECT what FROM public.planted_trace")]
    finally:
        await conn.close()


async def _open_and_close(connect: Callable[[Settings], Awaitable[asyncpg.Connection]], settings: Settings) -> None:
    conn = await connect(settings)
    await conn.close()


async def test_nothing_a_session_runs_before_its_check_reaches_a_planted_function(
    services: Services, database: Env, topic: str,
) -> None:
    """1. A database where the worker role may CREATE in public (PostgreSQL 14's default, emulated) and has planted
       every name our sessions' first statements use: count(text) (an exact match beats pg_catalog's count("any")),
       unnest, set_config, pg_backend_pid, the advisory-lock functions (an untyped parameter resolves to a text
       overload), the catalog functions and the `=` operators of the check; each body writes to a table only the
       owner may write.
    2. As the owner: the operator commands' sessions (connect_database, operator_session, reader_session), migrate
       (in process and `stock-ledger gaps list` through the CLI) are refused naming the planted objects; the worker's
       own session and the monitor's pool (pinned only, by design) connect. After each, the trace is empty: nothing
       ran with the owner's rights."""
    db = database
    await _exec(db.owner_url, "CREATE TABLE public.planted_trace (what text); GRANT CREATE ON SCHEMA public TO PUBLIC")
    await _exec(db.worker_url, PLANTED_EVERYWHERE)
    owner = load_settings({"DATABASE_URL": db.owner_url})
    for name, connect in (("connect_database", connect_database), ("operator_session", operator_session),
                          ("reader_session", reader_session)):
        with pytest.raises(DatabaseError, match="count_step") as refused:
            await _open_and_close(connect, owner)
        assert "owned by stock_ledger_worker" in str(refused.value), name
        assert await _planted_ran(db) == [], f"{name} ran a planted function as the owner"
    with pytest.raises(DatabaseError, match="count_step"):
        await migrate(db.owner_url, ROOT / "migrations")
    assert await _planted_ran(db) == [], "migrate ran a planted function as the owner"
    code, out = await _cli(services, topic, db.owner_url, "gaps", "list")
    assert code == 1, out
    assert "owned by stock_ledger_worker" in out, out
    assert await _planted_ran(db) == [], f"`gaps list` ran a planted function as the owner:\n{out}"

    await _open_and_close(worker_session, owner)  # not refused (its role is the untrusted one), runs nothing planted
    metrics_pool = await pool(owner, application_name="test-pool")
    try:
        async with metrics_pool.acquire() as conn:
            assert await conn.fetchval("SELECT pg_catalog.current_setting('search_path')") == "public"
    finally:
        await metrics_pool.close()
    assert await _planted_ran(db) == [], "the worker session or the pool ran a planted function as the owner"
