"""`stock-ledger offsets show|set`: look at the partitions' stored offsets, and move one.

Offsets live in PostgreSQL (`consumer_offsets`), so Kafka's own tools (`kafka-consumer-groups --reset-offsets`)
change nothing here. They run as the OWNER role (DATABASE_URL of `migrate`): the worker's role may not record gaps
it did not see.

Rules that keep the ledger effectively-once: `offsets set` never moves a partition below the highest offset already
in the ledger + 1 (those records would be applied twice); moving forward records the skipped range in `ledger_gaps`,
acknowledged by whoever ran it; it bumps the partition's epoch in the same transaction, so a worker still running is
fenced (its next batch's compare-and-set fails) and must claim again, reading the new offset. A move takes turns
with `repair` on the partition (ledger.offsets.operator_lock): it waits for a repair chunk in flight and then sees
its rows, so it can never move the offset below a record a repair is writing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from stock_ledger.cli.args import emit, parse_partitions, past_time, table
from stock_ledger.clients.database import operator_session, transaction
from stock_ledger.errors import ConfigError, OperatorError
from stock_ledger.ledger import closings, movements, offsets
from stock_ledger.topics import LogBounds, describe_group, log_bounds, partitions_of

if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence

    import asyncpg

    from stock_ledger.config import Settings

OPERATOR_SKIP: Final = "operator_skip"


def _gap(next_offset: int | None, log: LogBounds) -> str | None:
    if next_offset is None:
        return None
    if next_offset < log.start:
        return (f"records {next_offset}..{log.start - 1} were deleted before they were applied (retention, "
                "deleted records); `offsets set --to-log-start` moves past them and records the gap")
    if next_offset > log.end:
        return (f"stored offset {next_offset} is beyond the log end {log.end}: the topic was recreated or truncated; "
                "check, then `offsets set --offset`/`--to-log-start` (moving back is refused over applied rows)")
    return None


async def show(settings: Settings, args: argparse.Namespace) -> int:
    partitions = await partitions_of(settings)
    if not partitions:
        raise OperatorError(f"topic {settings.topic} does not exist on {settings.kafka_bootstrap_servers} "
                            "(check STOCK_LEDGER_TOPIC and KAFKA_BOOTSTRAP_SERVERS)")
    bounds, _ = await log_bounds(settings, partitions)
    group = await describe_group(settings)
    conn = await operator_session(settings)
    try:
        stored = await offsets.show(conn, settings.group_id, settings.topic)
        gaps = await offsets.gap_counts(conn, settings.group_id, settings.topic)
    finally:
        await conn.close()
    rows: list[dict[str, Any]] = []
    for p in partitions:
        row, log = stored.get(p), bounds[p]
        next_offset = row["next_offset"] if row else None
        rows.append({
            "partition": p, "next_offset": next_offset, "epoch": row["epoch"] if row else None,
            "owner": row["member_id"] if row else None, "claimed_at": row["claimed_at"] if row else None,
            "updated_at": row["updated_at"] if row else None, "log_start": log.start, "log_end": log.end,
            "lag": log.end - (next_offset if next_offset is not None else log.start),
            "gap": _gap(next_offset, log),
            "recorded_gaps": gaps[p]["total"] if p in gaps else 0,
            "unacknowledged_gaps": gaps[p]["open"] if p in gaps else 0,
        })
    document = {"topic": settings.topic, "group": settings.group_id, "group_state": group.state,
                "members": group.members, "partitions": rows}
    text = "\n".join([
        f"topic {settings.topic}, group {settings.group_id}: {group.state}, {len(group.members)} live member(s)",
        table(["partition", "next_offset", "epoch", "owner", "log_start", "log_end", "lag", "gaps(open)", "gap"],
              [[r["partition"], r["next_offset"], r["epoch"], r["owner"], r["log_start"], r["log_end"], r["lag"],
                f"{r['recorded_gaps']}({r['unacknowledged_gaps']})", r["gap"] or ""] for r in rows]),
    ])
    emit(document, text, as_json=args.json)
    return 0


async def _targets(settings: Settings, args: argparse.Namespace) -> dict[int, tuple[int, LogBounds]]:
    """Per named partition: the offset to move to, and the log's bounds."""
    wanted = sorted(parse_partitions(args.partition) or ())
    if not wanted:
        raise ConfigError("--partition: name at least one partition")
    partitions = await partitions_of(settings)
    if unknown := [p for p in wanted if p not in partitions]:
        raise OperatorError(f"topic {settings.topic} has no partition {', '.join(map(str, unknown))} "
                            f"(it has {len(partitions)})")
    stamp = None
    if args.to_timestamp is not None:
        stamp = int(past_time(args.to_timestamp, "--to-timestamp").timestamp() * 1000)
    bounds, at = await log_bounds(settings, wanted, stamp)
    targets: dict[int, tuple[int, LogBounds]] = {}
    for p in wanted:
        log = bounds[p]
        if args.to_log_start:
            targets[p] = log.start, log
        elif args.to_log_end:
            targets[p] = log.end, log
        elif stamp is not None:
            found = at.get(p)
            targets[p] = (found if found is not None else log.end), log
        elif not log.start <= args.offset <= log.end:
            raise OperatorError(
                f"--offset {args.offset} is outside the log of partition {p} [{log.start}, {log.end}]: "
                "records below the log start no longer exist (use --to-log-start) and none exist past the end")
        else:
            targets[p] = int(args.offset), log
    return targets


