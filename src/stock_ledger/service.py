"""The worker: startup -> main loop -> shutdown.

The main loop owns the database connection and is the only writer: it claims newly assigned partitions (the
rebalance listener only pauses them), reads a batch, applies it in one transaction (sink.Ledger.apply), then
tells Kafka advisorily. The rebalance listener runs in aiokafka's coordination task; it waits for the in-flight
batch on revocation, and on assignment pauses the partitions synchronously so nothing is fetched from Kafka's
committed offsets before we seek to the ones stored in PostgreSQL.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import time
from typing import TYPE_CHECKING, Any, TypeVar

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import IllegalStateError, KafkaError
from aiokafka.structs import OffsetAndMetadata
from prometheus_client import CollectorRegistry

from stock_ledger.clients import check_kafka, connect_database, kafka_options
from stock_ledger.errors import FencedError, StockLedgerError
from stock_ledger.faults import Faults
from stock_ledger.health import HttpServer
from stock_ledger.metrics import Metrics
from stock_ledger.migrate import check_schema
from stock_ledger.positions import PositionMonitor
from stock_ledger.retry import Backoff, transient_cause
from stock_ledger.sink import Batch, Claim, Ledger, Outcome, Record, build_batch

if TYPE_CHECKING:
    from collections import Counter
    from collections.abc import Awaitable, Callable, Iterable, Sequence

    import asyncpg

    from stock_ledger.config import Settings

log = structlog.get_logger(__name__)
_T = TypeVar("_T")
_OWNERS = """
SELECT partition, member_id FROM consumer_offsets WHERE group_id = $1 AND topic = $2 AND partition = ANY($3::int[])
"""


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, worker: Worker) -> None:
        self._worker = worker

    async def on_partitions_revoked(self, revoked: Sequence[TopicPartition]) -> None:
        await self._worker.on_revoked(revoked)

    async def on_partitions_assigned(self, assigned: Sequence[TopicPartition]) -> None:
        self._worker.on_assigned(assigned)


class Worker:
    def __init__(self, settings: Settings, registry: CollectorRegistry | None = None) -> None:
        self.settings = settings
        self.metrics = Metrics(registry or CollectorRegistry())
        self.faults = Faults(settings.fault)
        self.ledger = Ledger(settings.group_id, self.faults)
        self.stopping = asyncio.Event()
        self._consumer: AIOKafkaConsumer | None = None
        self._conn: asyncpg.Connection | None = None
        self._batch_lock = asyncio.Lock()
        self._claims: dict[int, int] = {}          # partition -> epoch we hold
        self._positions: dict[int, int | None] = {}  # partition -> next offset we expect (None: reset policy)
        self._reseeked: set[int] = set()
        self._fenced_at: dict[int, float] = {}     # partition -> when we were fenced off it
        self._pending: set[TopicPartition] = set()  # assigned, paused, not yet claimed
        self._assignment_version = 0
        self._joined = False
        self._last_progress = time.monotonic()
        self._db_ok = False
        self._backoff = Backoff(settings.retry_deadline_seconds)

    # ---------------------------------------------------------------- lifecycle

    async def run(self) -> None:
        s = self.settings
        log.info("worker.starting", settings=s.loggable())
        http = HttpServer("0.0.0.0", s.metrics_port, self.metrics.registry, self.liveness, self.readiness)  # noqa: S104
        await http.start()
        monitor = PositionMonitor(s, self.metrics)
        try:
            self._conn = await self._retry("connect to PostgreSQL", lambda: connect_database(s))
            await check_schema(self._conn)
            self._db_ok = True
            await self._retry("join the Kafka cluster", lambda: check_kafka(s))
            self._consumer = self._make_consumer()
            await self._retry("join the Kafka cluster", self._consumer.start)
            monitor.start()
            await self._main_loop()
        finally:
            self.metrics.ready.set(0)
            await monitor.close()
            await self._close_consumer()
            if self._conn is not None:
                await self._conn.close(timeout=2)
            await http.close()
            log.info("worker.stopped")

    def _make_consumer(self) -> AIOKafkaConsumer:
        s = self.settings
        consumer = AIOKafkaConsumer(
            bootstrap_servers=s.kafka_bootstrap_servers,
            group_id=s.group_id,
            group_instance_id=s.group_instance_id,
            client_id=f"stock-ledger-{socket.gethostname()}",
            enable_auto_commit=False,  # offsets live in PostgreSQL, committed with the rows
            auto_offset_reset=s.auto_offset_reset,
            isolation_level="read_committed",  # never apply a movement from an aborted producer transaction
            session_timeout_ms=s.session_timeout_ms,
            heartbeat_interval_ms=max(100, s.session_timeout_ms // 3),
            rebalance_timeout_ms=s.rebalance_timeout_ms,
            max_poll_interval_ms=max(300_000, s.rebalance_timeout_ms),
            fetch_max_wait_ms=min(500, s.batch_max_wait_ms),
            **kafka_options(s),
        )
        consumer.subscribe([s.topic], listener=_Listener(self))
        return consumer

    async def _close_consumer(self) -> None:
        if self._consumer is None:
            return
        try:
            # Leaving the group promptly hands our partitions to the survivors without waiting for a timeout.
            await asyncio.wait_for(self._consumer.stop(), 10)
        except (TimeoutError, KafkaError) as exc:
            log.warning("kafka.close_failed", error=str(exc))

    def request_stop(self) -> None:
        if not self.stopping.is_set():
            log.info("worker.stop_requested", grace_seconds=self.settings.shutdown_grace_seconds)
            self.stopping.set()

    # ---------------------------------------------------------------- health

    async def liveness(self) -> tuple[bool, str]:
        idle = time.monotonic() - self._last_progress
        if idle > self.settings.stall_seconds:
            return False, f"main loop made no progress for {idle:.0f}s (limit {self.settings.stall_seconds:g}s)"
        return True, f"main loop progressed {idle:.1f}s ago"

    async def readiness(self) -> tuple[bool, str]:
        if not self._db_ok:
            return False, "PostgreSQL not connected"
        if not self._joined:
            return False, "not yet a member of the consumer group"
        if self._pending:
            return False, f"{len(self._pending)} assigned partitions not yet claimed"
        return True, f"{len(self._claims)} partitions claimed"

    def _update_ready(self) -> None:
        self.metrics.ready.set(1 if self._db_ok and self._joined and not self._pending else 0)

    # ---------------------------------------------------------------- rebalance (aiokafka's coordination task)

    def on_assigned(self, assigned: Sequence[TopicPartition]) -> None:
        assert self._consumer is not None  # noqa: S101
        # Synchronously, before any await: the fetcher would otherwise start from Kafka's committed offsets.
        self._consumer.pause(*assigned)
        self._pending = set(assigned)
        self._assignment_version += 1
        self._joined = True
        self.metrics.rebalances.inc()
        self._update_ready()
        log.info("rebalance.assigned", partitions=sorted(tp.partition for tp in assigned),
                 generation=self._generation())

    async def on_revoked(self, revoked: Sequence[TopicPartition]) -> None:
        self._assignment_version += 1
        self._pending.clear()
        started = time.monotonic()
        # Wait for the in-flight batch, bounded well inside the rebalance timeout. If it is still running after
        # that, the database fences it anyway once the new owner claims: this wait only avoids pointless rollbacks.
        try:
            await asyncio.wait_for(self._batch_lock.acquire(), self.settings.rebalance_timeout_ms / 2000)
        except TimeoutError:
            log.warning("rebalance.revoke_without_waiting", waited_seconds=round(time.monotonic() - started, 1))
            self._drop(tp.partition for tp in revoked)
        else:
            try:
                self._drop(tp.partition for tp in revoked)
            finally:
                self._batch_lock.release()
        log.info("rebalance.revoked", partitions=sorted(tp.partition for tp in revoked),
                 waited_seconds=round(time.monotonic() - started, 3))

    def _drop(self, partitions: Iterable[int]) -> None:
        for p in partitions:
            self._claims.pop(p, None)
            self._positions.pop(p, None)
        self.metrics.assigned_partitions.set(len(self._claims))

    def _generation(self) -> tuple[int | None, str | None]:
        # aiokafka exposes neither publicly; kept beside the claim for diagnostics only.
        coordinator = getattr(self._consumer, "_coordinator", None)
        generation = getattr(coordinator, "generation", None)
        member_id = getattr(coordinator, "member_id", None)
        return (generation if isinstance(generation, int) and generation >= 0 else None,
                member_id if isinstance(member_id, str) and member_id else None)

    # ---------------------------------------------------------------- main loop

    async def _main_loop(self) -> None:
        assert self._consumer is not None  # noqa: S101
        s = self.settings
        while not self.stopping.is_set():
            self._last_progress = time.monotonic()
            self._check_fenced_partitions()
            if self._pending:
                await self._claim_pending()
                continue
            try:
                fetched = await self._consumer.getmany(timeout_ms=s.batch_max_wait_ms, max_records=s.batch_max_records)
            except KafkaError as exc:
                self.metrics.retries.labels("kafka").inc()
                log.warning("kafka.fetch_failed", error=f"{type(exc).__name__}: {exc}")
                await self._backoff.wait("fetching from Kafka", exc)
                continue
            if not fetched:
                continue
            if self.faults.reached("after_read"):
                await self.stopping.wait()
                break
            async with self._batch_lock:
                batch = self._build(fetched)
                committed = await self._apply(batch) if batch is not None else None
            if committed:
                await self._advisory_commit(committed)

    def _build(self, fetched: dict[TopicPartition, list[Any]]) -> Batch | None:
        """Keep only records of partitions we hold a claim on, from the offset we sought to."""
        assert self._consumer is not None  # noqa: S101
        accepted: dict[int, list[Record]] = {}
        for tp, records in fetched.items():
            p = tp.partition
            if p not in self._claims or not records:
                continue  # revoked, fenced or not yet claimed: its new claim seeks again
            expected = self._positions.get(p)
            if expected is not None and records[0].offset != expected and p not in self._reseeked:
                # Fetched before our seek took effect (or a hole in the log). Seek once more; if the log really has
                # a hole here, the next fetch starts past `expected` again and is accepted.
                log.warning("batch.unexpected_offset", partition=p, expected=expected, got=records[0].offset)
                self._consumer.seek(tp, expected)
                self._reseeked.add(p)
                continue
            fresh = records if expected is None else [r for r in records if r.offset >= expected]
            if fresh:
                accepted[p] = fresh
        if not accepted:
            return None
        return build_batch(self.settings.topic, accepted, self._claims)

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
                if self._needs_connection():
                    self._conn = await self._retry("reconnect to PostgreSQL", lambda: connect_database(self.settings))
                started = time.perf_counter()
                try:
                    outcome = await self.ledger.apply(self._conn, current)
                except FencedError as exc:
                    await self._on_fenced(exc)
                    current = self._without(current, set(exc.partitions))
                    continue
                except StockLedgerError:
                    raise
                except Exception as exc:
                    if not await self._may_retry(exc):
                        return None
                    continue
                self._committed(current, outcome, time.perf_counter() - started)
                return {x.partition: x.next_offset for x in current.slices}
        return None

    def _needs_connection(self) -> bool:
        """True if a new session is needed; a session the server closed under us (terminated, restarted, idle
        timeout) counts as a database retry, since no statement of ours saw the fault."""
        if self._conn is None:
            return True
        if not self._conn.is_closed():
            return False
        self.metrics.retries.labels("database").inc()
        log.info("db.reconnect", reason="the server closed our session while it was idle")
        return True

    async def _may_retry(self, exc: Exception) -> bool:
        """Back off before retrying a transient fault; False to abandon the (rolled back) batch; else re-raise."""
        cause = transient_cause(exc)
        if cause is None:
            raise exc
        if self.stopping.is_set():
            # Rolled back, nothing written: the next owner applies it from the stored offset.
            log.info("batch.abandoned", reason="shutdown during a transient fault", cause=cause)
            return False
        self.metrics.retries.labels(cause).inc()
        self._db_ok = False
        if cause == "database" and self._conn is not None:
            # The session may be half-dead (killed while we were frozen mid-statement): start afresh.
            self._conn.terminate()
            self._conn = None
        log.warning("batch.retry", cause=cause, attempt=self._backoff.attempt + 1, error=f"{type(exc).__name__}: {exc}")
        await self._backoff.wait("the batch transaction", exc)
        return True

    def _committed(self, batch: Batch, outcome: Outcome, seconds: float) -> None:
        self._backoff.reset()
        self._db_ok = True
        self._record(batch, outcome.applied, outcome.rejected, seconds)
        if outcome.already_applied:
            log.info("batch.already_applied", detail="an earlier attempt committed; its reply was lost")
        for x in batch.slices:
            self._positions[x.partition] = x.next_offset

    @staticmethod
    def _without(batch: Batch, fenced: set[int]) -> Batch | None:
        """The same batch without the fenced partitions (from the rows we hold, no re-fetch); None if empty."""
        slices = [x for x in batch.slices if x.partition not in fenced]
        if not slices:
            return None
        keep = [(m, raw) for m, raw in zip(batch.movements, batch.raw, strict=True) if m[7] not in fenced]
        rejects = [r for r in batch.rejects if r[1] not in fenced]
        return Batch(batch.topic, slices, [m for m, _ in keep], rejects, [raw for _, raw in keep],
                     batch.timestamps_ms)

    async def _on_fenced(self, exc: FencedError) -> None:
        assert self._consumer is not None  # noqa: S101
        self.metrics.fenced.inc()
        log.warning("batch.fenced", partitions={p: {"ours": o, "stored": s} for p, (o, s) in exc.partitions.items()},
                    detail="another worker claimed these partitions; not writing them until they are claimed again")
        tps = [TopicPartition(self.settings.topic, p) for p in exc.partitions]
        with contextlib.suppress(IllegalStateError):
            self._consumer.pause(*[tp for tp in tps if tp in self._consumer.assignment()])
        self._drop(exc.partitions)
        now = time.monotonic()
        for p in exc.partitions:
            self._fenced_at.setdefault(p, now)
        await self._exit_if_replaced(list(exc.partitions))

    async def _exit_if_replaced(self, partitions: list[int]) -> None:
        """With static membership, a claim by a newer process with our instance id means we are the zombie of a
        force-deleted pod: aiokafka would keep rejoining and the two would take turns fencing each other. Exit."""
        instance = self.settings.group_instance_id
        if not instance or self._conn is None:
            return
        _, ours = self._generation()
        try:
            rows = await self._conn.fetch(_OWNERS, self.settings.group_id, self.settings.topic, partitions)
        except Exception as exc:
            if transient_cause(exc) is None:
                raise
            return  # cannot tell now; the next fence asks again
        for r in rows:
            owner = r["member_id"]
            # Kafka names a static member "<group.instance.id>-<uuid>".
            if owner and owner != ours and owner.startswith(f"{instance}-"):
                raise StockLedgerError(
                    f"partition {r['partition']} was claimed by member {owner}, a newer process with this "
                    f"STOCK_LEDGER_GROUP_INSTANCE_ID={instance}: this process is a zombie and exits"
                )

    def _check_fenced_partitions(self) -> None:
        """A fenced partition that Kafka still assigns to us and never reassigns would stall: restart instead."""
        if not self._fenced_at:
            return
        assert self._consumer is not None  # noqa: S101
        assigned = {tp.partition for tp in self._consumer.assignment()}
        for p, since in list(self._fenced_at.items()):
            if p in self._claims or p not in assigned:
                del self._fenced_at[p]
            elif time.monotonic() - since > 3 * self.settings.session_timeout_ms / 1000:
                raise StockLedgerError(
                    f"partition {p} stayed assigned to this worker after it was fenced, but was not reassigned: "
                    "exiting so the restart rejoins the group with a fresh claim"
                )

    def _record(self, batch: Batch, applied: int, rejected: Counter[str], seconds: float) -> None:
        m = self.metrics
        m.applied.inc(applied)
        for code, n in rejected.items():
            m.rejected.labels(code).inc(n)
            log.warning("batch.rejected", reason=code, records=n)
        m.batches.inc()
        m.batch_duration.observe(seconds)
        m.batch_records.observe(batch.size)
        now = time.time()
        m.last_commit.set(now)
        m.end_to_end.observe_many([max(0.0, now - ts / 1000) for ts in batch.timestamps_ms if ts >= 0])
        log.debug("batch.committed", applied=applied, rejected=sum(rejected.values()), seconds=round(seconds, 4))

    async def _advisory_commit(self, offsets: dict[int, int]) -> None:
        """Tell Kafka too, for lag dashboards and kafka-consumer-groups.sh. Never fatal, never a source of truth."""
        assert self._consumer is not None  # noqa: S101
        assigned = self._consumer.assignment()
        tps = {TopicPartition(self.settings.topic, p): OffsetAndMetadata(o, "") for p, o in offsets.items()}
        tps = {tp: o for tp, o in tps.items() if tp in assigned}
        if not tps:
            return
        try:
            await asyncio.wait_for(self._consumer.commit(tps), 5)
        except (KafkaError, IllegalStateError, TimeoutError) as exc:
            log.info("kafka.advisory_commit_failed", error=f"{type(exc).__name__}: {exc}",
                     detail="harmless: PostgreSQL holds the offsets")

    async def _claim_pending(self) -> None:
        assert self._consumer is not None  # noqa: S101
        version = self._assignment_version
        pending = sorted(self._pending, key=lambda tp: tp.partition)
        generation, member_id = self._generation()
        try:
            if self._needs_connection():
                self._conn = await connect_database(self.settings)
            claims = await self.ledger.claim(self._conn, self.settings.topic, [tp.partition for tp in pending],
                                             generation, member_id)
            starts = await self._start_offsets(pending, claims)
        except Exception as exc:
            cause = transient_cause(exc)
            if cause is None:
                raise
            self.metrics.retries.labels(cause).inc()
            log.warning("claim.retry", cause=cause, error=f"{type(exc).__name__}: {exc}")
            await self._backoff.wait("claiming partitions", exc)
            return
        self._backoff.reset()
        if version != self._assignment_version:
            return  # a newer rebalance happened meanwhile; its own claim (a newer epoch) supersedes this one
        for tp, claim in zip(pending, claims, strict=True):
            self._consumer.seek(tp, starts[tp])
            self._claims[tp.partition] = claim.epoch
            self._positions[tp.partition] = starts[tp]
            self._reseeked.discard(tp.partition)
        self._consumer.resume(*pending)
        self._pending.clear()
        self.metrics.claims.inc(len(claims))
        self.metrics.assigned_partitions.set(len(self._claims))
        self._update_ready()
        log.info("claim.done", generation=generation, member_id=member_id,
                 claims={c.partition: {"epoch": c.epoch, "seek": starts[tp]} for tp, c in zip(pending, claims,
                                                                                             strict=True)})

    async def _start_offsets(self, tps: list[TopicPartition], claims: list[Claim]) -> dict[TopicPartition, int]:
        """Stored offset, or the reset policy when none is stored, resolved to a number before any seek."""
        assert self._consumer is not None  # noqa: S101
        starts = {tp: c.next_offset for tp, c in zip(tps, claims, strict=True) if c.next_offset is not None}
        missing = [tp for tp in tps if tp not in starts]
        if missing:
            policy = self.settings.auto_offset_reset
            if policy == "none":
                raise StockLedgerError(
                    f"no stored offset for partitions {[tp.partition for tp in missing]} and "
                    "STOCK_LEDGER_AUTO_OFFSET_RESET=none: set it to earliest to apply the whole history"
                )
            lookup = self._consumer.beginning_offsets if policy == "earliest" else self._consumer.end_offsets
            found = await lookup(missing)
            starts.update({tp: int(found[tp]) for tp in missing})
            log.info("claim.reset_policy", policy=policy, partitions={tp.partition: starts[tp] for tp in missing})
        return starts

    async def _retry(self, what: str, op: Callable[[], Awaitable[_T]]) -> _T:
        while True:
            try:
                result = await op()
            except Exception as exc:
                cause = transient_cause(exc)
                if cause is None or self.stopping.is_set():
                    raise
                self.metrics.retries.labels(cause).inc()
                log.warning("startup.retry", what=what, cause=cause, error=f"{type(exc).__name__}: {exc}")
                await self._backoff.wait(what, exc)
            else:
                self._backoff.reset()
                return result


async def serve(settings: Settings, registry: CollectorRegistry | None = None) -> int:
    """Run a worker until SIGTERM/SIGINT; the first signal drains, a second one exits at once."""
    worker = Worker(settings, registry)
    loop = asyncio.get_running_loop()
    main = asyncio.create_task(worker.run(), name="worker")

    def on_signal(sig: signal.Signals) -> None:
        if worker.stopping.is_set():
            log.warning("worker.forced_exit", signal=sig.name)
            main.cancel()
            return
        log.info("worker.signal", signal=sig.name)
        worker.request_stop()
        loop.call_later(settings.shutdown_grace_seconds, main.cancel)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await main
    except asyncio.CancelledError:
        if not worker.stopping.is_set():
            raise
        log.warning("worker.grace_expired", detail="in-flight batch abandoned; its transaction rolled back")
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return 0
