"""The movement tables: every write to `stock_movements`, `rejected_movements` and `stock_levels`, and the reads
that decide what to write.

The batch transaction (transaction.py), `repair` and `rejected replay` all write through here, so a movement is
written one way: COPY (or INSERT) of the row, its quarantine row when it is not applied, and the (warehouse, sku)
deltas added to stock_levels in key order (the order every writer locks those rows in).

The parser validates every value against what PostgreSQL can hold, so the database refusing a row is a bug of ours or
a database that differs (an encoding, a constraint someone added). Even then one record must not stop every
partition: `copy_isolating` bisects a refused COPY under SAVEPOINTs until the refused records stand alone; they are
quarantined as `database_rejected` with the server's message and the rest commits in the same transaction.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Final

import asyncpg
import structlog

from stock_ledger.domain import RejectCode, pg_text
from stock_ledger.ledger.batch import (
    M_ID,
    M_OFFSET,
    M_PARTITION,
    MOVEMENT_COLUMNS,
    R_HEADERS,
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

if TYPE_CHECKING:
    from collections.abc import AsyncIterable, Iterable, Sequence
    from datetime import datetime

log = structlog.get_logger(__name__)

Row = tuple[Any, ...]

# The movement_id registry's key (migrations/0014_segments.sql; the table's own before it): the trigger that fills
# the registry raises unique_violation under this name for a movement_id already in the ledger.
MOVEMENT_ID_KEY: Final = "stock_movements_movement_id_key"
# A conflict on the coordinates names the segment's key (stock_movements_p<partition>_o<first offset>_coordinates_key,
# migration 0014), or the table's.
_COORDINATE_KEY: Final = re.compile(
    r"(stock_movements|rejected_movements|stock_movements_p\d+_o\d+)_coordinates_key")


def is_coordinates_key(constraint: str | None) -> bool:
    return constraint is not None and _COORDINATE_KEY.fullmatch(constraint) is not None


def is_backstop(constraint: str | None) -> bool:
    """Our own uniqueness backstops: they mean a resend or a regression, handled by the callers, never a bad value."""
    return constraint == MOVEMENT_ID_KEY or is_coordinates_key(constraint)

# ------------------------------------------------------------------------------------------ the batch's writes

# One index probe per id, whatever the statistics say. The plain `movement_id = ANY($1)` let PostgreSQL cache a
# generic plan made while the table was small: a sequential scan comparing every row with every id of the array,
# seconds per batch after a few hundred thousand rows (docs/performance.md, "Latency").
_KNOWN_IDS: Final = """
SELECT k.movement_id FROM unnest($1::uuid[]) AS u(id)
CROSS JOIN LATERAL (SELECT m.movement_id FROM movement_ids AS m WHERE m.movement_id = u.id LIMIT 1) AS k
"""
# PostgreSQL's message when no segment holds a row's coordinates (migrations/0014_segments.sql).
NO_SEGMENT: Final = 'no partition of relation "stock_movements" found for row'
# went_negative_at: set when a level goes below zero, kept while it stays there, cleared when it recovers
# (migration 0004; its CHECK refuses a row where the two disagree).
_ADD_LEVELS: Final = """
INSERT INTO stock_levels AS l (warehouse_id, sku, on_hand, went_negative_at)
SELECT w, s, d, CASE WHEN d < 0 THEN now() END
  FROM unnest($1::text[], $2::text[], $3::bigint[]) AS t(w, s, d) ORDER BY w, s
ON CONFLICT (warehouse_id, sku) DO UPDATE SET on_hand = l.on_hand + EXCLUDED.on_hand, updated_at = now(),
    went_negative_at = CASE WHEN l.on_hand + EXCLUDED.on_hand < 0 THEN coalesce(l.went_negative_at, now()) END
"""


async def copy_movements(conn: asyncpg.Connection, rows: Iterable[Row] | AsyncIterable[Row]) -> None:
    await conn.copy_records_to_table("stock_movements", records=rows, columns=MOVEMENT_COLUMNS)


async def copy_rejects(conn: asyncpg.Connection, rows: Iterable[Row]) -> None:
    await conn.copy_records_to_table("rejected_movements", records=rows, columns=REJECT_COLUMNS)


async def add_levels(conn: asyncpg.Connection, movements: Sequence[Row], levels: Levels | None = None) -> None:
    """Add the movements' qty to stock_levels; `levels`, if given, must be `level_deltas(movements)`."""
    levels = level_deltas(movements) if levels is None else levels
    if levels.deltas:
        await conn.execute(_ADD_LEVELS, levels.warehouses, levels.skus, levels.deltas)


