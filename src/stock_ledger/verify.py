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
import re
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Final

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from stock_ledger.clients import connect_database, kafka_options
from stock_ledger.errors import ConfigError, StockLedgerError
from stock_ledger.gaps import find_gap
from stock_ledger.invariants import COORDINATES_UNIQUE, LEVEL_MISMATCHES
from stock_ledger.progress import Progress
from stock_ledger.ranges import Found, Run, Runs, clip, describe, difference, merged
from stock_ledger.sink import stored_offsets
from stock_ledger.topics import partitions_of

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Sequence

    import asyncpg

    from stock_ledger.config import Settings

# Records per getmany and bytes per partition fetch bound the topic side of verify's memory: each record is a Python
# object with its key and value. Reading 9M real movements took 119 MiB with 50,000 records and 8 MiB fetches, 49 MiB
# with these, in about the same time (docs/performance.md).
_FETCH_RECORDS: Final = 5_000
_STALL_SECONDS: Final = 60.0
# Both tables' offsets of one partition, from `$3` on, in offset order (a merge of the two unique indexes); only the
# rows where a run of consecutive offsets starts or ends, or where an offset repeats, leave the server.
_BOUNDARIES: Final = """
WITH u AS (
    SELECT kafka_offset AS o FROM stock_movements
     WHERE kafka_topic = $1 AND kafka_partition = $2 AND kafka_offset >= $3
    UNION ALL
    SELECT kafka_offset FROM rejected_movements
     WHERE kafka_topic = $1 AND kafka_partition = $2 AND kafka_offset >= $3
), w AS (
    SELECT o, lag(o) OVER (ORDER BY o) AS prev, lead(o) OVER (ORDER BY o) AS next FROM u
)
SELECT o, prev, next FROM w WHERE prev IS NULL OR next IS NULL OR o - prev <> 1 OR next - o <> 1 ORDER BY o
"""
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
# Ranges an operator (or `gaps ack`) acknowledged: their records stay in the topic, skipped on purpose.
_ACKNOWLEDGED: Final = """
SELECT partition, first_offset, last_offset, acknowledged_by, note FROM ledger_gaps
 WHERE acknowledged_at IS NOT NULL AND group_id = $1 AND topic = $2 ORDER BY partition, first_offset
"""


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
                            "missing": found(r.missing), "repeated": found(r.repeated), "phantoms": found(r.phantoms)}
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


@dataclass(frozen=True)
class AcknowledgedGap:
    partition: int
    first_offset: int
    last_offset: int
    by: str | None
    note: str | None

    def describe(self) -> str:
        return (f"acknowledged gap p{self.partition}: {describe((self.first_offset, self.last_offset))} by {self.by}, "
                f"note: {self.note}")


def set_aside(missing: Sequence[Run], gaps: Sequence[AcknowledgedGap],
              ) -> tuple[Found, list[tuple[AcknowledgedGap, int]]]:
    """Missing records outside every acknowledged gap (failures), and per gap how many missing records it holds.
    As `repair` leaves such ranges alone, verify does not count them as missing."""
    covered = merged((g.first_offset, g.last_offset) for g in gaps)
    held = [(g, n) for g in gaps
            if (n := sum(last - first + 1 for first, last in clip(missing, g.first_offset, g.last_offset)))]
    return Found().extend(difference(missing, covered)), held


_DURATION: Final = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhd])$")
_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(raw: str, now: datetime | None = None) -> datetime:
    """`--since`: an ISO 8601 time (naive = UTC) or a duration back from now: 90s, 15m, 6h, 2d."""
    text = raw.strip()
    if match := _DURATION.match(text):
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
        return (now or datetime.now(UTC)) - timedelta(seconds=seconds)
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(
            f"--since {raw!r} is neither an ISO 8601 time (2026-11-30T10:00:00+00:00) nor a duration (15m, 6h, 2d)"
        ) from None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def parse_partitions(values: Iterable[str]) -> frozenset[int] | None:
    """`--partition 3 --partition 5,7`: a set of partition numbers (None when the flag is absent)."""
    found: set[int] = set()
    for value in values:
        for part in value.split(","):
            if not part.strip():
                continue
            try:
                number = int(part)
            except ValueError:
                raise ConfigError(f"--partition {part.strip()!r} is not a partition number") from None
            if number < 0:
                raise ConfigError(f"--partition {number} is negative")
            found.add(number)
    return frozenset(found) if found else None