@dataclass(frozen=True, slots=True)
class _Step:
    """One partition's move, decided under its row lock."""

    partition: int
    target: int
    log: LogBounds
    before: int | None
    epoch_before: int | None
    start: int  # the first offset a forward move skips

    @property
    def skipped(self) -> int:
        return max(0, self.target - self.start)


async def _plan(conn: asyncpg.Connection, settings: Settings, targets: dict[int, tuple[int, LogBounds]],
                note: str | None) -> list[_Step]:
    """Lock every named partition's row (in order), check each move; one refusal refuses them all."""
    other = await offsets.other_group(conn, settings.group_id)
    if other is not None:
        raise OperatorError(
            f"this database holds the ledger of consumer group {other!r}, not {settings.group_id!r}: a row for "
            f"{settings.group_id!r} would stop every worker of {other!r} (their claims refuse a second group). "
            "Set STOCK_LEDGER_GROUP_ID to the group that owns it (`offsets show` there shows its partitions)")
    steps = []
    for p, (target, log) in sorted(targets.items()):
        fresh, before, epoch = await offsets.lock_for_move(conn, settings.group_id, settings.topic, p)
        floor = await movements.floor(conn, settings.topic, p)
        if target < floor:
            raise OperatorError(
                f"refusing to move partition {p} to {target}: offsets up to {floor - 1} are already "
                f"in the ledger (applied or quarantined, or recorded as holding no record) and would be applied "
                f"twice; the lowest allowed is {floor}")
        start = before if before is not None else floor
        if target > start and not note:
            raise ConfigError(f"moving partition {p} forward skips records {start}..{target - 1}: "
                              "say why with --note (it is stored with the acknowledged gap)")
        steps.append(_Step(p, target, log, before, None if fresh else epoch, start))
    return steps


def _render_plan(settings: Settings, steps: Sequence[_Step], members: int, *, dry_run: bool) -> str:
    head = (f"plan{' (dry run: nothing changes)' if dry_run else ''}: {settings.topic}, group {settings.group_id}"
            + (f", {members} live member(s) to fence" if members else ""))
    return head + "\n" + table(
        ["partition", "next_offset", "->", "log_start", "log_end", "skipped", "gap"],
        [[x.partition, "-" if x.before is None else x.before, x.target, x.log.start, x.log.end, x.skipped,
          f"{x.start}..{x.target - 1}" if x.skipped else ""] for x in steps])


