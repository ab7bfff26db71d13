"""The ledger's invariants, checked on a timer at a cost that follows the traffic, not the size of the ledger.

Every check (STOCK_LEDGER_INVARIANT_REFRESH_SECONDS) runs in one read-only REPEATABLE READ snapshot:

- the coordinates' unique constraint is present and valid (a catalog lookup). While it is, a duplicated
  (topic, partition, offset) cannot exist, so counting duplicates would only ever say 0;
- no partition holds a row at or beyond its stored next offset (an index probe per partition): rows and offsets
  are written in one transaction, so a row past the offset means they came apart;
- sum(stock_levels.on_hand) = the sum of every movement's qty, kept incrementally: the first check takes the
  snapshot's sum of on_hand and each partition's stored offset as its baseline; each later check adds the qty of
  the rows between the previous and the current stored offset of each partition (an index range scan of the
  unique index: the rows applied since the last check, whatever the size of the ledger);
- no record below a stored offset is in neither table (a hole): in the same range scans, the offsets between the
  previous and the current stored offset that neither stock_movements nor rejected_movements holds. Kafka leaves
  offsets without a record (transaction markers, aborted transactional records); the worker records those it read
  past (non_record_offsets), and ranges in ledger_gaps are `verify`'s, so neither is a candidate. Any other such
  offset is a hole if a read_committed read of the topic returns a record there (only the partitions with a
  candidate are read, from their first candidate to their last) or, below the log start where Kafka can no longer
  say, if it lies in the range whose non-record offsets the ledger recorded (compare.gone_or_unknown: verify and
  repair judge it the same way; outside that range it is logged as unconfirmed). Holes found stay counted
  (re-probed in the database on every check: `stock-ledger repair` fills them, or records those gone from Kafka in
  ledger_gaps) until they are filled or recorded or a new baseline is taken;
  `stock_ledger_ledger_missing_records` exports their size.

Why the stored offsets are a watermark that never skips a row, where a watermark on applied_at or on a sequence
would: a partition is applied by one owner at a time (the claim's epoch fences any other), in offset order, and a
batch's rows and its partition's new next_offset become visible in the same commit. So in any snapshot, the rows
of a partition below its stored next_offset are all there and no row below it can appear later (a batch only
writes from exactly the stored offset on, or is refused by the exact guard: OffsetMismatchError). applied_at =
now() is the start of each transaction and a sequence value is taken before commit: two workers' batches commit
out of that order, and a row committed late would fall below a watermark already passed.

Two things break "no row below it can appear later", and each check handles both:

- Operator commands write below the stored offset on purpose: `stock-ledger rejected replay` (a quarantined record
  becomes a movement at its own coordinates) and `stock-ledger repair` (fills a hole). Their qty is in stock_levels,
  so it must be in the expected sum. Each check also reads the movements below the previous watermark that were
  not visible in the previous check's snapshot (pg_visible_in_snapshot on the row's xmin: exact, and no row the
  workers wrote can pass it, since everything below a watermark was visible in that snapshot), among the rows
  applied since `LATE_COMMIT_SECONDS` before the previous check (the BRIN index on applied_at: those rows, and
  the pages (auto)vacuum has not summarized yet, which are the latest ones).
  An operator transaction open longer than that is not seen and reads as a mismatch: loud, never hidden, and the
  next full pass clears it.
- The database goes back in time (a failover to a standby that lost commits, a restore): a stored offset lower
  than the previous one, or the last movement below the previous watermark gone or rewritten (re-applied after the
  rewind: another applied_at). The ledger below the watermark is then not what the sums were built on, so the
  check logs `invariants.rewound` with the partitions and takes a new baseline of the sum instead of reporting a
  false mismatch, and re-scans each rewound partition for holes from its last surviving row (the range a worker
  may have skipped: it shows as a hole when Kafka still holds it, as lag while the stored offset is below it).

Every STOCK_LEDGER_INVARIANT_FULL_SCAN_SECONDS (default 6 h; the first one at a random point of the first interval,
so pods started together do not scan together) a full pass compares each (warehouse, sku) of stock_levels with
the sum of its movements (a sequential scan of stock_movements) and takes a new baseline. An incremental check
can only see that the totals differ, not which rows: it then reports at least 1 mismatch until a full pass counts
them (`stock-ledger verify` lists them). Holes below the first baseline (a pod that just became the monitor) are
not looked for: that needs the whole topic, `stock-ledger verify` reads it.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Final

import structlog

from stock_ledger.audit.compare import Key, Ranges, RecordOffsets, gone_or_unknown, missing_offsets, records_among
from stock_ledger.audit.ranges import Found, Run, clip, describe, difference, merged, union
from stock_ledger.ledger import archives, offsets

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence
    from datetime import datetime

    import asyncpg

log = structlog.get_logger(__name__)

# How long an operator transaction (rejected replay, repair) may stay open and still have its rows below the
# watermark counted (module docstring). Each check reads the rows applied in this long plus one interval.
LATE_COMMIT_SECONDS: Final = 120.0
# A read of the topic that makes no progress for this long fails the check (retried on the next one).
TOPIC_STALL_SECONDS: Final = 10.0

# The coordinates' unique constraint, exactly as migrations/0001_ledger.sql declares it, and usable.
COORDINATES_UNIQUE: Final = """
SELECT coalesce(bool_and(i.indisvalid AND i.indisunique AND i.indimmediate), false)
  FROM pg_constraint AS c JOIN pg_index AS i ON i.indexrelid = c.conindid
 WHERE c.conrelid = 'stock_movements'::regclass AND c.contype IN ('u', 'p')
   AND pg_get_constraintdef(c.oid) = 'UNIQUE (kafka_topic, kafka_partition, kafka_offset)'
