"""What a connection pooler (PgBouncer) in front of PostgreSQL changes for our sessions, without one running:
which startup parameters are sent, how a refused one is reported, and that it is never retried; behind a
transaction pooler, what is set per transaction and what refuses to run. The real pooler is
in tests/integration/test_pgbouncer.py."""

from __future__ import annotations

import os
from typing import Any

import asyncpg
import pytest

from stock_ledger.cli.main import main
from stock_ledger.clients import database as clients
from stock_ledger.clients import servers
from stock_ledger.clients.database import backend_pid, connect_database, refused_startup_parameter
from stock_ledger.config import Settings
from stock_ledger.errors import ConfigError
from stock_ledger.worker.retry import transient_cause

REFUSED = "unsupported startup parameter: lock_timeout"


class _FakeSession:
    """Records what connect_database asks of a new session."""

    def __init__(self) -> None:
        self.queries: list[tuple[str, tuple[Any, ...]]] = []
        self.statements: list[str] = []
        self.terminated = False

    async def fetchrow(self, query: str, *args: Any) -> tuple[int, int]:
        self.queries.append((query, args))
        return (4242, len(args[0]))

    async def fetchval(self, query: str, *_args: Any) -> int:
        raise AssertionError(f"the pid should be known from the connect already, not asked again: {query}")

    async def execute(self, query: str, *_args: Any) -> str:
        self.statements.append(query)  # the pinned search_path (schemaguard.pin): a SET, never a startup parameter
        return "SET"

    async def fetch(self, _query: str, *_args: Any) -> list[Any]:
        return []  # schemaguard.check: nothing planted, nobody else may create in public

    def terminate(self) -> None:
        self.terminated = True


class TestRefusedStartupParameter:
    """PgBouncer's refusal arrives as ProtocolViolationError (08P01, a connection exception, which the retry path
    counts as a lost connection): it is a configuration error naming the fix, and never retried."""

    def test_is_a_configuration_error_with_the_fix(self) -> None:
        problem = refused_startup_parameter(asyncpg.ProtocolViolationError(REFUSED))
        assert isinstance(problem, ConfigError)
        assert REFUSED in str(problem)
        assert "ignore_startup_parameters" in str(problem)
        assert "pgbouncer.ini" in str(problem)
        assert "connect to PostgreSQL directly" in str(problem)
        assert "\n" not in str(problem)

    def test_is_never_retried(self) -> None:
        assert transient_cause(asyncpg.ProtocolViolationError(REFUSED)) is None

    def test_other_protocol_violations_stay_transient(self) -> None:
        exc = asyncpg.ProtocolViolationError("query_wait_timeout")
        assert refused_startup_parameter(exc) is None
        assert transient_cause(exc) == "database"

    @pytest.mark.asyncio
    async def test_connect_database_raises_it(self, monkeypatch: pytest.MonkeyPatch) -> None:
        async def refuse(*_args: object, **_kwargs: object) -> None:
            raise asyncpg.ProtocolViolationError(REFUSED)

        monkeypatch.setattr(asyncpg, "connect", refuse)
        settings = Settings(database_url="postgresql://u:p@127.0.0.1:6432/db")
        with pytest.raises(ConfigError, match="ignore_startup_parameters"):
            await connect_database(settings)


