"""`stock-ledger archive run`: segments that have been online for STOCK_LEDGER_RETENTION_DAYS and that nothing still
needs leave the database for an archive file, checked before anything is dropped.

A segment is archived only if all of these hold, judged per Kafka partition from its oldest online segment on (the
first that fails stops that partition: archives are a prefix of each partition's offsets):
- the group's stored offset has passed its end (every offset of it was decided: applied, quarantined, or skipped);
- Kafka no longer holds any of its offsets (its end <= the log start): `verify` compares the ledger with every
  record the topic still holds, and `repair` can only re-read from there, so neither needs an archived offset;
- its newest movement was applied more than the retention ago;
- no gap recorded in its range waits for an acknowledgement (`gaps ack`), and no offset of it is a hole: each is in
  a table, recorded as holding no record, or in an acknowledged gap. Offsets applied before migration 0011, which
  nobody can judge any more, are archived as they are and counted (unknown_offsets).

Then, per segment (ledger/archives.py has the database's steps): the rows are written to Parquet, read back and
summed; the segment is summed again under a lock that keeps writers out and must match; only then, in that same
transaction, is the archive recorded and the segment detached; its table is dropped after. A crash anywhere leaves
either the segment attached and whole (the next run starts it again) or the archive recorded and the segment
detached (the next run drops its table).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import asyncpg
import structlog

from stock_ledger.archive import parquet
from stock_ledger.audit.compare import ledger_runs, topic_partitions, topic_reader
from stock_ledger.audit.ranges import describe, difference, merged, union
from stock_ledger.errors import ConfigError, OperatorError
from stock_ledger.ledger import archives, offsets
from stock_ledger.progress import Progress
from stock_ledger.versions import version_of

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

    from stock_ledger.audit.ranges import Run
    from stock_ledger.config import Settings

log = structlog.get_logger(__name__)

_CHUNK: Final = 50_000
_ATTEMPTS: Final = 5


@dataclass
class Decision:
    segment: archives.Segment
    archive: bool
    why: str


@dataclass
class RunReport:
    finished: list[str] = field(default_factory=list)  # archived earlier, detached and dropped now
    archived: list[parquet.Manifest] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)  # the first segment kept of each partition, and why

    def render(self, *, dry_run: bool) -> str:
        lines = [f"finished an earlier run's {s}: detached and dropped" for s in self.finished]
        verb = "would archive" if dry_run else "archived"
        if dry_run:
            lines += [f"{verb} {d.segment.table} ({d.segment.offsets}): {d.why}" for d in self.decisions if d.archive]
        lines += [f"{verb} {m.segment} (p{m.kafka_partition} [{m.first_offset}, {m.end_offset})): {m.summary.rows} "
                  f"movements, {m.bytes:,} bytes, sha256 {m.sha256[:12]}" for m in self.archived]
        kept = [d for d in self.decisions if not d.archive]
        lines += [f"kept {d.segment.table} ({d.segment.offsets}): {d.why}" for d in kept]
        if not lines:
            lines.append("no online segment: nothing to archive")
        return "\n".join(lines)


def archive_dir(settings: Settings, *, writable: bool) -> Path:
    if not settings.archive_dir:
        raise ConfigError("STOCK_LEDGER_ARCHIVE_DIR is not set: set it to the directory archives are written to (the "
                          "chart mounts its archive volume at /var/lib/stock-ledger/archive)")
    directory = Path(settings.archive_dir)
    if not directory.is_dir():
        raise ConfigError(f"STOCK_LEDGER_ARCHIVE_DIR={directory} is not a directory: create it, or mount the archive "
                          "volume there")
    if writable and not os.access(directory, os.W_OK):
        raise ConfigError(f"STOCK_LEDGER_ARCHIVE_DIR={directory} is not writable by this user (uid {os.getuid()}): "
                          "fix the volume's ownership or the pod's fsGroup")
    return directory


async def run(settings: Settings, conn: asyncpg.Connection, *, dry_run: bool = False,
              limit: int | None = None) -> RunReport:
    if settings.retention_days is None:
        raise ConfigError("STOCK_LEDGER_RETENTION_DAYS is not set: say how many days of movements stay online "
                          "(archival is off until you do)")
    directory = archive_dir(settings, writable=not dry_run)
    report = RunReport()
    if not dry_run:
        report.finished = await _finish_earlier(conn)
    log_starts = await _log_starts(settings)
    chosen = await choose(conn, settings, log_starts, settings.retention_days)
    report.decisions = chosen
    todo = [d.segment for d in chosen if d.archive][:limit]
    if dry_run:
        return report
    for segment in todo:
        report.archived.append(await archive_segment(conn, settings, directory, segment))
    return report


async def _log_starts(settings: Settings) -> dict[int, int]:
    consumer = topic_reader(settings)
    await consumer.start()
    try:
        tps = await topic_partitions(settings, None)
        return {tp.partition: int(o) for tp, o in (await consumer.beginning_offsets(tps)).items()}
    finally:
        await consumer.stop()


async def _finish_earlier(conn: asyncpg.Connection) -> list[str]:
    """Drop the tables of segments an earlier run archived and detached but did not get to drop."""
    done = []
    for segment in await archives.segments(conn):
        if segment.archived_at is not None and segment.dropped_at is None and not segment.attached:
            await archives.drop(conn, segment.table)
            log.info("archive.dropped", segment=segment.table, offsets=segment.offsets, resumed=True)
            done.append(segment.table)
    return done


@dataclass(frozen=True)
class _Partition:
    """What decides for one Kafka partition's segments: its stored offset, its log start, its known range."""

    stored: int | None
    log_start: int | None
    known: Run | None


