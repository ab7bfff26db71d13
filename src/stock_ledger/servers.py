"""Which PostgreSQL server a session reached, and whether it can take our writes.

A multi-host DATABASE_URL (`…@host1,host2/db?target_session_attrs=read-write`) lets a reconnect land on another
server after a failover; a restore or a lagging standby promoted can also put the same address back in time. Which
server answered is logged when it changes (its address, and where the role can read them the cluster's system
identifier and timeline: a promoted standby keeps the identifier and starts a new timeline). A server in recovery,
or one that makes every transaction read-only, is refused as a transient fault: the session is dropped and the
reconnect tries the next host, until the primary answers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Final

import asyncpg

_WHERE: Final = """
SELECT host(inet_server_addr()) AS host, inet_server_port() AS port, pg_is_in_recovery() AS recovery,
       current_setting('transaction_read_only') = 'on' AS read_only
"""
# pg_control_* may be revoked from ordinary roles on managed services: then only the address is known.
_CLUSTER: Final = """
SELECT (SELECT system_identifier FROM pg_control_system()) AS system_identifier,
       (SELECT timeline_id FROM pg_control_checkpoint()) AS timeline
"""


class ReadOnlyServerError(ConnectionError):
    """The session reached a server that cannot take writes (a standby, or default_transaction_read_only): a
    connection-level fault, retried on a new session like a lost connection."""


@dataclass(frozen=True, slots=True)
class Server:
    address: str  # host:port as the server sees itself; "local" over a Unix socket
    system_identifier: int | None
    timeline: int | None

    def describe(self) -> dict[str, object]:
        return {"address": self.address, "system_identifier": self.system_identifier, "timeline": self.timeline}


async def writable_server(conn: asyncpg.Connection) -> Server:
    """The server this session reached; ReadOnlyServerError if it cannot take our writes."""
    row = await conn.fetchrow(_WHERE)
    assert row is not None  # noqa: S101 - a SELECT without FROM returns one row
    address = f"{row['host']}:{row['port']}" if row["host"] is not None else "local"
    if row["recovery"] or row["read_only"]:
        why = "is a standby (in recovery)" if row["recovery"] else "makes every transaction read-only"
        raise ReadOnlyServerError(
            f"the PostgreSQL server at {address} {why}: reconnecting until the primary answers (list every host in "
            "DATABASE_URL with target_session_attrs=read-write)")
    system_identifier = timeline = None
    with contextlib.suppress(asyncpg.InsufficientPrivilegeError):
        cluster = await conn.fetchrow(_CLUSTER)
        if cluster is not None:
            system_identifier, timeline = cluster["system_identifier"], cluster["timeline"]
    return Server(address, system_identifier, timeline)
