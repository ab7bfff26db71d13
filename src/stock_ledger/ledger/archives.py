"""The database's side of archival: which segments there are, what an archived one leaves behind, and the steps
that take a segment out of stock_movements (migrations/0015_archives.sql). archive/run.py decides when; the file
itself is archive/parquet.py's.

A segment leaves in two steps, each safe to repeat after a crash:
  1. `record`, in the caller's transaction, under the operators' lock of its Kafka partition and a SHARE lock on
     the segment (no write can reach it meanwhile; the caller sums it again and compares it with the file): its
     archive row, its per-(warehouse, sku) sums, archived_at, and last DETACH PARTITION. So a reader sees the
     segment's movements either as rows or as archived_sums, never both and never neither. The plain DETACH takes
     ACCESS EXCLUSIVE on stock_movements for the few milliseconds to the commit, under lock_timeout (waiting for
     it would queue the workers' batches behind it); CONCURRENTLY would leave a window in which readers count the
     segment twice.
  2. `drop`: the detached table is dropped and dropped_at set, in one transaction.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from stock_ledger.errors import OperatorError

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterable, Sequence
    from datetime import datetime

    import asyncpg

_SEGMENT_NAME: Final = re.compile(r"(restored_)?stock_movements_p[0-9]+_o[0-9]+")
COLUMNS: Final = ("movement_id", "warehouse_id", "sku", "qty", "kind", "occurred_at", "kafka_topic",
                  "kafka_partition", "kafka_offset", "kafka_timestamp", "applied_at")

_SEGMENTS: Final = """
SELECT s.kafka_partition, s.first_offset, s.end_offset, s.table_name, s.created_at, s.archived_at, a.dropped_at,
       i.inhrelid IS NOT NULL AS attached
  FROM ledger_segments AS s
  LEFT JOIN ledger_archives AS a ON a.segment = s.table_name
  LEFT JOIN pg_catalog.pg_inherits AS i ON i.inhrelid = to_regclass('public.' || s.table_name)
 ORDER BY 1, 2
"""
_ARCHIVES: Final = """
SELECT segment, kafka_topic, kafka_partition, first_offset, end_offset, rows, qty, first_occurred_at,
       last_occurred_at, first_applied_at, last_applied_at, file, sha256, bytes, unknown_offsets, archived_at,
       archived_by, dropped_at
  FROM ledger_archives {where} ORDER BY kafka_topic, kafka_partition, first_offset
"""
_ARCHIVED_RUNS: Final = """
SELECT first_offset, end_offset - 1 FROM ledger_archives WHERE kafka_topic = $1 AND kafka_partition = $2
 ORDER BY first_offset
"""
_ARCHIVED_SUMS: Final = """
SELECT warehouse_id, sku, rows, qty, first_occurred_at, last_occurred_at FROM archived_sums WHERE segment = $1
"""
_ALL_ARCHIVED_RUNS: Final = """
SELECT kafka_topic, kafka_partition, first_offset, end_offset - 1 FROM ledger_archives ORDER BY 1, 2, 3
"""
# The segment summed as its manifest sums the file: per (warehouse, sku), and over all.
_SUMS: Final = """
SELECT warehouse_id, sku, count(*) AS rows, sum(qty)::bigint AS qty, min(occurred_at) AS first_occurred_at,
       max(occurred_at) AS last_occurred_at
  FROM public.{table} GROUP BY 1, 2
"""
_KAFKA: Final = """
SELECT kafka_topic, kafka_partition, count(*) AS rows, min(kafka_offset), max(kafka_offset), min(applied_at),
       max(applied_at)
  FROM public.{table} GROUP BY 1, 2
"""
# Only movements applied after the horizon: the segment's BRIN on applied_at skips every block range older than it,
# so a segment past the retention is judged without reading it (max() alone would read the whole segment).
_NEWEST: Final = "SELECT max(applied_at) FROM public.{table} WHERE applied_at > $1"
_ROWS: Final = f"SELECT {', '.join(COLUMNS)} FROM public.{{table}} ORDER BY kafka_offset"
_RECORD: Final = """
INSERT INTO ledger_archives (segment, kafka_topic, kafka_partition, first_offset, end_offset, rows, qty,
                             first_occurred_at, last_occurred_at, first_applied_at, last_applied_at, file, sha256,
                             bytes, unknown_offsets)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)
"""
_ARCHIVED_AT: Final = "UPDATE ledger_segments SET archived_at = now() WHERE table_name = $1 AND archived_at IS NULL"
_DETACH: Final = "ALTER TABLE public.stock_movements DETACH PARTITION public.{table}"
_DROP: Final = "DROP TABLE IF EXISTS public.{table}"
_DROPPED: Final = "UPDATE ledger_archives SET dropped_at = now() WHERE segment = $1 AND dropped_at IS NULL"


@dataclass(frozen=True, slots=True)
class Segment:
    partition: int
    first_offset: int
    end_offset: int
    table: str
    created_at: datetime
    archived_at: datetime | None
    dropped_at: datetime | None
    attached: bool  # still a partition of stock_movements

    @property
    def offsets(self) -> str:
        return f"p{self.partition} [{self.first_offset}, {self.end_offset})"


def table_name(name: str) -> str:
    """`name` if it is a segment's table name (it goes into DDL), else OperatorError."""
    if not _SEGMENT_NAME.fullmatch(name):
        raise OperatorError(f"{name!r} is not a segment of stock_movements (stock_movements_p<P>_o<offset>): see "
                            "`stock-ledger archive list`")
    return name


