"""Test tools: worker subprocesses, raw producers, and an independent check of the ledger.

The check deliberately does not reuse stock_ledger.audit.verify: it reads the topic and the tables itself, so a bug in
the product's verifier cannot hide a bug in the product.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import asyncpg
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic, RecordsToDelete

from stock_ledger.ledger.claims import Claims
from stock_ledger.ledger.transaction import Ledger
from tests.support.services import (
    WorkerProcess,
    drop_database,
    free_port,  # noqa: F401 - the tests take it from here
    kafka_admin,
    produce,
    start_worker,
    url_for,
    worker_env,
)


def claims_of(ledger: Ledger) -> Claims:
    """Claims for the same group, with the same crash points, as `ledger`'s batch transactions."""
    return Claims(ledger.group_id, ledger.faults)


# A claim made by a test stores offset 0 where nothing is stored yet, as the worker's claim stores the reset
# policy's position (STOCK_LEDGER_AUTO_OFFSET_RESET=earliest on a log that starts at 0).
FROM_ZERO: Final = dict.fromkeys(range(64), 0)


@dataclass(frozen=True)
class Services:
    kafka: str
    admin_url: str
    origin: str
    root: Path | None = None

    def url_for(self, database: str, user: str | None = None, password: str | None = None) -> str:
        return url_for(self.admin_url, database, user, password)

    def control(self, script: str, action: str) -> None:
        """Stop/start/restart a service this test run owns (scripts mode only)."""
        if self.root is None:
            msg = (f"this fault test restarts the services it runs against, which needs the project's scripts "
                   f"(services came from: {self.origin}); unset KAFKA_BOOTSTRAP_SERVERS/DATABASE_URL to use them")
            raise AssertionError(msg)
        env = {k: v for k, v in os.environ.items() if k not in {"KAFKA_BOOTSTRAP_SERVERS", "DATABASE_URL"}}
        subprocess.run(["bash", str(self.root / "scripts" / script), action], check=True, env=env, timeout=300,
                       capture_output=True)


@dataclass(frozen=True)
class Env:
    owner_url: str
    worker_url: str
    name: str


async def make_segments(conn: asyncpg.Connection, through: dict[int, int] | range | list[int]) -> None:
    """Segments of stock_movements for rows a test writes by hand (as the worker makes them before its batches):
    `through` maps partition -> the highest offset written, or lists partitions written from offset 0."""
    through = through if isinstance(through, dict) else dict.fromkeys(through, 0)
    await conn.execute("SELECT count(*) FROM stock_ledger_ensure_segments($1, $2)", list(through),
                       list(through.values()))


async def insert_foreign_row(owner_url: str, topic: str, partition: int, offset: int) -> None:
    """A stock_movements row at these coordinates that no batch wrote (as the owner): a later batch that brings
    the same coordinates must collide with it."""
    owner = await asyncpg.connect(owner_url)
    try:
        await make_segments(owner, {partition: offset})
        await owner.execute(
            "INSERT INTO stock_movements (movement_id, warehouse_id, sku, qty, kind, occurred_at, kafka_topic, "
            "kafka_partition, kafka_offset) VALUES ($1, 'WH-1', 'SKU-1', 1, 'receipt', now(), $2, $3, $4)",
            uuid.uuid4(), topic, partition, offset)
    finally:
        await owner.close()


@contextlib.asynccontextmanager
async def scratch_database(services: Services) -> AsyncIterator[str]:
    """A new, empty database (its name), dropped afterwards."""
    name = f"sl_test_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(services.admin_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    try:
        yield name
    finally:
        await drop_database(services.admin_url, name)


@contextlib.asynccontextmanager
async def scratch_topic(services: Services, partitions: int | None = 24, configs: dict[str, str] | None = None,
                        prefix: str = "warehouse.movements.test-", replication: int = 1) -> AsyncIterator[str]:
    """A new topic (its name; partitions=None: only the name, for code under test that creates it), deleted
    afterwards (best effort)."""
    name = f"{prefix}{uuid.uuid4().hex[:10]}"
    if partitions is not None:
        async with kafka_admin(services.kafka) as admin:
            await admin.create_topics([NewTopic(name, partitions, replication, topic_configs=configs or {})])
    try:
        yield name
    finally:
        with contextlib.suppress(Exception):  # cleanup of a test topic is best effort
            async with kafka_admin(services.kafka) as admin:
                await admin.delete_topics([name])


