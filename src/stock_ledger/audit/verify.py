"""`stock-ledger verify`: compare the topic with the ledger, partition by partition, and say what is wrong.

Bounded memory at any ledger size: nothing holds a set of coordinates. Per partition, the topic's offsets are read
and compressed into runs of consecutive offsets as they arrive (only transaction markers and aborted records break
a run), PostgreSQL turns the ledger's offsets into runs with window functions (it returns only the rows where a run
starts or ends, or where an offset repeats), and the two lists of runs are compared (`ranges.difference`). Memory
grows with the number of breaks in one partition, never with the number of records.

Consistency: the topic's end offsets are read first, then one REPEATABLE READ snapshot of the database serves every
query, then the end offsets are read again. Records produced after the first read are not compared; a row beyond
the second read cannot have come from the topic (a recreated topic, a foreign row) and is reported.

The last line on stdout is `rows|distinct` with the semantics of `SELECT count(*), count(DISTINCT source) FROM
stock_movements` (the staging pipeline reads it). `distinct` is not computed with a hash or a sort of every source:
`source` is a function of the coordinates that cannot collide (its two last `/`-separated parts are integers), so
while the coordinates' unique constraint is present and valid, distinct sources = rows. Without the constraint
the real count(DISTINCT) runs (PostgreSQL sorts on disk; slow, still bounded memory).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from aiokafka import TopicPartition

from stock_ledger.audit.compare import (
    AcknowledgedGap,
    TopicRecords,
    Window,
    compare,
    gone_or_unknown,
    history_start,
    ledger_runs,
    missing_runs,
    require_ledger,
    set_aside,
    topic_partitions,
    topic_reader,
    unread,
)
from stock_ledger.audit.invariants import COORDINATES_UNIQUE, LEVEL_MISMATCHES
from stock_ledger.audit.ranges import Found, Run, Runs, describe, difference
from stock_ledger.clients import kafka
from stock_ledger.clients.database import connect_database
from stock_ledger.gaps import find_gap
from stock_ledger.ledger import archives, offsets
from stock_ledger.progress import Progress
from stock_ledger.topics import committed_offsets, partitions_of

if TYPE_CHECKING:
    from collections.abc import Sequence
    from datetime import datetime

    import asyncpg
    from aiokafka import AIOKafkaConsumer

    from stock_ledger.config import Settings

# Per partition, the lowest offset applied (or quarantined) since a time: BRIN indexes of migration 0005.
_SINCE: Final = """
SELECT kafka_partition, min(kafka_offset) FROM (
    SELECT kafka_partition, kafka_offset FROM stock_movements WHERE kafka_topic = $1 AND applied_at >= $2
    UNION ALL
    SELECT kafka_partition, kafka_offset FROM rejected_movements WHERE kafka_topic = $1 AND rejected_at >= $2
) AS s GROUP BY 1
"""
_IN_SCOPE: Final = """
SELECT count(*) FROM {table} AS t JOIN unnest($2::int[], $3::bigint[]) AS s(p, lo)
    ON t.kafka_partition = s.p AND t.kafka_offset >= s.lo
 WHERE t.kafka_topic = $1
