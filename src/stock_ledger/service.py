"""The worker: startup -> main loop -> shutdown.

The main loop owns the database session and is the only writer: it claims newly assigned partitions (the
rebalance listener only pauses them), reads a batch, applies it in one transaction (sink.Ledger.apply); Kafka is
told the committed offsets advisorily, once a second (advice.KafkaAdvice). Which partitions may be written, and
from which offset, is `assignment.Assignment`; the claim, with its seek positions and the log's holes, is
`claims.Claimer`. The rebalance listener runs in aiokafka's coordination task: on revocation it waits for the
in-flight batch; on assignment it pauses the partitions synchronously, so nothing is fetched from Kafka's committed
offsets before we seek to ours.
"""

from __future__ import annotations

import asyncio
import functools
import signal
import time
from typing import TYPE_CHECKING, Any

import structlog
from aiokafka import TopicPartition
from aiokafka.errors import KafkaError, NoOffsetForPartitionError, OffsetOutOfRangeError
from prometheus_client import CollectorRegistry

from stock_ledger.advice import KafkaAdvice
from stock_ledger.assignment import Assignment
from stock_ledger.batch import Batch, BatchBuilder
from stock_ledger.claims import Claimer
from stock_ledger.clients import (
    check_kafka,
    connect_database,
    connect_worker,
    kafka_options,
    make_consumer,
    quiet_lost_session_replies,
)
from stock_ledger.errors import FencedError, OffsetMismatchError
from stock_ledger.faults import Faults
from stock_ledger.health import HttpServer
from stock_ledger.metrics import Metrics
from stock_ledger.migrate import check_schema
from stock_ledger.positions import PositionMonitor
from stock_ledger.rebalance import Rebalance
from stock_ledger.retry import Abandoned, Retrier
from stock_ledger.servers import refuse_transaction_pooling
from stock_ledger.sink import Ledger, Outcome
from stock_ledger.topics import TopicUnavailable, refuse_compacted, require_topic, watch_compaction

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    import asyncpg

    from stock_ledger.config import Settings

log = structlog.get_logger(__name__)

