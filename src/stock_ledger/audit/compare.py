"""The one comparison of the topic with the ledger that `verify`, `repair` and the invariant checks share.

Topic side (`TopicRecords`): a partition's committed records, read by a consumer outside the group with
read_committed, so transaction markers and aborted records are never records; their offsets as runs.
Ledger side (`ledger_runs`, `missing_offsets`): the offsets stock_movements and rejected_movements hold, as runs.
A record is missing when the topic holds it below the stored offset and neither table does (`missing_runs`);
an offset in neither table that held no record (a marker, an aborted record) is never missing, by construction.

Below the log start Kafka can no longer say what an offset held; the ledger can, for the offsets it read past:
the worker records, in each batch transaction, the runs of offsets that held no data record (non_record_offsets),
and each partition's range in which it recorded all of them (`known`). An offset below the log start in neither
table and not recorded as holding no record (`unread`) is then gone if it lies in that range (it held a record the
ledger lost: a hole) and unknown outside it (applied by a version that did not record them: a marker, an aborted
record or a lost movement, nobody can say any more) (`gone_or_unknown`). verify, repair and the invariant checks
all judge such offsets with these two functions.

Memory follows the number of breaks in a partition's offsets, never the number of records (ranges.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Protocol

from aiokafka import TopicPartition

from stock_ledger.audit.ranges import Found, Run, Runs, clip, describe, difference, merged, union
from stock_ledger.clients import kafka
from stock_ledger.errors import ConfigError, OperatorError, StockLedgerError
from stock_ledger.ledger import archives, offsets
from stock_ledger.topics import partitions_of

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterable, Iterator, Sequence

    import asyncpg
    from aiokafka import AIOKafkaConsumer

    from stock_ledger.config import Settings
    from stock_ledger.progress import Progress

Key = tuple[str, int]  # (topic, partition)
Ranges = list[tuple[Key, int, int]]  # (key, lo, hi): the offsets [lo, hi) of a partition

# Records per getmany bound the topic side's memory: each record is a Python object with its key and value.
_FETCH_RECORDS: Final = 5_000

# ------------------------------------------------------------------------------------------ the ledger side

# Both tables' offsets of one partition, from `$3` on, in offset order (a merge of the two unique indexes); only the
# rows where a run of consecutive offsets starts or ends, or where an offset repeats, leave the server.
_BOUNDARIES: Final = """
WITH u AS (
    SELECT kafka_offset AS o FROM stock_movements
     WHERE kafka_topic = $1 AND kafka_partition = $2 AND kafka_offset >= $3 AND kafka_offset < $4
    UNION ALL
    SELECT kafka_offset FROM rejected_movements
     WHERE kafka_topic = $1 AND kafka_partition = $2 AND kafka_offset >= $3 AND kafka_offset < $4
), w AS (
    SELECT o, lag(o) OVER (ORDER BY o) AS prev, lead(o) OVER (ORDER BY o) AS next FROM u
)
SELECT o, prev, next FROM w WHERE prev IS NULL OR next IS NULL OR o - prev <> 1 OR next - o <> 1 ORDER BY o
"""
# The offsets of [lo, hi) in neither table, as runs (first, last): a range scan of both unique indexes per range;
# the sentinel lo - 1 and lead()'s default hi close the runs at both ends. An offset held twice is not missing.
_MISSING: Final = """
SELECT w.topic, w.p, g.first, g.last
  FROM unnest($1::text[], $2::int[], $3::bigint[], $4::bigint[]) AS w(topic, p, lo, hi)
 CROSS JOIN LATERAL (
       SELECT s.o + 1 AS first, s.next - 1 AS last FROM (
              SELECT u.o, lead(u.o, 1, w.hi) OVER (ORDER BY u.o) AS next FROM (
                     SELECT w.lo - 1 AS o
                     UNION ALL
                     SELECT m.kafka_offset FROM stock_movements AS m
                      WHERE m.kafka_topic = w.topic AND m.kafka_partition = w.p
                        AND m.kafka_offset >= w.lo AND m.kafka_offset < w.hi
                     UNION ALL
                     SELECT r.kafka_offset FROM rejected_movements AS r
                      WHERE r.kafka_topic = w.topic AND r.kafka_partition = w.p
                        AND r.kafka_offset >= w.lo AND r.kafka_offset < w.hi
                     ) AS u
              ) AS s
        WHERE s.next > s.o + 1
       ) AS g
 ORDER BY 1, 2, 3
