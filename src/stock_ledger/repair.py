"""`stock-ledger repair`: re-apply from Kafka the records an earlier version skipped.

Earlier versions could move a partition's stored offset past records after a database failover or restore (issue
30): the records are in the topic, below the stored offset, and in neither stock_movements nor rejected_movements;
`verify` reports them as gaps. Repair finds exactly those with verify's own comparison (`verify.missing_runs` over
`read_partition` and `ledger_partition`), reads them from Kafka with read_committed, and writes each one as the
worker would have: through the worker's parser and batch builder (`batch.build_batch`: a bad record is quarantined
with its reason and raw bytes), a movement_id already in the ledger quarantined as duplicate_movement_id, the level
deltas added in the same transaction (`sink.add_levels`). It never moves consumer_offsets: what lies at or past the
stored offset is the workers'.

Exactly once, beside running workers and other repairs: one transaction per chunk of records, which
  1. takes a transaction-scoped advisory lock on (group, topic, partition), so repairs of a partition take turns;
  2. re-reads which of the chunk's coordinates are still in neither table and still below the stored offset
     (another repair or a `rejected replay` may have written some meanwhile) and writes only those;
  3. COPYs the rows, with the unique constraint on the coordinates as the backstop: a violation stops the run,
     loudly, with nothing of that chunk written;
  4. adds the level deltas and writes its `ledger_repairs` row (the audit trail, migration 0008).

Records below the log start can no longer be read. The ledger's holes there (offsets in neither table between its
first row and the log start) are reported and recorded as unacknowledged `ledger_gaps`, never invented: `verify`
fails until someone reconciles that stock and acknowledges them (`gaps ack`), and repair exits with EXIT_GONE
until then. Kafka cannot say any more whether such an offset held a movement or a transaction marker.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import asyncpg
import structlog
from aiokafka import TopicPartition

from stock_ledger.batch import M_ID, MOVEMENT_COLUMNS, R_CODE, REJECT_COLUMNS, Batch, build_batch
from stock_ledger.errors import CoordinateConflictError, StockLedgerError
from stock_ledger.operate import transaction
from stock_ledger.progress import Progress
from stock_ledger.ranges import Run, describe, difference, merged
from stock_ledger.sink import add_levels, known_movement_ids, refusal, stored_offsets, without_known
from stock_ledger.verify import (
    Scope,
    Window,
    ledger_partition,
    missing_runs,
    read_partition,
    topic_partitions,
    topic_reader,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterable, Sequence

    from aiokafka import AIOKafkaConsumer

    from stock_ledger.config import Settings

log = structlog.get_logger(__name__)

# Exit code when some skipped records are gone from Kafka (below the log start): reported, recorded, not applied.
EXIT_GONE: Final = 3
# ledger_gaps.reason of such a range.
GONE_REASON: Final = "skipped_below_log_start"
_STALL_SECONDS: Final = 60.0
# A chunk that met a deadlock, a lock timeout or a movement_id a worker committed meanwhile is redone from the
# start (its re-check makes that safe), this many times at most.
_ATTEMPTS: Final = 5
_MOVEMENT_ID_KEY: Final = "stock_movements_movement_id_key"  # migrations/0001_ledger.sql

# Why an advisory lock and not `SELECT ... FOR SHARE` on the partition's consumer_offsets row: every batch of the
# worker locks that row FOR UPDATE, so a share lock would make the partition's worker wait for each repair chunk
# (and a repair wait for each batch), and two share locks do not exclude each other, so two repairs would still
# race. No worker ever takes this lock: repairs of one partition take turns and workers never wait for them (they
# meet only on stock_levels rows, both locking them in (warehouse, sku) order, for one chunk's commit at most).
_LOCK: Final = "SELECT pg_advisory_xact_lock(hashtext('stock-ledger repair ' || $1 || ' ' || $2), $3)"
_STORED: Final = "SELECT next_offset FROM consumer_offsets WHERE group_id = $1 AND topic = $2 AND partition = $3"
_STILL_MISSING: Final = """
SELECT o FROM unnest($3::bigint[]) AS o
 WHERE NOT EXISTS (SELECT FROM stock_movements
                    WHERE kafka_topic = $1 AND kafka_partition = $2 AND kafka_offset = o)
   AND NOT EXISTS (SELECT FROM rejected_movements
                    WHERE kafka_topic = $1 AND kafka_partition = $2 AND kafka_offset = o)
