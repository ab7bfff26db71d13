"""The ledger's invariants, checked on a timer at a cost that follows the traffic, not the size of the ledger.

Every check (STOCK_LEDGER_INVARIANT_REFRESH_SECONDS) runs in one read-only REPEATABLE READ snapshot:

- the coordinates' unique constraint is present and valid (a catalog lookup). While it is, a duplicated
  (topic, partition, offset) cannot exist, so counting duplicates would only ever say 0;
- no partition holds a row at or beyond its stored next offset (an index probe per partition): rows and offsets
  are written in one transaction, so a row past the offset means they came apart;
- sum(stock_levels.on_hand) = the sum of every movement's qty, kept incrementally: the first check takes the
  snapshot's sum of on_hand and each partition's stored offset as its baseline; each later check adds the qty of
  the rows between the previous and the current stored offset of each partition (an index range scan of the
  unique index: the rows applied since the last check, whatever the size of the ledger).

Why the stored offsets are a watermark that never skips a row, where a watermark on applied_at or on a sequence
would: a partition is applied by one owner at a time (the claim's epoch fences any other), in offset order, and a
batch's rows and its partition's new next_offset become visible in the same commit. So in any snapshot, the rows
of a partition below its stored next_offset are all there and no row below it can appear later (a batch only
writes at or above the stored offset, or is refused as an OffsetRegressionError). applied_at = now() is the start
of each transaction and a sequence value is taken before commit: two workers' batches commit out of that order,
and a row committed late would fall below a watermark already passed.

Every STOCK_LEDGER_INVARIANT_FULL_SCAN_SECONDS (default 6 h; the first one at a random point of the first interval,
so pods started together do not scan together) a full pass compares each (warehouse, sku) of stock_levels with
the sum of its movements (a sequential scan of stock_movements) and takes a new baseline. An incremental check
can only see that the totals differ, not which rows: it then reports at least 1 mismatch until a full pass counts
them (`stock-ledger verify` lists them).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    import asyncpg

# The coordinates' unique constraint, exactly as migrations/0001_ledger.sql declares it, and usable.
COORDINATES_UNIQUE: Final = """
SELECT coalesce(bool_and(i.indisvalid AND i.indisunique AND i.indimmediate), false)
  FROM pg_constraint AS c JOIN pg_index AS i ON i.indexrelid = c.conindid
 WHERE c.conrelid = 'stock_movements'::regclass AND c.contype IN ('u', 'p')
   AND pg_get_constraintdef(c.oid) = 'UNIQUE (kafka_topic, kafka_partition, kafka_offset)'
"""
# Per (topic, partition), whatever the group: a second group on the same topic and database could only re-apply
# rows (refused by the unique constraint), so the furthest stored offset is the watermark.
_OFFSETS: Final = "SELECT topic, partition, max(next_offset) FROM consumer_offsets GROUP BY 1, 2"
_AHEAD: Final = """
SELECT count(*) FROM consumer_offsets AS c
 WHERE EXISTS (SELECT FROM stock_movements AS m WHERE m.kafka_topic = c.topic AND m.kafka_partition = c.partition
                  AND m.kafka_offset >= coalesce(c.next_offset, 0))
    OR EXISTS (SELECT FROM rejected_movements AS r WHERE r.kafka_topic = c.topic AND r.kafka_partition = c.partition
                  AND r.kafka_offset >= coalesce(c.next_offset, 0))
"""
_LEVELS_TOTAL: Final = "SELECT coalesce(sum(on_hand), 0)::numeric FROM stock_levels"
# LATERAL: one range scan of the unique index per partition, whatever the planner thinks of the whole table (a join
# over unnest() may pick a scan of all of stock_movements when its statistics are stale).
_DELTA: Final = """
SELECT coalesce(sum(d.qty), 0)::numeric, coalesce(sum(d.n), 0)::bigint
  FROM unnest($1::text[], $2::int[], $3::bigint[], $4::bigint[]) AS w(topic, p, lo, hi)
 CROSS JOIN LATERAL (
       SELECT sum(m.qty) AS qty, count(*) AS n FROM stock_movements AS m
        WHERE m.kafka_topic = w.topic AND m.kafka_partition = w.p AND m.kafka_offset >= w.lo AND m.kafka_offset < w.hi
       ) AS d
