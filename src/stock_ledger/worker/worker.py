"""The worker's life in one class: start -> main loop -> stop.

The main loop owns the database session (session.py) and is the only writer: it claims newly assigned partitions
(the rebalance listener only pauses them), reads a batch, applies it in one transaction (ledger.transaction); Kafka
is told the committed offsets advisorily, once a second (consumer.advice). Which partitions may be written, and
from which offset, is `consumer.assignment.Assignment`; the claim, with its seek positions and the log's holes, is
`consumer.claims.Claimer`. The rebalance listener runs in aiokafka's coordination task: on revocation it waits for
the in-flight batch; on assignment it pauses the partitions synchronously, so nothing is fetched from Kafka's
committed offsets before we seek to ours.

The pipeline: fetching and building a batch (intake.py) overlaps the transaction of the batch before it
(commit.py). Beside them: the checks before the first batch (checks.py), the monitor one pod runs (monitor.py), the
retries (retry.py) and the health server (health.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import time
from typing import TYPE_CHECKING

import structlog
from aiokafka.errors import KafkaError
from prometheus_client import CollectorRegistry

from stock_ledger.clients import kafka
from stock_ledger.clients.database import quiet_lost_session_replies, worker_session
from stock_ledger.clients.registry import RegistryClient
from stock_ledger.config import check_worker_timeouts
from stock_ledger.consumer.advice import KafkaAdvice
from stock_ledger.consumer.assignment import Assignment
from stock_ledger.consumer.claims import Claimer
from stock_ledger.consumer.rebalance import Rebalance
from stock_ledger.faults import Faults
from stock_ledger.formats.decode import RecordDecoder
from stock_ledger.formats.resolver import SchemaResolver
from stock_ledger.ledger.claims import Claims
from stock_ledger.ledger.transaction import Ledger
from stock_ledger.metrics import Metrics
from stock_ledger.migrate import check_schema
from stock_ledger.topics import watch_compaction
from stock_ledger.worker.checks import Checks
from stock_ledger.worker.commit import BatchWriter
from stock_ledger.worker.health import HttpServer
from stock_ledger.worker.intake import Intake
from stock_ledger.worker.monitor import PositionMonitor
from stock_ledger.worker.retry import Abandoned, Retrier
from stock_ledger.worker.session import Session

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from stock_ledger.config import Settings
    from stock_ledger.ledger.batch import Batch

# One logger name for the worker's events, whichever of its modules logs them.
log = structlog.get_logger("stock_ledger.worker")

_EXIT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Worker:
    def __init__(self, settings: Settings, registry: CollectorRegistry | None = None) -> None:
        check_worker_timeouts(settings)
        self.settings = settings
        self.metrics = Metrics(registry or CollectorRegistry())
        faults = Faults(settings.fault)
        self.ledger = Ledger(settings.group_id, faults)
        self.assignment = Assignment()
        self.stopping = asyncio.Event()
        self.consumer = kafka.group_consumer(settings)
        self._batch_lock = asyncio.Lock()
        self.consumer.subscribe([settings.topic], listener=Rebalance(
            self.consumer, self.assignment, self._batch_lock, self.metrics, settings.rebalance_timeout_ms / 2000))
        self.claimer = Claimer(settings, Claims(settings.group_id, faults), self.assignment, self.consumer,
                               self.metrics, functools.partial(worker_session, settings))
        self.session = Session(functools.partial(worker_session, settings), self.claimer.check_session, self.metrics)
        self._last_progress = self._idle_checked = time.monotonic()
        self._main: asyncio.Task[None] | None = None
        self._in_flight: asyncio.Task[None] | None = None  # the batch transaction running while the next is built
        self._compaction: asyncio.Task[None] | None = None  # fails (the worker halts) if compaction is switched on
        # Whether the last fetch brought a tenth of a full batch or more: records queue up, so the next batch is
        # built while this one commits (throughput). Below that we are caught up and fetch after the commit, so
        # what arrived meanwhile goes into the next batch (latency: docs/performance.md, "Pipelining").
        self._behind = False
        self.advice = KafkaAdvice(self.consumer, settings.topic)
        self._retry = Retrier(settings.retry_deadline_seconds, self.stopping, self._on_fault)
        self.checks = Checks(settings, self._retry, self.consumer)
        mapping = settings.mapping
        self.resolver = SchemaResolver(RegistryClient.of(settings), settings.schema_unknown_seconds,
                                       lambda outcome: self.metrics.schema_requests.labels(outcome).inc(),
                                       ) if mapping.uses_registry else None
        decoder = None if mapping.is_default else RecordDecoder(
            mapping, self.resolver.known if self.resolver else {}, registry=f"the schema registry at "
            f"{settings.schema_registry_url}")
        self.intake = Intake(settings, self.consumer, self.assignment, self.claimer, self._retry, decoder,
                             self.resolver)
        self.writer = BatchWriter(
            consumer=self.consumer, assignment=self.assignment, ledger=self.ledger, claimer=self.claimer,
            metrics=self.metrics, advice=self.advice, retry=self._retry, lock=self._batch_lock, session=self.session)
        # Computed at scrape time from what /readyz answers: it cannot disagree with it (a gauge set on some
        # transitions stayed 0 after the database came back while /readyz said 200).
        self.metrics.ready.set_function(lambda: 1.0 if self.ready()[0] else 0.0)

    async def serve(self) -> int:
        """Run until SIGTERM/SIGINT (see `handle_exit`); 0 on a requested stop."""
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(quiet_lost_session_replies)
        self._main = asyncio.create_task(self.run(), name="worker")
        with _exit_signals(loop, self.handle_exit):
            try:
                await self._main
            except asyncio.CancelledError:
                if not self.stopping.is_set():
                    raise
                log.warning("worker.grace_expired", detail="in-flight batch abandoned; its transaction rolled back")
        return 0

    # ---------------------------------------------------------------- start -> main loop -> stop

    async def run(self) -> None:
        s = self.settings
        log.info("worker.starting", settings=s.loggable())
        http = HttpServer(None, s.metrics_port, self.metrics.registry, self.liveness, self.readiness)
        await http.start()
        monitor = PositionMonitor(s, self.metrics, functools.partial(worker_session, s), self.ledger.faults)
        advisor: asyncio.Task[None] | None = None
        try:
            await self.checks.check_pooling()
            await check_schema(await self._retry("connect to PostgreSQL", self.session.get, "startup.retry"))
            if self.resolver is not None:
                await self._retry("reach the schema registry", self.resolver.client.check, "startup.retry")
            await self.checks.join_kafka()
            monitor.start()
            advisor = asyncio.create_task(self.advice.run(), name="advisory-commit")
            self._compaction = asyncio.create_task(watch_compaction(s, s.compaction_check_seconds),
                                                   name="compaction-watch")
            await self._main_loop()
            await _cancel(advisor)
            await self.advice.tell()  # the last batches' offsets, so the next owner's lag starts right
        except Abandoned as exc:
            log.info("worker.abandoned", detail=str(exc))
        finally:
            await _cancel(advisor, self._compaction)
            await monitor.close()
            await self._leave_group()
            await self.session.close()
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
            fetched = await self.intake.fetch()
            fetched_at = time.time()
            if not fetched:
                await self._check_while_idle()
                continue
            self._behind = sum(map(len, fetched.records.values())) >= self.settings.batch_max_records // 10
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
        await self.writer.write(batch)

    async def _claim(self) -> None:
        await self.claimer.claim(await self.session.get())

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
        fresh = self.session.fresh
        conn = await self.session.get()
        if not fresh:  # a new session has just checked itself
            await self.claimer.check_offsets(conn)

    def _on_fault(self, cause: str, _exc: Exception) -> None:
        self.metrics.retries.labels(cause).inc()
        self._last_progress = time.monotonic()  # retrying is alive: /healthz stays 200, /readyz says why not
        if cause == "database":
            self.session.broken()

    async def _leave_group(self) -> None:
        try:
            # Leaving the group promptly hands our partitions to the survivors without waiting for a timeout.
            await asyncio.wait_for(self.consumer.stop(), 10)
        except (TimeoutError, KafkaError) as exc:
            log.warning("kafka.close_failed", error=str(exc))

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
        if not self.session.ok:
            return False, "PostgreSQL not connected"
        if self.checks.topic_problem is not None:
            return False, self.checks.topic_problem
        if self.resolver is not None and self.resolver.problem is not None:
            return False, self.resolver.problem
        return self.assignment.readiness()


async def serve(settings: Settings, registry: CollectorRegistry | None = None) -> int:
    return await Worker(settings, registry).serve()


@contextlib.contextmanager
def _exit_signals(loop: asyncio.AbstractEventLoop, handler: Callable[[signal.Signals], None]) -> Iterator[None]:
    """`handler(sig)` on SIGTERM and SIGINT, while inside."""
    for sig in _EXIT_SIGNALS:
        loop.add_signal_handler(sig, handler, sig)
    try:
        yield
    finally:
        for sig in _EXIT_SIGNALS:
            loop.remove_signal_handler(sig)


async def _cancel(*tasks: asyncio.Task[None] | None) -> None:
    """Cancel each task (None: never started), then wait for it to end; what it raised on the way out is dropped."""
    for task in tasks:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