"""
_AUDIT: Final = """
INSERT INTO ledger_repairs (run_id, group_id, topic, partition, first_offset, last_offset, records, applied,
                            quarantined, reasons)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10::jsonb)
"""
_RECORDED_GAPS: Final = """
SELECT id, first_offset, last_offset, acknowledged_at IS NOT NULL AS acknowledged FROM ledger_gaps
 WHERE group_id = $1 AND topic = $2 AND partition = $3 ORDER BY first_offset
"""
_RECORD_GAP: Final = """
INSERT INTO ledger_gaps (group_id, topic, partition, first_offset, last_offset, reason)
VALUES ($1, $2, $3, $4, $5, $6) RETURNING id
"""


@dataclass
class PartitionRepair:
    """What repair found and did in one partition."""

    partition: int
    stored: int | None
    log_start: int
    log_end: int
    missing: list[Run] = field(default_factory=list)  # in the topic below the stored offset, in neither table
    applied: int = 0
    quarantined: Counter[str] = field(default_factory=Counter)
    already_present: int = 0  # written meanwhile by another repair or a replay: left as found
    left_to_workers: int = 0  # the stored offset was moved back below them meanwhile: the workers apply them
    excluded: int = 0  # inside a range recorded in ledger_gaps (an operator's skip, an acknowledged hole)
    gone: list[Run] = field(default_factory=list)  # below the log start, in neither table, not acknowledged
    gap_ids: list[int] = field(default_factory=list)  # the unacknowledged ledger_gaps rows that hold `gone`
    refused: str | None = None  # why this partition was not repaired

    @property
    def missing_records(self) -> int:
        return sum(last - first + 1 for first, last in self.missing)

    @property
    def gone_records(self) -> int:
        return sum(last - first + 1 for first, last in self.gone)

    def as_dict(self) -> dict[str, Any]:
        return {"partition": self.partition, "stored_offset": self.stored, "log_start": self.log_start,
                "log_end": self.log_end, "missing": self.missing_records, "missing_ranges": self.missing,
                "applied": self.applied, "quarantined": dict(self.quarantined),
                "already_present": self.already_present, "left_to_workers": self.left_to_workers,
                "excluded_recorded_gaps": self.excluded, "gone": self.gone_records, "gone_ranges": self.gone,
                "gap_ids": self.gap_ids, "refused": self.refused}


@dataclass
class RepairReport:
    topic: str
    group: str
    run_id: uuid.UUID
    dry_run: bool
    partitions: list[PartitionRepair] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """0: every repairable record applied and nothing gone; EXIT_GONE: some range is gone from Kafka;
        1: a partition could not be repaired (its reason says what to do)."""
        if any(p.refused for p in self.partitions):
            return 1
        return EXIT_GONE if any(p.gone for p in self.partitions) else 0

    def totals(self) -> dict[str, Any]:
        quarantined: Counter[str] = Counter()
        for p in self.partitions:
            quarantined.update(p.quarantined)
        return {"missing": sum(p.missing_records for p in self.partitions),
                "applied": sum(p.applied for p in self.partitions), "quarantined": dict(quarantined),
                "already_present": sum(p.already_present for p in self.partitions),
                "left_to_workers": sum(p.left_to_workers for p in self.partitions),
                "excluded_recorded_gaps": sum(p.excluded for p in self.partitions),
                "gone": sum(p.gone_records for p in self.partitions)}

    def as_dict(self) -> dict[str, Any]:
        return {"run_id": str(self.run_id), "topic": self.topic, "group": self.group, "dry_run": self.dry_run,
                "exit_code": self.exit_code, "totals": self.totals(),
                "partitions": [p.as_dict() for p in self.partitions]}


@dataclass
class _Chunk:
    applied: int = 0
    quarantined: Counter[str] = field(default_factory=Counter)
    already_present: int = 0
    left_to_workers: int = 0
    applied_ids: list[Any] = field(default_factory=list)


async def repair(settings: Settings, conn: asyncpg.Connection, *, partitions: frozenset[int] | None,  # noqa: PLR0913 - the command's options
                 dry_run: bool, batch_size: int, show_progress: bool = True) -> RepairReport:
    """Find and re-apply the skipped records of these partitions (None: all) on `conn`, the owner's session
    (with `pgtime` installed: rows carry timestamps in the wire form the worker writes)."""
    report = RepairReport(settings.topic, settings.group_id, uuid.uuid4(), dry_run)
    consumer = topic_reader(settings)
    await consumer.start()
    try:
        tps = await topic_partitions(settings, Scope(partitions))
        log_starts = {tp.partition: int(o) for tp, o in (await consumer.beginning_offsets(tps)).items()}
        ends = {tp.partition: int(o) for tp, o in (await consumer.end_offsets(tps)).items()}
        # Read once: records at or past these belong to the workers, whatever they apply meanwhile.
        stored = await stored_offsets(conn, settings.group_id, settings.topic)
        total = sum(max(0, min(stored.get(p) or 0, ends[p]) - log_starts[p]) for p in ends)
        reading = Progress(f"repair: reading {settings.topic}, {len(tps)} partitions", total) if show_progress \
            else None
        for tp in tps:
            p = tp.partition
            found = PartitionRepair(p, stored.get(p), log_starts[p], ends[p])
            await _scan(conn, consumer, settings, found, reading)
            report.partitions.append(found)
        if reading:
            reading.finish()
        applying = Progress("repair: applying", sum(p.missing_records for p in report.partitions)) \
            if show_progress else None
        run = _Run(conn, consumer, settings, report, batch_size, applying)
        for found in report.partitions:
            if found.missing:
                await _apply(run, found)
            if found.gone and not dry_run:
                found.gap_ids = await _record_gone(conn, settings, found)
            _log_partition(report, found)
        if applying:
            applying.finish()
    finally:
        await consumer.stop()
    log.info("repair.done", run_id=str(report.run_id), topic=report.topic, group=report.group, dry_run=dry_run,
             partitions=len(report.partitions), exit_code=report.exit_code, **report.totals())
    return report


def _count(runs: Iterable[Run]) -> int:
    return sum(last - first + 1 for first, last in runs)


async def _scan(conn: asyncpg.Connection, consumer: AIOKafkaConsumer, settings: Settings, found: PartitionRepair,
                progress: Progress | None) -> None:
    """Fill `found.missing` (readable, repairable) and `found.gone` (below the log start) for one partition."""
    stored = found.stored
    if not stored:
        return  # nothing applied yet: nothing below the stored offset
    if stored > found.log_end:
        found.refused = (f"stored offset {stored} is past the log end {found.log_end}: the topic was recreated or "
                         "truncated, so its offsets are not the ledger's (runbook: StockLedgerLogGap)")
        return

    async def ledger() -> tuple[Any, Any]:
        async with conn.transaction(readonly=True):  # a cursor needs a transaction
            return await ledger_partition(conn, settings.topic, found.partition, 0)

    tp = TopicPartition(settings.topic, found.partition)
    (applied, _), topic_runs = await asyncio.gather(
        ledger(), read_partition(consumer, tp, found.log_start, stored, progress))
    recorded = await conn.fetch(_RECORDED_GAPS, settings.group_id, settings.topic, found.partition)
    every_gap = merged((r["first_offset"], r["last_offset"]) for r in recorded)
    acknowledged = merged((r["first_offset"], r["last_offset"]) for r in recorded if r["acknowledged"])

    window = Window(start=0, log_start=found.log_start, end=stored, end_after=stored, stored=stored)
    every_missing = list(missing_runs(topic_runs, applied, window))
    found.missing = list(difference(every_missing, every_gap))
    found.excluded = _count(every_missing) - _count(found.missing)

    first_row = next(iter(applied), None)
    below = min(stored, found.log_start) - 1
    if first_row is not None and first_row[0] <= below:
        holes = list(difference([(first_row[0], below)], applied))
        found.gone = list(difference(holes, acknowledged))
        found.excluded += _count(holes) - _count(found.gone)
        found.gap_ids = sorted(r["id"] for r in recorded if not r["acknowledged"]
                               and any(r["first_offset"] <= last and first <= r["last_offset"]
                                       for first, last in found.gone))


async def _records(consumer: AIOKafkaConsumer, tp: TopicPartition, runs: Sequence[Run],
                   size: int) -> AsyncIterator[list[Any]]:
    """The records of `runs` (committed records only: the runs came from a read_committed read), in chunks."""
    consumer.assign([tp])
    chunk: list[Any] = []
    for first, last in runs:
        consumer.seek(tp, first)
        seen, moved = first, time.monotonic()
        while (position := await consumer.position(tp)) <= last:
            if position != seen:
                seen, moved = position, time.monotonic()
            elif time.monotonic() - moved > _STALL_SECONDS:
                raise StockLedgerError(f"reading {tp.topic}/{tp.partition} made no progress for {_STALL_SECONDS:g}s "
                                       f"at offset {position}: check the broker, then run repair again (what it "
                                       "applied so far is committed; it continues with the rest)")
            fetched = await consumer.getmany(tp, timeout_ms=1000, max_records=size)
            for r in fetched.get(tp, []):
                if first <= r.offset <= last:
                    chunk.append(r)
                    if len(chunk) >= size:
                        yield chunk
                        chunk = []
    if chunk:
        yield chunk


@dataclass
class _Run:
    """One repair's state while it applies."""

    conn: asyncpg.Connection
    consumer: AIOKafkaConsumer
    settings: Settings
    report: RepairReport
    batch_size: int
    progress: Progress | None
    # The movement_ids this run applied: a dry run's rollback takes them back out of the ledger, not out of here.
    seen: set[Any] = field(default_factory=set)


