"""Timers that refresh position and invariant metrics from Kafka and PostgreSQL, independent of traffic.

Positions (every STOCK_LEDGER_POSITION_REFRESH_SECONDS): log end offsets (ListOffsets), the group's committed
offsets (OffsetFetch) and the stored offsets; so a stalled worker still shows its lag growing. Each pod exports
every partition of the topic; aggregate with max by (topic, partition).

Invariants (every STOCK_LEDGER_INVARIANT_REFRESH_SECONDS, default 60 s): see invariants.py. Each check costs what
was applied since the previous one; a full scan of stock_movements runs every
STOCK_LEDGER_INVARIANT_FULL_SCAN_SECONDS (default 6 h).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Final

import asyncpg
import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from stock_ledger.invariants import Invariants
from stock_ledger.topics import partitions_of

if TYPE_CHECKING:
    from stock_ledger.config import Settings
    from stock_ledger.metrics import Metrics

log = structlog.get_logger(__name__)

_STORED: Final = "SELECT partition, next_offset FROM consumer_offsets WHERE group_id = $1 AND topic = $2"

class PositionMonitor:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self._s = settings
        self._m = metrics
        self._tasks: list[asyncio.Task[None]] = []
        self._pool: asyncpg.Pool | None = None
        self._kafka: AIOKafkaConsumer | None = None
        self._admin: AIOKafkaAdminClient | None = None
        self._partitions: list[int] = []
        self._checks = Invariants(settings.invariant_full_scan_seconds)

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._every(self._s.position_refresh_seconds, self._positions), name="positions"),
            # A full pass of a large ledger takes minutes: it gets them (a check is never run twice at once).
            asyncio.create_task(self._every(self._s.invariant_refresh_seconds, self._invariants, limit_seconds=3_600),
                                name="invariants"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for closer in (self._kafka and self._kafka.stop, self._admin and self._admin.close,
                       self._pool and self._pool.close):
            if closer is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(closer(), 5)

    async def _every(self, seconds: float, refresh: object, limit_seconds: float | None = None) -> None:
        assert callable(refresh)  # noqa: S101
        while True:
            try:
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
            self._pool = await asyncpg.create_pool(
                self._s.require_database_url(), min_size=0, max_size=1, timeout=5,
                server_settings={"application_name": "stock-ledger-metrics"},
            )
        return self._pool

    async def _positions(self) -> None:
        s = self._s
        if self._kafka is None:
            self._kafka = AIOKafkaConsumer(bootstrap_servers=s.kafka_bootstrap_servers, enable_auto_commit=False,
                                           isolation_level="read_committed")
            await self._kafka.start()
        if self._admin is None:
            self._admin = AIOKafkaAdminClient(bootstrap_servers=s.kafka_bootstrap_servers)
            await self._admin.start()
        if not self._partitions:
            self._partitions = await partitions_of(s.kafka_bootstrap_servers, s.topic)
        tps = [TopicPartition(s.topic, p) for p in self._partitions]
        ends = await self._kafka.end_offsets(tps) if tps else {}
        committed = await self._admin.list_consumer_group_offsets(s.group_id)
        pool = await self._db()
        stored = {r["partition"]: r["next_offset"] for r in await pool.fetch(_STORED, s.group_id, s.topic)}
        for tp in tps:
            labels = (s.topic, str(tp.partition))
            db = stored.get(tp.partition)
            end = int(ends[tp])
            self._m.log_end_offset.labels(*labels).set(end)
            self._m.db_offset.labels(*labels).set(db if db is not None else 0)
            self._m.lag.labels(*labels).set(end - (db or 0))
            meta = committed.get(tp)
            if meta is not None and meta.offset >= 0:
                self._m.kafka_committed_offset.labels(*labels).set(meta.offset)
                self._m.drift.labels(*labels).set((db or 0) - meta.offset)

    async def _invariants(self) -> None:
        pool = await self._db()
        async with pool.acquire() as conn:
            checked = await self._checks.check(conn)
        self._m.coordinates_unique.set(1 if checked.coordinates_unique else 0)
        self._m.partitions_ahead.set(checked.partitions_ahead)
        self._m.level_mismatches.set(checked.level_mismatches)
        self._m.invariant_check.labels(checked.scope).observe(checked.seconds)
        log.info("invariants.checked", scope=checked.scope, seconds=round(checked.seconds, 3),
                 rows=checked.rows_checked, unique=checked.coordinates_unique, ahead=checked.partitions_ahead,
                 mismatches=checked.level_mismatches)