async def choose(conn: asyncpg.Connection, settings: Settings, log_starts: dict[int, int],
                 retention_days: int) -> list[Decision]:
    """Per partition, the online segments that may be archived, oldest first, then the first one that may not (with
    why)."""
    stored = await offsets.stored_offsets(conn, settings.group_id, settings.topic)
    known = await offsets.non_records_known(conn)
    horizon = datetime.now(UTC) - timedelta(days=retention_days)
    decisions: list[Decision] = []
    blocked: set[int] = set()
    for segment in await archives.segments(conn):
        p = segment.partition
        if segment.archived_at is not None or p in blocked:
            continue
        facts = _Partition(stored.get(p), log_starts.get(p), known.get((settings.topic, p)))
        why = _passed(settings, segment, facts) or await _kept_because(conn, settings, segment, facts, horizon)
        if why is not None:
            blocked.add(p)
            decisions.append(Decision(segment, archive=False, why=why))
        else:
            decisions.append(Decision(segment, archive=True, why=f"online for more than {retention_days} days, "
                                      "complete, and gone from Kafka"))
    return decisions


def _passed(settings: Settings, segment: archives.Segment, facts: _Partition) -> str | None:
    """Why the worker or Kafka still needs the segment's offsets, if they do."""
    if facts.stored is None or facts.stored < segment.end_offset:
        return f"the stored offset ({facts.stored}) has not passed its end: the worker is still writing it"
    if facts.log_start is None:
        return f"partition {segment.partition} is not in topic {settings.topic}"
    if facts.log_start < segment.end_offset:
        return (f"Kafka still holds offsets of it (log start {facts.log_start}): verify still compares them with the "
                "topic; it is archived once Kafka's retention has deleted them")
    return None


async def _kept_because(conn: asyncpg.Connection, settings: Settings, segment: archives.Segment, facts: _Partition,
                        horizon: datetime) -> str | None:
    """Why the ledger still needs the segment online, if it does."""
    newest = await archives.newest_applied(conn, segment.table, horizon)
    if newest is not None:
        return f"its newest movement was applied at {newest.isoformat(timespec='seconds')}, within the retention"
    gaps = await offsets.gaps_of(conn, settings.group_id, settings.topic, segment.partition)
    last = segment.end_offset - 1
    open_gaps = [g for g in gaps if not g["acknowledged"] and g["first_offset"] <= last
                 and g["last_offset"] >= segment.first_offset]
    if open_gaps:
        return (f"gap(s) {', '.join(str(g['id']) for g in open_gaps[:5])} in its range wait for an acknowledgement "
                "(`stock-ledger gaps list`, `gaps ack`)")
    if gone := (await unaccounted(conn, settings, segment, gaps, facts.known))[0]:
        return (f"offsets {', '.join(describe(r) for r in gone[:5])} are in neither table and held records: run "
                "`stock-ledger repair`, then acknowledge what it records")
    return None


async def unaccounted(conn: asyncpg.Connection, settings: Settings, segment: archives.Segment,
                      gaps: Sequence[Any], known: Run | None) -> tuple[list[Run], list[Run]]:
    """The segment's offsets in no table, not recorded as holding no record, in no acknowledged gap: (gone: inside
    the range whose non-records the ledger recorded, so holes; unknown: outside it)."""
    key = (settings.topic, segment.partition)
    first, last = segment.first_offset, segment.end_offset - 1
    async with conn.transaction(readonly=True):  # the cursor of ledger_runs
        held, _ = await ledger_runs(conn, settings.topic, segment.partition, first, last + 1)
    non_records = (await offsets.non_records(conn, [(key, first, last + 1)])).get(key, [])
    acknowledged = merged((g["first_offset"], g["last_offset"]) for g in gaps if g["acknowledged"])
    left = list(difference([(first, last)], union(union(held, non_records), acknowledged)))
    inside = [known] if known is not None else []
    unknown = list(difference(left, inside))
    return list(difference(left, unknown)), unknown


