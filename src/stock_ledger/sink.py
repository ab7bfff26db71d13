"""The ledger's writes: partition claims, and THE batch transaction.

The whole guarantee is `Ledger.apply`: one PostgreSQL transaction per batch that
  1. advances each partition's offset with a compare-and-set on the epoch this worker claimed (fencing) and on the
     stored offset (no replay, no regression), locking those rows first, in partition order;
  2. quarantines movements whose movement_id is already in the ledger (upstream resends);
  3. COPYs the movements, with the unique constraint on Kafka coordinates as the backstop;
  4. writes the quarantine rows (bad input keeps its raw bytes and a reason);
  5. adds each (warehouse, sku) delta to stock_levels, in key order;
and then COMMITs. Either all of it is durable or none of it is. Kafka is told afterwards, advisorily.

Step 2 costs nothing on the common path: the COPY itself finds a known movement_id (UNIQUE (movement_id) raises),
and only then is the transaction rolled back and redone with the lookup. A lookup on every batch cost a round trip
and 5,000 index probes, and its cached generic plan could turn into a sequential scan (see `_KNOWN_IDS`).
"""

from __future__ import annotations

import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final

import asyncpg
import msgspec

from stock_ledger.domain import Movement, RejectCode, Rejection, parse
from stock_ledger.errors import CoordinateConflictError, FencedError, OffsetRegressionError

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    from stock_ledger.faults import Faults

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

    @property
    def size(self) -> int:
        return len(self.movements) + len(self.rejects)


@dataclass(frozen=True, slots=True)
class Outcome:
    applied: int
    rejected: Counter[str]
    already_applied: bool = False


def _ts(ms: int) -> datetime | None:
    return datetime.fromtimestamp(ms / 1000, UTC) if ms >= 0 else None


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
    for partition in sorted(records):
        recs = records[partition]
        if not recs:
            continue
        slices.append(PartitionSlice(partition, epochs[partition], recs[0].offset, recs[-1].offset + 1))
        for r in recs:
            ms = r.timestamp
            timestamps.append(ms)
            kafka_ts = stamps.get(ms)
            if kafka_ts is None and ms >= 0:
                kafka_ts = stamps[ms] = _ts(ms)
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
                topic, partition, r.offset, kafka_ts, r.key, r.value,
                parsed.code.value, parsed.reason, _movement_id_of(r.value),
            ))
    return Batch(topic, slices, movements, rejects, raw, timestamps)


class _JustTheId(msgspec.Struct):
    movement_id: uuid.UUID


def _movement_id_of(value: bytes | None) -> uuid.UUID | None:
    """Best effort, so quarantine can be searched by movement_id; bad input may have none."""
    if value is None:
        return None
    try:
        return msgspec.json.decode(value, type=_JustTheId).movement_id
    except msgspec.DecodeError:
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
        try:
            try:
                movements, rejects = await self._transaction(conn, batch, look_up_known=False)
            except asyncpg.UniqueViolationError as exc:
                if exc.constraint_name != _MOVEMENT_ID_KEY:
                    raise
                # An upstream resend: that transaction rolled back; redo it, quarantining the known movement_ids.
                movements, rejects = await self._transaction(conn, batch, look_up_known=True)
        except _AlreadyApplied:
            return Outcome(0, Counter(), already_applied=True)
        except asyncpg.UniqueViolationError as exc:
            if exc.constraint_name in {"stock_movements_coordinates_key", "rejected_movements_coordinates_key"}:
                raise CoordinateConflictError(
                    f"{exc.constraint_name}: a record of this batch is already in the ledger although the offset "
                    "guard let the batch through; refusing to continue (see `stock-ledger verify`)"
                ) from exc
            raise  # movement_id raced in from another partition's batch: retriable, the retry quarantines it
        self._faults.reached("after_commit")
        return Outcome(len(movements), Counter(r[6] for r in rejects))

    async def _transaction(
        self, conn: asyncpg.Connection, batch: Batch, *, look_up_known: bool,
    ) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
        async with conn.transaction():
            await self._advance_offsets(conn, batch)
            movements, rejects = batch.movements, batch.rejects
            if look_up_known:
                movements, rejects = await self._quarantine_known(conn, batch)
            if movements:
                await conn.copy_records_to_table("stock_movements", records=movements, columns=MOVEMENT_COLUMNS)
            if rejects:
                await conn.copy_records_to_table("rejected_movements", records=rejects, columns=REJECT_COLUMNS)
            self._faults.reached("after_rows")
            await _add_levels(conn, movements)
            self._faults.reached("before_commit")
        return movements, rejects

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