async def segments(conn: asyncpg.Connection) -> list[Segment]:
    return [Segment(*r) for r in await conn.fetch(_SEGMENTS)]


async def archives(conn: asyncpg.Connection, segment: str | None = None) -> list[asyncpg.Record]:
    if segment is None:
        return list(await conn.fetch(_ARCHIVES.format(where="")))
    return list(await conn.fetch(_ARCHIVES.format(where="WHERE segment = $1"), segment))


async def archived_sums(conn: asyncpg.Connection, segment: str) -> list[asyncpg.Record]:
    """What the ledger counts for an archived segment: (warehouse_id, sku, rows, qty, first and last occurred_at)."""
    return list(await conn.fetch(_ARCHIVED_SUMS, segment))


async def archived_runs(conn: asyncpg.Connection, topic: str, partition: int) -> list[tuple[int, int]]:
    """The offsets of the partition in archived segments, as runs (first, last)."""
    return [(r[0], r[1]) for r in await conn.fetch(_ARCHIVED_RUNS, topic, partition)]


async def all_archived_runs(conn: asyncpg.Connection) -> dict[tuple[str, int], list[tuple[int, int]]]:
    """(topic, partition) -> the offsets in archived segments, as runs (first, last) in offset order."""
    found: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for r in await conn.fetch(_ALL_ARCHIVED_RUNS):
        found.setdefault((r[0], r[1]), []).append((r[2], r[3]))
    return found


async def newest_applied(conn: asyncpg.Connection, table: str, after: datetime) -> datetime | None:
    """The segment's newest applied_at if it is after `after`, else None."""
    value: datetime | None = await conn.fetchval(_NEWEST.format(table=table_name(table)), after)
    return value


async def rows(conn: asyncpg.Connection, table: str, prefetch: int) -> AsyncIterator[asyncpg.Record]:
    """The segment's rows in offset order (a cursor: the caller holds a transaction)."""
    async for r in conn.cursor(_ROWS.format(table=table_name(table)), prefetch=prefetch):
        yield r


async def sums(conn: asyncpg.Connection, table: str) -> list[asyncpg.Record]:
    return list(await conn.fetch(_SUMS.format(table=table_name(table))))


async def kafka_ranges(conn: asyncpg.Connection, table: str) -> list[asyncpg.Record]:
    """Per Kafka (topic, partition) in the segment: rows, first and last offset, first and last applied_at."""
    return list(await conn.fetch(_KAFKA.format(table=table_name(table))))


async def lock_segment(conn: asyncpg.Connection, table: str) -> None:
    """Inside a transaction: no write reaches the segment until it ends (readers go on)."""
    await conn.execute(f"LOCK TABLE public.{table_name(table)} IN SHARE MODE")


async def record(conn: asyncpg.Connection, archive: Sequence[Any], key_sums: Sequence[Sequence[Any]],
                 lock_timeout_ms: int) -> None:
    """Inside the caller's transaction (after `lock_segment` and its checks): the archive row (columns of _RECORD,
    the segment first), its sums, archived_at, and the segment detached (lock_timeout: LockNotAvailableError)."""
    table = table_name(archive[0])
    await conn.execute(_RECORD, *archive)
    await conn.copy_records_to_table("archived_sums", records=[(k[0], k[1], table, *k[2:]) for k in key_sums],
                                     columns=("warehouse_id", "sku", "segment", "rows", "qty", "first_occurred_at",
                                              "last_occurred_at"))
    await conn.execute(_ARCHIVED_AT, table)
    await conn.execute("SELECT pg_catalog.set_config('lock_timeout', $1, true)", f"{int(lock_timeout_ms)}ms")
    await conn.execute(_DETACH.format(table=table))


async def drop(conn: asyncpg.Connection, table: str) -> None:
    async with conn.transaction():
        await conn.execute(_DROP.format(table=table_name(table)))
        await conn.execute(_DROPPED, table)


# ------------------------------------------------------------------------------------------ a restore for an audit

_RESTORED: Final = """
CREATE TABLE public.{table} (
    movement_id uuid NOT NULL, warehouse_id text NOT NULL, sku text NOT NULL, qty bigint NOT NULL, kind text NOT NULL,
    occurred_at timestamptz NOT NULL, kafka_topic text NOT NULL, kafka_partition integer NOT NULL,
    kafka_offset bigint NOT NULL, kafka_timestamp timestamptz, applied_at timestamptz NOT NULL,
    PRIMARY KEY (kafka_topic, kafka_partition, kafka_offset)
)
"""


def restored_name(segment: str) -> str:
    return f"restored_{table_name(segment)}"


async def create_restored(conn: asyncpg.Connection, segment: str, reader_role: str,
                          chunks: Iterable[Sequence[Sequence[Any]]]) -> str:
    """The archived rows of `segment` in a table of their own, restored_<segment>, readable by the readers' role: for
    an audit, never part of the ledger (stock_movements and archived_sums go on counting them once). One
    transaction."""
    table = restored_name(segment)
    async with conn.transaction():
        await conn.execute(_RESTORED.format(table=table))
        await conn.execute(f"COMMENT ON TABLE public.{table} IS 'restored from the archive of {segment} for an "
                           "audit: not part of the ledger; drop it when done'")
        for chunk in chunks:
            await conn.copy_records_to_table(table, records=chunk, columns=COLUMNS)
        await conn.execute(f'GRANT SELECT ON public.{table} TO "{reader_role}"')
    return table


async def table_exists(conn: asyncpg.Connection, table: str) -> bool:
    return bool(await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", f"public.{table}"))
