"""`stock-ledger verify`: compare the topic with the ledger, partition by partition, and say what is wrong."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from stock_ledger.clients import connect_database, kafka_options
from stock_ledger.errors import StockLedgerError
from stock_ledger.gaps import find_gap, unacknowledged
from stock_ledger.progress import Progress
from stock_ledger.topics import partitions_of

if TYPE_CHECKING:
    import asyncpg

    from stock_ledger.config import Settings


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class Report:
    rows: int = 0
    distinct_sources: int = 0
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def add(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append(Check(name, ok, detail))

    def render(self) -> str:
        width = max(len(c.name) for c in self.checks)
        lines = [f"{'check':<{width}}  result  detail", f"{'-' * width}  ------  ------"]
        lines += [f"{c.name:<{width}}  {'ok' if c.ok else 'FAIL':<6}  {c.detail}" for c in self.checks]
        lines.append(f"{self.rows}|{self.distinct_sources}")
        return "\n".join(lines)


async def read_topic(
    settings: Settings, show_progress: bool,
) -> tuple[dict[int, list[int]], dict[int, int], dict[int, int]]:
    """Every committed record's offset per partition, and the log start and end offsets."""
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap_servers, enable_auto_commit=False,
                                isolation_level="read_committed", max_partition_fetch_bytes=4 * 1024 * 1024,
                                **kafka_options(settings))
    await consumer.start()
    try:
        tps = [TopicPartition(settings.topic, p)
               for p in await partitions_of(settings.kafka_bootstrap_servers, settings.topic,
                                            options=kafka_options(settings))]
        if not tps:
            raise StockLedgerError(f"topic {settings.topic} does not exist at {settings.kafka_bootstrap_servers}")
        consumer.assign(tps)
        starts = await consumer.beginning_offsets(tps)
        ends = await consumer.end_offsets(tps)
        total = sum(ends[tp] - starts[tp] for tp in tps)
        offsets: dict[int, list[int]] = {tp.partition: [] for tp in tps}
        progress = Progress(f"verify: reading {settings.topic}", total) if show_progress else None
        for tp in tps:
            consumer.seek(tp, starts[tp])
        remaining = {tp for tp in tps if ends[tp] > starts[tp]}
        while remaining:
            batch = await consumer.getmany(*remaining, timeout_ms=1000, max_records=20_000)
            for tp, records in batch.items():
                offsets[tp.partition].extend(r.offset for r in records)
                if progress:
                    progress.advance(len(records))
            for tp in list(remaining):
                if await consumer.position(tp) >= ends[tp]:
                    remaining.discard(tp)
        if progress:
            progress.finish()
        return offsets, {tp.partition: starts[tp] for tp in tps}, {tp.partition: ends[tp] for tp in tps}
    finally:
        await consumer.stop()


async def _committed(settings: Settings) -> dict[int, int]:
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap_servers, **kafka_options(settings))
    await admin.start()
    try:
        found = await admin.list_consumer_group_offsets(settings.group_id)
    finally:
        await admin.close()
    return {tp.partition: meta.offset for tp, meta in found.items() if tp.topic == settings.topic and meta.offset >= 0}


async def _coordinates(conn: asyncpg.Connection, table: str, topic: str) -> dict[int, set[int]]:
    found: dict[int, set[int]] = {}
    rows = await conn.fetch(f"SELECT kafka_partition, kafka_offset FROM {table} WHERE kafka_topic = $1", topic)
    for r in rows:
        found.setdefault(r[0], set()).add(r[1])
    return found


async def wait_for_drain(settings: Settings, seconds: float) -> bool:
    """Wait until the stored offsets reach every partition's log end; True if they did in time."""
    deadline = time.monotonic() + seconds
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap_servers, enable_auto_commit=False,
                                isolation_level="read_committed", **kafka_options(settings))
    await consumer.start()
    conn = await connect_database(settings, application_name="stock-ledger-verify")
    try:
        while True:
            tps = [TopicPartition(settings.topic, p)
                   for p in await partitions_of(settings.kafka_bootstrap_servers, settings.topic,
                                                options=kafka_options(settings))]
            ends = await consumer.end_offsets(tps) if tps else {}
            stored = {r[0]: r[1] for r in await conn.fetch(
                "SELECT partition, next_offset FROM consumer_offsets WHERE group_id = $1 AND topic = $2",
                settings.group_id, settings.topic)}
            # next_offset may stop short of the log end only by trailing transaction markers; verify checks that.
            behind = {tp.partition: ends[tp] - (stored.get(tp.partition) or 0) for tp in tps
                      if ends[tp] - (stored.get(tp.partition) or 0) > 1}
            if not behind and tps:
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.5)
    finally:
        await conn.close()
        await consumer.stop()


