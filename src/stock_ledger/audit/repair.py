"""`stock-ledger repair`: re-apply from Kafka the records an earlier version skipped.

Earlier versions could move a partition's stored offset past records after a database failover or restore: the
records are in the topic, below the stored offset, and in neither stock_movements nor rejected_movements; `verify`
reports them as gaps. Repair finds exactly those with verify's own comparison (compare.py), reads them from Kafka
with read_committed, and writes each one as the worker would have: through the worker's parser and batch builder
(`ledger.batch.build_batch`: a bad record is quarantined with its reason and raw bytes), a movement_id already in the
ledger quarantined as duplicate_movement_id, the level deltas added in the same transaction (ledger.movements). It
never moves consumer_offsets: what lies at or past the stored offset is the workers'.

Exactly once, beside running workers and other repairs: one transaction per chunk of records, which
  1. takes the operators' lock on (group, topic, partition) (ledger.offsets.operator_lock), so repairs of a
     partition take turns, and an `offsets set` of it waits for the chunk to commit and then sees its rows (it
     may never move the stored offset below a row); no worker ever takes it;
  2. re-reads which of the chunk's coordinates are still in neither table and still below the stored offset
     (another repair or a `rejected replay` may have written some meanwhile) and writes only those;
  3. COPYs the rows, with the unique constraint on the coordinates as the backstop: a violation stops the run,
     loudly, with nothing of that chunk written; a row the database refuses (a value the parser let pass) is
     quarantined as database_rejected, as the worker's batch does (ledger.movements.copy_isolating);
  4. adds the level deltas and writes its `ledger_repairs` row (the audit trail, migration 0008).

Records below the log start can no longer be read, and Kafka can no longer say whether such an offset held a record
at all. The ledger can where it recorded, while applying, the offsets that held no data record (transaction
markers, aborted records: compare.py). An offset below the log start in neither table and not recorded so is gone
inside the range the ledger recorded them in (it held a movement the ledger lost: a hole), reported and recorded as
an unacknowledged `ledger_gaps` row, never invented: `verify` fails until someone reconciles that stock and
acknowledges it (`gaps ack`), and repair exits with EXIT_GONE until then. Outside that range (a ledger applied by a
version before they were recorded) it is unknown: reported, not recorded, no failure; nobody can tell a marker from
a lost movement there any more.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import asyncpg
import structlog
from aiokafka import TopicPartition

from stock_ledger.audit.compare import (
    TopicRecords,
    Window,
    gone_or_unknown,
    history_start,
    ledger_runs,
    missing_offsets,
    missing_runs,
    require_ledger,
    topic_partitions,
    topic_reader,
    unread,
)
from stock_ledger.audit.ranges import Run, describe, difference, merged
from stock_ledger.clients.database import transaction
from stock_ledger.errors import CoordinateConflictError, StockLedgerError
from stock_ledger.formats.resolver import Formats
from stock_ledger.ledger import closings, offsets
from stock_ledger.ledger.batch import M_ID, R_CODE, Batch, build_batch
from stock_ledger.ledger.movements import (
    MOVEMENT_ID_KEY,
    add_levels,
    copy_isolating,
    known_movement_ids,
    without_known,
)
from stock_ledger.progress import Progress

if TYPE_CHECKING:
    from collections.abc import Iterable

    from stock_ledger.config import Settings

log = structlog.get_logger(__name__)

# Exit code when some skipped records are gone from Kafka (below the log start): reported, recorded, not applied.
EXIT_GONE: Final = 3
# ledger_gaps.reason of such a range.
GONE_REASON: Final = "skipped_below_log_start"
# A chunk that met a deadlock, a lock timeout or a movement_id a worker committed meanwhile is redone from the
# start (its re-check makes that safe), this many times at most.
_ATTEMPTS: Final = 5

_AUDIT: Final = """
INSERT INTO ledger_repairs (run_id, group_id, topic, partition, first_offset, last_offset, records, applied,
                            quarantined, reasons)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10::jsonb)
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
    excluded: int = 0  # inside an acknowledged ledger_gaps range (an operator's skip, an acknowledged hole)
    gone: list[Run] = field(default_factory=list)  # below the log start, in neither table, not acknowledged
    # below the log start, in neither table, not acknowledged, outside the range whose non-record offsets the ledger
    # recorded: a marker, an aborted record or a lost movement; nobody can say any more
    unknown: list[Run] = field(default_factory=list)
    gap_ids: list[int] = field(default_factory=list)  # the unacknowledged ledger_gaps rows that hold `gone`/`unknown`
    refused: str | None = None  # why this partition was not repaired

    @property
    def missing_records(self) -> int:
        return sum(last - first + 1 for first, last in self.missing)

    @property
    def gone_records(self) -> int:
        return sum(last - first + 1 for first, last in self.gone)

    @property
    def unknown_offsets(self) -> int:
        return sum(last - first + 1 for first, last in self.unknown)

    def as_dict(self) -> dict[str, Any]:
        return {"partition": self.partition, "stored_offset": self.stored, "log_start": self.log_start,
                "log_end": self.log_end, "missing": self.missing_records, "missing_ranges": self.missing,
                "applied": self.applied, "quarantined": dict(self.quarantined),
                "already_present": self.already_present, "left_to_workers": self.left_to_workers,
                "excluded_recorded_gaps": self.excluded, "gone": self.gone_records, "gone_ranges": self.gone,
                "unknown": self.unknown_offsets, "unknown_ranges": self.unknown,
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
                "gone": sum(p.gone_records for p in self.partitions),
                "unknown": sum(p.unknown_offsets for p in self.partitions)}

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
    reader = TopicRecords(consumer, advice="check the broker, then run repair again (what it applied so far is "
                                           "committed; it continues with the rest)")
    try:
        tps = await topic_partitions(settings, partitions)
        log_starts = {tp.partition: int(o) for tp, o in (await consumer.beginning_offsets(tps)).items()}
        ends = {tp.partition: int(o) for tp, o in (await consumer.end_offsets(tps)).items()}
        await require_ledger(conn, settings, nothing_done="nothing was repaired")
        # Read once: records at or past these belong to the workers, whatever they apply meanwhile.
        stored = await offsets.stored_offsets(conn, settings.group_id, settings.topic)
        known = await offsets.non_records_known(conn)
        total = sum(max(0, min(stored.get(p) or 0, ends[p]) - log_starts[p]) for p in ends)
        reading = Progress(f"repair: reading {settings.topic}, {len(tps)} partitions", total) if show_progress \
            else None
        for tp in tps:
            p = tp.partition
            found = PartitionRepair(p, stored.get(p), log_starts[p], ends[p])
            await _scan(conn, reader, settings, found, reading, known=known.get((settings.topic, p)))
            report.partitions.append(found)
        if reading:
            reading.finish()
        applying = Progress("repair: applying", sum(p.missing_records for p in report.partitions)) \
            if show_progress else None
        run = _Run(conn, reader, settings, report, batch_size, applying, formats=Formats(settings))
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