"""
# The first statement of a check: clock_timestamp() is read after the snapshot is taken, so every row the snapshot
# holds was applied (applied_at = its transaction's start) before it.
_SNAPSHOT: Final = "SELECT clock_timestamp(), pg_current_snapshot()::text"
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
# The last movement below each watermark (offset, applied_at): one backward index probe per partition. A ledger
# is append-only, so the same row must still be there, unchanged, at the next check.
_LAST_ROW: Final = """
SELECT w.topic, w.p, m.kafka_offset, m.applied_at
  FROM unnest($1::text[], $2::int[], $3::bigint[]) AS w(topic, p, below)
 CROSS JOIN LATERAL (
       SELECT kafka_offset, applied_at FROM stock_movements
        WHERE kafka_topic = w.topic AND kafka_partition = w.p AND kafka_offset < w.below
        ORDER BY kafka_offset DESC LIMIT 1
       ) AS m
"""
_ROW_AT: Final = """
SELECT w.topic, w.p, m.applied_at
  FROM unnest($1::text[], $2::int[], $3::bigint[]) AS w(topic, p, o)
  JOIN stock_movements AS m ON m.kafka_topic = w.topic AND m.kafka_partition = w.p AND m.kafka_offset = w.o
"""
# The highest offset in either table below a watermark (where a rewound partition's surviving history ends).
_SURVIVING: Final = """
SELECT w.topic, w.p, greatest(
         (SELECT max(kafka_offset) FROM stock_movements
           WHERE kafka_topic = w.topic AND kafka_partition = w.p AND kafka_offset < w.below),
         (SELECT max(kafka_offset) FROM rejected_movements
           WHERE kafka_topic = w.topic AND kafka_partition = w.p AND kafka_offset < w.below))
  FROM unnest($1::text[], $2::int[], $3::bigint[]) AS w(topic, p, below)
"""
# Movements below the previous watermark that the previous snapshot ($5) did not hold: rows operator commands wrote
# since. MATERIALIZED: the BRIN index on applied_at picks the recent rows first, whatever the statistics say. xmin
# is a 32-bit xid: it is widened to xid8 with the epoch of the current snapshot's xmax (rows this recent are far
# less than 2^31 transactions old).
_BELOW: Final = """
WITH recent AS MATERIALIZED (
       SELECT kafka_topic, kafka_partition, kafka_offset, qty, xmin::text::bigint AS x FROM stock_movements
        WHERE applied_at >= $4
     ), ref AS (
       SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS r
     )
SELECT coalesce(sum(m.qty), 0)::numeric, count(*)
  FROM recent AS m
  JOIN unnest($1::text[], $2::int[], $3::bigint[]) AS w(topic, p, below)
    ON m.kafka_topic = w.topic AND m.kafka_partition = w.p AND m.kafka_offset < w.below
 CROSS JOIN ref
 WHERE NOT pg_visible_in_snapshot(
         ((ref.r / 4294967296 - CASE WHEN m.x > ref.r % 4294967296 THEN 1 ELSE 0 END) * 4294967296 + m.x)::text::xid8,
         $5::text::pg_snapshot)
