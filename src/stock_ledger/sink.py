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

import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Final

import asyncpg
import msgspec
import structlog

from stock_ledger.domain import Movement, RejectCode, Rejection, parse, pg_text
from stock_ledger.errors import CoordinateConflictError, FencedError, OffsetRegressionError

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    from stock_ledger.faults import Faults

log = structlog.get_logger(__name__)

MOVEMENT_COLUMNS: Final = (
    "movement_id", "warehouse_id", "sku", "qty", "kind", "occurred_at",
    "kafka_topic", "kafka_partition", "kafka_offset", "kafka_timestamp",
)
REJECT_COLUMNS: Final = (
    "kafka_topic", "kafka_partition", "kafka_offset", "kafka_timestamp",
    "key", "value", "reason_code", "reason", "movement_id",
)


@dataclass(frozen=True, slots=True)
class Claim:
    partition: int
    epoch: int
    next_offset: int | None  # None: nothing stored yet, the reset policy decides


@dataclass(frozen=True, slots=True)
class PartitionSlice:
    partition: int
    epoch: int
    first_offset: int
    next_offset: int


@dataclass(frozen=True, slots=True)
class Record:
    """The parts of a Kafka record the ledger needs (aiokafka's ConsumerRecord satisfies this shape)."""

    partition: int
    offset: int
    timestamp: int  # ms since the epoch, or -1
    key: bytes | None
    value: bytes | None


@dataclass(slots=True)
class Batch:
    topic: str
    slices: list[PartitionSlice]
    movements: list[tuple[Any, ...]]
    rejects: list[tuple[Any, ...]]
    # The raw (key, value) of each movement, parallel to `movements`: kept if the row is quarantined later.
    raw: list[tuple[bytes | None, bytes | None]] = field(default_factory=list)
    timestamps_ms: list[int] = field(default_factory=list)
    # Records whose Kafka timestamp is neither -1 (none) nor a time PostgreSQL and Python can hold (a producer that
    # sends microseconds, a negative value): stored as NULL kafka_timestamp, counted here for the metric.
    bad_timestamps: int = 0

    @property
    def size(self) -> int:
        return len(self.movements) + len(self.rejects)


@dataclass(frozen=True, slots=True)
class Outcome:
    applied: int
    rejected: Counter[str]
    already_applied: bool = False
    # Splits of a chunk the database refused (0 unless a record got past the parser that PostgreSQL refuses).
    bisections: int = 0


_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
# The last millisecond Python's datetime can hold (9999-12-31T23:59:59.999Z); timestamptz reaches further.
MAX_TIMESTAMP_MS: Final = (datetime(9999, 12, 31, 23, 59, 59, 999_000, tzinfo=UTC) - _EPOCH) // timedelta(
    milliseconds=1)


def _ts(ms: int) -> datetime | None:
    """A Kafka record timestamp as a datetime; None for -1 (no timestamp) and anything out of range."""
    if not 0 <= ms <= MAX_TIMESTAMP_MS:
        return None
    return _EPOCH + timedelta(milliseconds=ms)  # exact, unlike a float division


def build_batch(topic: str, records: Mapping[int, Sequence[Record]], epochs: Mapping[int, int]) -> Batch:
    """Parse records into COPY-ready rows. Pure. `records` holds each partition's records in offset order."""
    movements: list[tuple[Any, ...]] = []
    rejects: list[tuple[Any, ...]] = []
    slices: list[PartitionSlice] = []
    raw: list[tuple[bytes | None, bytes | None]] = []
    # Keyed by UUID.int: uuid.UUID hashes in Python code, an int in C. This loop runs once per record.
    seen_ids: set[int] = set()
    timestamps: list[int] = []
    # Records produced in the same millisecond share a timestamp (~70% of them under load): one datetime each.
    stamps: dict[int, datetime | None] = {}
    bad_timestamps = 0
    for partition in sorted(records):
        recs = records[partition]
        if not recs:
            continue
        slices.append(PartitionSlice(partition, epochs[partition], recs[0].offset, recs[-1].offset + 1))
        for r in recs:
            ms = r.timestamp
            timestamps.append(ms)
            kafka_ts = stamps.get(ms)
            if kafka_ts is None:
                kafka_ts = stamps[ms] = _ts(ms)
                if kafka_ts is None and ms != -1:
                    bad_timestamps += 1
            parsed = parse(r.key, r.value)
            if isinstance(parsed, Movement):
                mid = parsed.movement_id
                if mid.int not in seen_ids:
                    seen_ids.add(mid.int)
                    movements.append((mid, parsed.warehouse_id, parsed.sku, parsed.qty, parsed.kind,
                                      parsed.occurred_at, topic, partition, r.offset, kafka_ts))
                    raw.append((r.key, r.value))
                    continue
                parsed = Rejection(
                    RejectCode.DUPLICATE_MOVEMENT_ID,
                    f"movement_id {mid} appears earlier in this batch; applied once, this copy kept here",
                )
            rejects.append((
                topic, partition, r.offset, kafka_ts, r.key, r.value, parsed.code.value, pg_text(parsed.reason),
                None if parsed.code is RejectCode.TOO_DEEP else _movement_id_of(r.value),
            ))
    return Batch(topic, slices, movements, rejects, raw, timestamps, bad_timestamps)