class TestSessionSettings:
    """Only application_name (which PgBouncer accepts by default) is a startup parameter; the timeouts are set in one
    round trip right after connecting, which also tells the backend's own pid."""

    @pytest.mark.asyncio
    async def test_only_application_name_is_a_startup_parameter(self, monkeypatch: pytest.MonkeyPatch) -> None:
        session = _FakeSession()
        seen: dict[str, Any] = {}

        async def connect(_url: str, **kwargs: Any) -> _FakeSession:
            seen.update(kwargs)
            return session

        monkeypatch.setattr(asyncpg, "connect", connect)
        settings = Settings(database_url="postgresql://u:p@127.0.0.1:6432/db", lock_timeout_ms=1234,
                            idle_in_transaction_timeout_ms=56_000)
        conn = await connect_database(settings, application_name="stock-ledger/g")
        assert seen["server_settings"] == {"application_name": "stock-ledger/g"}
        (query, (names, values)), = session.queries
        assert "set_config" in query
        assert "pg_backend_pid()" in query
        assert dict(zip(names, values, strict=True)) == {
            "lock_timeout": "1234", "idle_in_transaction_session_timeout": "56000", "tcp_keepalives_idle": "30",
            "tcp_keepalives_interval": "10", "tcp_keepalives_count": "3"}
        assert await backend_pid(conn) == 4242  # type: ignore[arg-type]
        assert any("search_path" in q for q in session.statements)
        clients._backend_pids.pop(conn)  # type: ignore[call-overload]

    @pytest.mark.asyncio
    async def test_cli_sessions_are_set_too(self, monkeypatch: pytest.MonkeyPatch) -> None:
        session = _FakeSession()
        seen: dict[str, Any] = {}

        async def connect(_url: str, **kwargs: Any) -> _FakeSession:
            seen.update(kwargs)
            return session

        monkeypatch.setattr(asyncpg, "connect", connect)
        conn = await clients.reader_session(Settings(database_url="postgresql://u:p@127.0.0.1:6432/db"))
        assert seen["server_settings"] == {"application_name": "stock-ledger-cli"}
        (_, (names, values)), = session.queries
        assert dict(zip(names, values, strict=True)) == {"default_transaction_read_only": "on", "jit": "off"}
        clients._backend_pids.pop(conn)  # type: ignore[call-overload]


class _SharedSession:
    """A client connection to a transaction pooler, as the worker sees it: what it is asked, in order."""

    def __init__(self, pid: int = 777) -> None:
        self.asked: list[tuple[str, tuple[Any, ...]]] = []
        self.pid = pid

    async def fetchval(self, query: str, *args: Any) -> int:
        self.asked.append((query, args))
        return self.pid

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"a shared session was asked {name}: nothing may be set for the session")


TRANSACTION = Settings(database_url="postgresql://u:p@127.0.0.1:6433/db", database_pooling="transaction",
                       lock_timeout_ms=1234, idle_in_transaction_timeout_ms=56_000, group_id="g")


class TestBehindATransactionPooler:
    """STOCK_LEDGER_DATABASE_POOLING=transaction: a client connection is no session of its own, so the worker's
    sessions prepare nothing named and set nothing for the session; each transaction sets its timeouts and the
    search_path for itself (SET LOCAL: set_config(..., true)) in the statement that also names its backend."""

    @pytest.mark.asyncio
    async def test_a_worker_session_sets_nothing_and_names_no_statement(self, monkeypatch: pytest.MonkeyPatch) -> None:
        session = _SharedSession()
        seen: dict[str, Any] = {}

        async def connect(_url: str, **kwargs: Any) -> _SharedSession:
            seen.update(kwargs)
            return session

        monkeypatch.setattr(asyncpg, "connect", connect)
        conn = await clients.worker_session(TRANSACTION)
        assert seen["statement_cache_size"] == 0
        assert seen["server_settings"] == {"application_name": "stock-ledger/g"}
        assert session.asked == []
        assert await clients.in_transaction(conn) == 777  # type: ignore[arg-type]
        (query, (names, values)), = session.asked
        assert "set_config(name, value, true)" in query
        assert "pg_backend_pid()" in query
        assert dict(zip(names, values, strict=True)) == {
            "lock_timeout": "1234", "idle_in_transaction_session_timeout": "56000", "search_path": "public"}
        session.pid = 778  # the next transaction may run on another server connection: asked again, every time
        assert await clients.in_transaction(conn) == 778  # type: ignore[arg-type]

    @pytest.mark.asyncio
    async def test_on_a_session_of_its_own_the_transaction_asks_nothing(self, monkeypatch: pytest.MonkeyPatch) -> None:
        session = _FakeSession()

        async def connect(_url: str, **_kwargs: Any) -> _FakeSession:
            return session

        monkeypatch.setattr(asyncpg, "connect", connect)
        conn = await clients.worker_session(Settings(database_url="postgresql://u:p@127.0.0.1:5432/db"))
        assert await clients.in_transaction(conn) == 4242  # type: ignore[arg-type] - _FakeSession.fetchval raises
        clients._backend_pids.pop(conn)  # type: ignore[call-overload]

    @pytest.mark.asyncio
    @pytest.mark.parametrize("opens", [clients.operator_session, clients.reader_session, connect_database])
    async def test_the_other_commands_refuse_before_connecting(self, monkeypatch: pytest.MonkeyPatch,
                                                               opens: Any) -> None:
        async def connect(*_args: object, **_kwargs: object) -> None:
            raise AssertionError("connected")

        monkeypatch.setattr(asyncpg, "connect", connect)
        with pytest.raises(ConfigError, match="needs a database session of its own") as refused:
            await opens(TRANSACTION)
        assert "STOCK_LEDGER_DATABASE_POOLING" in str(refused.value)
        assert "docs/pgbouncer.md" in str(refused.value)

    @pytest.mark.asyncio
    async def test_the_pool_prepares_nothing_and_resets_nothing(self, monkeypatch: pytest.MonkeyPatch) -> None:
        seen: dict[str, Any] = {}

        async def create_pool(_url: str, **kwargs: Any) -> str:
            seen.update(kwargs)
            return "pool"

        monkeypatch.setattr(asyncpg, "create_pool", create_pool)
        await clients.pool(TRANSACTION, application_name="stock-ledger-metrics")
        assert seen["statement_cache_size"] == 0
        assert seen.get("setup") is None
        assert await seen["reset"](_SharedSession()) is None  # asks the shared session nothing


