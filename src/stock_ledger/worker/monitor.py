"""The monitor: one pod's timers (the pod holding the lease, lease.py) that refresh the position, negative-stock
and invariant metrics from Kafka and PostgreSQL, independent of traffic.

Positions (every STOCK_LEDGER_POSITION_REFRESH_SECONDS): log start and end offsets (ListOffsets), the group's
committed offsets (OffsetFetch) and the stored offsets; so a stalled worker still shows its lag growing, and a hole
(stored offset outside the log) shows as `stock_ledger_partition_gap_messages` whichever worker holds it.
The leader exports every partition of the topic; a pod that does not hold the monitor lease exports none of these
gauges, nor the ledger's (metrics.LeaderOnly), so `max by (topic, partition)` sees the leader's values only.

Negative stock (on the position timer): how many (warehouse, sku) levels are below zero and by how much, from the
partial index stock_levels_negative_idx (migration 0004): it holds the negative levels only.

Invariants (every STOCK_LEDGER_INVARIANT_REFRESH_SECONDS, default 60 s): see invariants.py. Each check costs what
was applied since the previous one; a full scan of stock_movements runs every
STOCK_LEDGER_INVARIANT_FULL_SCAN_SECONDS (default 6 h). The check has a Kafka consumer of its own (read_committed,
no group) to tell holes (records in neither table) from transaction markers.

Each refresh reads first and returns what to export; its results are exported only if the lease term it began in
is still this pod's (lease.py): an invariant check may run for up to an hour, and one begun by a former leader
that lost the lease and took it again must not pass its results off as the new term's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog
from aiokafka import TopicPartition

from stock_ledger.audit.compare import TopicRecords
from stock_ledger.audit.invariants import TOPIC_STALL_SECONDS, Invariants
from stock_ledger.clients import database, kafka
from stock_ledger.gaps import find_gap
from stock_ledger.ledger import closings
from stock_ledger.ledger.offsets import stored_offsets
from stock_ledger.ledger.stock import NEGATIVE_TOTALS
from stock_ledger.topics import committed_offsets, partitions_of
from stock_ledger.worker.lease import Lease, TableLease, lease_key

if TYPE_CHECKING:
    from collections.abc import Awaitable

    import asyncpg
    from aiokafka import AIOKafkaConsumer
    from aiokafka.admin import AIOKafkaAdminClient

    from stock_ledger.config import Settings
    from stock_ledger.faults import Faults
    from stock_ledger.metrics import Metrics

log = structlog.get_logger(__name__)

# What a refresh read, exported (or dropped: the lease term it began in has ended) once it returns.
Export = Callable[[], None]


class PositionMonitor:
    def __init__(self, settings: Settings, metrics: Metrics,
                 connect: Callable[[], Awaitable[asyncpg.Connection]], faults: Faults | None = None) -> None:
        self._s = settings
        self._m = metrics
        self._faults = faults
        # A leader silent for three refreshes (at least 10 s) is frozen: the server ends its lease session (or,
        # behind a transaction pooler, its lease expires).
        silent = max(10.0, 3 * settings.position_refresh_seconds)
        self._lease = (TableLease(connect, settings.group_id, settings.topic, silent)
                       if settings.database_pooling == "transaction"
                       else Lease(connect, lease_key(settings.group_id, settings.topic), silent))
        self._tasks: list[asyncio.Task[None]] = []
        self._pool: asyncpg.Pool | None = None
        self._kafka: AIOKafkaConsumer | None = None
        self._admin: AIOKafkaAdminClient | None = None
        self._records: AIOKafkaConsumer | None = None  # the invariant check's own: it is assigned one partition
        self._partitions: list[int] = []
        self._checks = Invariants(settings.invariant_full_scan_seconds, holes_in=settings.topic)
        self._started = time.monotonic()

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._every(self._s.position_refresh_seconds, self._positions), name="positions"),
            # A full pass of a large ledger takes minutes: it gets them (a check is never run twice at once).
            asyncio.create_task(self._every(self._s.invariant_refresh_seconds, self._invariants, limit_seconds=3_600),
                                name="invariants"),
            asyncio.create_task(self._every(self._s.position_refresh_seconds, self._negative_stock),
                                name="negative-stock"),
        ]
        if self._s.closing_seconds > 0:
            # Ticks at most every 5 min; `take` itself decides whether the newest closing is old enough.
            self._tasks.append(asyncio.create_task(
                self._every(min(self._s.closing_seconds, 300.0), self._closings, limit_seconds=1_800),
                name="closings"))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for closer in (self._kafka and self._kafka.stop, self._records and self._records.stop,
                       self._admin and self._admin.close,
                       self._pool and self._pool.close, self._lease.close):
            if closer is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(closer(), 5)

    async def _every(self, seconds: float, refresh: Callable[[], Awaitable[Export]],
                     limit_seconds: float | None = None) -> None:
        while True:
            try:
                leads = await asyncio.wait_for(self._lease.check(), timeout=10)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # A pod that cannot tell whether it still leads must not export as if it did (a thawed leader's
                # dead lease session fails here first); another pod may hold the lease meanwhile.
                leads = False
                log.info("monitor.lease_check_failed", error=f"{type(exc).__name__}: {exc}")
            self._m.lead(leading=leads)
            try:
                if leads:
                    term = self._lease.term
                    export = await asyncio.wait_for(refresh(), timeout=limit_seconds or max(10.0, seconds * 2))
                    # No await between this check and the export: the term cannot change in between.
                    if self._lease.holds(term):
                        export()
                    else:
                        log.info("monitor.refresh_dropped", what=getattr(refresh, "__name__", "?"), term=term,
                                 current_term=self._lease.term, leading=self._lease.held,
                                 detail="the lease was lost (perhaps taken again) while it ran: its results "
                                        "belong to a term that ended and are not exported")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # Metrics are a view, never a reason to stop applying movements.
                log.info("metrics.refresh_failed", what=getattr(refresh, "__name__", "?"),
                         error=f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(seconds)

    async def _db(self) -> asyncpg.Pool:
        if self._pool is None:
            # Two: the negative-stock read must not queue behind an invariant scan (seconds on a large ledger).
            self._pool = await database.pool(self._s, application_name="stock-ledger-metrics", max_size=2)
        return self._pool

    async def _positions(self) -> Export:
        s = self._s
        if self._kafka is None:
            # Reads one record per lagging partition (its timestamp is the lag in seconds), nothing more.
            self._kafka = kafka.reader(s, max_partition_fetch_bytes=64 * 1024)
            await self._kafka.start()
        if self._admin is None:
            self._admin = kafka.admin(s)
            await self._admin.start()
        if not self._partitions:
            self._partitions = await partitions_of(s)
        tps = [TopicPartition(s.topic, p) for p in self._partitions]
        if self._kafka.assignment() != set(tps):
            self._kafka.assign(tps)
            self._kafka.pause(*tps)
        # The order matters while workers commit: Kafka hears only offsets already committed in the database, so reading
        # it first keeps drift >= 0; the log ends only grow, so reading them after the stored offsets keeps
        # end >= stored (no phantom hole "past the log end").
        committed = await committed_offsets(s, self._admin)
        pool = await self._db()
        stored = await stored_offsets(pool, s.group_id, s.topic)
        ends = await self._kafka.end_offsets(tps) if tps else {}
        starts = await self._kafka.beginning_offsets(tps) if tps else {}
        gaps, oldest = {}, {}
        for tp in tps:
            db = stored.get(tp.partition)
            gaps[tp] = find_gap(tp.partition, db, int(starts[tp]), int(ends[tp])) if db is not None else None
            first = db if db is not None else int(starts[tp])  # nothing stored yet: the reset policy's start
            if gaps[tp] is None and first < ends[tp]:
                oldest[tp] = first
        ages = await self._ages(oldest)

        def export() -> None:
            for tp in tps:
                labels = (s.group_id, s.topic, str(tp.partition))
                db, end, gap = stored.get(tp.partition), int(ends[tp]), gaps[tp]
                self._m.log_end_offset.labels(*labels).set(end)
                self._m.db_offset.labels(*labels).set(db if db is not None else 0)
                self._m.lag.labels(*labels).set(end - (db or 0))
                self._m.gap.labels(*labels).set(gap.size if gap else 0)
                told = committed.get(tp.partition)
                if told is not None:
                    self._m.kafka_committed_offset.labels(*labels).set(told)
                    self._m.drift.labels(*labels).set((db or 0) - told)
                self._m.lag_seconds.labels(*labels).set(ages.get(tp, 0.0))
        return export

    async def _ages(self, oldest: dict[TopicPartition, int]) -> dict[TopicPartition, float]:
        """Seconds since each partition's oldest unapplied record was produced: one fetch round for all of them
        (a record each), bounded to a second; a partition not read in time shows 0 until the next refresh."""
        assert self._kafka is not None  # noqa: S101 - _positions started it
        if not oldest:
            return {}
        for tp, offset in oldest.items():
            self._kafka.seek(tp, offset)
        self._kafka.resume(*oldest)
        found: dict[TopicPartition, int] = {}
        deadline = time.monotonic() + 1.0
        try:
            while len(found) < len(oldest) and time.monotonic() < deadline:
                fetched = await self._kafka.getmany(*[tp for tp in oldest if tp not in found], timeout_ms=200)
                for tp, records in fetched.items():
                    if records and tp not in found:
                        found[tp] = records[0].timestamp
        finally:
            self._kafka.pause(*oldest)
        now = time.time()
        return {tp: max(0.0, now - ts / 1000) for tp, ts in found.items() if ts >= 0}
    async def _negative_stock(self) -> Export:
        # Reads the partial index of negative levels and those rows only: cheap at any ledger size, so it can run
        # on the fast timer (its own task: a Kafka outage that fails _positions must not freeze it).
        row = await (await self._db()).fetchrow(NEGATIVE_TOTALS)

        def export() -> None:
            self._m.negative_stock_levels.set(row["levels"])
            self._m.negative_stock_units.set(row["units"])
        return export

    async def _closings(self) -> Export:
        async with (await self._db()).acquire() as conn:
            taken = await closings.take(conn, self._s.topic, every_seconds=self._s.closing_seconds,
                                        daily_after_days=self._s.closing_daily_after_days, faults=self._faults)
            # Every tick, not only after a closing: at most 2,048 ranges a call (2 GiB of segment read again), so a
            # tick every 5 minutes keeps up with about 3 billion movements a day.
            summarized = await closings.summarize(conn)
            age = await conn.fetchval(closings.AGE, self._s.topic)
        if taken.closing_id is not None:
            log.info("closing.taken", closing_id=taken.closing_id, pairs=taken.pairs,
                     positioned_at=taken.positioned_at.isoformat() if taken.positioned_at else None,
                     seconds=round(taken.seconds, 3), thinned=taken.thinned, ranges_summarized=summarized.ranges,
                     ranges_behind=summarized.behind)
        if summarized.ranges and summarized.behind:
            # Catching up (after an upgrade from 0016, or behind a fast ingest): its progress, a line a tick.
            log.info("brin.summarizing", ranges_summarized=summarized.ranges, ranges_behind=summarized.behind)
        elif taken.skipped and not taken.skipped.startswith(closings.NOT_DUE):
            log.warning("closing.skipped", reason=taken.skipped)

        # None taken yet: as old as this monitor, so that closings that never start are alerted on as well.
        age_seconds = float(age) if age is not None else time.monotonic() - self._started

        def export() -> None:
            self._m.closing_age_seconds.set(age_seconds)
            self._m.brin_ranges_behind.set(summarized.behind)
        return export

    async def _invariants(self) -> Export:
        pool = await self._db()
        if self._records is None:
            s = self._s
            # Reads the ranges where offsets are in neither table, to tell holes from transaction markers.
            self._records = kafka.reader(s, auto_offset_reset="none", max_partition_fetch_bytes=1024 * 1024)
            await self._records.start()
        async with pool.acquire() as conn:
            checked = await self._checks.check(conn, records=TopicRecords(
                self._records, stall_seconds=TOPIC_STALL_SECONDS, advice="the check is repeated at the next interval"))
        # Timed and logged whoever exports it: the check ran. What it found is carried by the checker's state (holes,
        # the expected sum, the last full count), so a check whose results are dropped loses nothing for the next.
        self._m.invariant_check.labels(checked.scope).observe(checked.seconds)
        log.info("invariants.checked", scope=checked.scope, seconds=round(checked.seconds, 3),
                 rows=checked.rows_checked, unique=checked.coordinates_unique, ahead=checked.partitions_ahead,
                 mismatches=checked.level_mismatches, missing=checked.missing_records,
                 scanned=checked.offsets_scanned, read=checked.records_read)

        def export() -> None:
            self._m.coordinates_unique.set(1 if checked.coordinates_unique else 0)
            self._m.partitions_ahead.set(checked.partitions_ahead)
            self._m.level_mismatches.set(checked.level_mismatches)
            self._m.missing_records.set(checked.missing_records)
        return export