def ledger_runs(boundaries: Iterable[tuple[int, int | None, int | None]]) -> tuple[Runs, Found]:
    """Runs and repeated offsets from the boundary rows of `_BOUNDARIES` (offset, previous, next), in order."""
    runs, repeated = Runs(), Found()
    start = 0
    for offset, prev, nxt in boundaries:
        if prev is not None and offset == prev:
            repeated.add((offset, offset))
        elif prev is None or offset - prev > 1:
            start = offset
        if nxt is None or nxt - offset > 1:
            runs.add_run(start, offset)
    return runs, repeated


@dataclass(frozen=True)
class Window:
    """One partition's offsets for one run."""

    start: int  # the first offset checked in the ledger
    log_start: int
    end: int  # the log end before the database snapshot: records compared are below it
    end_after: int  # the log end after the snapshot: a row at or above it cannot come from the topic
    stored: int | None  # consumer_offsets.next_offset in the snapshot

    @property
    def low(self) -> int:
        """The first offset compared with the topic (nothing below the log start can be read)."""
        return max(self.start, self.log_start)


def missing_runs(topic: Runs, ledger: Runs, w: Window) -> Iterator[Run]:
    """Every run of records in the topic below the stored offset that is in neither table (`repair` applies them)."""
    return clip(difference(topic, ledger), 0, (w.stored or 0) - 1)


def compare(topic: Runs, ledger: Runs, w: Window) -> tuple[Found, Found]:
    """Missing records (in the topic below the stored offset, in neither table) and phantom rows (in the ledger at
    or above the log start, not in the topic; rows in [end, end_after) belong to records produced during the run)."""
    missing = Found().extend(missing_runs(topic, ledger, w))
    produced_during_run = [(w.end, w.end_after - 1)] if w.end_after > w.end else []
    extra = difference(difference(ledger, topic), produced_during_run)
    phantoms = Found().extend(clip(extra, w.low, 2**63 - 1))
    return missing, phantoms


async def read_partition(consumer: AIOKafkaConsumer, tp: TopicPartition, start: int, end: int,
                         progress: Progress | None) -> Runs:
    """The committed offsets of [start, end) as runs (read_committed: markers and aborted records are skipped)."""
    runs = Runs()
    if end <= start:
        return runs
    consumer.assign([tp])
    consumer.seek(tp, start)
    last, moved = start, time.monotonic()
    while (position := await consumer.position(tp)) < end:
        if position != last:
            last, moved = position, time.monotonic()
        elif time.monotonic() - moved > _STALL_SECONDS:
            raise StockLedgerError(f"reading {tp.topic}/{tp.partition} made no progress for {_STALL_SECONDS:g}s at "
                                   f"offset {position} (log end {end}): check the broker, then run verify again")
        fetched = await consumer.getmany(tp, timeout_ms=1000, max_records=_FETCH_RECORDS)
        records = fetched.get(tp, [])
        before = runs.count
        for r in records:
            if r.offset < end:
                runs.add(r.offset)
        if progress:
            progress.advance(runs.count - before)
    return runs


async def ledger_partition(conn: asyncpg.Connection, topic: str, partition: int, start: int) -> tuple[Runs, Found]:
    rows = [(r[0], r[1], r[2]) async for r in conn.cursor(_BOUNDARIES, topic, partition, start, prefetch=10_000)]
    return ledger_runs(rows)


async def _committed(settings: Settings) -> dict[int, int]:
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap_servers, **kafka_options(settings))
    await admin.start()
    try:
        found = await admin.list_consumer_group_offsets(settings.group_id)
    finally:
        await admin.close()
    return {tp.partition: meta.offset for tp, meta in found.items() if tp.topic == settings.topic and meta.offset >= 0}


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
            stored = await stored_offsets(conn, settings.group_id, settings.topic)
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


