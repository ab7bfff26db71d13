"""The ledger's writes: partition claims, and THE batch transaction.

The whole guarantee is `Ledger.apply`: one PostgreSQL transaction per batch that
  1. advances each partition's offset with a compare-and-set on the epoch this worker claimed (fencing) and on the
     stored offset (no replay, no regression), locking those rows first, in partition order;
  2. quarantines movements whose movement_id is already in the ledger (upstream resends);
  3. COPYs the movements, with the unique constraint on Kafka coordinates as the backstop;
  4. writes the quarantine rows (bad input keeps its raw bytes and a reason);
  5. adds each (warehouse, sku) delta to stock_levels, in key order;
and then COMMITs. Either all of it is durable or none of it is. Kafka is told afterwards, advisorily.

The parser validates every value against what PostgreSQL can hold, so the database refusing a row is a bug of ours or
a database that differs (an encoding, a constraint someone added). Even then one record must not stop every
partition: a batch refused for a data error is redone with each COPY under a SAVEPOINT, bisecting a refused chunk
until the refused records are isolated; they are quarantined as `database_rejected` with the server's message and the
rest commits in the same one transaction (see `_copy_isolating`).

Step 2 costs nothing on the common path: the COPY itself finds a known movement_id (UNIQUE (movement_id) raises),
and only then is the transaction rolled back and redone with the lookup. A lookup on every batch cost a round trip
and 5,000 index probes, and its cached generic plan could turn into a sequential scan (see `_KNOWN_IDS`).
"""

from __future__ import annotations

import asyncio
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, TypeVar

import asyncpg
import structlog