# Records parsed between two turns of the event loop while a batch is built (~4 ms of CPU here).
_BUILD_CHUNK = 500
# Records taken from the consumer between two turns of the event loop (see `_fetch`).
_FETCH_CHUNK = 500


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
        self._topic_problem: str | None = None  # why the topic cannot be read, until it can (readiness says it)
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
        # Computed at scrape time from what /readyz answers: it cannot disagree with it (a gauge set on some
        # transitions stayed 0 after the database came back while /readyz said 200).
        self.metrics.ready.set_function(lambda: 1.0 if self.ready()[0] else 0.0)

    async def serve(self) -> int:
        """Run until SIGTERM/SIGINT (see `handle_exit`); 0 on a requested stop."""
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(quiet_lost_session_replies)
        self._main = asyncio.create_task(self.run(), name="worker")
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.handle_exit, sig)
        try:
            await self._main
        except asyncio.CancelledError:
            if not self.stopping.is_set():
                raise
            log.warning("worker.grace_expired", detail="in-flight batch abandoned; its transaction rolled back")
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
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
            # Before any session of ours prepares a named statement a shared server connection would keep.
            await self._retry("check how PostgreSQL sessions are pooled", functools.partial(
                refuse_transaction_pooling, functools.partial(
                    connect_database, s, application_name="stock-ledger-pool-check", statement_cache_size=0,
                    guard=False)),
                "startup.retry")
            self._conn = await self._retry("connect to PostgreSQL", self._connect, "startup.retry")
            await check_schema(self._conn)
            self._db_ok = True
            # One plain connection first: aiokafka reports a bad password or certificate only as "Unable to
            # bootstrap"; this names the cause and fails fast, where a retry cannot help.
            await self._retry("join the Kafka cluster", functools.partial(check_kafka, s), "startup.retry")
            # Before the consumer starts: on a missing topic it would wait for ever, saying nothing of ours.
            await self._retry("find the topic", self._find_topic, "startup.retry")
            await self._retry("join the Kafka cluster", self.consumer.start, "startup.retry")
            await self._retry("read the topic's configuration", functools.partial(
                refuse_compacted, s.kafka_bootstrap_servers, s.topic, options=kafka_options(s)), "startup.retry")
            monitor.start()
            advisor = asyncio.create_task(self.advice.run(), name="advisory-commit")
            self._compaction = asyncio.create_task(watch_compaction(
                s.kafka_bootstrap_servers, s.topic, options=kafka_options(s),
                interval_seconds=s.invariant_refresh_seconds), name="compaction-watch")
            await self._main_loop()
            advisor.cancel()
            await asyncio.gather(advisor, return_exceptions=True)
            await self.advice.tell()  # the last batches' offsets, so the next owner's lag starts right
        except Abandoned as exc:
            log.info("worker.abandoned", detail=str(exc))
        finally:
            for task in (advisor, self._compaction):
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
            await monitor.close()
            await self._close_consumer()
            if self._conn is not None:
                await self._conn.close(timeout=2)
            await http.close()
            log.info("worker.stopped")

    async def _close_consumer(self) -> None:
        try:
            # Leaving the group promptly hands our partitions to the survivors without waiting for a timeout.
            await asyncio.wait_for(self.consumer.stop(), 10)
        except (TimeoutError, KafkaError) as exc:
            log.warning("kafka.close_failed", error=str(exc))

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
        if self._topic_problem is not None:
            return False, self._topic_problem
        return self.assignment.readiness()

    async def _find_topic(self) -> None:
        s = self.settings
        try:
            await require_topic(s.kafka_bootstrap_servers, s.topic, options=kafka_options(s))
        except TopicUnavailable as exc:
            if self._topic_problem is None:  # once: the retries that follow are logged as startup.retry
                deadline = s.retry_deadline_seconds
                log.error("topic.unavailable", topic=s.topic, bootstrap_servers=s.kafka_bootstrap_servers,
                          detail=f"{exc}: create it, grant access, or fix STOCK_LEDGER_TOPIC / "
                                 "KAFKA_BOOTSTRAP_SERVERS",
                          retrying=f"until STOCK_LEDGER_RETRY_DEADLINE_SECONDS={deadline:g}, then exit 1" if deadline
                          else "for ever (STOCK_LEDGER_RETRY_DEADLINE_SECONDS=0); /readyz says why")
            self._topic_problem = str(exc)
            raise
        self._topic_problem = None

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
            batch = await self._build(fetched)
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
        """One batch's transaction, under the lock a revocation waits for. Built while the previous batch was in
        flight, it first leaves out what a fence, revocation or reclaim took away since."""
        async with self._batch_lock:
            drop, reseek = self.assignment.stale(batch.slices)
            for p, offset in reseek.items():
                log.info("batch.reseek", partition=p, expected=offset, reason="built ahead of a batch that changed")
                self.consumer.seek(self._tp(p), offset)
            current = batch.without(drop) if drop else batch
            committed = await self._apply(current) if current is not None else None
        if committed:
            self.advice.note(committed)

    async def _claim(self) -> None:
        await self.claimer.claim(await self._session())

    async def _fetch(self) -> dict[TopicPartition, list[Any]]:
        """Up to a batch of records, taken in chunks with the event loop turning in between. aiokafka makes a
        Python object of every record inside `getmany`: taken in one go, 5,000 buffered records held the loop for
        ~15 ms (docs/bench/fetch-chunks-2026-12-01) while the batch in flight waited to send its next statement.

        Records once taken are never dropped (a partition's next fetch would start past them): an error ends the
        loop with what was taken before it (aiokafka raises only from a call that took nothing), and a chunk that
        a seek in between moved back is given back by seeking to its first record."""
        s = self.settings
        fetched: dict[TopicPartition, list[Any]] = {}
        wanted, timeout_ms = s.batch_max_records, s.batch_max_wait_ms
        try:
            while wanted > 0:
                got = await self._retry("fetching from Kafka", functools.partial(
                    self.consumer.getmany, timeout_ms=timeout_ms, max_records=min(_FETCH_CHUNK, wanted)),
                    "kafka.fetch_failed")
                back = take(fetched, got)
                for tp, offset in back.items():
                    log.info("fetch.give_back", partition=tp.partition, offset=offset,
                             reason="sought back while the batch was being fetched")
                    if tp in self.consumer.assignment():  # else its next owner's claim positions it
                        self.consumer.seek(tp, offset)
                taken = sum(map(len, got.values()))
                if not taken or back:
                    break
                wanted -= taken
                timeout_ms = 0  # only what has arrived: the batch in flight is not kept waiting for more
                await asyncio.sleep(0)
        except OffsetOutOfRangeError as exc:
            # Our position lies outside the log: a hole. The claim path examines it (record or halt).
            out = exc.args[0] if exc.args and isinstance(exc.args[0], dict) else {}
            self.claimer.reexamine([tp.partition for tp in out], reason=f"fetch out of range: {out}")
        except NoOffsetForPartitionError:
            pass  # raised once for a partition still paused for its claim; the claim's seek positions it
        return fetched

    async def _build(self, fetched: dict[TopicPartition, list[Any]]) -> Batch | None:
        accepted = self.assignment.accept({tp.partition: records for tp, records in fetched.items()})
        for p, offset in accepted.reseek.items():
            # Fetched before our seek took effect (or past transaction markers): seek once more to be sure.
            log.info("batch.reseek", partition=p, expected=offset, got=fetched[self._tp(p)][0].offset)
            self.consumer.seek(self._tp(p), offset)
        if not accepted.records:
            return None
        # Parsing is most of the worker's CPU (~40% in a drain). Built in one go, it held the event loop while the
        # batch in flight waited for its next statement to be sent, so the worker and PostgreSQL took turns (their
        # CPU summed to one core). Chunked, the transaction moves on between chunks. A rebalance or fence meanwhile
        # is what `_write` checks anyway (`Assignment.stale`), under the batch lock, with the epochs taken here.
        builder = BatchBuilder(self.settings.topic, self.assignment.epochs, self.assignment.positions)
        for p in sorted(accepted.records):
            records = accepted.records[p]
            for i in range(0, len(records), _BUILD_CHUNK):
                builder.add(p, records[i:i + _BUILD_CHUNK])
                await asyncio.sleep(0)
        batch = builder.batch()
        self.assignment.dispatched({x.partition: x.next_offset for x in batch.slices})
        return batch

    async def _apply(self, batch: Batch) -> dict[int, int] | None:
        """Run the batch transaction until it commits, is fenced away, or the retry deadline passes.

        Returns the committed next offsets, or None if nothing was committed (all fenced, or abandoned on shutdown).
        """
        with structlog.contextvars.bound_contextvars(
            topic=batch.topic,
            batch={x.partition: [x.first_offset, x.next_offset - 1, x.epoch] for x in batch.slices},
        ):
            current: Batch | None = batch
            while current is not None:
                try:
                    outcome, seconds = await self._retry("the batch transaction",
                                                         functools.partial(self._apply_once, current), "batch.retry")
                except FencedError as exc:
                    await self.claimer.fenced(exc, self._conn)
                    current = current.without(set(exc.partitions))
                    continue
                except OffsetMismatchError as exc:
                    self.claimer.mismatched(exc, {x.partition: x.epoch for x in current.slices})
                    current = current.without(set(exc.partitions))
                    continue
                except Abandoned as exc:
                    # Rolled back, nothing written: the next owner applies it from the stored offset.
                    log.info("batch.abandoned", reason="shutdown during a transient fault", cause=exc.cause)
                    return None
                self._committed(current, outcome, seconds)
                return {x.partition: x.next_offset for x in current.slices}
        return None

    async def _apply_once(self, batch: Batch) -> tuple[Outcome, float]:
        conn = await self._session()
        started = time.perf_counter()
        outcome = await self.ledger.apply(conn, batch)
        return outcome, time.perf_counter() - started

    def _committed(self, batch: Batch, outcome: Outcome, seconds: float) -> None:
        self._db_ok = True
        self.metrics.count_input_anomalies(batch.bad_timestamps, outcome.bisections)
        if outcome.already_applied:
            log.info("batch.already_applied", detail="an earlier attempt committed; its reply was lost")
        self.assignment.committed({x.partition: x.next_offset for x in batch.slices})
        for code, n in outcome.rejected.items():
            log.warning("batch.rejected", reason=code, records=n)
        self.metrics.batch_committed(outcome.applied, outcome.rejected, batch.size, seconds, batch.times_ms)
        log.debug("batch.committed", applied=outcome.applied, rejected=sum(outcome.rejected.values()),
                  seconds=round(seconds, 4), fetched=batch.fetched_at)

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


    def _tp(self, partition: int) -> TopicPartition:
        return TopicPartition(self.settings.topic, partition)


def take(fetched: dict[TopicPartition, list[Any]], got: Mapping[TopicPartition, Sequence[Any]],
         ) -> dict[TopicPartition, int]:
    """Append a chunk of records to those `fetched` so far, partition by partition. A partition whose chunk does
    not start past what is already held was sought back in between (a batch in flight found its partitions stale):
    its chunk is left out, and returned as the offset to seek to so that nothing taken is lost."""
    back: dict[TopicPartition, int] = {}
    for tp, records in got.items():
        if not records:
            continue
        held = fetched.get(tp)
        if held and records[0].offset <= held[-1].offset:
            back[tp] = records[0].offset
        elif held:
            held.extend(records)
        else:
            fetched[tp] = list(records)
    return back


async def serve(settings: Settings, registry: CollectorRegistry | None = None) -> int:
    return await Worker(settings, registry).serve()