async def _apply(run: _Run, found: PartitionRepair) -> None:
    tp, progress = TopicPartition(run.settings.topic, found.partition), run.progress
    async for records in _records(run.consumer, tp, found.missing, run.batch_size):
        done = await _chunk_with_retries(run, tp, records)
        found.applied += done.applied
        found.quarantined.update(done.quarantined)
        found.already_present += done.already_present
        found.left_to_workers += done.left_to_workers
        if progress:
            progress.advance(len(records))


async def _chunk_with_retries(run: _Run, tp: TopicPartition, records: list[Any]) -> _Chunk:
    for attempt in range(1, _ATTEMPTS + 1):
        try:
            done = await _chunk(run, tp, records)
        except asyncpg.UniqueViolationError as exc:
            if exc.constraint_name != _MOVEMENT_ID_KEY:
                raise CoordinateConflictError(
                    f"{exc.constraint_name}: a record of {tp.topic}/{tp.partition} offsets {records[0].offset}.."
                    f"{records[-1].offset} was written by someone else after repair found it missing, outside "
                    "repair's lock (a worker whose offset was moved back, another tool); nothing of this chunk was "
                    "written. Run `stock-ledger verify`, then repair again") from exc
            if attempt == _ATTEMPTS:
                raise
            # A worker committed one of these movement_ids meanwhile: the redo's lookup quarantines it.
        except (asyncpg.DeadlockDetectedError, asyncpg.LockNotAvailableError) as exc:
            if attempt == _ATTEMPTS:
                raise StockLedgerError(
                    f"{tp.topic}/{tp.partition}: gave up after {_ATTEMPTS} attempts ({type(exc).__name__}: {exc}); "
                    "nothing of this chunk was written. Run repair again: it continues with what is still missing "
                    "(raise STOCK_LEDGER_LOCK_TIMEOUT_MS if workers hold stock levels for long)") from exc
            await asyncio.sleep(0.2 * attempt)
        except (ValueError, OverflowError, asyncpg.PostgresError) as exc:
            why = refusal(exc)
            if why is None:
                raise
            # The worker would quarantine the refused record as database_rejected (sink._copy_isolating); repair
            # stops instead: the parser accepted the record, so this database differs from what migrations/ define.
            raise StockLedgerError(
                f"{tp.topic}/{tp.partition} offsets {records[0].offset}..{records[-1].offset}: {why}; nothing of "
                "this chunk was written. Check the schema against migrations/ (`stock-ledger migrate`); "
                f"`--partition {tp.partition} --batch-size 1` names the record") from exc
        else:
            run.seen.update(done.applied_ids)
            return done
    raise AssertionError("unreachable")  # pragma: no cover