"""
# stock_levels rows that differ from the sum of their movements (both sides: a level without movements, movements
# without a level), archived movements counted by their sums (archive/run.py). The one definition: the full pass
# counts them, `verify` shows a few.
LEVEL_MISMATCHES: Final = """
SELECT coalesce(m.warehouse_id, l.warehouse_id) AS w, coalesce(m.sku, l.sku) AS s,
       coalesce(m.total, 0) AS total, coalesce(l.on_hand, 0) AS on_hand
  FROM (SELECT warehouse_id, sku, sum(q) AS total FROM (
            SELECT warehouse_id, sku, qty AS q FROM stock_movements
            UNION ALL SELECT warehouse_id, sku, qty FROM archived_sums) AS a GROUP BY 1, 2) AS m
  FULL JOIN stock_levels AS l USING (warehouse_id, sku)
 WHERE coalesce(m.total, 0) <> coalesce(l.on_hand, 0)
"""
_MISMATCH_COUNT: Final = f"SELECT count(*) FROM ({LEVEL_MISMATCHES}) AS mismatches"

@dataclass(frozen=True)
class Checked:
    scope: str  # "baseline", "incremental" or "full"
    coordinates_unique: bool
    partitions_ahead: int
    level_mismatches: int
    rows_checked: int  # movements whose qty an incremental check added (0 for the others)
    seconds: float
    missing_records: int = 0  # records below a stored offset in neither table (holes), as known after this check
    offsets_scanned: int = 0  # offsets this check scanned for holes (the new ranges and the known holes)
    records_read: int = 0  # Kafka records read to tell holes from markers
    rewound: tuple[int, ...] = ()  # partitions whose stored history went back since the previous check
    holes: dict[Key, list[Run]] = field(default_factory=dict)


@dataclass(frozen=True)
class _Snapshot:
    """What one check read, kept for the next."""

    clock: datetime
    snapshot: str  # pg_snapshot as text
    watermarks: dict[Key, int]
    last_rows: dict[Key, tuple[int, datetime]]


def _columns(ranges: Sequence[tuple[Key, int, int]]) -> tuple[list[str], list[int], list[int], list[int]]:
    return [k[0] for k, _, _ in ranges], [k[1] for k, _, _ in ranges], [lo for _, lo, _ in ranges], \
        [hi for _, _, hi in ranges]


class Invariants:
    """The state between checks: the previous snapshot, the expected sum of on_hand, the holes found."""

    def __init__(self, full_scan_seconds: float, now: float | None = None, *, holes_in: str | None = None) -> None:
        """`holes_in`: the one topic whose holes are looked for (None: every topic with a stored offset; a topic
        the reader cannot read would fail every check)."""
        self._full_every = full_scan_seconds
        self._holes_in = holes_in
        start = time.monotonic() if now is None else now
        self._next_full = start + random.uniform(0, full_scan_seconds)  # noqa: S311 - jitter, not a secret
        self._previous: _Snapshot | None = None
        self._expected: int | None = None
        self._mismatches = 0  # as counted by the last full pass
        self._holes: dict[Key, list[Run]] = {}

    def full_due(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) >= self._next_full

    async def check(self, conn: asyncpg.Connection, *, full: bool | None = None,
                    records: RecordOffsets | None = None) -> Checked:
        """One check in one snapshot; `full` forces (True) or forbids (False) the full pass (default: when due).
        `records` reads the topic where offsets are missing from both tables (None: holes are not looked for)."""
        started = time.perf_counter()
        full = self.full_due() if full is None else full
        prev = self._previous
        async with conn.transaction(isolation="repeatable_read", readonly=True):
            clock, snapshot = await conn.fetchrow(_SNAPSHOT)
            unique = bool(await conn.fetchval(COORDINATES_UNIQUE))
            ahead = await offsets.partitions_ahead(conn)
            watermarks = await offsets.watermarks(conn)
            total = int(await conn.fetchval(_LEVELS_TOTAL))
            rewound: set[Key] = await self._rewound(conn, prev, watermarks) if prev else set()
            scan: Ranges = await self._scan_ranges(conn, prev, watermarks, rewound) if prev else []
            expected, rows, counted = self._expected, 0, self._mismatches
            if full:
                counted = int(await conn.fetchval(_MISMATCH_COUNT))
                scope, expected = "full", total
            elif expected is None or prev is None or rewound:
                scope, expected = "baseline", total
            else:
                scope = "incremental"
                added, rows = await self._delta(conn, prev, watermarks)
                expected += added
            known = [(k, first, last + 1) for k, runs in self._holes.items() for first, last in runs]
            missing = await missing_offsets(conn, [*scan, *known]) if records is not None else {}
            missing = await self._candidates(conn, missing)
            knowledge = await offsets.non_records_known(conn) if missing else {}
            last_rows = await self._last_rows(conn, watermarks)
        new = {k: [r for r in runs if not _within(r, self._holes.get(k, []))] for k, runs in missing.items()}
        confirmed, read = await self._confirm(new, records, knowledge) if records is not None else ({}, 0)
        holes: dict[Key, list[Run]] = {}
        for k in {*missing, *confirmed}:
            # A known hole stays one while its offsets are still missing and below the stored offset (a stored
            # offset that went back below it makes it lag, no longer a hole).
            still = [r for r in missing.get(k, []) if _within(r, self._holes.get(k, []))]
            if runs := merged(clip([*confirmed.get(k, []), *still], 0, watermarks.get(k, 0) - 1)):
                holes[k] = runs
        if rewound:
            log.warning("invariants.rewound", partitions=sorted(k[1] for k in rewound),
                        detail="the stored history of these partitions went back (a database failover to a standby "
                               "that lost commits, or a restore): new baseline of the level sum; the range since "
                               "their last surviving row is checked for holes",
                        offsets={f"{k[0]}/{k[1]}": [prev.watermarks.get(k) if prev else None, watermarks.get(k)]
                                 for k in sorted(rewound)})
        self._report_new_holes(holes)
        # The state moves only once everything was read: a check that failed (Kafka down) is repeated in full.
        self._previous = _Snapshot(clock, snapshot, watermarks, last_rows)
        self._expected = expected
        self._mismatches = counted
        self._holes = holes
        if full:
            self._next_full = time.monotonic() + self._full_every
        mismatches = self._mismatches if total == self._expected else max(1, self._mismatches)
        return Checked(scope, unique, ahead, mismatches, rows, time.perf_counter() - started,
                       missing_records=sum(b - a + 1 for runs in holes.values() for a, b in runs),
                       offsets_scanned=sum(hi - lo for _, lo, hi in [*scan, *known]) if records else 0,
                       records_read=read,
                       rewound=tuple(sorted(k[1] for k in rewound)), holes=holes)

    async def _rewound(self, conn: asyncpg.Connection, prev: _Snapshot, watermarks: dict[Key, int]) -> set[Key]:
        """Partitions whose stored offset went back, or whose last movement below the previous watermark is gone or
        was written again (another applied_at): the database went back in time."""
        back = {k for k, w in prev.watermarks.items() if watermarks.get(k, 0) < w}
        rows = [(k, o) for k, (o, _) in prev.last_rows.items()]
        found = {(r[0], r[1]): r[2] for r in await conn.fetch(
            _ROW_AT, [k[0] for k, _ in rows], [k[1] for k, _ in rows], [o for _, o in rows])}
        archived = await archives.all_archived_runs(conn)
        # A row archived since (archive/run.py) left in order, with its whole segment: not a step back in time.
        changed = {k for k, (o, at) in prev.last_rows.items()
                   if found.get(k) != at and not any(a <= o <= b for a, b in archived.get(k, []))}
        return back | changed

    async def _scan_ranges(self, conn: asyncpg.Connection, prev: _Snapshot, watermarks: dict[Key, int],
                           rewound: set[Key]) -> Ranges:
        """Per partition, the offsets to look for holes in: those applied since the previous check, and for a
        rewound partition everything since its last surviving row."""
        lows = {k: prev.watermarks.get(k, 0) for k in watermarks}
        if rewound & lows.keys():
            keys = sorted(rewound & lows.keys())
            for r in await conn.fetch(_SURVIVING, [k[0] for k in keys], [k[1] for k in keys],
                                      [prev.watermarks.get(k, 0) for k in keys]):
                key = (r[0], r[1])
                lows[key] = min(lows[key], (r[2] + 1) if r[2] is not None else 0)
        return [(k, lows[k], hi) for k, hi in watermarks.items()
                if hi > lows[k] and self._holes_in in (None, k[0])]

    async def _delta(self, conn: asyncpg.Connection, prev: _Snapshot, watermarks: dict[Key, int]) -> tuple[int, int]:
        """The qty of the rows applied since the previous check: between the previous stored offsets and these,
        and below the previous ones the rows the previous snapshot did not hold (operator commands)."""
        ranges = [(k, prev.watermarks.get(k, 0), hi) for k, hi in watermarks.items() if hi > prev.watermarks.get(k, 0)]
        added, rows = 0, 0
        if ranges:
            qty, n = await conn.fetchrow(_DELTA, *_columns(ranges))
            added, rows = int(qty), int(n)
        below = [(k, w) for k, w in prev.watermarks.items() if w > 0]
        if below:
            since = prev.clock - timedelta(seconds=LATE_COMMIT_SECONDS)
            qty, n = await conn.fetchrow(_BELOW, [k[0] for k, _ in below], [k[1] for k, _ in below],
                                         [w for _, w in below], since, prev.snapshot)
            added, rows = added + int(qty), rows + int(n)
        return added, rows

    @staticmethod
    async def _last_rows(conn: asyncpg.Connection, watermarks: dict[Key, int]) -> dict[Key, tuple[int, datetime]]:
        keys = [k for k, hi in watermarks.items() if hi > 0]
        return {(r[0], r[1]): (r[2], r[3]) for r in await conn.fetch(
            _LAST_ROW, [k[0] for k in keys], [k[1] for k in keys], [watermarks[k] for k in keys])}

    @staticmethod
    async def _candidates(conn: asyncpg.Connection, missing: dict[Key, list[Run]]) -> dict[Key, list[Run]]:
        """The offsets in neither table that may be holes: not recorded as holding no data record (the worker read
        past them), and outside every range recorded in ledger_gaps (verify fails on those until acknowledged)."""
        spans = [(k, runs[0][0], runs[-1][1] + 1) for k, runs in missing.items() if runs]
        if not spans:
            return missing
        non_records = await offsets.non_records(conn, spans)
        recorded = await offsets.gap_ranges(conn)
        archived = await archives.all_archived_runs(conn)
        return {k: left for k, runs in missing.items()
                if (left := list(difference(runs, union(union(non_records.get(k, []), merged(recorded.get(k, []))),
                                                        archived.get(k, [])))))}

    @staticmethod
    async def _confirm(missing: dict[Key, list[Run]], records: RecordOffsets,
                       knowledge: dict[Key, Run]) -> tuple[dict[Key, list[Run]], int]:
        """The candidates that are holes: those Kafka holds a committed record at, and below the log start those the
        ledger knows held one (compare.gone_or_unknown). One read per partition, from its first candidate to its
        last."""
        holes: dict[Key, list[Run]] = {}
        read = 0
        for key, runs in missing.items():
            if not runs:
                continue
            topic_runs, log_start = await records(key[0], key[1], runs[0][0], runs[-1][1] + 1)
            read += topic_runs.count
            gone, unknown = gone_or_unknown(clip(runs, 0, log_start - 1), knowledge.get(key))
            if lost := merged([*records_among(topic_runs, runs), *gone]):
                holes[key] = lost
            if unknown:
                log.warning("invariants.unconfirmed", topic=key[0], partition=key[1],
                            offsets=", ".join(describe(r) for r in unknown[:5]),
                            detail="offsets in neither table are below the log start, and were applied before the "
                                   "ledger recorded which offsets held no record: Kafka no longer says whether they "
                                   "held records; `stock-ledger verify` cannot either")
            await asyncio.sleep(0)
        return holes, read

    def _report_new_holes(self, holes: dict[Key, list[Run]]) -> None:
        for key, runs in holes.items():
            new = [r for r in runs if not _within(r, self._holes.get(key, []))]
            if new:
                found = Found().extend(new)
                log.error("invariants.hole", topic=key[0], partition=key[1], records=found.offsets,
                          offsets=", ".join(describe(r) for r in found.sample),
                          detail="records below the stored offset are in neither stock_movements nor "
                                 "rejected_movements: run `stock-ledger verify`, then `stock-ledger repair`")


def _within(run: Run, runs: Iterable[Run]) -> bool:
    return any(a <= run[0] and run[1] <= b for a, b in runs)
