"""The worker: startup -> main loop -> shutdown.

The main loop owns the database session and is the only writer: it claims newly assigned partitions (the
rebalance listener only pauses them), reads a batch, applies it in one transaction (sink.Ledger.apply); Kafka is
told the committed offsets advisorily, once a second (advice.KafkaAdvice). Which partitions may be written, and
from which offset, is `assignment.Assignment`; the claim, with its seek positions and the log's holes, is
`claims.Claimer`. The rebalance listener runs in aiokafka's coordination task: on revocation it waits for the
in-flight batch; on assignment it pauses the partitions synchronously, so nothing is fetched from Kafka's committed
offsets before we seek to ours.

Beside this module: the checks before the first batch (startup.py), fetching and building a batch (intake.py), the
batch transaction and its bookkeeping (commit.py), signals and teardown (shutdown.py).
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import TYPE_CHECKING, Any

import structlog
from prometheus_client import CollectorRegistry

from stock_ledger.advice import KafkaAdvice
from stock_ledger.assignment import Assignment
from stock_ledger.claims import Claimer
from stock_ledger.clients import connect_worker, kafka_options, make_consumer, quiet_lost_session_replies
from stock_ledger.commit import BatchWriter
from stock_ledger.faults import Faults
from stock_ledger.health import HttpServer
from stock_ledger.intake import Intake, take
from stock_ledger.metrics import Metrics
from stock_ledger.migrate import check_schema
from stock_ledger.positions import PositionMonitor
from stock_ledger.rebalance import Rebalance
from stock_ledger.retry import Abandoned, Retrier
from stock_ledger.shutdown import cancel, close_consumer, exit_signals
from stock_ledger.sink import Ledger
from stock_ledger.startup import Startup
from stock_ledger.topics import watch_compaction

if TYPE_CHECKING:
    import signal

    import asyncpg
    from aiokafka import TopicPartition

    from stock_ledger.batch import Batch
    from stock_ledger.config import Settings

__all__ = ["Worker", "serve", "take"]

log = structlog.get_logger(__name__)


class Worker:
    def __init__(self, settings: Settings, registry: CollectorRegistry | None = None) -> None:
        self.settings = settings
        self.metrics = Metrics(registry or CollectorRegistry())
        self.ledger = Ledger(settings.group_id, Faults(settings.fault))
        self.assignment = Assignment()
        self.stopping = asyncio.Event()
        self.consumer = make_consumer(settings)
        self._batch_lock = asyncio.Lock()
        self.consumer.subscribe([settings.topic], listener=Rebalance(
            self.consumer, self.assignment, self._batch_lock, self.metrics, settings.rebalance_timeout_ms / 2000))
        self.claimer = Claimer(settings, self.ledger, self.assignment, self.consumer, self.metrics,
                               functools.partial(connect_worker, settings))
        self._conn: asyncpg.Connection | None = None
        self._db_ok = False
        self._last_progress = self._idle_checked = time.monotonic()
        self._main: asyncio.Task[None] | None = None
        self._in_flight: asyncio.Task[None] | None = None  # the batch transaction running while the next is built
        self._compaction: asyncio.Task[None] | None = None  # fails (the worker halts) if compaction is switched on
        # Whether the last fetch brought a tenth of a full batch or more: records queue up, so the next batch is
        # built while this one commits (throughput). Below that we are caught up and fetch after the commit, so
        # what arrived meanwhile goes into the next batch (latency: a small batch built ahead would hold the
        # records that arrive behind it for one more cycle). Measured at 5,000/s (batches of ~50, serial) and
        # 20,000/s (batches of ~3,000, which a fetch-after-commit loop left at half the CPU of either side).
        self._behind = False
        self.advice = KafkaAdvice(self.consumer, settings.topic)
        self._retry = Retrier(settings.retry_deadline_seconds, self.stopping, self._on_fault)
        self.startup = Startup(settings, self._retry, self.consumer)
        self.intake = Intake(settings, self.consumer, self.assignment, self.claimer, self._retry)
        self.writer = BatchWriter(
            consumer=self.consumer, assignment=self.assignment, ledger=self.ledger, claimer=self.claimer,
            metrics=self.metrics, advice=self.advice, retry=self._retry, lock=self._batch_lock,
            session=self._session, current_session=lambda: self._conn)
        # Computed at scrape time from what /readyz answers: it cannot disagree with it (a gauge set on some
        # transitions stayed 0 after the database came back while /readyz said 200).
        self.metrics.ready.set_function(lambda: 1.0 if self.ready()[0] else 0.0)

    async def serve(self) -> int:
        """Run until SIGTERM/SIGINT (see `handle_exit`); 0 on a requested stop."""
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(quiet_lost_session_replies)
        self._main = asyncio.create_task(self.run(), name="worker")
        with exit_signals(loop, self.handle_exit):
            try:
                await self._main
            except asyncio.CancelledError:
                if not self.stopping.is_set():
                    raise
                log.warning("worker.grace_expired", detail="in-flight batch abandoned; its transaction rolled back")
        return 0

    # ---------------------------------------------------------------- lifecycle

    async def run(self) -> None:
        s = self.settings
        log.info("worker.starting", settings=s.loggable())
        http = HttpServer("0.0.0.0", s.metrics_port, self.metrics.registry, self.liveness, self.readiness)  # noqa: S104
        await http.start()
        monitor = PositionMonitor(s, self.metrics, functools.partial(connect_worker, s))
        advisor: asyncio.Task[None] | None = None
        try:
            await self.startup.refuse_pooling()
            self._conn = await self._retry("connect to PostgreSQL", self._connect, "startup.retry")
            await check_schema(self._conn)
            self._db_ok = True
            await self.startup.join_kafka()
            monitor.start()
            advisor = asyncio.create_task(self.advice.run(), name="advisory-commit")
            self._compaction = asyncio.create_task(watch_compaction(
                s.kafka_bootstrap_servers, s.topic, options=kafka_options(s),
                interval_seconds=s.invariant_refresh_seconds), name="compaction-watch")
            await self._main_loop()
            await cancel(advisor)
            await self.advice.tell()  # the last batches' offsets, so the next owner's lag starts right
        except Abandoned as exc:
            log.info("worker.abandoned", detail=str(exc))
        finally:
            await cancel(advisor, self._compaction)
            await monitor.close()
            await close_consumer(self.consumer)
            if self._conn is not None:
                await self._conn.close(timeout=2)
            await http.close()
            log.info("worker.stopped")

    def handle_exit(self, sig: signal.Signals) -> None:
        """The first SIGTERM/SIGINT drains (bounded by the grace period), a second one exits at once."""
        if self.stopping.is_set():
            log.warning("worker.forced_exit", signal=sig.name)
            if self._main is not None:
                self._main.cancel()
            return
        log.info("worker.signal", signal=sig.name, grace_seconds=self.settings.shutdown_grace_seconds)
        self.stopping.set()
        if self._main is not None:
            asyncio.get_running_loop().call_later(self.settings.shutdown_grace_seconds, self._main.cancel)

    # ---------------------------------------------------------------- health

    async def liveness(self) -> tuple[bool, str]:
        idle = time.monotonic() - self._last_progress
        if idle > self.settings.stall_seconds:
            return False, f"main loop made no progress for {idle:.0f}s (limit {self.settings.stall_seconds:g}s)"
        return True, f"main loop progressed {idle:.1f}s ago"

    async def readiness(self) -> tuple[bool, str]:
        return self.ready()

    def ready(self) -> tuple[bool, str]:
        """/readyz and stock_ledger_ready: connected, a member, every assigned partition claimed."""
        if not self._db_ok:
            return False, "PostgreSQL not connected"
        if self.startup.topic_problem is not None:
            return False, self.startup.topic_problem
        return self.assignment.readiness()

    # ---------------------------------------------------------------- main loop

    async def _main_loop(self) -> None:
        """While behind, fetching and building batch N+1 overlaps batch N's transaction: Python work against
        database work, one writer. A claim waits for the batch in flight; a stop lets it commit (or abandon it on a
        fault)."""
        try:
            await self._pipeline()
        except BaseException:
            if self._in_flight is not None:
                self._in_flight.cancel()  # rolled back: the next owner applies it from the stored offsets
            raise
        await self._drain()

    async def _pipeline(self) -> None:
        while not self.stopping.is_set():
            self._last_progress = time.monotonic()
            if self._compaction is not None and self._compaction.done():
                self._compaction.result()  # raises: the topic became compacted, nothing more is applied
            if self._in_flight is not None and self._in_flight.done():
                await self._drain()  # a batch that failed for good stops the worker now, not after the next fetch
            self.claimer.check_fenced_partitions()
            if self.assignment.pending or self.claimer.recheck_due():
                await self._drain()
                await self._retry("claiming partitions", self._claim, "claim.retry")
                continue
            if not self._behind:
                await self._drain()
            fetched = await self._fetch()
            fetched_at = time.time()
            if not fetched:
                await self._check_while_idle()
                continue
            self._behind = sum(map(len, fetched.values())) >= self.settings.batch_max_records // 10
            if self.ledger.faults.reached("after_read"):
                await self.stopping.wait()
                break
            batch = await self.intake.build(fetched)
            await self._drain()
            if batch is not None:
                batch.fetched_at = fetched_at
                self._in_flight = asyncio.create_task(self._write(batch), name="batch")

    async def _drain(self) -> None:
        """Wait for the batch in flight, if any; its failure is ours."""
        task, self._in_flight = self._in_flight, None
        if task is not None:
            await task

    async def _write(self, batch: Batch) -> None:
        if await self.writer.write(batch) is not None:
            self._db_ok = True  # a commit: the database answers

    async def _claim(self) -> None:
        await self.claimer.claim(await self._session())

    async def _fetch(self) -> dict[TopicPartition, list[Any]]:
        return await self.intake.fetch()

    # ---------------------------------------------------------------- sessions and retries

    async def _session(self) -> asyncpg.Connection:
        """The one database session; a session the server closed under us (terminated, restarted, idle timeout)
        counts as a database retry, since no statement of ours saw the fault."""
        if self._conn is not None and self._conn.is_closed():
            self.metrics.retries.labels("database").inc()
            log.info("db.reconnect", reason="the server closed our session while it was idle")
            self._conn = None
        if self._conn is None:
            self._conn = await self._connect()
        self._db_ok = True
        return self._conn

    async def _check_while_idle(self) -> None:
        """With no records, no batch guard looks at the stored offsets: a failover or restore while the topic is
        quiet would leave its lost range missing until each partition's next record. So every
        STOCK_LEDGER_POSITION_REFRESH_SECONDS of idleness the session is checked (a dead one reconnects, and a new
        session checks itself) and the stored offsets compared with ours: one small query."""
        now = time.monotonic()
        if now - self._idle_checked < self.settings.position_refresh_seconds or self._in_flight is not None:
            return
        self._idle_checked = now
        await self._retry("checking the stored offsets", self._check_offsets, "db.retry")

    async def _check_offsets(self) -> None:
        fresh = self._conn is None or self._conn.is_closed()
        conn = await self._session()
        if not fresh:  # a new session has just checked itself
            await self.claimer.check_offsets(conn)

    async def _connect(self) -> asyncpg.Connection:
        """A new session, checked before it writes (claims.Claimer.check_session)."""
        conn = await connect_worker(self.settings)
        try:
            await self.claimer.check_session(conn)
        except BaseException:
            conn.terminate()
            raise
        return conn

    def _on_fault(self, cause: str, _exc: Exception) -> None:
        self.metrics.retries.labels(cause).inc()
        self._last_progress = time.monotonic()  # retrying is alive: /healthz stays 200, /readyz says why not
        if cause == "database":
            self._db_ok = False
            if self._conn is not None:
                # The session may be half-dead (killed while we were frozen mid-statement): start afresh.
                self._conn.terminate()
                self._conn = None


async def serve(settings: Settings, registry: CollectorRegistry | None = None) -> int:
    return await Worker(settings, registry).serve()
