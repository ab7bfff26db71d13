"""THE batch transaction: the whole guarantee, in `Ledger.apply`.

One PostgreSQL transaction per batch that
  1. advances each partition's offset with a compare-and-set on the epoch this worker claimed (fencing) and on the
     stored offset (no replay, no regression), locking those rows first, in partition order (offsets.advance);
  2. records the offsets the batch read past that held no data record (transaction markers, aborted records), only
     where there are some (offsets.record_non_records): once retention deleted them, only the ledger knows;
  3. quarantines movements whose movement_id is already in the ledger (upstream resends);
  4. COPYs the movements, with the unique constraint on Kafka coordinates as the backstop;
  5. writes the quarantine rows (bad input keeps its raw bytes and a reason);
  6. adds each (warehouse, sku) delta to stock_levels, in key order;
and then COMMITs. Either all of it is durable or none of it is. Kafka is told afterwards, advisorily.

Step 3 costs nothing on the common path: the COPY itself finds a known movement_id (UNIQUE (movement_id) raises),
and only then is the transaction rolled back and redone with the lookup. A row the database refuses (a value the
parser let pass) rolls the batch back too; it is redone with each COPY bisected under SAVEPOINTs, the refused rows
quarantined as `database_rejected` (movements.copy_isolating).

A record whose coordinates are already in the ledger although the offset guard let the batch through (something
outside the guard wrote at or above the stored offset: a repair racing an `offsets set` before they took turns, a
tool, a restore that kept rows and lost offsets) makes the COPY hit the coordinates' unique constraint. That must
never stop the partition for good (the same batch would fail after every restart): the redo's lookup also finds
the coordinates the ledger holds and leaves those records out, as found, writing the others. Nothing is skipped
and nothing written twice; `Outcome.present` names them, and the worker logs an error and counts them.
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import asyncpg

from stock_ledger.clients.database import in_transaction
from stock_ledger.errors import CoordinateConflictError, FencedError, Mismatch, OffsetMismatchError
from stock_ledger.ledger import movements as rows
from stock_ledger.ledger import offsets, pgtime
from stock_ledger.ledger.batch import M_ID, R_CODE
from stock_ledger.ledger.segments import Segments

if TYPE_CHECKING:
    from stock_ledger.faults import Faults
    from stock_ledger.ledger.batch import Batch


@dataclass(frozen=True, slots=True)
class Outcome:
    applied: int
    rejected: Counter[str]
    already_applied: bool = False
    # Splits of a chunk the database refused (0 unless a record got past the parser that PostgreSQL refuses).
    bisections: int = 0
    # partition -> offsets of this batch the ledger already held (written outside the offset guard): left as found.
    present: dict[int, list[int]] = field(default_factory=dict)


# Redos of one batch that look up the coordinates already in the ledger: more conflicts than this mean another
# writer keeps writing this batch's coordinates while it runs.
_LOOKUPS = 3


class _AlreadyApplied(Exception):  # a control-flow signal that rolls back, not an error
    pass


@dataclass(frozen=True, slots=True)
class _Written:
    applied: int
    rejects: list[tuple[Any, ...]]
    bisections: int
    present: set[tuple[int, int]]


class Ledger:
    """Batch transactions on one asyncpg connection (the caller owns reconnects)."""

    def __init__(self, group_id: str, faults: Faults) -> None:
        self.group_id = group_id
        self.faults = faults
        # Sessions that take batch rows' timestamps in their wire form (pgtime.install, once per session).
        self._wire_sessions: weakref.WeakSet[asyncpg.Connection] = weakref.WeakSet()
        self.segments = Segments()

    async def apply(self, conn: asyncpg.Connection, batch: Batch) -> Outcome:
        """THE batch transaction. Raises FencedError, OffsetMismatchError or CoordinateConflictError."""
        if conn not in self._wire_sessions:
            await pgtime.install(conn)
            self._wire_sessions.add(conn)
        through = {x.partition: x.next_offset for x in batch.slices}
        await self.segments.ensure(conn, through)  # before the transaction: segments ahead of its rows
        try:
            return await self._apply(conn, batch)
        except asyncpg.CheckViolationError as exc:
            if not rows.no_segment(exc):
                raise
            # A segment this session counted on is gone (a restore, someone's DDL): made again, tried again.
            await self.segments.ensure(conn, through, force=True)
            return await self._apply(conn, batch)

    async def _apply(self, conn: asyncpg.Connection, batch: Batch) -> Outcome:
        look_up = isolate = False
        lookups = 0
        try:
            while True:
                try:
                    written = await self._transaction(conn, batch, look_up=look_up, isolate=isolate)
                    break
                except Exception as exc:
                    if (isinstance(exc, asyncpg.UniqueViolationError) and lookups < _LOOKUPS and (
                            rows.is_coordinates_key(exc.constraint_name)
                            or (exc.constraint_name == rows.MOVEMENT_ID_KEY and not look_up))):
                        # An upstream resend, or coordinates written outside the guard (again, if written between
                        # the lookup and the COPY): rolled back; redo it, leaving out the coordinates already
                        # present and quarantining the known movement_ids.
                        look_up, lookups = True, lookups + 1
                    elif not isolate and rows.refusal(exc) is not None:
                        # The database refused a value: rolled back; redo it, isolating the refused records.
                        isolate = True
                    else:
                        raise
        except _AlreadyApplied:
            return Outcome(0, Counter(), already_applied=True)
        except asyncpg.UniqueViolationError as exc:
            if rows.is_coordinates_key(exc.constraint_name):
                raise CoordinateConflictError(
                    f"{exc.constraint_name}: records of this batch kept appearing in the ledger, written by someone "
                    f"else while the batch ran, after {_LOOKUPS} lookups; stop the other writer (see "
                    "`stock-ledger verify`)"
                ) from exc
            raise  # movement_id raced in from another partition's batch: retriable, the retry quarantines it
        self.faults.reached("after_commit")
        present: dict[int, list[int]] = {}
        for partition, offset in sorted(written.present):
            present.setdefault(partition, []).append(offset)
        return Outcome(written.applied, Counter(r[R_CODE] for r in written.rejects), bisections=written.bisections,
                       present=present)

    async def _transaction(
        self, conn: asyncpg.Connection, batch: Batch, *, look_up: bool, isolate: bool,
    ) -> _Written:
        async with conn.transaction():
            await in_transaction(conn)  # behind a transaction pooler, this transaction's timeouts: else a no-op
            await self._advance_offsets(conn, batch)
            # Only where a slice read past offsets that held no data record: nothing on a non-transactional topic.
            await offsets.record_non_records(conn, batch.topic, batch.slices)
            present: set[tuple[int, int]] = set()
            if look_up:
                present = await rows.present_coordinates(conn, batch)
                batch = rows.without_present(batch, present)
            movements, rejects = batch.movements, batch.rejects
            if look_up and movements:
                known = await rows.known_movement_ids(conn, [m[M_ID] for m in movements])
                movements, rejects = rows.without_known(batch, known)
            bisections = 0
            if isolate:
                movements, rejects, bisections = await rows.copy_isolating(conn, batch, movements, rejects)
            else:
                if movements:
                    await rows.copy_movements(conn, self.faults.midway("during_copy", movements)
                                              if self.faults.armed("during_copy") else movements)
                if rejects:
                    await rows.copy_rejects(conn, rejects)
            self.faults.reached("after_rows")
            # The deltas summed at build time hold for the batch's own rows; a lookup or an isolation changed them.
            await rows.add_levels(conn, movements, batch.levels if movements is batch.movements else None)
            self.faults.reached("before_commit")
        return _Written(len(movements), rejects, bisections, present)

    async def _advance_offsets(self, conn: asyncpg.Connection, batch: Batch) -> None:
        s = batch.slices
        moved = await offsets.advance(conn, self.group_id, batch.topic, s)
        if len(moved) == len(s):
            return
        failed = [x for x in s if x.partition not in moved]
        current = await offsets.current(conn, self.group_id, batch.topic, [x.partition for x in failed])
        # Epochs only grow: a newer one is another worker's claim. An older one, or no row at all, is the database
        # gone back to before our claim (a restore, a failover): nobody fenced us, the ledger lost what we wrote.
        fenced = {x.partition: (x.epoch, current[x.partition][0]) for x in failed
                  if x.partition in current and current[x.partition][0] > x.epoch}
        if fenced:
            raise FencedError(fenced)
        # Same epoch, offset already at this batch's end on every partition: an earlier attempt of this very batch
        # committed (the COMMIT's reply was lost): nothing to do.
        if not moved and all(current.get(x.partition) == (x.epoch, x.next_offset) for x in failed):
            raise _AlreadyApplied
        raise OffsetMismatchError({x.partition: Mismatch(x.expected, *current.get(x.partition, (None, None)))
                                   for x in failed})
