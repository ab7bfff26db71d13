"""The one translation of database failures into a line that says the cause and the fix, for every command.

A new install's usual mistakes (a wrong password, a database not created yet, a worker role nobody granted
stock_ledger_app, a Service name that does not resolve) all reach the operator through `explain`. The line names
what it can see (user, database, host:port; never the password) and the SQLSTATE the server sent.

`connect_database` and `migrate` translate at connect time; cli.py and the operator commands translate what
fails later (a missing privilege, an unmigrated database). Exit code 1 for all of them (cli.py's docstring).
"""

from __future__ import annotations

import getpass
import os
import re
import socket
import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final
from urllib.parse import parse_qsl, unquote, urlsplit

import asyncpg

from stock_ledger.errors import (
    ConnectionSecurityError,
    DatabaseError,
    DatabaseUnreachableError,
    StockLedgerError,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

# The commands that must run as the owner role (they delete, record gaps, move offsets or change the schema).
OWNER_COMMANDS: Final = frozenset({"migrate", "offsets set", "rejected list", "rejected show", "rejected replay",
                                   "repair", "gaps ack"})
# Read-only commands a member of stock_ledger_reader may run.
READER_COMMANDS: Final = frozenset({"stock show", "movements"})
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


def explain(exc: BaseException, url: str | None, command: str = "") -> str | None:  # noqa: PLR0911 - one branch per cause
    """One line with the cause and the fix for a failure of the database at `url`, or None if it is not one we
    know. `command` ("gaps list", "offsets set", ...) picks the advice for a missing privilege."""
    t = target(url)
    state = f"SQLSTATE {exc.sqlstate}" if isinstance(exc, asyncpg.PostgresError) else type(exc).__name__
    if isinstance(exc, ssl.SSLCertVerificationError):
        from stock_ledger.clients import _certificate_problem  # noqa: PLC0415 - clients imports this module

        return _certificate_problem("PostgreSQL", t.hosts, exc, "the URL's sslrootcert", "use sslmode=verify-ca")
    if isinstance(exc, asyncpg.InvalidPasswordError):
        return (f"PostgreSQL refused the login of user {t.user!r} at {t.hosts}: wrong password ({state}). Check the "
                "user and password in DATABASE_URL (or DATABASE_URL_FILE)")
    if isinstance(exc, asyncpg.InvalidAuthorizationSpecificationError):
        return (f"PostgreSQL refused the login of user {t.user!r} at {t.hosts}: {exc} ({state}). A role that may not "
                "log in: connect as a LOGIN role that is a member of stock_ledger_app; no pg_hba.conf entry: ask the "
                "DBA to allow this host, user and database (or use sslmode=require if only TLS is allowed)")
    if isinstance(exc, asyncpg.InvalidCatalogNameError):
        return (f"database {t.database!r} does not exist on PostgreSQL at {t.hosts} ({state}): fix the database name "
                f"in DATABASE_URL, or create it (CREATE DATABASE {identifier(t.database)} OWNER <owner role>) and run "
                "`stock-ledger migrate` with the owner's DATABASE_URL")
    if isinstance(exc, asyncpg.InsufficientPrivilegeError):
        return _privilege(exc, t, command, state)
    if isinstance(exc, asyncpg.UndefinedTableError):
        return (f"database {t.database!r} at {t.hosts} holds no ledger ({exc}; {state}): run `stock-ledger migrate` "
                "with the owner's DATABASE_URL first")
    if isinstance(exc, asyncpg.CannotConnectNowError):
        return f"PostgreSQL at {t.hosts} is starting up or shutting down ({exc}; {state}): run the command again"
    if isinstance(exc, asyncpg.RaiseError):  # a migration's own refusal (0009): its message says what to do
        return f"PostgreSQL at {t.hosts} refused: {exc} ({state})"
    return _unreachable(exc, t)


def _privilege(exc: asyncpg.InsufficientPrivilegeError, t: Target, command: str, state: str) -> str:
    role = identifier(t.user)
    if command in OWNER_COMMANDS:
        return (f"role {t.user!r} may not do what `stock-ledger {command}` does ({exc}; {state}): it runs as the owner "
                "role (the DATABASE_URL of `stock-ledger migrate`, the role that owns the ledger's tables)")
    grant = (f"GRANT stock_ledger_reader TO {role}; (read-only) or GRANT stock_ledger_app TO {role};"
             if command in READER_COMMANDS else f"GRANT stock_ledger_app TO {role};")
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


def connect_error(exc: BaseException, url: str, command: str = "") -> StockLedgerError | None:
    """A failed connect as our exception carrying `explain`'s line; None for anything else. Unreachable stays an
    OSError (DatabaseUnreachableError), so the worker retries it; the others cannot heal by retrying."""
    problem = explain(exc, url, command)
    if problem is None:
        return None
    if isinstance(exc, (ssl.SSLCertVerificationError, asyncpg.InvalidAuthorizationSpecificationError)):
        return ConnectionSecurityError(problem)
    if isinstance(exc, (OSError, asyncpg.CannotConnectNowError)):
        return DatabaseUnreachableError(problem)
    if isinstance(exc, asyncpg.InvalidCatalogNameError):
        return DatabaseError(problem)
    return None