"""
_MISMATCHES: Final = f"{LEVEL_MISMATCHES} LIMIT 5"
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
    # `verify --json`: per partition, what the comparison with the topic found (as_dict).
    partitions: list[PartitionResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def as_dict(self) -> dict[str, Any]:
        """`verify --json`: the same checks, and each partition's findings as offset ranges [first, last]
        (at most ranges.SAMPLE ranges of each kind; `runs` and `offsets` count them all)."""
        def found(f: Found) -> dict[str, Any]:
            return {"offsets": f.offsets, "runs": f.runs, "sample": [list(r) for r in f.sample]}

        return {
            "ok": self.ok, "rows": self.rows, "distinct_sources": self.distinct_sources,
            "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in self.checks],
            "partitions": [{"partition": r.partition, "records": r.records, "last_record": r.last_record,
                            "missing": found(r.missing), "repeated": found(r.repeated), "phantoms": found(r.phantoms),
                            "gone": found(r.gone), "unknown": found(r.unknown)}
                           for r in self.partitions],
        }

    def add(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append(Check(name, ok, detail))

    def render(self) -> str:
        """The human table first, then the machine-readable `rows|distinct` line, always last."""
        width = max(len(c.name) for c in self.checks)
        lines = [f"{'check':<{width}}  result  detail", f"{'-' * width}  ------  ------"]
        lines += [f"{c.name:<{width}}  {'ok' if c.ok else 'FAIL':<6}  {c.detail}" for c in self.checks]
        lines.append(f"{self.rows}|{self.distinct_sources}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Scope:
    """What one run checks: some partitions (None = all), records applied since a time (None = all)."""

    partitions: frozenset[int] | None = None
    since: datetime | None = None

    @property
    def whole(self) -> bool:
        return self.partitions is None and self.since is None


@dataclass
class PartitionResult:
    partition: int
    records: int  # committed records in the topic, in the compared range
    missing: Found  # in the topic, below the stored offset, in neither table
    repeated: Found  # offsets held twice (in both tables, or twice in one without its constraint)
    phantoms: Found  # in the ledger, not in the topic (at or above the log start)
    last_record: int | None  # the topic's last committed record offset in the compared range
    # of the records missing, those inside an acknowledged ledger_gaps range: (the gap, how many), not a failure
    acknowledged: list[tuple[AcknowledgedGap, int]] = field(default_factory=list)
    # below the log start, in neither table, not recorded as holding no record nor in any ledger_gaps range
    # (compare.py): records the ledger lost (gone), or offsets it cannot judge (unknown)
    gone: Found = field(default_factory=Found)
    unknown: Found = field(default_factory=Found)


async def wait_for_drain(settings: Settings, seconds: float) -> bool:
    """Wait until the stored offsets reach every partition's log end; True if they did in time."""
    deadline = time.monotonic() + seconds
    consumer = kafka.reader(settings)
    try:
        await consumer.start()  # inside: a SIGTERM during the start still closes it
        conn = await connect_database(settings, application_name="stock-ledger-verify")
    except BaseException:
        await consumer.stop()
        raise
    try:
        while True:
            tps = [TopicPartition(settings.topic, p) for p in await partitions_of(settings)]
            ends = await consumer.end_offsets(tps) if tps else {}
            stored = await offsets.stored_offsets(conn, settings.group_id, settings.topic)
            # The end of the committed log (read_committed): a drained partition is stored exactly there, past the
            # transaction markers and aborted records after its last record too.
            behind = {tp.partition: ends[tp] - (stored.get(tp.partition) or 0) for tp in tps
                      if ends[tp] > (stored.get(tp.partition) or 0)}
            if not behind and tps:
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.5)
    finally:
        await conn.close()
        await consumer.stop()


async def log_checks(conn: asyncpg.Connection, settings: Settings, log_starts: dict[int, int],
                     stored: dict[int, int | None], log_ends: dict[int, int] | None = None) -> list[Check]:
    """Holes in the log: unacknowledged rows of `ledger_gaps` (and those acknowledged by a role that may not: named),
    stored offsets below the log start (records deleted by retention before the ledger applied them) and past the
    log end (the topic was recreated or truncated)."""
    checks = []
    if await offsets.gaps_table_exists(conn):
        open_gaps = await offsets.unacknowledged(conn, settings.group_id, settings.topic)
        checks.append(Check(
            "no unacknowledged gap (ledger_gaps)", not open_gaps,
            "none" if not open_gaps else f"{len(open_gaps)} open: " + "; ".join(
                f"p{g['partition']} {describe((g['first_offset'], g['last_offset']))} ({g['reason']}"
                + (f"; acknowledged by {g['acknowledged_by']}, which may not acknowledge gaps: does not count"
                   if g["acknowledged_by"] is not None else "") + ")"
                for g in open_gaps[:5])
            + "; reconcile the stock they moved, then `stock-ledger gaps ack ID --note ...` (`gaps list` shows IDs)"))
    below = {p: (s, log_starts[p]) for p, s in stored.items()
             if s is not None and p in log_starts and s < log_starts[p]}
    checks.append(Check(
        "stored offsets >= log start", not below,
        f"{len(log_starts)} partitions" if not below else "records deleted before they were applied: " + "; ".join(
            f"p{p}: stored {s}, log starts at {start}" for p, (s, start) in sorted(below.items())[:6])))
    if log_ends is not None:
        beyond = [g for p, s in sorted(stored.items()) if s is not None and p in log_ends
                  if (g := find_gap(p, s, log_starts.get(p, 0), log_ends[p])) is not None and not g.skippable]
        checks.append(Check("stored offsets <= log end", not beyond, f"{len(log_ends)} partitions" if not beyond
                            else "; ".join(f"p{g.partition}: {g.describe()}" for g in beyond[:6])))
    return checks