async def log_checks(conn: asyncpg.Connection, settings: Settings, log_starts: dict[int, int],
                     stored: dict[int, int | None], log_ends: dict[int, int] | None = None) -> list[Check]:
    """Holes in the log: unacknowledged rows of `ledger_gaps`, stored offsets below the log start (records deleted
    by retention before the ledger applied them) and past the log end (the topic was recreated or truncated)."""
    checks = []
    if await conn.fetchval("SELECT to_regclass('ledger_gaps') IS NOT NULL"):
        open_gaps = await conn.fetch(
            """SELECT partition, first_offset, last_offset, reason FROM ledger_gaps
                WHERE acknowledged_at IS NULL AND group_id = $1 AND topic = $2 ORDER BY id""",
            settings.group_id, settings.topic)
        checks.append(Check(
            "no unacknowledged gap (ledger_gaps)", not open_gaps,
            "none" if not open_gaps else f"{len(open_gaps)} open: " + "; ".join(
                f"p{g[0]} {describe((g[1], g[2]))} ({g[3]})" for g in open_gaps[:5])
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


def topic_reader(settings: Settings) -> AIOKafkaConsumer:
    """A consumer outside the group that reads committed records only, as the worker does (not yet started)."""
    # fetch_max_wait_ms: the partitions are read one after the other, and the fetch for the next one waits for the
    # long poll in flight for the previous one (at its end, so the broker holds it this long): 500 ms by default.
    return AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap_servers, enable_auto_commit=False,
                            isolation_level="read_committed", auto_offset_reset="none", fetch_max_wait_ms=20,
                            max_partition_fetch_bytes=1024 * 1024, fetch_max_bytes=64 * 1024 * 1024,
                            **kafka_options(settings))


async def verify(settings: Settings, expect: int | None = None, show_progress: bool = True,
                 scope: Scope | None = None) -> Report:
    scope = scope or Scope()
    consumer = topic_reader(settings)
    await consumer.start()
    try:
        tps = await topic_partitions(settings, scope)
        log_starts = {tp.partition: int(o) for tp, o in (await consumer.beginning_offsets(tps)).items()}
        ends = {tp.partition: int(o) for tp, o in (await consumer.end_offsets(tps)).items()}
        committed = await _committed(settings)
        conn = await connect_database(settings, application_name="stock-ledger-verify")
        try:
            async with conn.transaction(isolation="repeatable_read", readonly=True):
                stored = await stored_offsets(conn, settings.group_id, settings.topic)
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


async def topic_partitions(settings: Settings, scope: Scope) -> list[TopicPartition]:
    numbers = await partitions_of(settings.kafka_bootstrap_servers, settings.topic, options=kafka_options(settings))
    if not numbers:
        raise StockLedgerError(f"topic {settings.topic} does not exist at {settings.kafka_bootstrap_servers}: "
                               "check STOCK_LEDGER_TOPIC and KAFKA_BOOTSTRAP_SERVERS")
    if scope.partitions is not None:
        if unknown := scope.partitions - set(numbers):
            raise ConfigError(f"--partition {', '.join(map(str, sorted(unknown)))}: not a partition of "
                              f"{settings.topic} (it has {numbers[0]}-{numbers[-1]})")
        numbers = sorted(scope.partitions)
    return [TopicPartition(settings.topic, p) for p in numbers]


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
    if await conn.fetchval("SELECT to_regclass('ledger_gaps') IS NOT NULL"):
        for r in await conn.fetch(_ACKNOWLEDGED, settings.group_id, settings.topic):
            found.setdefault(r[0], []).append(AcknowledgedGap(*r))
    return found


async def _compare_all(conn: asyncpg.Connection, consumer: AIOKafkaConsumer, settings: Settings, scope: Scope,  # noqa: PLR0913 - the run's state, read once by verify()
                       windows: dict[int, Window], *, show_progress: bool) -> Report:
    total = sum(max(0, w.end - w.low) for w in windows.values())
    progress = Progress(f"verify: {settings.topic}, {len(windows)} partitions", total) if show_progress else None
    results = []
    acknowledged = await _acknowledged(conn, settings)
    for p, w in sorted(windows.items()):
        # Kafka and PostgreSQL work at the same time: the fetch decodes here, the window functions run there.
        topic_runs, (ledger, repeated) = await asyncio.gather(
            read_partition(consumer, TopicPartition(settings.topic, p), w.low, w.end, progress),
            ledger_partition(conn, settings.topic, p, w.start),
        )
        missing, phantoms = compare(topic_runs, ledger, w)
        held: list[tuple[AcknowledgedGap, int]] = []
        if missing and p in acknowledged:
            missing, held = set_aside(list(missing_runs(topic_runs, ledger, w)), acknowledged[p])
        results.append(PartitionResult(p, topic_runs.count, missing, repeated, phantoms, topic_runs.last, held))
    if progress:
        progress.finish()
    return _report(results, scope, {p: w.stored for p, w in windows.items()})


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
    if scope.whole:
        report.rows = int(await conn.fetchval("SELECT count(*) FROM stock_movements"))
        report.distinct_sources = report.rows if unique else int(
            await conn.fetchval("SELECT count(DISTINCT source) FROM stock_movements"))
    else:
        report.rows = int(await conn.fetchval(_IN_SCOPE.format(table="stock_movements"), topic, parts, lows))
        report.distinct_sources = report.rows if unique else int(await conn.fetchval(
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