@dataclass
class WorkerPool:
    services: Services
    db: Env
    topic: str
    group: str
    logs: Path
    started: list[WorkerProcess] = field(default_factory=list)

    def env(self, **extra: str) -> dict[str, str]:
        return worker_env(self.services.kafka, self.db.worker_url, self.topic, self.group, **{
            "STOCK_LEDGER_SESSION_TIMEOUT_MS": "6000",
            "STOCK_LEDGER_REBALANCE_TIMEOUT_MS": "20000",
            "STOCK_LEDGER_LOG_LEVEL": "info",
            "STOCK_LEDGER_POSITION_REFRESH_SECONDS": "1",
            "STOCK_LEDGER_INVARIANT_REFRESH_SECONDS": "2",
            "STOCK_LEDGER_RETRY_DEADLINE_SECONDS": "120",
        } | extra)

    def start(self, **extra: str) -> WorkerProcess:
        log = self.logs / f"worker-{len(self.started)}-{uuid.uuid4().hex[:6]}.log"
        worker = start_worker(self.env(**extra), log)
        self.started.append(worker)
        return worker

    def alive(self) -> list[WorkerProcess]:
        return [w for w in self.started if w.alive()]

    def kill_all(self) -> None:
        for w in self.started:
            if w.alive():
                w.kill()

    def assert_no_tracebacks(self) -> None:
        """Expected conditions (faults we injected) are logged as one line each, never as a stack trace."""
        for w in self.started:
            offending = [line for line in w.log_text().splitlines() if "Traceback" in line or '"exception":' in line]
            # The offending lines themselves, whole: a tail of the log would cut the one that matters.
            assert not offending, f"stack trace in {w.log.name}:\n" + "\n".join(line[:6000] for line in offending[:3])

    def logs_tail(self, lines: int = 40) -> str:
        return "\n".join(f"--- {w.log.name} (exit {w.proc.poll()})\n" + w.log_tail(lines)
                         for w in self.started)


# ------------------------------------------------------------------------------------------ producing

def movement(sku: str = "SKU-1", *, qty: int = 5, kind: str = "receipt", warehouse: str = "WH-1",
             movement_id: str | None = None, **extra: object) -> dict[str, object]:
    return {"movement_id": movement_id or str(uuid.uuid4()), "warehouse_id": warehouse, "sku": sku, "qty": qty,
            "kind": kind, "occurred_at": "2026-11-29T10:00:00+01:00", **extra}


async def send_raw(bootstrap: str, topic: str, records: Iterable[tuple[bytes | None, bytes | None]], *,
                   timestamp_ms: int | None = None) -> int:
    """Send exactly these key/value bytes (an idempotent producer, so no broker-side duplicates), with the record
    timestamp `timestamp_ms` if given (else the producer's clock)."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True, acks="all", linger_ms=5)
    await producer.start()
    n = 0
    try:
        futures = [await producer.send(topic, key=k, value=v, timestamp_ms=timestamp_ms) for k, v in records]
        await producer.flush()
        for f in futures:
            await f
            n += 1
    finally:
        await producer.stop()
    return n


class SteadyLoad:
    """Movements at a steady rate, one second's worth at a time, until stopped: the fault happens under load however
    long the steps before it take on a busy host (a fixed count at a fixed rate can run out first)."""

    def __init__(self, kafka: str, topic: str, rate: int, seed: int) -> None:
        self.kafka, self.topic, self.rate, self.seed = kafka, topic, rate, seed
        self.sent = 0
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        chunk = 0
        while not self._stop.is_set():
            # A seed per chunk: the same seed would repeat movement_ids, which the ledger quarantines as resends.
            self.sent += await produce(self.kafka, self.topic, self.rate, rate=self.rate,
                                       seed=self.seed * 100_000 + chunk, show_progress=False)
            chunk += 1

    def running(self) -> bool:
        return not self._task.done()

    async def cancel(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def finish(self, after: float) -> int:
        """Keep producing `after` more seconds, then stop (after the chunk under way); the number sent."""
        await asyncio.sleep(after)
        self._stop.set()
        await self._task
        return self.sent


# ------------------------------------------------------------------------------------------ checking

async def _partitions(bootstrap: str, topic: str) -> list[TopicPartition]:
    """The topic's partitions, from the broker's metadata (written apart from the product's own helper)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        described = await admin.describe_topics([topic])
    finally:
        await admin.close()
    return [TopicPartition(topic, p["partition"]) for p in described[0]["partitions"]]


async def topic_offsets(bootstrap: str, topic: str) -> dict[int, list[int]]:
    """Every committed record's offset, per partition, read from the broker."""
    tps = await _partitions(bootstrap, topic)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, isolation_level="read_committed")
    await consumer.start()
    try:
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        found: dict[int, list[int]] = {tp.partition: [] for tp in tps}
        while any([await consumer.position(tp) < ends[tp] for tp in tps]):
            for tp, records in (await consumer.getmany(timeout_ms=500, max_records=20_000)).items():
                found[tp.partition].extend(r.offset for r in records)
        return found
    finally:
        await consumer.stop()


