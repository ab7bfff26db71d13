"""What a connection pooler (PgBouncer) in front of PostgreSQL changes for our sessions, without one running:
which startup parameters are sent, how a refused one is reported, and that it is never retried. The real pooler is
in tests/integration/test_pgbouncer.py."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest

from stock_ledger import clients
from stock_ledger.clients import backend_pid, connect_database, refused_startup_parameter
from stock_ledger.config import Settings
from stock_ledger.errors import ConfigError
from stock_ledger.retry import transient_cause

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
        from stock_ledger import cli  # noqa: PLC0415

        session = _FakeSession()
        seen: dict[str, Any] = {}

        async def connect(_url: str, **kwargs: Any) -> _FakeSession:
            seen.update(kwargs)
            return session

        monkeypatch.setattr(asyncpg, "connect", connect)
        conn = await cli._read_only(Settings(database_url="postgresql://u:p@127.0.0.1:6432/db"))
        assert seen["server_settings"] == {"application_name": "stock-ledger-cli"}
        (_, (names, values)), = session.queries
        assert dict(zip(names, values, strict=True)) == {"default_transaction_read_only": "on", "jit": "off"}
        clients._backend_pids.pop(conn)  # type: ignore[call-overload]
