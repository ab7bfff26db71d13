"""Database mistakes of a new install, through the real CLI against the real PostgreSQL: every command says the
cause and the fix in one line and exits 1, instead of the driver's text and "check DATABASE_URL /
KAFKA_BOOTSTRAP_SERVERS and that the services are up".

The URLs are crafted per case: a wrong password, a database that does not exist, a fresh LOGIN role nobody granted
stock_ledger_app (created as the owner for the test, dropped after), and a port nothing listens on.
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import asyncpg
import pytest
import pytest_asyncio

from tests.support.helpers import Env, Services, free_port

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(300)]

COMMANDS = [("migrate",), ("gaps", "list"), ("verify",), ("offsets", "show"), ("stock", "show", "--warehouse", "W1")]
WRONG_PASSWORD = f"wrong-{uuid.uuid4().hex[:8]}"
ROLE_PASSWORD = f"pw-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class Case:
    url: str
    says: dict[str, str]  # command -> the text its line must hold ("" key: every command)
    secret: str


def _with(url: str, *, user: str | None = None, password: str | None = None, database: str | None = None,
          port: int | None = None) -> str:
    from urllib.parse import urlsplit, urlunsplit  # noqa: PLC0415

    parts = urlsplit(url)
    userinfo, _, hostport = parts.netloc.rpartition("@")
    name, _, secret = userinfo.partition(":")
    host = hostport.rsplit(":", 1)[0]
    netloc = f"{user or name}:{password or secret}@{host}:{port or hostport.rsplit(':', 1)[1]}"
    return urlunsplit((parts.scheme, netloc, f"/{database}" if database else parts.path, parts.query, ""))


@pytest_asyncio.fixture
async def ungranted_role(database: Env) -> AsyncIterator[str]:
    """A fresh LOGIN role that is a member of nothing, dropped afterwards."""
    role = f"sl_nogrant_{uuid.uuid4().hex[:8]}"
    owner = await asyncpg.connect(database.owner_url)
    try:
        await owner.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{ROLE_PASSWORD}'")
    finally:
        await owner.close()
    yield role
    owner = await asyncpg.connect(database.owner_url)
    try:
        await owner.execute(f"DROP ROLE IF EXISTS {role}")
    finally:
        await owner.close()


async def _run(services: Services, topic: str, url: str, *args: str) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STOCK_LEDGER_")}
    env |= {"KAFKA_BOOTSTRAP_SERVERS": services.kafka, "DATABASE_URL": url, "STOCK_LEDGER_TOPIC": topic,
            "STOCK_LEDGER_LOG_FORMAT": "json", "STOCK_LEDGER_MIGRATE_DEADLINE_SECONDS": "1"}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "stock_ledger", *args, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode or 0, out.decode() + err.decode()


def _assert_one_line(code: int, out: str, says: str, secret: str, command: str) -> None:
    assert code == 1, f"{command}: exit {code}\n{out}"
    lines = [line for line in out.splitlines() if says in line]
    assert len(lines) == 1, f"{command}: expected one line with {says!r}:\n{out}"
    assert "services are up" not in out, out
    assert "Traceback" not in out, out
    assert secret not in out, f"{command} printed the password"


async def _check(services: Services, topic: str, case: Case) -> None:
    for args in COMMANDS:
        command = " ".join(a for a in args if not a.startswith("-") and a != "W1")
        says = case.says.get(command, case.says.get("", ""))
        code, out = await _run(services, topic, case.url, *args)
        _assert_one_line(code, out, says, case.secret, command)


async def test_a_wrong_password(services: Services, database: Env, topic: str) -> None:
    """The owner's user with a wrong password: 'wrong password (SQLSTATE 28P01)' and where to fix it."""
    url = _with(database.owner_url, password=WRONG_PASSWORD)
    await _check(services, topic, Case(url, {"": "wrong password (SQLSTATE 28P01). Check the user and password in "
                                                 "DATABASE_URL (or DATABASE_URL_FILE)"}, WRONG_PASSWORD))


async def test_an_unknown_database(services: Services, database: Env, topic: str) -> None:
    """A database name that does not exist: named, with how to create it and migrate."""
    name = f"sl_absent_{uuid.uuid4().hex[:8]}"
    url = _with(database.owner_url, database=name)
    await _check(services, topic, Case(url, {"": f"database '{name}' does not exist on PostgreSQL at 127.0.0.1:5432 "
                                                 "(SQLSTATE 3D000)"}, "\0"))


async def test_a_role_without_the_grant(services: Services, database: Env, topic: str, ungranted_role: str) -> None:
    """A LOGIN role nobody granted stock_ledger_app: the reading commands print the exact GRANT to run as the owner;
    migrate says it runs as the owner role."""
    url = _with(database.owner_url, user=ungranted_role, password=ROLE_PASSWORD)
    grant = f"GRANT stock_ledger_app TO {ungranted_role};"
    await _check(services, topic, Case(url, {"": grant, "migrate": "runs as the owner role"}, ROLE_PASSWORD))


async def test_an_unreachable_server(services: Services, database: Env, topic: str) -> None:
    """A port nothing listens on: host:port named, the server down or the URL wrong (migrate after its 1 s
    STOCK_LEDGER_MIGRATE_DEADLINE_SECONDS)."""
    port = free_port()
    url = _with(database.owner_url, port=port)
    await _check(services, topic, Case(url, {"": f"cannot reach PostgreSQL at 127.0.0.1:{port}: connection refused: "
                                                 "the server is down, or DATABASE_URL's host or port is wrong"}, "\0"))
