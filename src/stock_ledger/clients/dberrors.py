"""The one translation of database failures into a line that says the cause and the fix, for every command.

A new install's usual mistakes (a wrong password, a database not created yet, a worker role nobody granted
stock_ledger_app, a Service name that does not resolve) all reach the operator through `explain`. The line names
what it can see (user, database, host:port; never the password) and the SQLSTATE the server sent.

The sessions (clients/database.py) translate at connect time; the CLI translates what fails later (a missing
privilege, an unmigrated database). Exit code 1 for all of them (cli/main.py's docstring).
"""

from __future__ import annotations

import getpass
import os
import re
import socket
import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal
from urllib.parse import parse_qsl, unquote, urlsplit

import asyncpg

from stock_ledger.clients.tls import certificate_problem
from stock_ledger.errors import (
    ConnectionSecurityError,
    DatabaseError,
    DatabaseUnreachableError,
    StockLedgerError,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

# Whose DATABASE_URL a command needs (the CLI declares it per command, cli/commands.py): the owner role (it deletes,
# records gaps, moves offsets or changes the schema), a member of the ledger's reader role (read-only commands), or
# of its app role (the worker, and what it may read): stock_ledger_reader and stock_ledger_app unless
# STOCK_LEDGER_READER_ROLE / STOCK_LEDGER_APP_ROLE name others.
RunsAs = Literal["owner", "reader", "worker"]
_PLAIN_IDENTIFIER: Final = re.compile(r"^[a-z_][a-z0-9_$]*$")


@dataclass(frozen=True, slots=True)
class Target:
    """Where DATABASE_URL points, as asyncpg reads it (URL, then the PG* variables, then its defaults)."""

    hosts: str
    user: str
    database: str


def target(url: str | None, environ: Mapping[str, str] = os.environ) -> Target:
    parts = urlsplit(url or "")
    query = dict(parse_qsl(parts.query))
    hosts = parts.netloc.rpartition("@")[2] or query.get("host") or environ.get("PGHOST") or "localhost"
    if ":" not in hosts.rsplit("]", 1)[-1] and "," not in hosts:
        hosts += f":{query.get('port') or environ.get('PGPORT') or 5432}"
    user = unquote(parts.netloc.rpartition("@")[0].partition(":")[0]) if "@" in parts.netloc else ""
    user = user or query.get("user") or environ.get("PGUSER") or getpass.getuser()
    database = unquote(parts.path.lstrip("/")) or query.get("dbname") or environ.get("PGDATABASE") or user
    return Target(hosts, user, database)


def identifier(name: str) -> str:
    """`name` as SQL would need it written in a GRANT."""
    return name if _PLAIN_IDENTIFIER.match(name) else '"' + name.replace('"', '""') + '"'


def explain(  # noqa: PLR0911, PLR0913 - one branch per cause; the roles a missing privilege names
    exc: BaseException, url: str | None, command: str = "", runs_as: RunsAs = "worker", *,
    app_role: str = "stock_ledger_app", reader_role: str = "stock_ledger_reader",
) -> str | None:
    """One line with the cause and the fix for a failure of the database at `url`, or None if it is not one we
    know. `command` ("gaps list", "offsets set", ...) and the role it runs as pick the advice for a missing
    privilege, which names the ledger's roles (STOCK_LEDGER_APP_ROLE, STOCK_LEDGER_READER_ROLE)."""
    t = target(url)
    state = f"SQLSTATE {exc.sqlstate}" if isinstance(exc, asyncpg.PostgresError) else type(exc).__name__
    if isinstance(exc, ssl.SSLCertVerificationError):
        return certificate_problem("PostgreSQL", t.hosts, exc, "the URL's sslrootcert", "use sslmode=verify-ca")
    if isinstance(exc, asyncpg.InvalidPasswordError):
        return (f"PostgreSQL refused the login of user {t.user!r} at {t.hosts}: wrong password ({state}). Check the "
                "user and password in DATABASE_URL (or DATABASE_URL_FILE)")
    if isinstance(exc, asyncpg.InvalidAuthorizationSpecificationError):
        return (f"PostgreSQL refused the login of user {t.user!r} at {t.hosts}: {exc} ({state}). A role that may not "
                "log in: connect as a LOGIN role that is a member of the ledger's app role (stock_ledger_app unless "
                "STOCK_LEDGER_APP_ROLE names another); no pg_hba.conf entry: ask the "
                "DBA to allow this host, user and database (or use sslmode=require if only TLS is allowed)")
    if isinstance(exc, asyncpg.InvalidCatalogNameError):
        return (f"database {t.database!r} does not exist on PostgreSQL at {t.hosts} ({state}): fix the database name "
                f"in DATABASE_URL, or create it (CREATE DATABASE {identifier(t.database)} OWNER <owner role>) and run "
                "`stock-ledger migrate` with the owner's DATABASE_URL")
    if isinstance(exc, asyncpg.InsufficientPrivilegeError):
        return _privilege(exc, t, command, runs_as, state, roles=(app_role, reader_role))
    if isinstance(exc, asyncpg.UndefinedTableError):
        return (f"database {t.database!r} at {t.hosts} holds no ledger ({exc}; {state}): run `stock-ledger migrate` "
                "with the owner's DATABASE_URL first")
    if isinstance(exc, asyncpg.CannotConnectNowError):
        return f"PostgreSQL at {t.hosts} is starting up or shutting down ({exc}; {state}): run the command again"
    if isinstance(exc, asyncpg.RaiseError):  # a migration's own refusal (0009): its message says what to do
        return f"PostgreSQL at {t.hosts} refused: {exc} ({state})"
    return _unreachable(exc, t)


def _privilege(exc: asyncpg.InsufficientPrivilegeError, t: Target, command: str, runs_as: RunsAs,  # noqa: PLR0913
               state: str, *, roles: tuple[str, str]) -> str:
    role = identifier(t.user)
    app, reader = roles
    if runs_as == "owner":
        return (f"role {t.user!r} may not do what `stock-ledger {command}` does ({exc}; {state}): it runs as the owner "
                "role (the DATABASE_URL of `stock-ledger migrate`, the role that owns the ledger's tables)")
    grant = (f"GRANT {reader} TO {role}; (read-only) or GRANT {app} TO {role};"
             if runs_as == "reader" else f"GRANT {app} TO {role};")
    return (f"role {t.user!r} may not read the ledger ({exc}; {state}): as the owner, run  {grant}  (migrations grant "
            "that role exactly what the worker needs; if it is already a member, run `stock-ledger migrate` with "
            "the owner's DATABASE_URL)")


def _unreachable(exc: BaseException, t: Target) -> str | None:
    fix = "the server is down, or DATABASE_URL's host or port is wrong"
    if isinstance(exc, socket.gaierror):
        return (f"cannot reach PostgreSQL at {t.hosts}: the host name does not resolve ({exc.strerror}): "
                "DATABASE_URL's host is wrong, or the name (a Kubernetes Service) does not exist yet")
    if isinstance(exc, ConnectionRefusedError):
        return f"cannot reach PostgreSQL at {t.hosts}: connection refused: {fix}"
    if isinstance(exc, TimeoutError):
        return f"cannot reach PostgreSQL at {t.hosts}: no answer within the connect timeout: {fix} (or a firewall)"
    if isinstance(exc, (asyncpg.ConnectionDoesNotExistError, asyncpg.PostgresConnectionError)):
        return f"lost the connection to PostgreSQL at {t.hosts} ({type(exc).__name__}: {exc}): run the command again"
    if isinstance(exc, OSError):
        return f"cannot reach PostgreSQL at {t.hosts} ({type(exc).__name__}: {exc}): {fix}"
    return None


def connect_error(exc: BaseException, url: str) -> StockLedgerError | None:
    """A failed connect as our exception carrying `explain`'s line; None for anything else. Unreachable stays an
    OSError (DatabaseUnreachableError), so the worker retries it; the others cannot heal by retrying."""
    problem = explain(exc, url)
    if problem is None:
        return None
    if isinstance(exc, (ssl.SSLCertVerificationError, asyncpg.InvalidAuthorizationSpecificationError)):
        return ConnectionSecurityError(problem)
    if isinstance(exc, (OSError, asyncpg.CannotConnectNowError)):
        return DatabaseUnreachableError(problem)
    if isinstance(exc, asyncpg.InvalidCatalogNameError):
        return DatabaseError(problem)
    return None