"""
# stock_levels rows that differ from the sum of their movements (both sides: a level without movements, movements
# without a level). The one definition: the full pass counts them, `verify` shows a few.
LEVEL_MISMATCHES: Final = """
SELECT coalesce(m.warehouse_id, l.warehouse_id) AS w, coalesce(m.sku, l.sku) AS s,
       coalesce(m.total, 0) AS total, coalesce(l.on_hand, 0) AS on_hand
  FROM (SELECT warehouse_id, sku, sum(qty) AS total FROM stock_movements GROUP BY 1, 2) AS m
  FULL JOIN stock_levels AS l USING (warehouse_id, sku)
 WHERE coalesce(m.total, 0) <> coalesce(l.on_hand, 0)
"""
_MISMATCH_COUNT: Final = f"SELECT count(*) FROM ({LEVEL_MISMATCHES}) AS mismatches"

Key = tuple[str, int]  # (topic, partition)


@dataclass(frozen=True)
class Checked:
    scope: str  # "baseline", "incremental" or "full"
    coordinates_unique: bool
    partitions_ahead: int
    level_mismatches: int
    rows_checked: int  # movements whose qty an incremental check added (0 for the others)
    seconds: float


class Invariants:
    """The state between checks: the stored offsets and the expected sum of on_hand at the last one."""

    def __init__(self, full_scan_seconds: float, now: float | None = None) -> None:
        self._full_every = full_scan_seconds
        start = time.monotonic() if now is None else now
        self._next_full = start + random.uniform(0, full_scan_seconds)  # noqa: S311 - jitter, not a secret
        self._watermarks: dict[Key, int] = {}
        self._expected: int | None = None
        self._mismatches = 0  # as counted by the last full pass

    def full_due(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) >= self._next_full

    async def check(self, conn: asyncpg.Connection, *, full: bool | None = None) -> Checked:
        """One check in one snapshot; `full` forces (True) or forbids (False) the full pass (default: when due)."""
        started = time.perf_counter()
        full = self.full_due() if full is None else full
        async with conn.transaction(isolation="repeatable_read", readonly=True):
            unique = bool(await conn.fetchval(COORDINATES_UNIQUE))
            ahead = int(await conn.fetchval(_AHEAD))
            offsets: dict[Key, int] = {(r[0], r[1]): r[2] or 0 for r in await conn.fetch(_OFFSETS)}
            total = int(await conn.fetchval(_LEVELS_TOTAL))
            if full:
                self._mismatches = int(await conn.fetchval(_MISMATCH_COUNT))
                scope, rows = "full", 0
                self._expected = total
            elif self._expected is None:
                scope, rows = "baseline", 0
                self._expected = total
            else:
                scope = "incremental"
                added, rows = await self._delta(conn, offsets)
                self._expected += added
        self._watermarks = offsets
        if full:
            self._next_full = time.monotonic() + self._full_every
        mismatches = self._mismatches if total == self._expected else max(1, self._mismatches)
        return Checked(scope, unique, ahead, mismatches, rows, time.perf_counter() - started)

    async def _delta(self, conn: asyncpg.Connection, offsets: dict[Key, int]) -> tuple[int, int]:
        """The qty of the rows applied between the previous stored offsets and these, per partition."""
        ranges = [(k, self._watermarks.get(k, 0), hi) for k, hi in offsets.items() if hi > self._watermarks.get(k, 0)]
        if not ranges:
            return 0, 0
        added, rows = await conn.fetchrow(_DELTA, [k[0] for k, _, _ in ranges], [k[1] for k, _, _ in ranges],
                                          [lo for _, lo, _ in ranges], [hi for _, _, hi in ranges])
        return int(added), int(rows)