class _JustTheId(msgspec.Struct):
    movement_id: uuid.UUID


def _movement_id_of(value: bytes | None) -> uuid.UUID | None:
    """Best effort, so quarantine can be searched by movement_id; bad input may have none."""
    if value is None:
        return None
    try:
        return msgspec.json.decode(value, type=_JustTheId).movement_id
    except (msgspec.DecodeError, RecursionError):
        return None


_CLAIM: Final = """
INSERT INTO consumer_offsets AS o (group_id, topic, partition, epoch, generation, member_id, claimed_at)
SELECT $1, $2, p, 1, $4, $5, now() FROM unnest($3::int[]) AS p ORDER BY p
ON CONFLICT (group_id, topic, partition) DO UPDATE
    SET epoch = o.epoch + 1, generation = EXCLUDED.generation, member_id = EXCLUDED.member_id, claimed_at = now()
RETURNING partition, epoch, next_offset
"""

# Compare-and-set: the row moves only if we still hold its epoch and the batch starts at or after the stored
# offset (offsets may have holes: transaction markers, compaction). Rows are locked in partition order.
_ADVANCE: Final = """
UPDATE consumer_offsets AS o
   SET next_offset = b.next_offset, updated_at = now()
  FROM unnest($3::int[], $4::bigint[], $5::bigint[], $6::bigint[]) AS b(partition, epoch, first_offset, next_offset)
 WHERE o.group_id = $1 AND o.topic = $2 AND o.partition = b.partition
   AND o.epoch = b.epoch
   AND (o.next_offset IS NULL OR o.next_offset <= b.first_offset)
RETURNING o.partition
"""

