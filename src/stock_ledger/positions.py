"""Timers that refresh position and invariant metrics from Kafka and PostgreSQL, independent of traffic.

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
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING

import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from stock_ledger.clients import create_database_pool, kafka_options
from stock_ledger.gaps import find_gap
from stock_ledger.invariants import Invariants, KafkaRecords
from stock_ledger.lease import Lease, lease_key
from stock_ledger.sink import stored_offsets
from stock_ledger.stock import NEGATIVE_TOTALS
from stock_ledger.topics import partitions_of

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    import asyncpg

    from stock_ledger.config import Settings
    from stock_ledger.metrics import Metrics

log = structlog.get_logger(__name__)


class PositionMonitor:
    def __init__(self, settings: Settings, metrics: Metrics,
                 connect: Callable[[], Awaitable[asyncpg.Connection]]) -> None:
        self._s = settings
        self._m = metrics
        # A leader silent for three refreshes (at least 10 s) is frozen: the server ends its lease session.
        self._lease = Lease(connect, lease_key(settings.group_id, settings.topic),
                            max(10.0, 3 * settings.position_refresh_seconds))
        self._tasks: list[asyncio.Task[None]] = []
        self._pool: asyncpg.Pool | None = None
        self._kafka: AIOKafkaConsumer | None = None
        self._admin: AIOKafkaAdminClient | None = None
        self._records: AIOKafkaConsumer | None = None  # the invariant check's own: it is assigned one partition
        self._partitions: list[int] = []
        self._checks = Invariants(settings.invariant_full_scan_seconds, holes_in=settings.topic)

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._every(self._s.position_refresh_seconds, self._positions), name="positions"),
            # A full pass of a large ledger takes minutes: it gets them (a check is never run twice at once).
            asyncio.create_task(self._every(self._s.invariant_refresh_seconds, self._invariants, limit_seconds=3_600),
                                name="invariants"),
            asyncio.create_task(self._every(self._s.position_refresh_seconds, self._negative_stock),
                                name="negative-stock"),
        ]

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

    async def _every(self, seconds: float, refresh: Callable[[], Awaitable[None]],
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
                    await asyncio.wait_for(refresh(), timeout=limit_seconds or max(10.0, seconds * 2))
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
            self._pool = await create_database_pool(self._s, application_name="stock-ledger-metrics", max_size=2)
        return self._pool

    async def _positions(self) -> None:
        s = self._s
        if self._kafka is None:
            # Reads one record per lagging partition (its timestamp is the lag in seconds), nothing more.
            self._kafka = AIOKafkaConsumer(bootstrap_servers=s.kafka_bootstrap_servers, enable_auto_commit=False,
                                           isolation_level="read_committed", max_partition_fetch_bytes=64 * 1024,
                                           **kafka_options(s))
            await self._kafka.start()
        if self._admin is None:
            self._admin = AIOKafkaAdminClient(bootstrap_servers=s.kafka_bootstrap_servers, **kafka_options(s))
            await self._admin.start()
        if not self._partitions:
            self._partitions = await partitions_of(s.kafka_bootstrap_servers, s.topic, options=kafka_options(s))
        tps = [TopicPartition(s.topic, p) for p in self._partitions]
        if self._kafka.assignment() != set(tps):
            self._kafka.assign(tps)
            self._kafka.pause(*tps)
        # The order matters while workers commit: Kafka hears only offsets already committed in the database, so reading
        # it first keeps drift >= 0; the log ends only grow, so reading them after the stored offsets keeps
        # end >= stored (no phantom hole "past the log end").
        committed = await self._admin.list_consumer_group_offsets(s.group_id)
        pool = await self._db()
        stored = await stored_offsets(pool, s.group_id, s.topic)
        ends = await self._kafka.end_offsets(tps) if tps else {}
        starts = await self._kafka.beginning_offsets(tps) if tps else {}
        oldest: dict[TopicPartition, int] = {}
        for tp in tps:
            labels = (s.group_id, s.topic, str(tp.partition))
            db = stored.get(tp.partition)
            end = int(ends[tp])
            self._m.log_end_offset.labels(*labels).set(end)
            self._m.db_offset.labels(*labels).set(db if db is not None else 0)
            self._m.lag.labels(*labels).set(end - (db or 0))
            gap = find_gap(tp.partition, db, int(starts[tp]), end) if db is not None else None
            self._m.gap.labels(*labels).set(gap.size if gap else 0)
            first = db if db is not None else int(starts[tp])  # nothing stored yet: the reset policy's start
            if gap is None and first < end:
                oldest[tp] = first
            meta = committed.get(tp)
            if meta is not None and meta.offset >= 0:
                self._m.kafka_committed_offset.labels(*labels).set(meta.offset)
                self._m.drift.labels(*labels).set((db or 0) - meta.offset)
        ages = await self._ages(oldest)
        for tp in tps:
            self._m.lag_seconds.labels(s.group_id, s.topic, str(tp.partition)).set(ages.get(tp, 0.0))

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
    async def _negative_stock(self) -> None:
        # Reads the partial index of negative levels and those rows only: cheap at any ledger size, so it can run
        # on the fast timer (its own task: a Kafka outage that fails _positions must not freeze it).
        row = await (await self._db()).fetchrow(NEGATIVE_TOTALS)
        self._m.negative_stock_levels.set(row["levels"])
        self._m.negative_stock_units.set(row["units"])

    async def _invariants(self) -> None:
        pool = await self._db()
        if self._records is None:
            s = self._s
            # Reads the ranges where offsets are in neither table, to tell holes from transaction markers.
            self._records = AIOKafkaConsumer(bootstrap_servers=s.kafka_bootstrap_servers, enable_auto_commit=False,
                                             isolation_level="read_committed", auto_offset_reset="none",
                                             max_partition_fetch_bytes=1024 * 1024, **kafka_options(s))
            await self._records.start()
        async with pool.acquire() as conn:
            checked = await self._checks.check(conn, records=KafkaRecords(self._records))
        self._m.coordinates_unique.set(1 if checked.coordinates_unique else 0)
        self._m.partitions_ahead.set(checked.partitions_ahead)
        self._m.level_mismatches.set(checked.level_mismatches)
        self._m.missing_records.set(checked.missing_records)
        self._m.invariant_check.labels(checked.scope).observe(checked.seconds)
        log.info("invariants.checked", scope=checked.scope, seconds=round(checked.seconds, 3),
                 rows=checked.rows_checked, unique=checked.coordinates_unique, ahead=checked.partitions_ahead,
                 mismatches=checked.level_mismatches, missing=checked.missing_records,
                 scanned=checked.offsets_scanned, read=checked.records_read)