from stock_ledger import pgtime
from stock_ledger.batch import (
    M_ID,
    M_OFFSET,
    M_PARTITION,
    MOVEMENT_COLUMNS,
    R_CODE,
    R_KEY,
    R_OFFSET,
    R_PARTITION,
    R_REASON,
    R_TOPIC,
    R_VALUE,
    REJECT_COLUMNS,
    Batch,
    Levels,
    level_deltas,
    quarantined,
)
from stock_ledger.clients import backend_pid
from stock_ledger.domain import RejectCode, pg_text
from stock_ledger.errors import (
    CoordinateConflictError,
    FencedError,
    LedgerIntegrityError,
    Mismatch,
    OffsetMismatchError,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence

    from stock_ledger.faults import Faults
    from stock_ledger.gaps import Gap

log = structlog.get_logger(__name__)
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Unblock:
    """Terminates the sessions of this service and group that keep a claim waiting (zombies: frozen, even inside
    COPY, where the server's own timeouts do not reach them), once it has waited `after` seconds."""

    after: float
    connect: Callable[[], Awaitable[asyncpg.Connection]]
    application_name: str

    async def run(self, conn: asyncpg.Connection, statement: Awaitable[_T]) -> _T:
        # The backend's own pid (behind PgBouncer get_server_pid() is made up), known before the session is busy.
        waiting_pid = await backend_pid(conn)
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


@dataclass(frozen=True, slots=True)
class Outcome:
    applied: int
    rejected: Counter[str]
    already_applied: bool = False
    # Splits of a chunk the database refused (0 unless a record got past the parser that PostgreSQL refuses).
    bisections: int = 0


# The claim takes a partition only from a claim of the same or an older Kafka generation: a claim that started
# before a rebalance and reaches the database after it (it waited on a lock, a connect, a frozen process) takes
# nothing, so it can never fence the rightful newer owner. An unknown generation (NULL: aiokafka resets it to -1 on
# UnknownMemberId / IllegalGeneration until the member rejoins) takes only what no known generation holds. $6 forces
# it (a group whose generation restarted), and only with a known generation.
_CLAIM: Final = """
INSERT INTO consumer_offsets AS o (group_id, topic, partition, epoch, generation, member_id, claimed_at)
SELECT $1, $2, p, 1, $4, $5, now() FROM unnest($3::int[]) AS p ORDER BY p
ON CONFLICT (group_id, topic, partition) DO UPDATE
    SET epoch = o.epoch + 1, generation = EXCLUDED.generation, member_id = EXCLUDED.member_id, claimed_at = now()
    WHERE ($6 AND EXCLUDED.generation IS NOT NULL) OR o.generation IS NULL OR o.generation <= EXCLUDED.generation
RETURNING partition, epoch, next_offset
"""
# Where nothing was stored yet, the reset policy's position is stored by the claim itself: the ledger then always
# knows where it started, so a later hole below it (retention outran a worker that never committed) is found.
_RECORD_START: Final = """
UPDATE consumer_offsets AS o SET next_offset = r.start, updated_at = now()
  FROM unnest($3::int[], $4::bigint[]) AS r(partition, start)
 WHERE o.group_id = $1 AND o.topic = $2 AND o.partition = r.partition AND o.next_offset IS NULL
RETURNING o.partition
"""

_OTHER_GROUP: Final = "SELECT group_id FROM consumer_offsets WHERE group_id <> $1 LIMIT 1"

# The exact guard: the row moves only if we still hold its epoch and it stands exactly where this worker believes
# the ledger stands (`expected`). The batch's first record may lie past that (transaction markers, aborted records),
# so the stored value is compared with `expected`, never with the first record: a stored offset behind it means
# the database went back in time (a failover to a standby that lost commits, a restore), one ahead of it that
# someone else moved it; either way the batch is never written past it. Rows are locked first, in partition order,
# as claims lock them, so a batch and a claim can never deadlock.
_ADVANCE: Final = """
WITH locked AS (
    SELECT partition FROM consumer_offsets
     WHERE group_id = $1 AND topic = $2 AND partition = ANY($3::int[])
     ORDER BY partition FOR UPDATE
)
UPDATE consumer_offsets AS o
   SET next_offset = b.next_offset, updated_at = now()
  FROM unnest($3::int[], $4::bigint[], $5::bigint[], $6::bigint[]) AS b(partition, epoch, expected, next_offset)
  JOIN locked USING (partition)
 WHERE o.group_id = $1 AND o.topic = $2 AND o.partition = b.partition
   AND o.epoch = b.epoch
   AND o.next_offset = b.expected
RETURNING o.partition
"""

# Moving past a hole in the log (STOCK_LEDGER_ON_GAP=record): the offset moves only under our epoch and only from
# where it stood, and the skipped range is written in the same transaction.
_SKIP: Final = """
UPDATE consumer_offsets SET next_offset = $6, updated_at = now()
 WHERE group_id = $1 AND topic = $2 AND partition = $3 AND epoch = $4 AND next_offset = $5
RETURNING partition
"""
_RECORD_GAP: Final = """
INSERT INTO ledger_gaps (group_id, topic, partition, first_offset, last_offset, reason)
VALUES ($1, $2, $3, $4, $5, $6) RETURNING id
"""

# Sessions of this service and group that block our claim: zombies by definition, since the claim is the owner's.
# Two statements on purpose: in one, PostgreSQL may call pg_terminate_backend before the filters have run.
_BLOCKERS: Final = """
SELECT pid FROM pg_stat_activity
 WHERE pid = ANY(pg_blocking_pids($1)) AND application_name = $2 AND datname = current_database()
"""
_TERMINATE: Final = "SELECT pid FROM unnest($1::int[]) AS pid WHERE pg_terminate_backend(pid)"

_STORED: Final = "SELECT partition, next_offset FROM consumer_offsets WHERE group_id = $1 AND topic = $2"


async def stored_offsets(db: asyncpg.Connection | asyncpg.Pool, group_id: str, topic: str) -> dict[int, int | None]:
    """The source of truth for positions: partition -> next offset to apply (None: claimed, nothing applied)."""
    return {r[0]: r[1] for r in await db.fetch(_STORED, group_id, topic)}


CURRENT: Final = """
SELECT partition, epoch, next_offset FROM consumer_offsets
 WHERE group_id = $1 AND topic = $2 AND partition = ANY($3::int[])
"""

# One index probe per id, whatever the statistics say. The plain `movement_id = ANY($1)` let PostgreSQL cache a
# generic plan made while the table was small: a sequential scan comparing every row with every id of the array,
# seconds per batch after a few hundred thousand rows (measured by scripts/bench.py's latency run).
_KNOWN_IDS: Final = """
SELECT k.movement_id FROM unnest($1::uuid[]) AS u(id)
CROSS JOIN LATERAL (SELECT m.movement_id FROM stock_movements AS m WHERE m.movement_id = u.id LIMIT 1) AS k
"""
_MOVEMENT_ID_KEY: Final = "stock_movements_movement_id_key"
_COORDINATE_KEYS: Final = frozenset({"stock_movements_coordinates_key", "rejected_movements_coordinates_key"})
# Our own uniqueness backstops: they mean a resend or a regression, handled above, never a bad value.
_BACKSTOPS: Final = _COORDINATE_KEYS | {_MOVEMENT_ID_KEY}

# went_negative_at: set when a level goes below zero, kept while it stays there, cleared when it recovers
# (migration 0004; its CHECK refuses a row where the two disagree).
_ADD_LEVELS: Final = """
INSERT INTO stock_levels AS l (warehouse_id, sku, on_hand, went_negative_at)
SELECT w, s, d, CASE WHEN d < 0 THEN now() END
  FROM unnest($1::text[], $2::text[], $3::bigint[]) AS t(w, s, d) ORDER BY w, s
ON CONFLICT (warehouse_id, sku) DO UPDATE SET on_hand = l.on_hand + EXCLUDED.on_hand, updated_at = now(),
    went_negative_at = CASE WHEN l.on_hand + EXCLUDED.on_hand < 0 THEN coalesce(l.went_negative_at, now()) END
"""


class _AlreadyApplied(Exception):  # a control-flow signal that rolls back, not an error
    pass


@dataclass(frozen=True, slots=True)
class _Written:
    applied: int
    rejects: list[tuple[Any, ...]]
    bisections: int


class Ledger:
    """Claims and batch transactions on one asyncpg connection (the caller owns reconnects)."""

    def __init__(self, group_id: str, faults: Faults) -> None:
        self.group_id = group_id
        self.faults = faults
        # Sessions that take batch rows' timestamps in their wire form (pgtime.install, once per session).
        self._wire_sessions: weakref.WeakSet[asyncpg.Connection] = weakref.WeakSet()

    async def claim(  # noqa: PLR0913 - the claim's whole input, as stored beside it
        self, conn: asyncpg.Connection, topic: str, partitions: Iterable[int], generation: int | None,
        member_id: str | None, *, force: bool = False, unblock: Unblock | None = None,
        reset: Mapping[int, int] | None = None,
    ) -> list[Claim]:
        """Bump each partition's epoch and return the offset to seek to, in one transaction.

        Partitions whose stored generation is newer than ours (or known, where ours is not) are not taken (not
        returned): this claim is stale. If a zombie's batch transaction holds a row, this waits for it; after
        `unblock.after` seconds the zombie's session is terminated (same service, same group: the claim is the
        owner's), then this reads the offset the zombie committed, never a stale one. A partition with nothing
        stored gets `reset[partition]` stored, in the same transaction. Refuses a database that holds another
        group's ledger.
        """
        async with conn.transaction():
            other = await conn.fetchval(_OTHER_GROUP, self.group_id)
            if other is not None:
                raise LedgerIntegrityError(
                    f"this database already holds the ledger of consumer group {other!r}, not {self.group_id!r}: "
                    "movement_id and Kafka coordinates are unique across the ledger, so two groups would collide. "
                    "Use one database per group (or set STOCK_LEDGER_GROUP_ID to the group that owns it)"
                )
            pending = conn.fetch(_CLAIM, self.group_id, topic, sorted(partitions), generation, member_id, force)
            rows = await (pending if unblock is None else unblock.run(conn, pending))
            claims = [Claim(r["partition"], r["epoch"], r["next_offset"]) for r in rows]
            starts = {c.partition: reset[c.partition] for c in claims
                      if c.next_offset is None and reset is not None and c.partition in reset}
            if starts:
                await conn.fetch(_RECORD_START, self.group_id, topic, list(starts), list(starts.values()))
                claims = [Claim(c.partition, c.epoch, starts[c.partition], reset=True) if c.partition in starts
                          else c for c in claims]
        return sorted(claims, key=lambda c: c.partition)

    async def skip_gap(self, conn: asyncpg.Connection, topic: str, gap: Gap, epoch: int) -> int | None:
        """Move the partition's offset past a hole and record the hole, in one transaction; the id of the
        ledger_gaps row, or None if the offset moved meanwhile (fenced: a newer claim decides)."""
        async with conn.transaction():
            moved = await conn.fetchval(_SKIP, self.group_id, topic, gap.partition, epoch, gap.first_offset,
                                        gap.last_offset + 1)
            if moved is None:
                return None
            return int(await conn.fetchval(_RECORD_GAP, self.group_id, topic, gap.partition, gap.first_offset,
                                           gap.last_offset, gap.reason))

    async def apply(self, conn: asyncpg.Connection, batch: Batch) -> Outcome:
        """THE batch transaction. Raises FencedError, OffsetMismatchError or CoordinateConflictError."""
        if conn not in self._wire_sessions:
            await pgtime.install(conn)
            self._wire_sessions.add(conn)
        look_up_known = isolate = False
        try:
            while True:
                try:
                    written = await self._transaction(conn, batch, look_up_known=look_up_known, isolate=isolate)
                    break
                except Exception as exc:
                    if (isinstance(exc, asyncpg.UniqueViolationError) and exc.constraint_name == _MOVEMENT_ID_KEY
                            and not look_up_known):
                        # An upstream resend: rolled back; redo it, quarantining the known movement_ids.
                        look_up_known = True
                    elif not isolate and refusal(exc) is not None:
                        # The database refused a value: rolled back; redo it, isolating the refused records.
                        isolate = True
                    else:
                        raise
        except _AlreadyApplied:
            return Outcome(0, Counter(), already_applied=True)
        except asyncpg.UniqueViolationError as exc:
            if exc.constraint_name in _COORDINATE_KEYS:
                raise CoordinateConflictError(
                    f"{exc.constraint_name}: a record of this batch is already in the ledger although the offset "
                    "guard let the batch through; refusing to continue (see `stock-ledger verify`)"
                ) from exc
            raise  # movement_id raced in from another partition's batch: retriable, the retry quarantines it
        self.faults.reached("after_commit")
        return Outcome(written.applied, Counter(r[R_CODE] for r in written.rejects), bisections=written.bisections)

    async def _transaction(
        self, conn: asyncpg.Connection, batch: Batch, *, look_up_known: bool, isolate: bool,
    ) -> _Written:
        async with conn.transaction():
            await self._advance_offsets(conn, batch)
            movements, rejects = batch.movements, batch.rejects
            if look_up_known:
                movements, rejects = await self._quarantine_known(conn, batch)
            bisections = 0
            if isolate:
                movements, refused, bisections = await _copy_isolating(conn, "stock_movements", MOVEMENT_COLUMNS,
                                                                       movements)
                rejects = [*rejects, *_quarantine_refused(batch, refused)]
                rejects, refused_rejects, more = await _copy_isolating(conn, "rejected_movements", REJECT_COLUMNS,
                                                                       rejects)
                bisections += more
                rejects += await _copy_bare_rejects(conn, refused_rejects)
            else:
                if movements:
                    rows = (self.faults.midway("during_copy", movements) if self.faults.armed("during_copy")
                            else movements)
                    await conn.copy_records_to_table("stock_movements", records=rows, columns=MOVEMENT_COLUMNS)
                if rejects:
                    await conn.copy_records_to_table("rejected_movements", records=rejects, columns=REJECT_COLUMNS)
            self.faults.reached("after_rows")
            # The deltas summed at build time hold for the batch's own rows; a lookup or an isolation changed them.
            await add_levels(conn, movements, batch.levels if movements is batch.movements else None)
            self.faults.reached("before_commit")
        return _Written(len(movements), rejects, bisections)

    async def _advance_offsets(self, conn: asyncpg.Connection, batch: Batch) -> None:
        s = batch.slices
        moved = await conn.fetch(
            _ADVANCE, self.group_id, batch.topic, [x.partition for x in s], [x.epoch for x in s],
            [x.expected for x in s], [x.next_offset for x in s],
        )
        if len(moved) == len(s):
            return
        moved_set = {r["partition"] for r in moved}
        failed = [x for x in s if x.partition not in moved_set]
        current = {
            r["partition"]: (r["epoch"], r["next_offset"])
            for r in await conn.fetch(CURRENT, self.group_id, batch.topic, [x.partition for x in failed])
        }
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

    async def _quarantine_known(
        self, conn: asyncpg.Connection, batch: Batch,
    ) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
        if not batch.movements:
            return batch.movements, batch.rejects
        return without_known(batch, {r[0] for r in await conn.fetch(_KNOWN_IDS, [m[M_ID] for m in batch.movements])})


async def known_movement_ids(conn: asyncpg.Connection, ids: Sequence[Any]) -> set[Any]:
    """The movement_ids among `ids` already in stock_movements (`_KNOWN_IDS`, as step 2 reads them; for repair)."""
    return {r[0] for r in await conn.fetch(_KNOWN_IDS, list(ids))}


def without_known(batch: Batch, known: set[Any]) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """The batch's movements and rejects with each movement whose movement_id is `known` (already in the ledger)
    moved to quarantine as duplicate_movement_id, raw bytes kept: an upstream resend is never applied twice."""
    if not known:
        return batch.movements, batch.rejects
    movements, rejects = [], list(batch.rejects)
    for m, (key, value) in zip(batch.movements, batch.raw, strict=True):
        if m[M_ID] in known:
            rejects.append(quarantined(
                m, key, value, RejectCode.DUPLICATE_MOVEMENT_ID,
                f"movement_id {m[M_ID]} is already in the ledger (an upstream resend); not applied twice",
            ))
        else:
            movements.append(m)
    return movements, rejects


async def add_levels(conn: asyncpg.Connection, movements: Sequence[tuple[Any, ...]], levels: Levels | None = None,
                     ) -> None:
    """Add the movements' qty to stock_levels; `levels`, if given, must be `level_deltas(movements)`."""
    levels = level_deltas(movements) if levels is None else levels
    if levels.deltas:
        await conn.execute(_ADD_LEVELS, levels.warehouses, levels.skus, levels.deltas)


def refusal(exc: BaseException) -> str | None:
    """What was wrong, if `exc` is PostgreSQL or the driver refusing a value (so the same rows fail again on every
    retry); None for anything else (faults, fencing, our own uniqueness backstops)."""
    if isinstance(exc, asyncpg.PostgresError):
        state = exc.sqlstate or ""
        # 22: data exception (encoding, range, format); 54: program limit (row too big); 23: a constraint.
        if state[:2] in {"22", "54"} or (state[:2] == "23" and getattr(exc, "constraint_name", None) not in _BACKSTOPS):
            return f"PostgreSQL refused the row ({state}): {exc}"
        return None
    # Client side, inside COPY: asyncpg's encoders raise DataError (a ValueError), UnicodeEncodeError (a lone
    # surrogate), OverflowError (a datetime that leaves the range once converted to UTC) or ValueError.
    if isinstance(exc, ValueError | OverflowError):
        return f"the database driver cannot encode the row: {type(exc).__name__}: {exc}"
    return None


async def _copy_isolating(
    conn: asyncpg.Connection, table: str, columns: tuple[str, ...], rows: list[tuple[Any, ...]],
) -> tuple[list[tuple[Any, ...]], list[tuple[tuple[Any, ...], str]], int]:
    """COPY `rows`, each chunk under a SAVEPOINT; a refused chunk is rolled back to it and split in two, until the
    refused rows stand alone. Returns (copied rows, refused rows with the reason, number of splits): k refused rows
    cost about k * log2(len(rows)) extra COPYs, inside the one batch transaction."""
    copied: list[tuple[Any, ...]] = []
    refused: list[tuple[tuple[Any, ...], str]] = []
    splits = 0
    pending = [rows] if rows else []
    while pending:
        chunk = pending.pop()
        try:
            async with conn.transaction():  # nested: a SAVEPOINT
                await conn.copy_records_to_table(table, records=chunk, columns=columns)
        except Exception as exc:
            why = refusal(exc)
            if why is None:
                raise
            if len(chunk) == 1:
                refused.append((chunk[0], why))
                continue
            splits += 1
            half = len(chunk) // 2
            pending += [chunk[half:], chunk[:half]]  # the first half is tried first: rows keep their order
        else:
            copied += chunk
    if refused:
        log.warning("batch.rows_refused", table=table, rows=len(refused), splits=splits,
                    first=pg_text(refused[0][1], 500),
                    detail="quarantined as database_rejected; the rest of the batch commits")
    return copied, refused, splits


def _quarantine_refused(
    batch: Batch, refused: list[tuple[tuple[Any, ...], str]],
) -> list[tuple[Any, ...]]:
    """Quarantine rows for movement rows the database refused, with the record's raw bytes and the refusal."""
    if not refused:
        return []
    raw = {(m[M_PARTITION], m[M_OFFSET]): kv for m, kv in zip(batch.movements, batch.raw, strict=True)}
    return [quarantined(m, *raw.get((m[M_PARTITION], m[M_OFFSET]), (None, None)), RejectCode.DATABASE_REJECTED, why)
            for m, why in refused]


async def _copy_bare_rejects(
    conn: asyncpg.Connection, refused: list[tuple[tuple[Any, ...], str]],
) -> list[tuple[Any, ...]]:
    """Quarantine rows the database refused in turn get stored bare: coordinates, raw bytes (bytea holds anything)
    and the refusal. If even that is refused, the coordinates themselves are bad: no Kafka record has such."""
    rows = [
        (r[R_TOPIC], r[R_PARTITION], r[R_OFFSET], None, r[R_KEY], r[R_VALUE], RejectCode.DATABASE_REJECTED.value,
         pg_text(f"{why}; the original reason was: {r[R_REASON]}"), None)
        for r, why in refused
    ]
    if rows:
        await conn.copy_records_to_table("rejected_movements", records=rows, columns=REJECT_COLUMNS)
    return rows