_CURRENT: Final = """
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

_ADD_LEVELS: Final = """
INSERT INTO stock_levels AS l (warehouse_id, sku, on_hand)
SELECT w, s, d FROM unnest($1::text[], $2::text[], $3::bigint[]) AS t(w, s, d) ORDER BY w, s
ON CONFLICT (warehouse_id, sku) DO UPDATE SET on_hand = l.on_hand + EXCLUDED.on_hand, updated_at = now()
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
        self._faults = faults

    async def claim(
        self, conn: asyncpg.Connection, topic: str, partitions: Iterable[int], generation: int | None,
        member_id: str | None,
    ) -> list[Claim]:
        """Bump each partition's epoch and return the offset to seek to, in one statement.

        If a zombie's batch transaction holds a row, this waits for it (bounded by lock_timeout) and then reads
        the offset that batch committed, never a stale one.
        """
        rows = await conn.fetch(_CLAIM, self.group_id, topic, sorted(partitions), generation, member_id)
        return sorted((Claim(r["partition"], r["epoch"], r["next_offset"]) for r in rows), key=lambda c: c.partition)

    async def apply(self, conn: asyncpg.Connection, batch: Batch) -> Outcome:
        """THE batch transaction. Raises FencedError, OffsetRegressionError or CoordinateConflictError."""
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
        self._faults.reached("after_commit")
        return Outcome(written.applied, Counter(r[6] for r in written.rejects), bisections=written.bisections)

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
                    await conn.copy_records_to_table("stock_movements", records=movements, columns=MOVEMENT_COLUMNS)
                if rejects:
                    await conn.copy_records_to_table("rejected_movements", records=rejects, columns=REJECT_COLUMNS)
            self._faults.reached("after_rows")
            await _add_levels(conn, movements)
            self._faults.reached("before_commit")
        return _Written(len(movements), rejects, bisections)

    async def _advance_offsets(self, conn: asyncpg.Connection, batch: Batch) -> None:
        s = batch.slices
        moved = await conn.fetch(
            _ADVANCE, self.group_id, batch.topic, [x.partition for x in s], [x.epoch for x in s],
            [x.first_offset for x in s], [x.next_offset for x in s],
        )
        if len(moved) == len(s):
            return
        moved_set = {r["partition"] for r in moved}
        failed = [x for x in s if x.partition not in moved_set]
        current = {
            r["partition"]: (r["epoch"], r["next_offset"])
            for r in await conn.fetch(_CURRENT, self.group_id, batch.topic, [x.partition for x in failed])
        }
        fenced = {x.partition: (x.epoch, current.get(x.partition, (None, None))[0]) for x in failed
                  if current.get(x.partition, (None, None))[0] != x.epoch}
        if fenced:
            raise FencedError(fenced)
        # Same epoch, offset already past the batch start. If every partition stands exactly at this batch's end,
        # an earlier attempt of this very batch committed (the COMMIT's reply was lost): nothing to do.
        if not moved and all(current[x.partition][1] == x.next_offset for x in failed):
            raise _AlreadyApplied
        detail = ", ".join(
            f"partition {x.partition}: batch starts at {x.first_offset}, stored next_offset {current[x.partition][1]}"
            for x in failed
        )
        raise OffsetRegressionError(f"replay refused under our own epoch ({detail}): the seek path is broken")

    async def _quarantine_known(
        self, conn: asyncpg.Connection, batch: Batch,
    ) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
        if not batch.movements:
            return batch.movements, batch.rejects
        known = {r[0] for r in await conn.fetch(_KNOWN_IDS, [m[0] for m in batch.movements])}
        if not known:
            return batch.movements, batch.rejects
        movements, rejects = [], list(batch.rejects)
        for m, (key, value) in zip(batch.movements, batch.raw, strict=True):
            if m[0] in known:
                rejects.append((
                    m[6], m[7], m[8], m[9], key, value, RejectCode.DUPLICATE_MOVEMENT_ID.value,
                    f"movement_id {m[0]} is already in the ledger (an upstream resend); not applied twice", m[0],
                ))
            else:
                movements.append(m)
        return movements, rejects


async def _add_levels(conn: asyncpg.Connection, movements: Sequence[tuple[Any, ...]]) -> None:
    deltas: defaultdict[tuple[str, str], int] = defaultdict(int)
    for m in movements:
        deltas[m[1], m[2]] += m[3]
    if not deltas:
        return
    keys = sorted(deltas)
    await conn.execute(_ADD_LEVELS, [k[0] for k in keys], [k[1] for k in keys], [deltas[k] for k in keys])


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
    raw = {(m[7], m[8]): kv for m, kv in zip(batch.movements, batch.raw, strict=True)}
    rows = []
    for m, why in refused:
        key, value = raw.get((m[7], m[8]), (None, None))
        rows.append((m[6], m[7], m[8], m[9], key, value, RejectCode.DATABASE_REJECTED.value, pg_text(why), m[0]))
    return rows


async def _copy_bare_rejects(
    conn: asyncpg.Connection, refused: list[tuple[tuple[Any, ...], str]],
) -> list[tuple[Any, ...]]:
    """Quarantine rows the database refused in turn get stored bare: coordinates, raw bytes (bytea holds anything)
    and the refusal. If even that is refused, the coordinates themselves are bad: no Kafka record has such."""
    rows = [
        (r[0], r[1], r[2], None, r[4], r[5], RejectCode.DATABASE_REJECTED.value,
         pg_text(f"{why}; the original reason was: {r[7]}"), None)
        for r, why in refused
    ]
    if rows:
        await conn.copy_records_to_table("rejected_movements", records=rows, columns=REJECT_COLUMNS)
    return rows