async def _chunk(run: _Run, tp: TopicPartition, records: list[Any]) -> _Chunk:
    """One transaction (rolled back in a dry run, once its effects are known)."""
    conn, settings, report = run.conn, run.settings, run.report
    topic, partition, done = tp.topic, tp.partition, _Chunk()
    async with transaction(conn, commit=not report.dry_run):
        await conn.execute(_LOCK, settings.group_id, topic, partition)
        # Under the lock, so another repair's chunk has committed or not started: what it wrote is seen here.
        stored = await conn.fetchval(_STORED, settings.group_id, topic, partition)
        still = {r[0] for r in await conn.fetch(_STILL_MISSING, topic, partition, [r.offset for r in records])}
        todo = [r for r in records if r.offset in still and stored is not None and r.offset < stored]
        done.already_present = sum(r.offset not in still for r in records)
        done.left_to_workers = len(records) - len(todo) - done.already_present
        if not todo:
            return done
        batch = build_batch(topic, {partition: todo}, {partition: 0})
        movements, rejects = await _quarantine_known(conn, batch, run.seen)
        if movements:
            await conn.copy_records_to_table("stock_movements", records=movements, columns=MOVEMENT_COLUMNS)
        if rejects:
            await conn.copy_records_to_table("rejected_movements", records=rejects, columns=REJECT_COLUMNS)
        await add_levels(conn, movements, batch.levels if movements is batch.movements else None)
        done.applied, done.applied_ids = len(movements), [m[M_ID] for m in movements]
        done.quarantined = Counter(r[R_CODE] for r in rejects)
        await conn.execute(_AUDIT, report.run_id, settings.group_id, topic, partition, todo[0].offset,
                           todo[-1].offset, len(todo), len(movements), len(rejects), json.dumps(done.quarantined))
    return done