class TestCheckPooling:
    """What the start-up probe saw, against what STOCK_LEDGER_DATABASE_POOLING says (servers.check_pooling)."""

    @staticmethod
    async def _check(monkeypatch: pytest.MonkeyPatch, seen: servers.Shared | None, pooling: str) -> None:
        async def probe(_connect: object) -> servers.Shared | None:
            return seen

        monkeypatch.setattr(servers, "transaction_pooling", probe)
        await servers.check_pooling(lambda: None, pooling)  # type: ignore[arg-type, return-value]

    @pytest.mark.asyncio
    @pytest.mark.parametrize("pooling", ["session", "transaction"])
    async def test_a_session_of_its_own_suits_either_setting(self, monkeypatch: pytest.MonkeyPatch,
                                                            pooling: str) -> None:
        await self._check(monkeypatch, None, pooling)

    @pytest.mark.asyncio
    async def test_transaction_pooling_is_refused_under_the_session_setting(
            self, monkeypatch: pytest.MonkeyPatch) -> None:
        with pytest.raises(ConfigError) as refused:
            await self._check(monkeypatch, servers.Shared("transaction", "pid 1 twice"), "session")
        assert "STOCK_LEDGER_DATABASE_POOLING=transaction" in str(refused.value)
        assert "pool_mode = session" in str(refused.value)
        assert "pid 1 twice" in str(refused.value)

    @pytest.mark.asyncio
    async def test_transaction_pooling_is_accepted_under_the_transaction_setting(
            self, monkeypatch: pytest.MonkeyPatch) -> None:
        await self._check(monkeypatch, servers.Shared("transaction", "pid 1 twice"), "transaction")

    @pytest.mark.asyncio
    @pytest.mark.parametrize("pooling", ["session", "transaction"])
    async def test_statement_pooling_is_refused_whatever_the_setting(self, monkeypatch: pytest.MonkeyPatch,
                                                                   pooling: str) -> None:
        with pytest.raises(ConfigError, match="statement pool_mode"):
            await self._check(monkeypatch, servers.Shared("statement", "transaction blocks not allowed"), pooling)


@pytest.mark.parametrize("command", [["migrate"], ["verify"], ["gaps", "list"], ["stock", "show", "--warehouse",
                                                                                  "WH-1"]])
def test_only_run_works_through_a_transaction_pooler(command: list[str], monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Every command but `run` needs a session of its own (migrate its advisory lock, the others their session
    settings and prepared statements): with STOCK_LEDGER_DATABASE_POOLING=transaction it exits 2 before connecting,
    saying where to point DATABASE_URL instead."""
    for name in [n for n in os.environ if n.startswith(("STOCK_LEDGER_", "DATABASE_URL"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("DATABASE_URL", "postgresql://u:p@127.0.0.1:1/db")  # nothing listens: connecting would fail
    monkeypatch.setenv("STOCK_LEDGER_DATABASE_POOLING", "transaction")
    assert main(command) == 2
    assert "needs a database session of its own" in capsys.readouterr().err