async def end_offsets(bootstrap: str, topic: str, isolation_level: str = "read_uncommitted") -> dict[int, int]:
    """Each partition's log end (read_committed: its last stable offset, short of an open transaction)."""
    tps = await _partitions(bootstrap, topic)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, isolation_level=isolation_level)
    await consumer.start()
    try:
        return {tp.partition: int(o) for tp, o in (await consumer.end_offsets(tps)).items()}
    finally:
        await consumer.stop()


async def stored_offsets(conn: asyncpg.Connection, group: str, topic: str) -> dict[int, int | None]:
    """consumer_offsets of one group and topic: partition -> next_offset (None: claimed, nothing applied yet)."""
    return {r[0]: r[1] for r in await conn.fetch(
        "SELECT partition, next_offset FROM consumer_offsets WHERE group_id = $1 AND topic = $2", group, topic)}


async def wait_drained(services: Services, db: Env, topic: str, group: str, timeout: float,
                       pool: WorkerPool | None = None) -> None:
    """Wait until the stored offsets reach every partition's log end."""
    ends = await end_offsets(services.kafka, topic)
    deadline = time.monotonic() + timeout
    conn = await asyncpg.connect(db.owner_url)
    try:
        while True:
            stored = await stored_offsets(conn, group, topic)
            behind = {p: e - (stored.get(p) or 0) for p, e in ends.items() if e > (stored.get(p) or 0)}
            if not behind:
                return
            if time.monotonic() > deadline:
                detail = pool.logs_tail() if pool else ""
                raise AssertionError(f"not drained after {timeout}s; behind per partition: {behind}\n{detail}")
            await asyncio.sleep(0.5)
            with contextlib.suppress(Exception):
                ends = await end_offsets(services.kafka, topic)
    finally:
        await conn.close()


@dataclass
class LedgerState:
    rows: int
    distinct_sources: int
    rejected: int
    gaps: dict[int, list[int]]
    overlaps: dict[int, list[int]]
    level_mismatches: int
    offsets_behind: dict[int, tuple[int | None, int]]
    produced: int


async def ledger_state(services: Services, db: Env, topic: str, group: str) -> LedgerState:
    offsets = await topic_offsets(services.kafka, topic)
    ends = await end_offsets(services.kafka, topic, "read_committed")
    conn = await asyncpg.connect(db.owner_url)
    try:
        rows, distinct = await conn.fetchrow("SELECT count(*), count(DISTINCT source) FROM stock_movements")
        applied = {(r[0], r[1]) for r in await conn.fetch(
            "SELECT kafka_partition, kafka_offset FROM stock_movements WHERE kafka_topic = $1", topic)}
        rejected = {(r[0], r[1]) for r in await conn.fetch(
            "SELECT kafka_partition, kafka_offset FROM rejected_movements WHERE kafka_topic = $1", topic)}
        mismatches = await conn.fetchval("""
            SELECT count(*) FROM (SELECT warehouse_id, sku, sum(qty) AS t FROM stock_movements GROUP BY 1, 2) m
            FULL JOIN stock_levels l USING (warehouse_id, sku) WHERE coalesce(m.t, 0) <> coalesce(l.on_hand, 0)""")
        stored = await stored_offsets(conn, group, topic)
    finally:
        await conn.close()
    gaps: dict[int, list[int]] = {}
    overlaps: dict[int, list[int]] = {}
    behind: dict[int, tuple[int | None, int]] = {}
    for p, offs in offsets.items():
        missing = [o for o in offs if (p, o) not in applied and (p, o) not in rejected]
        if missing:
            gaps[p] = missing[:10]
        both = [o for o in offs if (p, o) in applied and (p, o) in rejected]
        if both:
            overlaps[p] = both[:10]
        # Drained: the stored offset is the log end, past the last record and past any transaction markers and
        # aborted records after it (a partition of markers only included).
        if (stored.get(p) or 0) != ends[p]:
            behind[p] = (stored.get(p), ends[p])
    return LedgerState(rows, distinct, len(rejected), gaps, overlaps, mismatches, behind,
                       sum(len(v) for v in offsets.values()))