# The offsets of each slice's range [lo, hi) already in either table: one range scan of each unique index per slice.
_PRESENT: Final = """
SELECT w.p, x.o FROM unnest($2::int[], $3::bigint[], $4::bigint[]) AS w(p, lo, hi)
 CROSS JOIN LATERAL (
       SELECT kafka_offset AS o FROM stock_movements
        WHERE kafka_topic = $1 AND kafka_partition = w.p AND kafka_offset >= w.lo AND kafka_offset < w.hi
       UNION ALL
       SELECT kafka_offset FROM rejected_movements
        WHERE kafka_topic = $1 AND kafka_partition = w.p AND kafka_offset >= w.lo AND kafka_offset < w.hi
       ) AS x
 ORDER BY 1, 2
"""


async def present_coordinates(conn: asyncpg.Connection, batch: Batch) -> set[tuple[int, int]]:
    """(partition, offset) of the batch's records that either table already holds."""
    s = batch.slices
    return {(r[0], r[1]) for r in await conn.fetch(_PRESENT, batch.topic, [x.partition for x in s],
                                                    [x.first_offset for x in s], [x.next_offset for x in s])}


def without_present(batch: Batch, present: set[tuple[int, int]]) -> Batch:
    """The batch without the records whose coordinates the ledger already holds (someone else wrote them outside
    the offset guard): they are left as found, never written twice."""
    if not present:
        return batch
    keep = [i for i, m in enumerate(batch.movements) if (m[M_PARTITION], m[M_OFFSET]) not in present]
    return Batch(batch.topic, batch.slices, [batch.movements[i] for i in keep],
                 [r for r in batch.rejects if (r[R_PARTITION], r[R_OFFSET]) not in present],
                 [batch.raw[i] for i in keep], fetched_at=batch.fetched_at)


async def known_movement_ids(conn: asyncpg.Connection, ids: Sequence[Any]) -> set[Any]:
    """The movement_ids among `ids` already in the ledger (the registry keeps them after their rows leave)."""
    return {r[0] for r in await conn.fetch(_KNOWN_IDS, list(ids))} if ids else set()


def without_known(batch: Batch, known: set[Any]) -> tuple[list[Row], list[Row]]:
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


def no_segment(exc: BaseException) -> bool:
    """PostgreSQL found no segment of stock_movements for a row's coordinates (segments.py makes them)."""
    return isinstance(exc, asyncpg.CheckViolationError) and str(exc).startswith(NO_SEGMENT)


def refusal(exc: BaseException) -> str | None:
    """What was wrong, if `exc` is PostgreSQL or the driver refusing a value (so the same rows fail again on every
    retry); None for anything else (faults, fencing, our own uniqueness backstops)."""
    if isinstance(exc, asyncpg.PostgresError):
        state = exc.sqlstate or ""
        # 22: data exception (encoding, range, format); 54: program limit (row too big); 23: a constraint.
        if no_segment(exc):
            return None  # no segment for these offsets yet: the caller makes one and tries again (segments.py)
        if state[:2] in {"22", "54"} or (state[:2] == "23" and not is_backstop(getattr(exc, "constraint_name", None))):
            return f"PostgreSQL refused the row ({state}): {exc}"
        return None
    # Client side, inside COPY: asyncpg's encoders raise DataError (a ValueError), UnicodeEncodeError (a lone
    # surrogate), OverflowError (a datetime that leaves the range once converted to UTC) or ValueError.
    if isinstance(exc, ValueError | OverflowError):
        return f"the database driver cannot encode the row: {type(exc).__name__}: {exc}"
    return None


async def copy_isolating(conn: asyncpg.Connection, batch: Batch, movements: list[Row],
                         rejects: list[Row]) -> tuple[list[Row], list[Row], int]:
    """COPY `movements` and `rejects`, quarantining as database_rejected each row the database refuses (bisected
    under SAVEPOINTs, see `_copy_bisecting`). Returns the movements copied, the quarantine rows written, and the
    number of splits."""
    movements, refused, bisections = await _copy_bisecting(conn, "stock_movements", MOVEMENT_COLUMNS, movements)
    rejects = [*rejects, *_quarantine_refused(batch, refused)]
    rejects, refused_rejects, more = await _copy_bisecting(conn, "rejected_movements", REJECT_COLUMNS, rejects)
    rejects += await _copy_bare_rejects(conn, refused_rejects)
    return movements, rejects, bisections + more