async def _scan(conn: asyncpg.Connection, reader: TopicRecords, settings: Settings, found: PartitionRepair,  # noqa: PLR0913 - the run's state
                progress: Progress | None, *, known: Run | None) -> None:
    """Fill `found.missing` (readable, repairable), `found.gone` and `found.unknown` (below the log start: compare.py)
    for one partition; `known`: the offsets whose non-record offsets the ledger recorded."""
    stored = found.stored
    if not stored:
        return  # nothing applied yet: nothing below the stored offset
    if stored > found.log_end:
        found.refused = (f"stored offset {stored} is past the log end {found.log_end}: the topic was recreated or "
                         "truncated, so its offsets are not the ledger's (runbook: StockLedgerLogGap)")
        return

    async def ledger() -> tuple[Any, Any]:
        async with conn.transaction(readonly=True):  # a cursor needs a transaction
            return await ledger_runs(conn, settings.topic, found.partition, 0)

    tp = TopicPartition(settings.topic, found.partition)
    (applied, _), topic_runs = await asyncio.gather(
        ledger(), reader.offsets(tp, found.log_start, stored, progress))
    recorded = await offsets.gaps_of(conn, settings.group_id, settings.topic, found.partition)
    # Only an acknowledgement that counts (made by a role that may acknowledge: ledger/offsets.py) sets readable
    # records aside. A hole a worker records lies below the log start, where nothing is readable; a recorded range
    # over records still in the topic is not a hole, and nobody who may decide so has skipped them.
    acknowledged = merged((r["first_offset"], r["last_offset"]) for r in recorded if r["acknowledged"])

    window = Window(start=0, log_start=found.log_start, end=stored, end_after=stored, stored=stored)
    every_missing = list(missing_runs(topic_runs, applied, window))
    found.missing = list(difference(every_missing, acknowledged))
    found.excluded = _count(every_missing) - _count(found.missing)

    below = min(stored, found.log_start) - 1
    key = (settings.topic, found.partition)
    non_records = (await offsets.non_records(conn, [(key, 0, below + 1)])).get(key, [])
    start = history_start(applied, non_records, known)
    if start is not None and start <= below:
        gone, unknown = gone_or_unknown(unread(applied, non_records, start, below), known)
        found.gone = list(difference(gone, acknowledged))
        found.unknown = list(difference(unknown, acknowledged))
        found.excluded += _count(gone) + _count(unknown) - _count(found.gone) - _count(found.unknown)
        found.gap_ids = sorted(r["id"] for r in recorded if not r["acknowledged"]
                               and any(r["first_offset"] <= last and first <= r["last_offset"]
                                       for first, last in [*found.gone, *found.unknown]))