async def verify(settings: Settings, expect: int | None = None, show_progress: bool = True,
                 scope: Scope | None = None) -> Report:
    scope = scope or Scope()
    consumer = topic_reader(settings)
    await consumer.start()
    try:
        tps = await topic_partitions(settings, scope.partitions)
        log_starts = {tp.partition: int(o) for tp, o in (await consumer.beginning_offsets(tps)).items()}
        ends = {tp.partition: int(o) for tp, o in (await consumer.end_offsets(tps)).items()}
        committed = await committed_offsets(settings)
        conn = await connect_database(settings, application_name="stock-ledger-verify")
        try:
            async with conn.transaction(isolation="repeatable_read", readonly=True):
                await require_ledger(conn, settings, nothing_done="nothing was checked")
                stored = await offsets.stored_offsets(conn, settings.group_id, settings.topic)
                ends_after = {tp.partition: int(o) for tp, o in (await consumer.end_offsets(tps)).items()}
                starts = await _starts(conn, settings.topic, scope, stored, log_starts)
                windows = {p: Window(starts[p], log_starts[p], ends[p], ends_after[p], stored.get(p))
                           for p in starts}
                report = await _compare_all(conn, consumer, settings, scope, windows, show_progress=show_progress)
                await _counts(conn, report, settings.topic, scope, starts)
                if expect is not None:
                    report.add("expected rows", report.rows == expect, f"expected {expect}, found {report.rows}")
                # The ends read after the snapshot: a stored offset can only be behind them, never past them.
                report.checks += await log_checks(conn, settings, log_starts, stored, ends_after)
                report.checks.append(await _levels(conn, scope))
        finally:
            await conn.close()
    finally:
        await consumer.stop()
    negative = {p: (stored.get(p) or 0) - c for p, c in committed.items()
                if p in ends and (stored.get(p) or 0) < c}
    report.add("drift (stored - kafka committed) >= 0", not negative,
               f"{len(committed)} partitions with a Kafka commit" if not negative else
               "; ".join(f"p{p}: {d}" for p, d in sorted(negative.items())[:6]))
    return report


async def _levels(conn: asyncpg.Connection, scope: Scope) -> Check:
    name = "stock_levels = sum(movements)"
    if not scope.whole:
        return Check(name, ok=True, detail="not checked (needs the whole ledger: run without --partition/--since)")
    mismatches = await conn.fetch(_MISMATCHES)
    return Check(name, not mismatches, "all equal" if not mismatches else "; ".join(
        f"{m['w']}/{m['s']}: levels {m['on_hand']} vs movements {m['total']}" for m in mismatches))


async def _starts(conn: asyncpg.Connection, topic: str, scope: Scope, stored: dict[int, int | None],
                  log_starts: dict[int, int]) -> dict[int, int]:
    """The first offset checked per partition: 0, or with --since the first one applied since then (a partition
    that applied nothing since then is checked from its stored offset: only that the rest of its log is applied)."""
    if scope.since is None:
        return dict.fromkeys(log_starts, 0)
    first = {r[0]: r[1] for r in await conn.fetch(_SINCE, topic, scope.since)}
    starts = {}
    for p, log_start in log_starts.items():
        fallback = stored.get(p)
        starts[p] = first.get(p, fallback if fallback is not None else log_start)
    return starts


async def _acknowledged(conn: asyncpg.Connection, settings: Settings) -> dict[int, list[AcknowledgedGap]]:
    found: dict[int, list[AcknowledgedGap]] = {}
    if await offsets.gaps_table_exists(conn):
        for r in await offsets.acknowledged(conn, settings.group_id, settings.topic):
            found.setdefault(r[0], []).append(AcknowledgedGap(*r))
    return found