async def _copy_bisecting(
    conn: asyncpg.Connection, table: str, columns: tuple[str, ...], rows: list[Row],
) -> tuple[list[Row], list[tuple[Row, str]], int]:
    """COPY `rows`, each chunk under a SAVEPOINT; a refused chunk is rolled back to it and split in two, until the
    refused rows stand alone. Returns (copied rows, refused rows with the reason, number of splits): k refused rows
    cost about k * log2(len(rows)) extra COPYs, inside the one batch transaction."""
    copied: list[Row] = []
    refused: list[tuple[Row, str]] = []
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


def _quarantine_refused(batch: Batch, refused: list[tuple[Row, str]]) -> list[Row]:
    """Quarantine rows for movement rows the database refused, with the record's raw bytes and the refusal."""
    if not refused:
        return []
    raw = {(m[M_PARTITION], m[M_OFFSET]): kv for m, kv in zip(batch.movements, batch.raw, strict=True)}
    return [quarantined(m, *raw.get((m[M_PARTITION], m[M_OFFSET]), (None, None)), RejectCode.DATABASE_REJECTED, why)
            for m, why in refused]


async def _copy_bare_rejects(conn: asyncpg.Connection, refused: list[tuple[Row, str]]) -> list[Row]:
    """Quarantine rows the database refused in turn get stored bare: coordinates, raw bytes (bytea holds anything)
    and the refusal. If even that is refused, the coordinates themselves are bad: no Kafka record has such."""
    rows = [
        (r[R_TOPIC], r[R_PARTITION], r[R_OFFSET], None, r[R_KEY], r[R_VALUE], RejectCode.DATABASE_REJECTED.value,
         pg_text(f"{why}; the original reason was: {r[R_REASON]}"), None, r[R_HEADERS])
        for r, why in refused
    ]
    if rows:
        await copy_rejects(conn, rows)
    return rows


# ------------------------------------------------------------------------------------------ rejected replay

_COUNT_REJECTED: Final = "SELECT count(*) FROM rejected_movements WHERE $1::text IS NULL OR reason_code = $1"
_LIST_REJECTED: Final = """
SELECT id, kafka_topic, kafka_partition, kafka_offset, reason_code, rejected_at, replay_attempts, reason
  FROM rejected_movements
 WHERE ($1::text IS NULL OR reason_code = $1) AND ($2::timestamptz IS NULL OR rejected_at >= $2)
 ORDER BY id LIMIT $3
"""
_ONE_REJECTED: Final = """
SELECT id, kafka_topic, kafka_partition, kafka_offset, kafka_timestamp, key, value, headers, reason_code, reason,
       movement_id, rejected_at, replay_attempts, last_replay_at, last_replay_reason
  FROM rejected_movements WHERE id = $1
"""
_LOCK_REJECTED: Final = """
SELECT id, kafka_topic, kafka_partition, kafka_offset, kafka_timestamp, key, value, headers
  FROM rejected_movements
 WHERE id > $1 AND ($2::text IS NULL OR reason_code = $2)
 ORDER BY id LIMIT $3
   FOR UPDATE SKIP LOCKED
"""
# A movement_id already in the ledger (an upstream resend, or a copy applied meanwhile by a worker) is left out
# before the INSERT (insert_replayed) and its row stays quarantined: the registry's trigger would refuse the whole
# statement. ON CONFLICT DO NOTHING for the coordinates, which cannot conflict: the record is in rejected_movements,
# and the worker writes each coordinate to exactly one table.
_INSERT_REPLAYED: Final = """
INSERT INTO stock_movements (movement_id, warehouse_id, sku, qty, kind, occurred_at, kafka_topic, kafka_partition,
                             kafka_offset, kafka_timestamp)
SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::bigint[], $5::text[], $6::timestamptz[], $7::text[],
                     $8::int[], $9::bigint[], $10::timestamptz[])
ON CONFLICT DO NOTHING
RETURNING kafka_topic, kafka_partition, kafka_offset
"""
_DELETE_REPLAYED: Final = "DELETE FROM rejected_movements WHERE id = ANY($1::bigint[])"
_RECORD_ATTEMPTS: Final = """
UPDATE rejected_movements AS r
   SET replay_attempts = r.replay_attempts + 1, last_replay_at = now(), last_replay_reason = a.reason
  FROM unnest($1::bigint[], $2::text[]) AS a(id, reason)
 WHERE r.id = a.id
"""