async def move(settings: Settings, args: argparse.Namespace) -> int:
    targets = await _targets(settings, args)
    group = await describe_group(settings)
    if group.members and not args.force:
        raise OperatorError(
            f"group {settings.group_id} has {len(group.members)} live member(s) ({', '.join(group.members)}): "
            "stop the workers first (e.g. kubectl scale --replicas=0), or pass --force to fence them "
            "(their next batch on the partition is refused; they exit and claim it again at the new offset)")
    conn = await operator_session(settings)
    changes: list[dict[str, Any]] = []
    try:
        async with transaction(conn, commit=not args.dry_run):
            steps = await _plan(conn, settings, targets, args.note)
            if not args.json:
                # Shown before anything moves (the rows stay locked meanwhile; the moves follow at once).
                print(_render_plan(settings, steps, len(group.members), dry_run=bool(args.dry_run)), flush=True)
            changes = [await _move(conn, settings, x, args, len(group.members)) for x in steps]
    finally:
        await conn.close()
    if len(changes) == 1:
        emit(changes[0], _describe_change(changes[0]), as_json=args.json)
    else:
        emit({"topic": settings.topic, "group": settings.group_id, "dry_run": bool(args.dry_run),
              "changes": changes}, "\n".join(_describe_change(c) for c in changes), as_json=args.json)
    return 0


async def _move(conn: asyncpg.Connection, settings: Settings, x: _Step, args: argparse.Namespace,
                members: int) -> dict[str, Any]:
    note, dry_run = args.note, bool(args.dry_run)
    epoch = await offsets.move(conn, settings.group_id, settings.topic, x.partition, x.target)
    # Back: the workers may now write below the cut of a closing taken since (a hole they skipped); it would miss them.
    forgotten = (await closings.forget_above(conn, settings.topic, x.partition, x.target)
                 if x.before is not None and x.target < x.before else 0)
    change: dict[str, Any] = {
        "topic": settings.topic, "group": settings.group_id, "partition": x.partition,
        "next_offset_before": x.before, "next_offset_after": x.target,
        "epoch_before": x.epoch_before, "epoch_after": epoch,
        "log_start": x.log.start, "log_end": x.log.end, "live_members_fenced": members,
        "gap": None, "closings_forgotten": forgotten, "dry_run": dry_run,
    }
    if x.skipped:
        gap = await offsets.record_skip(conn, settings.group_id, settings.topic, x.partition, first=x.start,
                                        last=x.target - 1, reason=OPERATOR_SKIP, note=note)
        change["gap"] = {"id": gap["id"], "first_offset": x.start, "last_offset": x.target - 1,
                         "records": x.skipped, "acknowledged_by": gap["acknowledged_by"], "note": note}
    return change


def _describe_change(c: dict[str, Any]) -> str:
    verb = "would move" if c["dry_run"] else "moved"
    text = (f"{verb} {c['topic']}/{c['partition']} (group {c['group']}): next_offset {c['next_offset_before']} -> "
            f"{c['next_offset_after']}, epoch {c['epoch_before']} -> {c['epoch_after']} (log {c['log_start']}.."
            f"{c['log_end']})")
    if c["gap"]:
        g = c["gap"]
        text += (f"\n{'would record' if c['dry_run'] else 'recorded'} gap #{g['id']}: offsets {g['first_offset']}.."
                 f"{g['last_offset']} ({g['records']} records) skipped, acknowledged by {g['acknowledged_by']}: "
                 f"{g['note']}")
    if c["closings_forgotten"]:
        text += (f"\n{'would forget' if c['dry_run'] else 'forgot'} {c['closings_forgotten']} closing(s) whose cut lay "
                 "past the new offset (`stock show --at` reads the others)")
    if c["live_members_fenced"]:
        text += (f"\n{c['live_members_fenced']} live member(s) will be fenced at their next batch on the partition "
                 "and exit to claim it again")
    return text
