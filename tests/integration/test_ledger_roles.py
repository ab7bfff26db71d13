"""Several ledgers on one PostgreSQL cluster. Role names are global to a cluster: with the default names every
ledger's migrations grant to the same `stock_ledger_app`, so a worker of one ledger may write every other's tables.
Each ledger here is migrated by the real `stock-ledger migrate` with role names of its own (STOCK_LEDGER_APP_ROLE,
STOCK_LEDGER_READER_ROLE); its worker and its reader log in as members of those roles only. See docs/security.md,
"Several ledgers on one cluster"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest
import pytest_asyncio

from stock_ledger.migrate import Roles, find_migrations_dir, migrate
from tests.support.helpers import (
    Env,
    Services,
    WorkerPool,
    assert_exact,
    movement,
    scratch_database,
    send_raw,
    wait_drained,
)
from tests.support.services import WORKER_PASSWORD, WORKER_ROLE

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(300)]

PASSWORD = f"pw-{uuid.uuid4().hex[:8]}"
PRIVILEGES = ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "REFERENCES", "TRIGGER")
READ = "SELECT count(*) FROM stock_movements"
WRITES = (
    "INSERT INTO consumer_offsets (group_id, topic, partition, next_offset) VALUES ('g', 't', 0, 0)",
    "UPDATE consumer_offsets SET next_offset = 0",
    "INSERT INTO stock_levels (warehouse_id, sku, on_hand) VALUES ('WH-1', 'SKU-1', 1)",
    ("INSERT INTO stock_movements (movement_id, warehouse_id, sku, qty, kind, occurred_at, kafka_topic, "
     "kafka_partition, kafka_offset) VALUES (gen_random_uuid(), 'WH-1', 'SKU-1', 1, 'receipt', now(), 't', 0, 0)"),
    "INSERT INTO monitor_leases (group_id, topic, holder, term, expires_at) VALUES ('g', 't', 'h', 1, now())",
)


@dataclass(frozen=True)
class Ledger:
    """A ledger's database and roles: `app` and `reader` the NOLOGIN roles its migrations grant to, `worker` and
    `person` LOGIN members of them."""

    name: str
    owner_url: str
    app: str
    reader: str
    worker: str
    person: str

    def roles(self) -> dict[str, str]:
        return {"STOCK_LEDGER_APP_ROLE": self.app, "STOCK_LEDGER_READER_ROLE": self.reader}


def stock_ledger(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The real CLI, with `env` over the caller's environment minus its own database settings."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("STOCK_LEDGER_", "DATABASE_URL"))}
    return subprocess.run([sys.executable, "-m", "stock_ledger", *args], env=base | env, capture_output=True,
                          text=True, timeout=240, check=False)


async def _sql(url: str, *statements: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


async def _refused(url: str, statement: str) -> bool:
    """Whether `statement` (rolled back either way) is refused for want of a privilege."""
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("BEGIN")
        await conn.execute(statement)
    except asyncpg.InsufficientPrivilegeError:
        return True
    else:
        return False
    finally:
        conn.terminate()  # the transaction goes with the session


@pytest_asyncio.fixture
async def ledgers(services: Services) -> AsyncIterator[dict[str, Ledger]]:
    """Two ledgers, `a` and `b`, each in a scratch database of the shared cluster, migrated with role names of its
    own (the roles made first, as the README's quick start makes them; each ledger's worker and reader logins
    members of its roles only). Everything dropped afterwards."""
    tag = uuid.uuid4().hex[:8]
    made: list[Ledger] = []
    try:
        async with scratch_database(services) as a, scratch_database(services) as b:
            for key, name in (("a", a), ("b", b)):
                ledger = Ledger(name, services.url_for(name), *(f"sl_{tag}_{key}_{r}" for r in
                                                                 ("app", "reader", "worker", "person")))
                made.append(ledger)
                await _sql(services.admin_url, f"CREATE ROLE {ledger.app} NOLOGIN",
                           f"CREATE ROLE {ledger.reader} NOLOGIN",
                           f"CREATE ROLE {ledger.worker} LOGIN PASSWORD '{PASSWORD}' IN ROLE {ledger.app}",
                           f"CREATE ROLE {ledger.person} LOGIN PASSWORD '{PASSWORD}' IN ROLE {ledger.reader}")
                await migrate(ledger.owner_url, find_migrations_dir(None), roles=Roles(ledger.app, ledger.reader))
                await _sql(ledger.owner_url, "SELECT stock_ledger_ensure_segments('{0}', '{0}')")  # rows by hand
            yield {"a": made[0], "b": made[1]}
    finally:
        for ledger in made:
            await _sql(services.admin_url, *(f"DROP ROLE IF EXISTS {r}" for r in
                                             (ledger.worker, ledger.person, ledger.app, ledger.reader)))


async def _privileges(url: str, role: str) -> dict[tuple[str, str], bool]:
    """(table, privilege) -> whether `role` holds it, for every table of schema public; and CREATE on the schema."""
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch(
            "SELECT c.relname, p, has_table_privilege($1, c.oid, p) FROM pg_class AS c, unnest($2::text[]) AS p "
            "WHERE c.relnamespace = 'public'::regnamespace AND c.relkind IN ('r', 'p')", role, list(PRIVILEGES))
        found = {(r[0], r[1]): r[2] for r in rows}
        found["public", "CREATE"] = await conn.fetchval("SELECT has_schema_privilege($1, 'public', 'CREATE')", role)
        return found
    finally:
        await conn.close()


async def test_a_worker_of_one_ledger_cannot_write_another_ledgers_tables(
    services: Services, ledgers: dict[str, Ledger], database: Env,
) -> None:
    """1. Each ledger's own roles hold on it exactly the privileges the migrations give stock_ledger_app and
          stock_ledger_reader on a default-migrated ledger (every table, and CREATE on schema public), and the
          default roles hold none there: no grant of any migration kept the default name.
    2. Each ledger's worker may write its own tables and neither write nor read the other's; each ledger's reader
       may read its own tables only.
    3. Against that, the default names: the tests' `stock_ledger_worker` (a member of stock_ledger_app) writes a
       default-migrated ledger, and so every such ledger on the cluster; it may not write either of these two."""
    a, b = ledgers["a"], ledgers["b"]
    await _sql(database.owner_url, "SELECT stock_ledger_ensure_segments('{0}', '{0}')")  # as in `ledgers`
    for ledger in (a, b):
        assert await _privileges(ledger.owner_url, ledger.app) == await _privileges(database.owner_url,
                                                                                    "stock_ledger_app")
        assert await _privileges(ledger.owner_url, ledger.reader) == await _privileges(database.owner_url,
                                                                                       "stock_ledger_reader")
        assert not any((await _privileges(ledger.owner_url, "stock_ledger_app")).values())
    for own, other in ((a, b), (b, a)):
        for write in WRITES:
            assert not await _refused(services.url_for(own.name, own.worker, PASSWORD), write), (own.worker, write)
            assert await _refused(services.url_for(other.name, own.worker, PASSWORD), write), (own.worker, write)
        assert await _refused(services.url_for(other.name, own.worker, PASSWORD), READ)
        assert not await _refused(services.url_for(own.name, own.person, PASSWORD), READ)
        assert await _refused(services.url_for(other.name, own.person, PASSWORD), READ)
    assert not await _refused(database.worker_url, WRITES[0]), "the default role writes a default-migrated ledger"
    for ledger in (a, b):
        assert await _refused(services.url_for(ledger.name, WORKER_ROLE, WORKER_PASSWORD), WRITES[0])


async def test_migrate_keeps_a_ledger_to_the_role_names_it_was_migrated_with(ledgers: dict[str, Ledger]) -> None:
    """`stock-ledger migrate` run again with the ledger's names has nothing to do. With other names (the defaults:
    a setting forgotten at an upgrade; another ledger's reader) it exits 2 before applying anything, naming the role
    the ledger uses and the variable to set: the next migration would grant to a role the older ones never did."""
    a, b = ledgers["a"], ledgers["b"]
    again = stock_ledger("migrate", env={"DATABASE_URL": a.owner_url, **a.roles()})
    assert again.returncode == 0, again.stderr
    assert "none (already up to date)" in again.stdout
    refused = stock_ledger("migrate", env={"DATABASE_URL": a.owner_url})
    assert refused.returncode == 2, refused.stderr
    assert "STOCK_LEDGER_APP_ROLE=stock_ledger_app" in refused.stderr
    assert a.app in refused.stderr
    refused = stock_ledger("migrate", env={"DATABASE_URL": a.owner_url, "STOCK_LEDGER_APP_ROLE": a.app,
                                           "STOCK_LEDGER_READER_ROLE": b.reader})
    assert refused.returncode == 2, refused.stderr
    assert f"STOCK_LEDGER_READER_ROLE={b.reader}" in refused.stderr
    assert a.reader in refused.stderr


async def test_a_worker_applies_its_own_ledger_and_is_refused_the_other(
    services: Services, ledgers: dict[str, Ledger], topic: str, tmp_path: Path,
) -> None:
    """`stock-ledger run` as ledger a's worker drains 300 movements into ledger a exactly once (its role holds
    everything a worker needs). Pointed at ledger b, the same login exits 1 at its first query, naming the GRANT
    the owner would have to run (b's app role, from STOCK_LEDGER_APP_ROLE), and writes nothing there."""
    a, b = ledgers["a"], ledgers["b"]
    pool = WorkerPool(services, Env(a.owner_url, services.url_for(a.name, a.worker, PASSWORD), a.name), topic,
                      group=f"roles-{uuid.uuid4().hex[:8]}", logs=tmp_path)
    try:
        pool.start(**a.roles())
        sent = await send_raw(services.kafka, topic, [
            (f"SKU-{i % 30}".encode(), json.dumps(movement(f"SKU-{i % 30}")).encode()) for i in range(300)])
        assert sent == 300
        await wait_drained(services, pool.db, topic, pool.group, 90, pool)
        await assert_exact(services, pool.db, topic, pool.group, rows=300, pool=pool)
        stranger = pool.start(DATABASE_URL=services.url_for(b.name, a.worker, PASSWORD), **b.roles())
        assert stranger.wait(60) == 1, stranger.log_tail(20)
        assert f"GRANT {b.app} TO {a.worker};" in stranger.log_text()
        pool.assert_no_tracebacks()
    finally:
        pool.kill_all()
    conn = await asyncpg.connect(b.owner_url)
    try:
        assert await conn.fetchval("SELECT count(*) FROM consumer_offsets") == 0
    finally:
        await conn.close()