@dataclass
class _Run:
    """One repair's state while it applies."""

    conn: asyncpg.Connection
    reader: TopicRecords
    settings: Settings
    report: RepairReport
    batch_size: int
    progress: Progress | None
    # The movement_ids this run applied: a dry run's rollback takes them back out of the ledger, not out of here.
    seen: set[Any] = field(default_factory=set)
    formats: Formats | None = None  # the declared format the worker reads (None: plain JSON)


async def _apply(run: _Run, found: PartitionRepair) -> None:
    tp, progress = TopicPartition(run.settings.topic, found.partition), run.progress
    async for records in run.reader.records(tp, found.missing, run.batch_size):
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
            if exc.constraint_name != MOVEMENT_ID_KEY:
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
        else:
            run.seen.update(done.applied_ids)
            return done
    raise AssertionError("unreachable")  # pragma: no cover


async def _chunk(run: _Run, tp: TopicPartition, records: list[Any]) -> _Chunk:
    """One transaction (rolled back in a dry run, once its effects are known)."""
    conn, settings, report = run.conn, run.settings, run.report
    topic, partition, done = tp.topic, tp.partition, _Chunk()
    async with transaction(conn, commit=not report.dry_run):
        await offsets.operator_lock(conn, settings.group_id, topic, partition)
        # Under the lock, so another repair's chunk or an `offsets set` of this partition has committed or not
        # started: what it wrote (rows, a moved offset) is seen here.
        stored = (await offsets.current(conn, settings.group_id, topic, [partition])).get(partition, (0, None))[1]
        neither = (await missing_offsets(conn, [((topic, partition), records[0].offset, records[-1].offset + 1)])
                   ).get((topic, partition), [])
        still = {r.offset for r in records if any(first <= r.offset <= last for first, last in neither)}
        todo = [r for r in records if r.offset in still and stored is not None and r.offset < stored]
        done.already_present = sum(r.offset not in still for r in records)
        done.left_to_workers = len(records) - len(todo) - done.already_present
        if not todo:
            return done
        decode = await run.formats.decoder_for(todo) if run.formats is not None else None
        batch = build_batch(topic, {partition: todo}, {partition: 0}, decode=decode)
        movements, rejects = await _quarantine_known(conn, batch, run.seen)
        # As the worker's batch does: a row the database refuses (a value the parser let pass) is quarantined as
        # database_rejected with the refusal and its raw bytes, and the rest of the chunk is written.
        movements, rejects, _ = await copy_isolating(conn, batch, movements, rejects)
        await add_levels(conn, movements, batch.levels if movements is batch.movements else None)
        await closings.include(conn, movements)  # below the stored offset: below the cuts of recent closings
        done.applied, done.applied_ids = len(movements), [m[M_ID] for m in movements]
        done.quarantined = Counter(r[R_CODE] for r in rejects)
        await conn.execute(_AUDIT, report.run_id, settings.group_id, topic, partition, todo[0].offset,
                           todo[-1].offset, len(todo), len(movements), len(rejects), json.dumps(done.quarantined))
    return done