async def assert_exact(services: Services, db: Env, topic: str, group: str, *, rows: int, rejected: int = 0,
                       pool: WorkerPool | None = None) -> LedgerState:
    """The guarantee: every record exactly once in exactly one table, levels exact, offsets at the log end."""
    s = await ledger_state(services, db, topic, group)
    context = f"\n{pool.logs_tail()}" if pool else ""
    assert s.rows == s.distinct_sources, f"duplicates: {s.rows} rows, {s.distinct_sources} distinct{context}"
    assert not s.gaps, f"gaps (records in neither table): {s.gaps}{context}"
    assert not s.overlaps, f"records both applied and rejected: {s.overlaps}"
    assert s.rows == rows, f"expected {rows} rows, found {s.rows} (rejected {s.rejected}){context}"
    assert s.rejected == rejected, f"expected {rejected} rejected, found {s.rejected}"
    assert s.level_mismatches == 0, f"{s.level_mismatches} stock_levels rows differ from the sum of movements"
    assert not s.offsets_behind, f"stored next_offset != log end: {s.offsets_behind}"
    return s


async def closings_off(url: str) -> list[str]:
    """Every closing that does not hold exactly the ledger's movements below its cut (a partition without a cut row
    counts none), described; empty when all are exact. Online rows only: a ledger with archived segments needs their
    manifests' sums as well."""
    conn = await asyncpg.connect(url)
    try:
        off = []
        for closing_id in [r[0] for r in await conn.fetch("SELECT closing_id FROM ledger_closings ORDER BY 1")]:
            held = {(r[0], r[1]): r[2] for r in await conn.fetch(
                "SELECT warehouse_id, sku, on_hand FROM stock_closings WHERE closing_id = $1", closing_id)}
            below = {(r[0], r[1]): r[2] for r in await conn.fetch(
                "SELECT m.warehouse_id, m.sku, sum(m.qty)::bigint FROM stock_movements AS m "
                "LEFT JOIN closing_cuts AS c ON c.closing_id = $1 AND c.kafka_partition = m.kafka_partition "
                "WHERE m.kafka_offset < coalesce(c.next_offset, 0) GROUP BY 1, 2 HAVING sum(m.qty) <> 0", closing_id)}
            if held != below:
                wrong = sorted(k for k in held.keys() | below.keys() if held.get(k) != below.get(k))
                off.append(f"closing {closing_id}: {len(wrong)} pairs differ from the rows below its cut, e.g. "
                           + ", ".join(f"{k}: held {held.get(k)}, rows {below.get(k)}" for k in wrong[:3]))
        return off
    finally:
        await conn.close()


async def assert_atomic(db: Env, topic: str, group: str) -> tuple[int, int]:
    """Between any two commits the ledger holds exactly the records below each stored offset: no row beyond
    the offset (a half-applied batch) and none missing below it (a lost one). Topics here have no holes."""
    conn = await asyncpg.connect(db.owner_url)
    try:
        # One snapshot: other workers may be committing while we look.
        await conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        stored = {p: o or 0 for p, o in (await stored_offsets(conn, group, topic)).items()}
        per_partition = {r[0]: (r[1], r[2]) for r in await conn.fetch("""
            SELECT kafka_partition, count(*), max(kafka_offset) FROM (
                SELECT kafka_partition, kafka_offset FROM stock_movements WHERE kafka_topic = $1
                UNION ALL SELECT kafka_partition, kafka_offset FROM rejected_movements WHERE kafka_topic = $1) t
            GROUP BY 1""", topic)}
        rows = await conn.fetchval("SELECT count(*) FROM stock_movements")
    finally:
        await conn.close()
    for p, (count, highest) in per_partition.items():
        assert highest < stored.get(p, 0), f"partition {p}: row at offset {highest} beyond stored {stored.get(p)}"
        assert count == stored.get(p, 0), f"partition {p}: {count} rows below stored offset {stored.get(p)}"
    return rows, sum(stored.values())


async def eventually(check: Callable[[], object], timeout: float, what: str, pool: WorkerPool | None = None) -> None:
    """Poll `check()` (sync or async, truthy = done) every 0.2 s until it holds or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{pool.logs_tail() if pool else ''}")
        await asyncio.sleep(0.2)


def process_state(pid: int) -> str:
    """The kernel's state letter for `pid` (R, S, T for stopped, Z...)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0]


async def delete_records_below(bootstrap: str, topic: str, partition: int, offset: int) -> None:
    """Kafka's retention at work: the partition's log start moves to `offset` (its records below are deleted)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.delete_records({TopicPartition(topic, partition): RecordsToDelete(before_offset=offset)},
                                   timeout_ms=10_000)
    finally:
        await admin.close()