async def _quarantine_known(conn: asyncpg.Connection, batch: Batch, seen: set[Any],
                            ) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """The worker's step 2 (sink.Ledger._quarantine_known), in its words: a movement_id already in the ledger is
    quarantined, not applied twice. `seen`: the ids this run applied, which a dry run's rollback took back out."""
    ids = [m[M_ID] for m in batch.movements]
    known = (await known_movement_ids(conn, ids) if ids else set()) | (seen & set(ids))
    return without_known(batch, known)


async def _record_gone(conn: asyncpg.Connection, settings: Settings, found: PartitionRepair) -> list[int]:
    """Record the gone ranges no ledger_gaps row holds yet (under the lock: two repairs record them once); the ids
    of every unacknowledged row that holds them."""
    group, topic, partition = settings.group_id, settings.topic, found.partition
    async with conn.transaction():
        await conn.execute(_LOCK, group, topic, partition)
        recorded = await conn.fetch(_RECORDED_GAPS, group, topic, partition)
        held = merged((r["first_offset"], r["last_offset"]) for r in recorded)
        for first, last in difference(found.gone, held):
            await conn.fetchval(_RECORD_GAP, group, topic, partition, first, last, GONE_REASON)
        recorded = await conn.fetch(_RECORDED_GAPS, group, topic, partition)
    return sorted(r["id"] for r in recorded if not r["acknowledged"]
                  and any(r["first_offset"] <= last and first <= r["last_offset"] for first, last in found.gone))


