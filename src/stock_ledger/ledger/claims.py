"""Claiming partitions in the database: the epoch that fences every other writer, the position the claim starts
from, moving past a hole in the log, and the zombie sessions that keep a claim waiting.

A claim bumps each partition's epoch in `consumer_offsets` (offsets.claim), guarded by Kafka's group generation
so a claim delayed across a rebalance takes nothing. If a zombie's batch transaction holds a row (a frozen or lost
former owner, even one frozen inside COPY, where the server's own timeouts do not reach it), the claim waits for it
and after a while terminates that session (`Unblock`): same service, same group, so the claim is the owner's.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, TypeVar

import structlog

from stock_ledger.clients.database import in_transaction
from stock_ledger.errors import LedgerIntegrityError
from stock_ledger.ledger import movements, offsets

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterable, Mapping

    import asyncpg

    from stock_ledger.faults import Faults
    from stock_ledger.gaps import Gap

log = structlog.get_logger(__name__)
_T = TypeVar("_T")

# Sessions of this service and group that block our claim: zombies by definition, since the claim is the owner's.
# Two statements on purpose: in one, PostgreSQL may call pg_terminate_backend before the filters have run.
_BLOCKERS: Final = """
SELECT pid FROM pg_stat_activity
 WHERE pid = ANY(pg_blocking_pids($1)) AND application_name = $2 AND datname = current_database()
"""
_TERMINATE: Final = "SELECT pid FROM unnest($1::int[]) AS pid WHERE pg_terminate_backend(pid)"


@dataclass(frozen=True, slots=True)
class Unblock:
    """Terminates the sessions of this service and group that keep a claim waiting (zombies: frozen, even inside
    COPY, where the server's own timeouts do not reach them), once it has waited `after` seconds."""

    after: float
    connect: Callable[[], Awaitable[asyncpg.Connection]]
    application_name: str

    async def run(self, statement: Awaitable[_T], waiting_pid: int) -> _T:
        """`statement`, run by the backend `waiting_pid` (in_transaction: the backend's own pid, asked of the
        server, since behind PgBouncer get_server_pid() is made up and, in transaction mode, the backend is the
        one this transaction got)."""
        task = asyncio.ensure_future(statement)
        try:
            done, _ = await asyncio.wait({task}, timeout=self.after)
            if not done:
                await self._terminate_blockers(waiting_pid)
            return await task
        finally:
            if not task.done():
                task.cancel()

    async def _terminate_blockers(self, waiting_pid: int) -> None:
        try:
            side = await self.connect()
            try:
                zombies = [r[0] for r in await side.fetch(_BLOCKERS, waiting_pid, self.application_name)]
                pids = [r[0] for r in await side.fetch(_TERMINATE, zombies)] if zombies else []
            finally:
                await side.close(timeout=2)
        except Exception as exc:
            # The claim still waits for lock_timeout and is retried; nothing depends on this succeeding.
            log.warning("claim.unblock_failed", error=f"{type(exc).__name__}: {exc}")
            return
        if pids:
            log.warning("claim.zombies_terminated", pids=pids,
                        detail="sessions of this group held our partitions' rows: a frozen or lost former owner")


@dataclass(frozen=True, slots=True)
class Claim:
    partition: int
    epoch: int
    next_offset: int | None  # None: nothing stored, and no reset position given (STOCK_LEDGER_AUTO_OFFSET_RESET=none)
    reset: bool = False  # next_offset is the reset policy's position, stored by this claim
    # Nothing was stored, but the ledger holds rows of the partition: next_offset is where they end (+1), stored by
    # this claim, not the reset policy's position.
    resumed: bool = False


class Claims:
    """A group's claims, on a connection the caller owns (and reconnects)."""

    def __init__(self, group_id: str, faults: Faults) -> None:
        self.group_id = group_id
        self.faults = faults

    async def claim(  # noqa: PLR0913 - the claim's whole input, as stored beside it
        self, conn: asyncpg.Connection, topic: str, partitions: Iterable[int], generation: int | None,
        member_id: str | None, *, force: bool = False, unblock: Unblock | None = None,
        reset: Mapping[int, int] | None = None,
    ) -> list[Claim]:
        """Bump each partition's epoch and return the offset to seek to, in one transaction.

        Partitions whose stored generation is newer than ours (or known, where ours is not) are not taken (not
        returned): this claim is stale. If a zombie's batch transaction holds a row, this waits for it; after
        `unblock.after` seconds the zombie's session is terminated, then this reads the offset the zombie committed,
        never a stale one. A partition with nothing stored gets `reset[partition]` stored, in the same transaction.
        Refuses a database that holds another group's ledger.
        """
        async with conn.transaction():
            waiting_pid = await in_transaction(conn)
            other = await offsets.other_group(conn, self.group_id)
            if other is not None:
                raise LedgerIntegrityError(
                    f"this database already holds the ledger of consumer group {other!r}, not {self.group_id!r}: "
                    "movement_id and Kafka coordinates are unique across the ledger, so two groups would collide. "
                    "Use one database per group (or set STOCK_LEDGER_GROUP_ID to the group that owns it)"
                )
            pending = offsets.claim(conn, self.group_id, topic, list(partitions), generation=generation,
                                    member_id=member_id, force=force)
            rows = await (pending if unblock is None else unblock.run(pending, waiting_pid))
            claims = [Claim(r["partition"], r["epoch"], r["next_offset"]) for r in rows]
            claims = await self._starts(conn, topic, claims, reset or {})
        return sorted(claims, key=lambda c: c.partition)

    async def _starts(self, conn: asyncpg.Connection, topic: str, claims: list[Claim],
                      reset: Mapping[int, int]) -> list[Claim]:
        """Where nothing is stored: resume where the ledger's own rows of the partition end, or, if it holds none,
        start at the reset policy's position; either is stored by the claim (in its transaction).

        Nothing stored but rows present means the partition was claimed before and its consumer_offsets row was lost
        (a restore or failover to a point before its first claim, a row deleted by hand): the reset policy would
        then skip what lies between (`latest`) or silently step over what retention deleted since (`earliest`)."""
        unset = [c.partition for c in claims if c.next_offset is None]
        if not unset:
            return claims
        ledger = {p: f for p, f in (await movements.floors(conn, topic, unset)).items() if f > 0}
        starts = {p: start for p in unset if (start := ledger.get(p, reset.get(p))) is not None}
        if starts:
            await offsets.record_start(conn, self.group_id, topic, starts)
        return [c if c.partition not in starts else
                Claim(c.partition, c.epoch, starts[c.partition], reset=c.partition not in ledger,
                      resumed=c.partition in ledger) for c in claims]

    async def skip_gap(self, conn: asyncpg.Connection, topic: str, gap: Gap, epoch: int) -> int | None:
        """Move the partition's offset past a hole and record the hole, in one transaction; the id of the
        ledger_gaps row, or None if the offset moved meanwhile (fenced: a newer claim decides)."""
        async with conn.transaction():
            await in_transaction(conn)
            if not await offsets.skip(conn, self.group_id, topic, gap.partition, epoch=epoch,
                                      from_offset=gap.first_offset, to_offset=gap.last_offset + 1):
                return None
            return await offsets.record_gap(conn, self.group_id, topic, gap.partition, first=gap.first_offset,
                                            last=gap.last_offset, reason=gap.reason)