async def _quarantine_known(conn: asyncpg.Connection, batch: Batch, seen: set[Any],
                            ) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """The worker's step 3 (ledger.transaction), in its words: a movement_id already in the ledger is
    quarantined, not applied twice. `seen`: the ids this run applied, which a dry run's rollback took back out."""
    ids = [m[M_ID] for m in batch.movements]
    known = await known_movement_ids(conn, ids) | (seen & set(ids))
    return without_known(batch, known)


async def _record_gone(conn: asyncpg.Connection, settings: Settings, found: PartitionRepair) -> list[int]:
    """Record the gone ranges no ledger_gaps row holds yet (under the lock: two repairs record them once); the ids
    of every unacknowledged row that holds them."""
    group, topic, partition = settings.group_id, settings.topic, found.partition
    async with conn.transaction():
        await offsets.operator_lock(conn, group, topic, partition)
        recorded = await offsets.gaps_of(conn, group, topic, partition)
        held = merged((r["first_offset"], r["last_offset"]) for r in recorded)
        for first, last in difference(found.gone, held):
            await offsets.record_gap(conn, group, topic, partition, first=first, last=last, reason=GONE_REASON)
        recorded = await offsets.gaps_of(conn, group, topic, partition)
    return sorted(r["id"] for r in recorded if not r["acknowledged"]
                  and any(r["first_offset"] <= last and first <= r["last_offset"]
                          for first, last in [*found.gone, *found.unknown]))


def _log_partition(report: RepairReport, found: PartitionRepair) -> None:
    if not (found.missing or found.gone or found.unknown or found.refused or found.excluded):
        return
    log.info("repair.partition", run_id=str(report.run_id), topic=report.topic, group=report.group,
             partition=found.partition, dry_run=report.dry_run, missing=found.missing_records,
             missing_ranges=[describe(r) for r in found.missing[:20]], applied=found.applied,
             quarantined=dict(found.quarantined), already_present=found.already_present,
             left_to_workers=found.left_to_workers, excluded_recorded_gaps=found.excluded,
             gone=found.gone_records, gone_ranges=[describe(r) for r in found.gone[:20]],
             unknown=found.unknown_offsets, unknown_ranges=[describe(r) for r in found.unknown[:20]],
             gap_ids=found.gap_ids,
             refused=found.refused)


def render(report: RepairReport) -> str:
    """The per-partition summary for people: partitions where something was found, then what to do."""
    verb = "would apply" if report.dry_run else "applied"
    rows = [p for p in report.partitions if p.missing or p.gone or p.unknown or p.refused or p.excluded]
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
            lines.append(f"p{p.partition}: {p.excluded} offsets inside ranges acknowledged in ledger_gaps, left alone")
        if p.gone:
            held = f" (ledger_gaps #{', #'.join(map(str, p.gap_ids))})" if p.gap_ids else \
                (" (not recorded: dry run)" if report.dry_run else "")
            lines.append(f"p{p.partition}: GONE from Kafka, below the log start {p.log_start}: "
                         f"{', '.join(describe(r) for r in p.gone[:10])}{' ...' if len(p.gone) > 10 else ''}{held}")
        if p.unknown:
            held = f" (ledger_gaps #{', #'.join(map(str, p.gap_ids))})" if p.gap_ids and not p.gone else ""
            lines.append(f"p{p.partition}: unknown below the log start {p.log_start}: "
                         f"{', '.join(describe(r) for r in p.unknown[:10])}{' ...' if len(p.unknown) > 10 else ''}"
                         f"{held}: applied before the ledger recorded which offsets held no record (transaction "
                         "markers, aborted records); Kafka no longer says either, so they are not taken for holes")
        if p.refused:
            lines.append(f"p{p.partition}: NOT REPAIRED: {p.refused}")
    t = report.totals()
    lines.append(f"total: missing {t['missing']}, {verb} {t['applied']}, quarantined {sum(t['quarantined'].values())}"
                 f", already present {t['already_present']}, gone {t['gone']}"
                 + (f", unknown {t['unknown']}" if t["unknown"] else ""))
    if report.exit_code == EXIT_GONE:
        lines.append("gone records cannot be re-applied: reconcile the stock they moved by hand (a count, or "
                     "adjustments produced to the topic), then `stock-ledger gaps ack ID --note ...` (runbook: "
                     '"Repairing movements an earlier version skipped")')
    return "\n".join(lines)