"""


def runs_from_boundaries(boundaries: Iterable[tuple[int, int | None, int | None]]) -> tuple[Runs, Found]:
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


async def ledger_runs(conn: asyncpg.Connection, topic: str, partition: int, start: int,
                      end: int = 2**63 - 1) -> tuple[Runs, Found]:
    """The partition's offsets of [start, end) the ledger holds, as runs: in either table, or in an archived segment
    (archive/run.py archives only complete segments); and the offsets held twice (a cursor: the caller holds a
    transaction)."""
    rows = [(r[0], r[1], r[2]) async for r in conn.cursor(_BOUNDARIES, topic, partition, start, end,
                                                           prefetch=10_000)]
    runs, repeated = runs_from_boundaries(rows)
    archived = list(clip(await archives.archived_runs(conn, topic, partition), start, end - 1))
    if not archived:
        return runs, repeated
    held = Runs()
    for first, last in union(archived, runs):
        held.add_run(first, last)
    return held, repeated


async def missing_offsets(conn: asyncpg.Connection, ranges: Ranges) -> dict[Key, list[Run]]:
    """Per partition, the runs of offsets of `ranges` in neither table (candidates: a record, or no record)."""
    found: dict[Key, list[Run]] = {}
    if ranges:
        columns = ([k[0] for k, _, _ in ranges], [k[1] for k, _, _ in ranges], [lo for _, lo, _ in ranges],
                   [hi for _, _, hi in ranges])
        for r in await conn.fetch(_MISSING, *columns):
            found.setdefault((r[0], r[1]), []).append((r[2], r[3]))
    return found


async def require_ledger(conn: asyncpg.Connection, settings: Settings, *, nothing_done: str) -> None:
    """Refuse a group and topic this database stores no offset of (a typo in STOCK_LEDGER_GROUP_ID, the wrong
    database): every stored offset would read as none, so nothing would be found missing and all would look well.
    One line naming what the database holds; `nothing_done` says what the command did not do."""
    held = await offsets.held(conn)
    if any((group, topic) == (settings.group_id, settings.topic) for group, topic, _ in held):
        return
    if not held:
        raise OperatorError(
            f"this database holds no stored offsets of any group (no worker has claimed a partition in it), so "
            f"{nothing_done}: check DATABASE_URL, STOCK_LEDGER_GROUP_ID ({settings.group_id}) and STOCK_LEDGER_TOPIC "
            f"({settings.topic})")
    holds = ", ".join(f"group {group!r} (topic {topic!r}, {n} partitions)" for group, topic, n in held[:5])
    raise OperatorError(
        f"group {settings.group_id!r} has no stored offsets of topic {settings.topic!r} in this database, which "
        f"holds those of {holds}{' ...' if len(held) > 5 else ''}, so {nothing_done}: set STOCK_LEDGER_GROUP_ID "
        "and STOCK_LEDGER_TOPIC to the ledger's")


# ------------------------------------------------------------------------------------------ the topic side


def topic_reader(settings: Settings) -> AIOKafkaConsumer:
    """The consumer verify and repair read the topic with (not yet started)."""
    # fetch_max_wait_ms: the partitions are read one after the other, and the fetch for the next one waits for the
    # long poll in flight for the previous one (at its end, so the broker holds it this long): 500 ms by default.
    # Bytes per partition fetch (and records per getmany, compare.py) bound the topic side of verify's memory: each
    # record is a Python object with its key and value. Reading 9M real movements took 119 MiB with 50,000 records
    # and 8 MiB fetches, 49 MiB with these, in about the same time (docs/performance.md).
    return kafka.reader(settings, auto_offset_reset="none", fetch_max_wait_ms=20,
                        max_partition_fetch_bytes=1024 * 1024, fetch_max_bytes=64 * 1024 * 1024)


async def topic_partitions(settings: Settings, partitions: frozenset[int] | None) -> list[TopicPartition]:
    """The topic's partitions, or those of `partitions` (each must exist)."""
    numbers = await partitions_of(settings)
    if not numbers:
        raise StockLedgerError(f"topic {settings.topic} does not exist at {settings.kafka_bootstrap_servers}: "
                               "check STOCK_LEDGER_TOPIC and KAFKA_BOOTSTRAP_SERVERS")
    if partitions is not None:
        if unknown := partitions - set(numbers):
            raise ConfigError(f"--partition {', '.join(map(str, sorted(unknown)))}: not a partition of "
                              f"{settings.topic} (it has {numbers[0]}-{numbers[-1]})")
        numbers = sorted(partitions)
    return [TopicPartition(settings.topic, p) for p in numbers]




class RecordOffsets(Protocol):
    """The offsets of the committed records of a partition in [start, end) (read_committed: transaction markers
    and aborted records are not records), and the partition's log start (below it nothing can be read)."""

    async def __call__(self, topic: str, partition: int, start: int, end: int) -> tuple[Runs, int]: ...