def _log_partition(report: RepairReport, found: PartitionRepair) -> None:
    if not (found.missing or found.gone or found.refused or found.excluded):
        return
    log.info("repair.partition", run_id=str(report.run_id), topic=report.topic, group=report.group,
             partition=found.partition, dry_run=report.dry_run, missing=found.missing_records,
             missing_ranges=[describe(r) for r in found.missing[:20]], applied=found.applied,
             quarantined=dict(found.quarantined), already_present=found.already_present,
             left_to_workers=found.left_to_workers, excluded_recorded_gaps=found.excluded,
             gone=found.gone_records, gone_ranges=[describe(r) for r in found.gone[:20]], gap_ids=found.gap_ids,
             refused=found.refused)


def render(report: RepairReport) -> str:
    """The per-partition summary for people: partitions where something was found, then what to do."""
    verb = "would apply" if report.dry_run else "applied"
    rows = [p for p in report.partitions if p.missing or p.gone or p.refused or p.excluded]
    dry = " -- dry run, nothing written" if report.dry_run else ""
    title = (f"repair of {report.topic} (group {report.group}){dry}: {len(report.partitions)} partitions examined "
             "below their stored offsets")
    lines = [title]
    if rows:
        header = ["partition", "stored", "log_start", "missing", verb.rsplit(maxsplit=1)[-1], "quarantined",
                  "present", "gone"]
        cells = [[str(p.partition), str(p.stored), str(p.log_start), str(p.missing_records), str(p.applied),
                  str(sum(p.quarantined.values())), str(p.already_present), str(p.gone_records)] for p in rows]
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
        lines += ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    for p in rows:
        if p.missing:
            lines.append(f"p{p.partition}: missing {', '.join(describe(r) for r in p.missing[:10])}"
                         f"{' ...' if len(p.missing) > 10 else ''}")
        if p.quarantined:
            reasons = ", ".join(f"{c} {n}" for c, n in sorted(p.quarantined.items()))
            lines.append(f"p{p.partition}: quarantined {reasons}")
        if p.excluded:
            lines.append(f"p{p.partition}: {p.excluded} offsets inside ranges recorded in ledger_gaps, left alone")
        if p.gone:
            held = f" (ledger_gaps #{', #'.join(map(str, p.gap_ids))})" if p.gap_ids else \
                (" (not recorded: dry run)" if report.dry_run else "")
            lines.append(f"p{p.partition}: GONE from Kafka, below the log start {p.log_start}: "
                         f"{', '.join(describe(r) for r in p.gone[:10])}{' ...' if len(p.gone) > 10 else ''}{held}")
        if p.refused:
            lines.append(f"p{p.partition}: NOT REPAIRED: {p.refused}")
    t = report.totals()
    lines.append(f"total: missing {t['missing']}, {verb} {t['applied']}, quarantined {sum(t['quarantined'].values())}"
                 f", already present {t['already_present']}, gone {t['gone']}")
    if report.exit_code == EXIT_GONE:
        lines.append("gone records cannot be re-applied: reconcile the stock they moved by hand (a count, or "
                     "adjustments produced to the topic), then `stock-ledger gaps ack ID --note ...` (runbook: "
                     '"Repairing movements an earlier version skipped")')
    return "\n".join(lines)