async def _compare_all(conn: asyncpg.Connection, consumer: AIOKafkaConsumer, settings: Settings, scope: Scope,  # noqa: PLR0913 - the run's state, read once by verify()
                       windows: dict[int, Window], *, show_progress: bool) -> Report:
    total = sum(max(0, w.end - w.low) for w in windows.values())
    progress = Progress(f"verify: {settings.topic}, {len(windows)} partitions", total) if show_progress else None
    results = []
    reader = TopicRecords(consumer, advice="check the broker, then run verify again")
    acknowledged = await _acknowledged(conn, settings)
    known = await offsets.non_records_known(conn)
    recorded = await offsets.gap_ranges(conn) if await offsets.gaps_table_exists(conn) else {}
    for p, w in sorted(windows.items()):
        # Kafka and PostgreSQL work at the same time: the fetch decodes here, the window functions run there.
        topic_runs, (ledger, repeated) = await asyncio.gather(
            reader.offsets(TopicPartition(settings.topic, p), w.low, w.end, progress),
            ledger_runs(conn, settings.topic, p, w.start),
        )
        missing, phantoms = compare(topic_runs, ledger, w)
        held: list[tuple[AcknowledgedGap, int]] = []
        if missing and p in acknowledged:
            missing, held = set_aside(list(missing_runs(topic_runs, ledger, w)), acknowledged[p])
        result = PartitionResult(p, topic_runs.count, missing, repeated, phantoms, topic_runs.last, held)
        if scope.since is None:
            key = (settings.topic, p)
            result.gone, result.unknown = await _below_log_start(conn, key, ledger, w, known=known.get(key),
                                                                 recorded=recorded.get(key, []))
        results.append(result)
    if progress:
        progress.finish()
    return _report(results, scope, {p: w.stored for p, w in windows.items()})


async def _below_log_start(conn: asyncpg.Connection, key: tuple[str, int], ledger: Runs, w: Window,  # noqa: PLR0913 - one partition's comparison
                           *, known: Run | None, recorded: list[Run]) -> tuple[Found, Found]:
    """Offsets below the log start (and the stored offset) in neither table that the ledger did not record as
    holding no data record, outside every ledger_gaps range: (gone, unknown), as repair judges them (compare.py)."""
    below = min(w.stored or 0, w.log_start) - 1
    non_records = (await offsets.non_records(conn, [(key, 0, below + 1)])).get(key, []) if below >= 0 else []
    start = history_start(ledger, non_records, known)
    if start is None or start > below:
        return Found(), Found()
    gone, unknown = gone_or_unknown(unread(ledger, non_records, start, below), known)
    return Found().extend(difference(gone, recorded)), Found().extend(difference(unknown, recorded))