async def archive_segment(conn: asyncpg.Connection, settings: Settings, directory: Path,
                          segment: archives.Segment) -> parquet.Manifest:
    table = segment.table
    path, manifest_path = parquet.paths(directory, table)
    log.info("archive.writing", segment=table, offsets=segment.offsets, file=str(path))
    progress = Progress(f"archive: {table}", None)
    async with conn.transaction(readonly=True, isolation="repeatable_read"):
        written = await parquet.write(path, _chunks(conn, table, progress))
    progress.finish()
    sha256, size = parquet.sha256(path)
    read_back = parquet.summarize(path)
    if differs := written.differences(read_back):
        raise OperatorError(f"{path} does not read back as written ({'; '.join(differs)}): the archive volume is "
                            "failing; the segment was left in place")
    gaps = await offsets.gaps_of(conn, settings.group_id, settings.topic, segment.partition)
    known = (await offsets.non_records_known(conn)).get((settings.topic, segment.partition))
    manifest = parquet.Manifest(
        table, segment.partition, segment.first_offset, segment.end_offset, read_back, sha256, size,
        unknown_offsets=sum(b - a + 1 for a, b in (await unaccounted(conn, settings, segment, gaps, known))[1]),
        created_at=parquet.now(), created_by=f"stock-ledger {version_of('stock-ledger')}")
    parquet.write_manifest(manifest_path, manifest)
    await _record(conn, settings, segment, manifest)
    log.info("archive.recorded", segment=table, rows=read_back.rows, sha256=sha256, bytes=size)
    await archives.drop(conn, table)
    log.info("archive.dropped", segment=table, offsets=segment.offsets)
    return manifest


async def _chunks(conn: asyncpg.Connection, table: str, progress: Progress) -> AsyncIterator[list[Any]]:
    chunk: list[Any] = []
    async for r in archives.rows(conn, table, prefetch=_CHUNK):
        chunk.append(tuple(r))
        if len(chunk) >= _CHUNK:
            progress.advance(len(chunk))
            yield chunk
            chunk = []
    if chunk:
        progress.advance(len(chunk))
        yield chunk


async def segment_summary(conn: asyncpg.Connection, table: str) -> parquet.Summary:
    """The segment's rows summed as parquet.Summary sums a file."""
    summary = parquet.Summary()
    for r in await archives.sums(conn, table):
        summary.add_key((r["warehouse_id"], r["sku"]), r["rows"], r["qty"], r["first_occurred_at"],
                        r["last_occurred_at"])
        summary.rows += r["rows"]
        summary.qty += r["qty"]
    for t, p, n, lo, hi, first_applied, last_applied in await archives.kafka_ranges(conn, table):
        summary.partitions[(t, p)] = [n, lo, hi]
        summary.applied = ([first_applied, last_applied] if not summary.applied else
                           [min(summary.applied[0], first_applied), max(summary.applied[1], last_applied)])
    if summary.keys:
        summary.occurred = [min(v[2] for v in summary.keys.values()), max(v[3] for v in summary.keys.values())]
    return summary


async def _record(conn: asyncpg.Connection, settings: Settings, segment: archives.Segment,
                  manifest: parquet.Manifest) -> None:
    """The one transaction after which the segment's movements count from the archive: the segment must still hold
    exactly what the file holds, with writers kept out until it commits. Its DETACH waits at most
    STOCK_LEDGER_LOCK_TIMEOUT_MS for the transactions using stock_movements (a batch, a long read): then all of it is
    tried again, a few times."""
    s = manifest.summary
    topics = {t for t, _ in s.partitions} or {settings.topic}
    if len(topics) != 1:
        raise OperatorError(f"{segment.table} holds movements of several topics ({', '.join(sorted(topics))}): "
                            "one ledger per topic is the only layout archival supports")
    archive = (segment.table, topics.pop(), segment.partition, segment.first_offset, segment.end_offset, s.rows,
               s.qty, *(s.occurred or (None, None)), *(s.applied or (None, None)), manifest.file, manifest.sha256,
               manifest.bytes, manifest.unknown_offsets)
    for attempt in range(1, _ATTEMPTS + 1):
        try:
            async with conn.transaction():
                await offsets.operator_lock(conn, settings.group_id, settings.topic, segment.partition)
                await archives.lock_segment(conn, segment.table)
                if differs := (await segment_summary(conn, segment.table)).differences(s):
                    raise OperatorError(f"{segment.table} changed while it was being archived ({'; '.join(differs)}): "
                                        "nothing was recorded or dropped; run `stock-ledger archive run` again")
                await archives.record(conn, archive, list(s.key_sums()), settings.lock_timeout_ms)
        except asyncpg.LockNotAvailableError:
            if attempt == _ATTEMPTS:
                raise OperatorError(
                    f"{segment.table} could not be detached: stock_movements stayed in use for "
                    f"{settings.lock_timeout_ms} ms at each of {_ATTEMPTS} tries (a long read or a stuck session: "
                    "see pg_stat_activity); nothing was recorded; run `stock-ledger archive run` again") from None
            log.info("archive.detach_waited", segment=segment.table, attempt=attempt)
            await asyncio.sleep(min(2.0 * attempt, 10.0))
        else:
            return