class TopicRecords:
    """The topic's committed records, read by a started consumer outside the group (clients.kafka.reader) that
    is assigned one partition at a time. A read that makes no progress for `stall_seconds` fails, with `advice`."""

    def __init__(self, consumer: AIOKafkaConsumer, *, stall_seconds: float = 60.0,
                 advice: str = "check the broker, then run the command again") -> None:
        self._consumer = consumer
        self._stall = stall_seconds
        self._advice = advice

    async def offsets(self, tp: TopicPartition, start: int, end: int, progress: Progress | None = None) -> Runs:
        """The committed offsets of [start, end) as runs."""
        runs = Runs()
        if end <= start:
            return runs
        consumer = self._consumer
        consumer.assign([tp])
        consumer.seek(tp, start)
        watch = _Stall(tp, end, self._stall, self._advice)
        while (position := await consumer.position(tp)) < end:
            watch.check(position)
            fetched = await consumer.getmany(tp, timeout_ms=1000, max_records=_FETCH_RECORDS)
            before = runs.count
            for r in fetched.get(tp, []):
                if r.offset < end:
                    runs.add(r.offset)
            if progress:
                progress.advance(runs.count - before)
        return runs

    async def __call__(self, topic: str, partition: int, start: int, end: int) -> tuple[Runs, int]:
        """`RecordOffsets`: the offsets of [start, end) within the log, and the log start."""
        tp = TopicPartition(topic, partition)
        self._consumer.assign([tp])
        log_start = int((await self._consumer.beginning_offsets([tp]))[tp])
        # Below the log start nothing can be read; past the last stable offset nothing will be returned (a stored
        # offset past the log end is StockLedgerLogGap's, not a hole of the ledger).
        end = min(end, int((await self._consumer.end_offsets([tp]))[tp]))
        return await self.offsets(tp, max(start, log_start), end), log_start

    async def records(self, tp: TopicPartition, runs: Sequence[Run], size: int) -> AsyncIterator[list[Any]]:
        """The committed records of `runs`, in chunks of at most `size`."""
        consumer = self._consumer
        consumer.assign([tp])
        chunk: list[Any] = []
        for first, last in runs:
            consumer.seek(tp, first)
            watch = _Stall(tp, last + 1, self._stall, self._advice)
            while (position := await consumer.position(tp)) <= last:
                watch.check(position)
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
class _Stall:
    """Fails a read whose position has not moved for `seconds`."""

    tp: TopicPartition
    end: int
    seconds: float
    advice: str
    last: int | None = None
    moved: float = field(default_factory=time.monotonic)

    def check(self, position: int) -> None:
        if position != self.last:
            self.last, self.moved = position, time.monotonic()
        elif time.monotonic() - self.moved > self.seconds:
            raise StockLedgerError(
                f"reading {self.tp.topic}/{self.tp.partition} made no progress for {self.seconds:g}s at offset "
                f"{position} (reading up to {self.end}): {self.advice}")


# ------------------------------------------------------------------------------------------ the comparison


@dataclass(frozen=True)
class Window:
    """One partition's offsets for one comparison."""

    start: int  # the first offset checked in the ledger
    log_start: int
    end: int  # the log end before the database snapshot: records compared are below it
    end_after: int  # the log end after the snapshot: a row at or above it cannot come from the topic
    stored: int | None  # consumer_offsets.next_offset in the snapshot

    @property
    def low(self) -> int:
        """The first offset compared with the topic (nothing below the log start can be read)."""
        return max(self.start, self.log_start)


def missing_runs(topic: Iterable[Run], ledger: Iterable[Run], w: Window) -> Iterator[Run]:
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


def unread(ledger: Iterable[Run], non_records: Iterable[Run], low: int, high: int) -> list[Run]:
    """The offsets of [low, high] in neither table (`ledger`: both tables' offsets as runs) and not recorded as
    holding no data record (`non_records`): below the log start, the candidates for a hole."""
    if high < low:
        return []
    return list(difference([(low, high)], union(ledger, non_records)))


def gone_or_unknown(candidates: Iterable[Run], known: Run | None) -> tuple[list[Run], list[Run]]:
    """Offsets below the log start in neither table and not recorded as holding no record: (gone, unknown). Gone:
    inside `known`, the offsets whose non-record offsets the ledger recorded, so each held a record the ledger does
    not have (a hole). Unknown: outside it; the ledger did not record them then and Kafka no longer can say."""
    candidates = list(candidates)
    inside = [known] if known is not None else []
    unknown = list(difference(candidates, inside))
    return list(difference(candidates, unknown)), unknown


def history_start(ledger: Runs, non_records: Sequence[Run], known: Run | None) -> int | None:
    """The first offset of a partition the ledger has any knowledge of (a row, a non-record run, the start of its
    known range): below it lies what the ledger never saw, never a hole."""
    firsts = [x for x in (next(iter(ledger), (None,))[0], non_records[0][0] if non_records else None,
                          known[0] if known is not None else None) if x is not None]
    return min(firsts) if firsts else None


def records_among(topic: Iterable[Run], candidates: Iterable[Run]) -> list[Run]:
    """The offsets of `candidates` that the topic holds a committed record at (topic ∩ candidates)."""
    topic = list(topic)
    return list(difference(topic, difference(topic, candidates)))


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