def _report(results: Sequence[PartitionResult], scope: Scope, stored: dict[int, int | None]) -> Report:
    report = Report(partitions=list(results))
    produced = sum(r.records for r in results)
    what = "committed records"
    if scope.since is not None:
        what += f" from the first one applied since {scope.since.isoformat(timespec='seconds')}"
    report.add("records in topic", ok=True, detail=f"{produced} {what} in {len(results)} partitions")
    report.add("gaps (in topic, in neither table)", not any(r.missing for r in results),
               _summary({r.partition: r.missing for r in results}))
    held = [x for r in results for x in r.acknowledged]
    report.add("acknowledged gaps (skipped on purpose)", ok=True, detail="none" if not held else
               f"{sum(n for _, n in held)} records in the topic: "
               + "; ".join(f"{g.describe()} ({n} records)" for g, n in held[:5]) + (" ..." if len(held) > 5 else ""))
    if scope.since is None:
        unknown = {r.partition: r.unknown for r in results if r.unknown}
        report.add("records gone below the log start", not any(r.gone for r in results),
                   _summary({r.partition: r.gone for r in results})
                   + ("" if not any(r.gone for r in results) else
                      " (held records the ledger does not have, and Kafka deleted them: `stock-ledger repair` records"
                      " them in ledger_gaps; reconcile, then `gaps ack`)")
                   + ("" if not unknown else
                      f"; {sum(f.offsets for f in unknown.values())} offsets below the log start unknown ("
                      "applied before the ledger recorded which offsets held no record; Kafka no longer says): "
                      + "; ".join(f"p{p}: {', '.join(describe(r) for r in f.sample)}"
                                  f"{' ...' if f.runs > len(f.sample) else ''}"
                                  for p, f in sorted(unknown.items())[:5])))
    report.add("in both tables", not any(r.repeated for r in results),
               _summary({r.partition: r.repeated for r in results}))
    report.add("rows not in topic", not any(r.phantoms for r in results),
               _summary({r.partition: r.phantoms for r in results}))
    behind = {r.partition: f"stored {stored.get(r.partition)}, last record {r.last_record}" for r in results
              if r.last_record is not None and (stored.get(r.partition) or 0) < r.last_record + 1}
    if scope.since is None:
        report.add("stored offsets cover the log", not behind, "all partitions drained" if not behind else
                   "; ".join(f"p{p}: {d}" for p, d in sorted(behind.items())[:6]))
    else:
        # A frequent check of a live ledger always finds the last few records not yet applied: that is lag (the
        # lag metric and its alert watch it), not an integrity failure.
        report.add("stored offsets cover the log", ok=True,
                   detail=f"lag not judged with --since; {len(behind)} partitions with records still to apply")
    return report


async def _counts(conn: asyncpg.Connection, report: Report, topic: str, scope: Scope,
                  starts: dict[int, int]) -> None:
    unique = bool(await conn.fetchval(COORDINATES_UNIQUE))
    report.add("unique (topic, partition, offset)", unique,
               "constraint present and valid" if unique else
               "constraint stock_movements_coordinates_key missing or invalid: re-apply migrations/0001_ledger.sql")
    parts, lows = list(starts), [starts[p] for p in starts]
    stored = [r for r in await archives.archives(conn) if r["kafka_topic"] == topic
              and (scope.partitions is None or r["kafka_partition"] in scope.partitions)]
    # Archived movements count as the ledger's: each archive was checked against its segment when it left, and
    # `archive verify` checks its file. The comparison with the topic reads them as held (compare.ledger_runs).
    archived = sum(r["rows"] for r in stored) if scope.since is None else 0
    report.add("archived", ok=True, detail="none" if not stored else
               f"{sum(r['rows'] for r in stored)} movements in {len(stored)} archived segments: " + "; ".join(
                   f"p{r['kafka_partition']} [{r['first_offset']}, {r['end_offset']})" for r in stored[:5])
               + (" ..." if len(stored) > 5 else "") + " (`stock-ledger archive verify` checks their files)")
    if scope.whole:
        report.rows = int(await conn.fetchval("SELECT count(*) FROM stock_movements")) + archived
        report.distinct_sources = report.rows if unique else archived + int(
            await conn.fetchval("SELECT count(DISTINCT source) FROM stock_movements"))
    else:
        report.rows = archived + int(await conn.fetchval(_IN_SCOPE.format(table="stock_movements"), topic, parts,
                                                         lows))
        report.distinct_sources = report.rows if unique else archived + int(await conn.fetchval(
            _IN_SCOPE.format(table="stock_movements").replace("count(*)", "count(DISTINCT source)"),
            topic, parts, lows))
    report.add("rows vs distinct coordinates", report.rows == report.distinct_sources,
               f"{report.rows} rows, {report.distinct_sources} distinct sources"
               + ("" if scope.whole else " (in the checked ranges)"))
    rejected = int(await conn.fetchval(_IN_SCOPE.format(table="rejected_movements"), topic, parts, lows))
    report.add("quarantined", ok=True, detail=f"{rejected} records in rejected_movements")


def _summary(found: dict[int, Found]) -> str:
    found = {p: f for p, f in found.items() if f}
    if not found:
        return "none"
    total = sum(f.offsets for f in found.values())
    sample = "; ".join(
        f"p{p}: {', '.join(describe(r) for r in f.sample)}{' ...' if f.runs > len(f.sample) else ''}"
        for p, f in sorted(found.items())[:5])
    return f"{total} records: {sample}"