async def verify(settings: Settings, expect: int | None = None, show_progress: bool = True) -> Report:
    report = Report()
    topic_offsets, log_starts, log_ends = await read_topic(settings, show_progress)
    committed = await _committed(settings)
    conn = await connect_database(settings, application_name="stock-ledger-verify")
    try:
        async with conn.transaction(isolation="repeatable_read", readonly=True):
            report.rows, report.distinct_sources = await conn.fetchrow(
                "SELECT count(*), count(DISTINCT source) FROM stock_movements")
            applied = await _coordinates(conn, "stock_movements", settings.topic)
            rejected = await _coordinates(conn, "rejected_movements", settings.topic)
            mismatches = await conn.fetch("""
                SELECT coalesce(m.warehouse_id, l.warehouse_id) AS w, coalesce(m.sku, l.sku) AS s,
                       coalesce(m.total, 0) AS total, coalesce(l.on_hand, 0) AS on_hand
                  FROM (SELECT warehouse_id, sku, sum(qty) AS total FROM stock_movements GROUP BY 1, 2) AS m
                  FULL JOIN stock_levels AS l USING (warehouse_id, sku)
                 WHERE coalesce(m.total, 0) <> coalesce(l.on_hand, 0)
                 LIMIT 5""")
            stored = {r[0]: r[1] for r in await conn.fetch(
                "SELECT partition, next_offset FROM consumer_offsets WHERE group_id = $1 AND topic = $2",
                settings.group_id, settings.topic)}
            open_gaps = await unacknowledged(conn, settings.group_id, settings.topic)
    finally:
        await conn.close()

    produced = sum(len(v) for v in topic_offsets.values())
    n_rejected = sum(len(v) for v in rejected.values())
    report.add("records in topic", ok=True, detail=f"{produced} committed records in {len(topic_offsets)} partitions")
    report.add("rows vs distinct coordinates", report.rows == report.distinct_sources,
               f"{report.rows} rows, {report.distinct_sources} distinct sources")
    report.add("quarantined", ok=True, detail=f"{n_rejected} records in rejected_movements")
    if expect is not None:
        report.add("expected rows", report.rows == expect, f"expected {expect}, found {report.rows}")

    gaps, both, phantoms = {}, {}, {}
    for p, offsets in topic_offsets.items():
        a, r = applied.get(p, set()), rejected.get(p, set())
        present = set(offsets)
        if missing := present - a - r:
            gaps[p] = sorted(missing)
        if overlap := a & r:
            both[p] = sorted(overlap)
        if unknown := {o for o in (a | r) - present if o >= log_starts.get(p, 0)}:
            phantoms[p] = sorted(unknown)
    report.add("gaps (in topic, in neither table)", not gaps, _summary(gaps))
    report.add("in both tables", not both, _summary(both))
    report.add("rows not in topic", not phantoms, _summary(phantoms))
    report.add("stock_levels = sum(movements)", not mismatches,
               "all equal" if not mismatches else "; ".join(
                   f"{m['w']}/{m['s']}: levels {m['on_hand']} vs movements {m['total']}" for m in mismatches))

    behind = {p: f"stored {stored.get(p)}, last record {max(o)}" for p, o in topic_offsets.items()
              if o and (stored.get(p) or 0) < max(o) + 1}
    report.add("stored offsets cover the log", not behind, "all partitions drained" if not behind else
               "; ".join(f"p{p}: {d}" for p, d in sorted(behind.items())[:6]))
    holes = [g for p, o in stored.items() if o is not None and p in log_starts
             if (g := find_gap(p, o, log_starts[p], log_ends[p])) is not None]
    report.add("stored offsets inside the log (no hole)", not holes, "none" if not holes else
               "; ".join(f"p{g.partition}: {g.describe()}" for g in holes[:6]))
    report.add("no unacknowledged gap in ledger_gaps", not open_gaps, "none" if not open_gaps else "; ".join(
        f"#{g['id']} p{g['partition']} offsets {g['first_offset']}-{g['last_offset']} ({g['reason']})"
        for g in open_gaps[:6]) + ": reconcile, then `stock-ledger gaps ack ID --note ...`")
    negative = {p: (stored.get(p) or 0) - c for p, c in committed.items() if (stored.get(p) or 0) < c}
    report.add("drift (stored - kafka committed) >= 0", not negative,
               f"{len(committed)} partitions with a Kafka commit" if not negative else
               "; ".join(f"p{p}: {d}" for p, d in sorted(negative.items())[:6]))
    return report


def _summary(found: dict[int, list[int]]) -> str:
    if not found:
        return "none"
    total = sum(len(v) for v in found.values())
    sample = "; ".join(f"p{p}: {v[:5]}{'...' if len(v) > 5 else ''}" for p, v in sorted(found.items())[:5])
    return f"{total} records: {sample}"
