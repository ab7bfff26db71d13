"""dberrors.explain: each database failure a new install meets becomes one line with the cause and the fix, naming
what DATABASE_URL points at and never its password. (The same lines through the real CLI and server:
tests/integration/test_database_errors.py.)"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import asyncpg
import pytest

from stock_ledger.clients.dberrors import connect_error, explain, target
from stock_ledger.errors import ConnectionSecurityError, DatabaseError, DatabaseUnreachableError
from stock_ledger.worker.retry import transient_cause

URL = "postgresql://app_worker:S3cret-pw@db.internal:6432/ledger"


class TestExplain:
    """The cause and the fix per failure, with user, database and host:port from the URL."""

    def test_where_comes_from_the_url_and_the_defaults(self) -> None:
        t = target(URL)
        assert (t.hosts, t.user, t.database) == ("db.internal:6432", "app_worker", "ledger")
        assert target("postgresql://u@h/d").hosts == "h:5432"

    def test_a_missing_grant_names_the_exact_grant_to_run(self) -> None:
        line = explain(asyncpg.InsufficientPrivilegeError("permission denied for table ledger_gaps"), URL, "gaps list")
        assert line is not None
        assert "GRANT stock_ledger_app TO app_worker;" in line
        assert "permission denied for table ledger_gaps" in line

    def test_an_owner_command_says_to_run_as_the_owner_instead(self) -> None:
        line = explain(asyncpg.InsufficientPrivilegeError("permission denied"), URL, "offsets set", "owner")
        assert line is not None
        assert "runs as the owner role" in line
        assert "GRANT" not in line

    def test_a_role_name_that_needs_quoting_is_quoted(self) -> None:
        line = explain(asyncpg.InsufficientPrivilegeError("x"), "postgresql://Ledger-Worker:p@h/d", "run")
        assert line is not None
        assert 'GRANT stock_ledger_app TO "Ledger-Worker";' in line

    @pytest.mark.parametrize(("exc", "says"), [
        (asyncpg.InvalidPasswordError("password authentication failed"), "wrong password"),
        (asyncpg.InvalidCatalogNameError('database "ledger" does not exist'), "'ledger' does not exist"),
        (asyncpg.UndefinedTableError('relation "ledger_gaps" does not exist'), "run `stock-ledger migrate`"),
        (ConnectionRefusedError(111, "Connection refused"), "db.internal:6432: connection refused"),
        (socket.gaierror(-2, "Name or service not known"), "db.internal:6432: the host name does not resolve"),
        (TimeoutError(), "db.internal:6432: no answer"),
    ])
    def test_each_cause_and_never_the_password(self, exc: BaseException, says: str) -> None:
        line = explain(exc, URL, "verify")
        assert line is not None
        assert says in line
        assert "S3cret" not in line

    def test_unreachable_stays_transient_for_the_worker_and_the_rest_do_not(self) -> None:
        """The worker retries an unreachable server until its deadline; a wrong password or database never heals."""
        unreachable = connect_error(ConnectionRefusedError(111, "refused"), URL)
        assert isinstance(unreachable, DatabaseUnreachableError)
        assert transient_cause(unreachable) == "database"
        wrong = connect_error(asyncpg.InvalidPasswordError("x"), URL)
        assert isinstance(wrong, ConnectionSecurityError)
        assert transient_cause(wrong) is None
        unknown = connect_error(asyncpg.InvalidCatalogNameError("x"), URL)
        assert isinstance(unknown, DatabaseError)
        assert transient_cause(unknown) is None
        assert connect_error(ValueError("not ours"), URL) is None


def test_no_color_turns_the_console_log_colours_off() -> None:
    """STOCK_LEDGER_LOG_FORMAT=console colours its lines; NO_COLOR=1 (https://no-color.org) leaves no escape."""
    def fatal_line(**env: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "stock_ledger", "gaps", "list"], capture_output=True, text=True, timeout=60,
            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
                 "STOCK_LEDGER_LOG_FORMAT": "console",
                 "DATABASE_URL": "postgresql://u:p@127.0.0.1:1/d", **env}, check=False)
        assert done.returncode == 1, done.stdout + done.stderr
        return done.stdout + done.stderr

    assert "\x1b[" in fatal_line()
    plain = fatal_line(NO_COLOR="1")
    assert "\x1b" not in plain
    assert "cannot reach PostgreSQL at 127.0.0.1:1: connection refused" in plain