async def count_rejected(conn: asyncpg.Connection, reason: str | None) -> int:
    return int(await conn.fetchval(_COUNT_REJECTED, reason))


async def list_rejected(conn: asyncpg.Connection, reason: str | None, since: datetime | None,
                        limit: int) -> list[dict[str, Any]]:
    return [dict(r) for r in await conn.fetch(_LIST_REJECTED, reason, since, limit)]


async def one_rejected(conn: asyncpg.Connection, row_id: int) -> asyncpg.Record | None:
    return await conn.fetchrow(_ONE_REJECTED, row_id)


async def lock_rejected(conn: asyncpg.Connection, after_id: int, reason: str | None,
                        limit: int) -> list[asyncpg.Record]:
    """The next quarantined rows after `after_id`, locked FOR UPDATE SKIP LOCKED (two replays never take one)."""
    return list(await conn.fetch(_LOCK_REJECTED, after_id, reason, limit))


async def insert_replayed(conn: asyncpg.Connection, movements: Sequence[Row]) -> set[tuple[str, int, int]]:
    """Insert replayed movements at their original coordinates; the coordinates inserted (a movement_id already
    in the ledger is not)."""
    known = await known_movement_ids(conn, [m[M_ID] for m in movements])
    fresh: dict[Any, Row] = {}
    for m in movements:
        if m[M_ID] not in known:
            fresh.setdefault(m[M_ID], m)  # the first of two quarantined copies of one movement
    if not fresh:
        return set()
    columns = list(zip(*fresh.values(), strict=True))
    return {(x["kafka_topic"], x["kafka_partition"], x["kafka_offset"])
            for x in await conn.fetch(_INSERT_REPLAYED, *columns)}


async def delete_replayed(conn: asyncpg.Connection, ids: Sequence[int]) -> None:
    await conn.execute(_DELETE_REPLAYED, list(ids))


async def record_attempts(conn: asyncpg.Connection, attempts: dict[int, str]) -> None:
    """Note a replay attempt, and why the row stays quarantined, on each row id."""
    ids = sorted(attempts)
    await conn.execute(_RECORD_ATTEMPTS, ids, [attempts[i] for i in ids])


# ------------------------------------------------------------------------------------------ where a partition stands

# Per partition, the highest offset in either table, recorded as holding no data record, or in an archived segment,
# + 1 (0 if none): where the ledger's own rows say the partition stands. A backward probe of each table's unique
# index per partition (the runs of non_record_offsets never overlap: the last one ends highest).
_FLOORS: Final = """
SELECT p, greatest(
    (SELECT max(kafka_offset) + 1 FROM stock_movements WHERE kafka_topic = $1 AND kafka_partition = p),
    (SELECT max(kafka_offset) + 1 FROM rejected_movements WHERE kafka_topic = $1 AND kafka_partition = p),
    (SELECT last_offset + 1 FROM non_record_offsets WHERE kafka_topic = $1 AND kafka_partition = p
      ORDER BY first_offset DESC LIMIT 1),
    (SELECT max(end_offset) FROM ledger_archives WHERE kafka_topic = $1 AND kafka_partition = p),
    0)
  FROM unnest($2::int[]) AS p
"""


async def floors(conn: asyncpg.Connection, topic: str, partitions: Iterable[int]) -> dict[int, int]:
    """partition -> the highest offset of the partition in either table, in a recorded run of offsets that held no
    data record or in an archived segment, + 1 (0 if none): the lowest offset the partition may be moved to
    (everything below is in the ledger), and where a claim that finds nothing stored resumes if the ledger holds rows
    of the partition."""
    return {r[0]: r[1] for r in await conn.fetch(_FLOORS, topic, list(partitions))}


async def floor(conn: asyncpg.Connection, topic: str, partition: int) -> int:
    """`floors` of one partition."""
    return (await floors(conn, topic, [partition]))[partition]
