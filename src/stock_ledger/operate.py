"""Operator commands: `offsets show|set`, `rejected list|show|replay` and `repair` (its engine: repair.py).

Offsets live in PostgreSQL (`consumer_offsets`), so Kafka's own tools (`kafka-consumer-groups --reset-offsets`)
change nothing here; these commands are the way to look at positions and to move one. They run as the OWNER role
(DATABASE_URL of `migrate`): the worker's role may not delete quarantined rows nor record gaps it did not see.

Rules that keep the ledger effectively-once:
- `offsets set` never moves a partition below the highest offset already in the ledger + 1 (those records would be
  applied twice); moving forward records the skipped range in `ledger_gaps`, acknowledged by whoever ran it; it
  bumps the partition's epoch in the same transaction, so a worker still running is fenced (its next batch's
  compare-and-set fails) and must claim again, reading the new offset.
- `rejected replay` moves a record from `rejected_movements` to `stock_movements` (with its ORIGINAL Kafka
  coordinates) and adds it to `stock_levels` in one transaction per batch, over rows locked FOR UPDATE SKIP LOCKED:
  every record stays in exactly one table, and two replays at once never apply a record twice.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import re
import sys
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Final

import asyncpg
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from stock_ledger import pgtime
from stock_ledger.batch import M_ID, M_OFFSET, M_PARTITION, M_TOPIC
from stock_ledger.clients import connect_database, kafka_options
from stock_ledger.dberrors import explain
from stock_ledger.domain import Movement, RejectCode, parse
from stock_ledger.errors import ConfigError, StockLedgerError
from stock_ledger.progress import Progress
from stock_ledger.sink import add_levels
from stock_ledger.topics import partitions_of
from stock_ledger.verify import parse_partitions

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Coroutine, Sequence

    from stock_ledger.config import Settings

_KAFKA_ENV: Final = ("KAFKA_BOOTSTRAP_SERVERS", "STOCK_LEDGER_TOPIC", "STOCK_LEDGER_GROUP_ID")
_DB_ENV: Final = ("DATABASE_URL (the owner role)", "STOCK_LEDGER_LOCK_TIMEOUT_MS")
_LOG_ENV: Final = ("STOCK_LEDGER_LOG_LEVEL", "STOCK_LEDGER_LOG_FORMAT")
# The variables each operator command reads; shown in its --help.
ENVIRONMENT: Final[dict[str, tuple[str, ...]]] = {
    "offsets": (*_KAFKA_ENV, *_DB_ENV, *_LOG_ENV),
    "rejected": (*_DB_ENV, *_LOG_ENV),
    "repair": (*_KAFKA_ENV, *_DB_ENV, *_LOG_ENV),
}
OPERATOR_SKIP: Final = "operator_skip"


class OperatorError(StockLedgerError):
    """A refused operator command: the message says why and what to do instead."""


def environment_epilog(names: Sequence[str]) -> str:
    return "environment: " + ", ".join(names)


# ------------------------------------------------------------------------------------------------ parsers


def _command(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, group: str, help_text: str,
             description: str | None = None) -> argparse.ArgumentParser:
    """One parser of the group: its help, and the group's environment as epilog."""
    return sub.add_parser(name, help=help_text, description=description, epilog=environment_epilog(ENVIRONMENT[group]),
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The `offsets` and `rejected` command groups, and `repair`; each takes --json."""
    for command in (*_add_offsets(sub), *_add_rejected(sub), _add_repair(sub)):
        command.add_argument("--json", action="store_true", help="one JSON document on stdout")


def _add_offsets(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> tuple[argparse.ArgumentParser, ...]:
    offsets = _command(sub, "offsets", "offsets",
                       "show or move the partitions' stored offsets (the source of truth, in PostgreSQL)",
                       "Offsets live in PostgreSQL; Kafka's --reset-offsets changes nothing here.")
    osub = offsets.add_subparsers(dest="action", required=True)
    show = _command(osub, "show", "offsets", "per partition: stored offset, epoch, owner, log start/end, lag, any gap")
    move = _command(
        osub, "set", "offsets",
        "move partitions' stored offsets (skip a hole, skip records, or go back to unapplied ones)",
        "Moves each named partition's next offset in consumer_offsets and bumps its epoch, so running workers\n"
        "are fenced and re-read it. Refuses while the group has live members unless --force. Moving forward\n"
        "records the skipped range in ledger_gaps as acknowledged by you (reason operator_skip, --note).\n"
        "Moving below the highest applied or quarantined offset + 1 is refused: those records would be\n"
        "applied twice. Refused for a group whose database holds another group's ledger (a typo would stop\n"
        "every worker). Prints the plan, then the result; one refused partition moves none. Several\n"
        'partitions (--partition 1,2,5, or repeated): --json gives {"changes": [...]}. Run it as the owner role.')
    move.add_argument("--partition", action="append", required=True, metavar="P[,P...]",
                      help="the partition(s) to move (repeatable, or a comma-separated list)")
    target = move.add_mutually_exclusive_group(required=True)
    target.add_argument("--offset", type=int, help="the next offset to apply")
    target.add_argument("--to-log-start", action="store_true", help="the partition's current log start offset")
    target.add_argument("--to-log-end", action="store_true",
                        help="the partition's current log end offset (skips everything not yet applied)")
    target.add_argument("--to-timestamp", metavar="T",
                        help="the first offset with a record timestamp >= T (RFC 3339, e.g. 2026-11-30T08:00:00Z)")
    move.add_argument("--note", default=None, help="why (required when skipping records; stored in ledger_gaps)")
    move.add_argument("--force", action="store_true",
                      help="act although workers are in the group (they are fenced, exit and re-claim)")
    move.add_argument("--dry-run", action="store_true", help="show the plan, change nothing")
    return show, move


def _add_rejected(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> tuple[argparse.ArgumentParser, ...]:
    rejected = _command(sub, "rejected", "rejected", "list, show and replay quarantined records (rejected_movements)")
    rsub = rejected.add_subparsers(dest="action", required=True)
    listing = _command(rsub, "list", "rejected", "quarantined records, oldest first")
    listing.add_argument("--reason", metavar="CODE", choices=[c.value for c in RejectCode],
                         help="only this reason_code")
    listing.add_argument("--since", metavar="T", help="rejected at or after T: RFC 3339, or an age such as 30m, 6h, 7d")
    listing.add_argument("--limit", type=int, default=100, help="at most this many rows (default 100)")
    one = _command(rsub, "show", "rejected", "one quarantined record, raw key and value included")
    one.add_argument("id", type=int, help="the row's id (first column of `rejected list`)")
    replay = _command(
        rsub, "replay", "rejected", "re-parse quarantined records with this version's parser and apply those now valid",
        "Each batch is one transaction: valid records go to stock_movements with their original Kafka\n"
        "coordinates and into stock_levels, and leave rejected_movements; the others stay, with the attempt\n"
        "recorded (replay_attempts, last_replay_at, last_replay_reason). A movement_id already in the ledger\n"
        "stays rejected. Safe to run twice at once (rows are locked FOR UPDATE SKIP LOCKED).")
    replay.add_argument("--reason", metavar="CODE", choices=[c.value for c in RejectCode],
                        help="only rows with this reason_code")
    replay.add_argument("--dry-run", action="store_true", help="report what would be applied, change nothing")
    replay.add_argument("--batch-size", type=int, default=500, help="rows per transaction (default 500)")
    return listing, one, replay


def _add_repair(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    fix = _command(
        sub, "repair", "repair",
        "re-apply from Kafka the records an earlier version skipped (verify's gaps), exactly once",
        "Finds the records below each partition's stored offset that are in the topic and in neither\n"
        "stock_movements nor rejected_movements (what `verify` reports as gaps) and applies them as the worker\n"
        "would: the same parser, bad records quarantined with their reason and raw bytes, a movement_id already\n"
        "in the ledger quarantined as duplicate_movement_id, stock_levels updated in the same transaction, one\n"
        "transaction per --batch-size records, each recorded in ledger_repairs. Never moves consumer_offsets.\n"
        "Safe while workers run and beside another repair. Ranges recorded in ledger_gaps are left alone.\n"
        "Records below the log start are gone: reported and recorded as unacknowledged ledger_gaps, never\n"
        "invented. Run it as the owner role.\n\n"
        "exit codes: 0 every missing record applied (or quarantined) and nothing gone; 3 some range is gone from\n"
        "Kafka (reconcile that stock by hand, then `stock-ledger gaps ack`); 1 failure or a partition not\n"
        "repaired (the message says why); 2 bad usage or configuration.")
    fix.add_argument("--partition", action="append", default=[], metavar="P[,P...]",
                     help="repair only these partitions (repeatable, or a comma-separated list)")
    fix.add_argument("--dry-run", action="store_true",
                     help="find and count exactly what would be written (each chunk rolled back), change nothing")
    fix.add_argument("--batch-size", type=int, default=500, help="records per transaction (default 500)")
    fix.set_defaults(action="")
    return fix


def handler(settings: Settings, args: argparse.Namespace) -> Callable[[], Coroutine[Any, Any, int]] | None:
    """The coroutine for an operator command, or None if `args.command` is not one."""
    table: dict[tuple[str, str], Callable[[], Coroutine[Any, Any, int]]] = {
        ("offsets", "show"): lambda: offsets_show(settings, as_json=args.json),
        ("offsets", "set"): lambda: offsets_set(settings, args),
        ("rejected", "list"): lambda: rejected_list(settings, args),
        ("rejected", "show"): lambda: rejected_show(settings, args.id, as_json=args.json),
        ("rejected", "replay"): lambda: rejected_replay(settings, args),
        ("repair", ""): lambda: repair(settings, args),
    }
    command = table.get((args.command, getattr(args, "action", "")))
    if command is None:
        return None

    name = " ".join(part for part in ("stock-ledger", args.command, args.action) if part)

    async def refusals_on_stderr() -> int:
        # stdout holds the command's output (perhaps JSON for a script): a refusal is one line on stderr, exit 1.
        try:
            return await command()
        except OperatorError as exc:
            print(f"{name}: {exc}", file=sys.stderr)
            return 1
        except asyncpg.InsufficientPrivilegeError as exc:
            command_name = " ".join(part for part in (args.command, args.action) if part)
            print(f"{name}: {explain(exc, settings.database_url, command_name)}", file=sys.stderr)
            return 1

    return refusals_on_stderr


# ------------------------------------------------------------------------------------------------ helpers


def _emit(document: object, text: str, *, as_json: bool) -> None:
    print(json.dumps(document, indent=2, default=str) if as_json else text)


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[("" if v is None else str(v)) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(line.rstrip() for line in lines)


_AGE: Final = re.compile(r"^(\d+)([smhd])$")


def parse_time(raw: str, what: str) -> datetime:
    """RFC 3339 (a missing offset means UTC) or an age before now: 90s, 30m, 6h, 7d."""
    age = _AGE.match(raw.strip())
    if age:
        unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[age.group(2)]
        return datetime.now(UTC) - timedelta(**{unit: int(age.group(1))})
    try:
        parsed = datetime.fromisoformat(raw.strip())
    except ValueError:
        raise ConfigError(f"{what} {raw!r} is neither RFC 3339 (2026-11-30T08:00:00Z) nor an age (30m, 6h, 7d)") \
            from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


async def _owner(settings: Settings) -> asyncpg.Connection:
    conn = await connect_database(settings, application_name="stock-ledger-operator")
    await conn.execute(f"SET lock_timeout = {int(settings.lock_timeout_ms)}")
    await pgtime.install(conn)  # a replayed movement keeps its exact time, as the worker writes it
    return conn


@dataclass(frozen=True, slots=True)
class LogBounds:
    start: int
    end: int


async def _log_bounds(settings: Settings, partitions: Sequence[int],
                      timestamp_ms: int | None = None) -> tuple[dict[int, LogBounds], dict[int, int | None]]:
    """Log start/end per partition, and (if asked) the first offset at or after `timestamp_ms`."""
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap_servers, enable_auto_commit=False,
                                isolation_level="read_committed", **kafka_options(settings))
    await consumer.start()
    try:
        tps = [TopicPartition(settings.topic, p) for p in partitions]
        starts = await consumer.beginning_offsets(tps)
        ends = await consumer.end_offsets(tps)
        at: dict[int, int | None] = {}
        if timestamp_ms is not None:
            found = await consumer.offsets_for_times(dict.fromkeys(tps, timestamp_ms))
            at = {tp.partition: (meta.offset if meta is not None else None) for tp, meta in found.items()}
    finally:
        await consumer.stop()
    return {tp.partition: LogBounds(int(starts[tp]), int(ends[tp])) for tp in tps}, at


@dataclass(frozen=True, slots=True)
class Group:
    state: str
    members: list[str]


async def describe_group(settings: Settings) -> Group:
    """The Kafka group's state and live members (client id / host), from DescribeGroups."""
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap_servers, **kafka_options(settings))
    await admin.start()
    try:
        responses = await admin.describe_consumer_groups([settings.group_id])
    finally:
        await admin.close()
    for response in responses:
        for group in response.to_object()["groups"]:
            if group["group"] == settings.group_id:
                members = [f"{m['member_id']} ({m['client_host'].lstrip('/')})" for m in group["members"]]
                return Group(str(group["state"]), members)
    return Group("Dead", [])


# ------------------------------------------------------------------------------------------------ offsets show

_OFFSETS: Final = """
SELECT partition, next_offset, epoch, member_id, claimed_at, updated_at FROM consumer_offsets
 WHERE group_id = $1 AND topic = $2
"""
_GAPS: Final = """
SELECT partition, count(*) FILTER (WHERE acknowledged_at IS NULL) AS open, count(*) AS total
  FROM ledger_gaps WHERE group_id = $1 AND topic = $2 GROUP BY partition
"""


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


async def offsets_show(settings: Settings, *, as_json: bool) -> int:
    partitions = await partitions_of(settings.kafka_bootstrap_servers, settings.topic, options=kafka_options(settings))
    if not partitions:
        raise OperatorError(f"topic {settings.topic} does not exist on {settings.kafka_bootstrap_servers} "
                            "(check STOCK_LEDGER_TOPIC and KAFKA_BOOTSTRAP_SERVERS)")
    bounds, _ = await _log_bounds(settings, partitions)
    group = await describe_group(settings)
    conn = await _owner(settings)
    try:
        stored = {r["partition"]: r for r in await conn.fetch(_OFFSETS, settings.group_id, settings.topic)}
        gaps = {r["partition"]: r for r in await conn.fetch(_GAPS, settings.group_id, settings.topic)}
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
        _table(["partition", "next_offset", "epoch", "owner", "log_start", "log_end", "lag", "gaps(open)", "gap"],
               [[r["partition"], r["next_offset"], r["epoch"], r["owner"], r["log_start"], r["log_end"], r["lag"],
                 f"{r['recorded_gaps']}({r['unacknowledged_gaps']})", r["gap"] or ""] for r in rows]),
    ])
    _emit(document, text, as_json=as_json)
    return 0


# ------------------------------------------------------------------------------------------------ offsets set

# A partition never claimed has no row to lock: a placeholder row is inserted first (epoch 0: the move makes it 1, as
# a first claim would), so a claim of that partition (its INSERT ... ON CONFLICT) waits for this transaction and
# then bumps the epoch past ours, and a batch cannot commit between the floor check and the move. Done partition by
# partition in order, as claims and batches lock rows, so they never deadlock. A dry run rolls the row back.
_PLACEHOLD: Final = """
INSERT INTO consumer_offsets (group_id, topic, partition, epoch) VALUES ($1, $2, $3, 0)
ON CONFLICT (group_id, topic, partition) DO NOTHING
RETURNING partition
"""
_LOCK_OFFSET: Final = """
SELECT next_offset, epoch FROM consumer_offsets WHERE group_id = $1 AND topic = $2 AND partition = $3 FOR UPDATE
"""
# As the claim asks (sink.Ledger.claim): the ledger belongs to the one group that has rows here.
_OTHER_GROUP: Final = "SELECT group_id FROM consumer_offsets WHERE group_id <> $1 LIMIT 1"
# The lowest offset the partition may be moved to: everything below is in the ledger (applied or quarantined).
_FLOOR: Final = """
SELECT greatest(
    (SELECT max(kafka_offset) + 1 FROM stock_movements WHERE kafka_topic = $1 AND kafka_partition = $2),
    (SELECT max(kafka_offset) + 1 FROM rejected_movements WHERE kafka_topic = $1 AND kafka_partition = $2),
    0)
"""
_MOVE: Final = """
INSERT INTO consumer_offsets AS o (group_id, topic, partition, next_offset, epoch, member_id, claimed_at, updated_at)
VALUES ($1, $2, $3, $4, 1, 'operator:' || current_user, now(), now())
ON CONFLICT (group_id, topic, partition) DO UPDATE
    SET next_offset = EXCLUDED.next_offset, epoch = o.epoch + 1, generation = NULL, member_id = EXCLUDED.member_id,
        claimed_at = now(), updated_at = now()
RETURNING epoch
"""
_RECORD_GAP: Final = """
INSERT INTO ledger_gaps (group_id, topic, partition, first_offset, last_offset, reason, acknowledged_at,
                         acknowledged_by, note)
VALUES ($1, $2, $3, $4, $5, $6, now(), current_user, $7)
RETURNING id, acknowledged_by
"""


@contextlib.asynccontextmanager
async def transaction(conn: asyncpg.Connection, *, commit: bool) -> AsyncIterator[None]:
    """A transaction that a dry run rolls back once its effects are known (and any error rolls back)."""
    transaction = conn.transaction()
    await transaction.start()
    try:
        yield
    except BaseException:
        await transaction.rollback()
        raise
    await (transaction.commit() if commit else transaction.rollback())


async def _targets(settings: Settings, args: argparse.Namespace) -> dict[int, tuple[int, LogBounds]]:
    """Per named partition: the offset to move to, and the log's bounds."""
    wanted = sorted(parse_partitions(args.partition) or ())
    if not wanted:
        raise ConfigError("--partition: name at least one partition")
    partitions = await partitions_of(settings.kafka_bootstrap_servers, settings.topic, options=kafka_options(settings))
    if unknown := [p for p in wanted if p not in partitions]:
        raise OperatorError(f"topic {settings.topic} has no partition {', '.join(map(str, unknown))} "
                            f"(it has {len(partitions)})")
    stamp = None
    if args.to_timestamp is not None:
        stamp = int(parse_time(args.to_timestamp, "--to-timestamp").timestamp() * 1000)
    bounds, at = await _log_bounds(settings, wanted, stamp)
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
    other = await conn.fetchval(_OTHER_GROUP, settings.group_id)
    if other is not None:
        raise OperatorError(
            f"this database holds the ledger of consumer group {other!r}, not {settings.group_id!r}: a row for "
            f"{settings.group_id!r} would stop every worker of {other!r} (their claims refuse a second group). "
            "Set STOCK_LEDGER_GROUP_ID to the group that owns it (`offsets show` there shows its partitions)")
    steps = []
    for p, (target, log) in sorted(targets.items()):
        fresh = await conn.fetchval(_PLACEHOLD, settings.group_id, settings.topic, p) is not None
        locked = await conn.fetchrow(_LOCK_OFFSET, settings.group_id, settings.topic, p)
        floor = int(await conn.fetchval(_FLOOR, settings.topic, p))
        if target < floor:
            raise OperatorError(
                f"refusing to move partition {p} to {target}: offsets up to {floor - 1} are already "
                f"in the ledger (applied or quarantined) and would be applied twice; the lowest allowed is {floor}")
        before = locked["next_offset"]
        start = before if before is not None else floor
        if target > start and not note:
            raise ConfigError(f"moving partition {p} forward skips records {start}..{target - 1}: "
                              "say why with --note (it is stored with the acknowledged gap)")
        steps.append(_Step(p, target, log, before, None if fresh else locked["epoch"], start))
    return steps


def _render_plan(settings: Settings, steps: Sequence[_Step], members: int, *, dry_run: bool) -> str:
    head = (f"plan{' (dry run: nothing changes)' if dry_run else ''}: {settings.topic}, group {settings.group_id}"
            + (f", {members} live member(s) to fence" if members else ""))
    return head + "\n" + _table(
        ["partition", "next_offset", "->", "log_start", "log_end", "skipped", "gap"],
        [[x.partition, "-" if x.before is None else x.before, x.target, x.log.start, x.log.end, x.skipped,
          f"{x.start}..{x.target - 1}" if x.skipped else ""] for x in steps])


async def offsets_set(settings: Settings, args: argparse.Namespace) -> int:
    targets = await _targets(settings, args)
    group = await describe_group(settings)
    if group.members and not args.force:
        raise OperatorError(
            f"group {settings.group_id} has {len(group.members)} live member(s) ({', '.join(group.members)}): "
            "stop the workers first (e.g. kubectl scale --replicas=0), or pass --force to fence them "
            "(their next batch on the partition is refused; they exit and claim it again at the new offset)")
    conn = await _owner(settings)
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
        _emit(changes[0], _describe_change(changes[0]), as_json=args.json)
    else:
        _emit({"topic": settings.topic, "group": settings.group_id, "dry_run": bool(args.dry_run),
               "changes": changes}, "\n".join(_describe_change(c) for c in changes), as_json=args.json)
    return 0


async def _move(conn: asyncpg.Connection, settings: Settings, x: _Step, args: argparse.Namespace,
                members: int) -> dict[str, Any]:
    note, dry_run = args.note, bool(args.dry_run)
    epoch = await conn.fetchval(_MOVE, settings.group_id, settings.topic, x.partition, x.target)
    change: dict[str, Any] = {
        "topic": settings.topic, "group": settings.group_id, "partition": x.partition,
        "next_offset_before": x.before, "next_offset_after": x.target,
        "epoch_before": x.epoch_before, "epoch_after": epoch,
        "log_start": x.log.start, "log_end": x.log.end, "live_members_fenced": members,
        "gap": None, "dry_run": dry_run,
    }
    if x.skipped:
        gap = await conn.fetchrow(_RECORD_GAP, settings.group_id, settings.topic, x.partition, x.start,
                                  x.target - 1, OPERATOR_SKIP, note)
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
    if c["live_members_fenced"]:
        text += (f"\n{c['live_members_fenced']} live member(s) will be fenced at their next batch on the partition "
                 "and exit to claim it again")
    return text


# ------------------------------------------------------------------------------------------------ rejected

_LIST: Final = """
SELECT id, kafka_topic, kafka_partition, kafka_offset, reason_code, rejected_at, replay_attempts, reason
  FROM rejected_movements
 WHERE ($1::text IS NULL OR reason_code = $1) AND ($2::timestamptz IS NULL OR rejected_at >= $2)
 ORDER BY id LIMIT $3
"""
_ONE: Final = """
SELECT id, kafka_topic, kafka_partition, kafka_offset, kafka_timestamp, key, value, reason_code, reason,
       movement_id, rejected_at, replay_attempts, last_replay_at, last_replay_reason
  FROM rejected_movements WHERE id = $1
"""


def _text(raw: bytes | None) -> str | None:
    return None if raw is None else raw.decode("utf-8", errors="backslashreplace")


async def rejected_list(settings: Settings, args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise ConfigError("--limit must be >= 1")
    since = parse_time(args.since, "--since") if args.since else None
    conn = await _owner(settings)
    try:
        rows = [dict(r) for r in await conn.fetch(_LIST, args.reason, since, args.limit)]
    finally:
        await conn.close()
    text = _table(["id", "topic", "partition", "offset", "reason_code", "rejected_at", "replays", "reason"],
                  [[r["id"], r["kafka_topic"], r["kafka_partition"], r["kafka_offset"], r["reason_code"],
                    r["rejected_at"].isoformat(timespec="seconds"), r["replay_attempts"], r["reason"][:80]]
                   for r in rows])
    _emit({"rejected": rows}, text + f"\n({len(rows)} row(s))", as_json=args.json)
    return 0


async def rejected_show(settings: Settings, row_id: int, *, as_json: bool) -> int:
    conn = await _owner(settings)
    try:
        row = await conn.fetchrow(_ONE, row_id)
    finally:
        await conn.close()
    if row is None:
        raise OperatorError(f"no rejected movement with id {row_id} (it may have been replayed); "
                            "see `stock-ledger rejected list`")
    document = dict(row)
    document["key"], document["value"] = _text(row["key"]), _text(row["value"])
    text = "\n".join(f"{name:>18}: {value}" for name, value in document.items())
    _emit(document, text, as_json=as_json)
    return 0


_CLAIM_REJECTED: Final = """
SELECT id, kafka_topic, kafka_partition, kafka_offset, kafka_timestamp, key, value
  FROM rejected_movements
 WHERE id > $1 AND ($2::text IS NULL OR reason_code = $2)
 ORDER BY id LIMIT $3
   FOR UPDATE SKIP LOCKED
"""
# ON CONFLICT DO NOTHING: a movement_id already in the ledger (an upstream resend, or a copy applied meanwhile by a
# worker) is skipped and its row stays quarantined. The coordinates cannot conflict: the record is in
# rejected_movements, and the worker writes each coordinate to exactly one table.
_REPLAY_INSERT: Final = """
INSERT INTO stock_movements (movement_id, warehouse_id, sku, qty, kind, occurred_at, kafka_topic, kafka_partition,
                             kafka_offset, kafka_timestamp)
SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::bigint[], $5::text[], $6::timestamptz[], $7::text[],
                     $8::int[], $9::bigint[], $10::timestamptz[])
ON CONFLICT DO NOTHING
RETURNING kafka_topic, kafka_partition, kafka_offset
"""
_DELETE_REPLAYED: Final = "DELETE FROM rejected_movements WHERE id = ANY($1::bigint[])"
_RECORD_ATTEMPTS: Final = """
UPDATE rejected_movements AS r
   SET replay_attempts = r.replay_attempts + 1, last_replay_at = now(), last_replay_reason = a.reason
  FROM unnest($1::bigint[], $2::text[]) AS a(id, reason)
 WHERE r.id = a.id
"""


@dataclass
class ReplayReport:
    examined: int = 0
    applied: int = 0
    still_rejected: Counter[str] | None = None
    dry_run: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"examined": self.examined, "applied": self.applied,
                "still_rejected": dict(self.still_rejected or {}), "dry_run": self.dry_run}


async def _replay_batch(conn: asyncpg.Connection, rows: Sequence[asyncpg.Record],
                        report: ReplayReport) -> None:
    """One transaction's worth (the caller holds it): apply the now-valid rows, record an attempt on the rest."""
    assert report.still_rejected is not None  # noqa: S101
    movements: list[tuple[Any, ...]] = []
    by_coordinates: dict[tuple[str, int, int], int] = {}
    stays: dict[int, tuple[str, str]] = {}
    for r in rows:
        parsed = parse(r["key"], r["value"])
        if isinstance(parsed, Movement):
            movements.append((parsed.movement_id, parsed.warehouse_id, parsed.sku, parsed.qty, parsed.kind,
                              parsed.occurred_at, r["kafka_topic"], r["kafka_partition"], r["kafka_offset"],
                              r["kafka_timestamp"]))
            by_coordinates[r["kafka_topic"], r["kafka_partition"], r["kafka_offset"]] = r["id"]
        else:
            stays[r["id"]] = (parsed.code.value, parsed.reason)
    inserted: set[tuple[str, int, int]] = set()
    if movements:
        columns = list(zip(*movements, strict=True))
        inserted = {(x["kafka_topic"], x["kafka_partition"], x["kafka_offset"])
                    for x in await conn.fetch(_REPLAY_INSERT, *columns)}
    applied = [m for m in movements if (m[M_TOPIC], m[M_PARTITION], m[M_OFFSET]) in inserted]
    for m in movements:
        if (m[M_TOPIC], m[M_PARTITION], m[M_OFFSET]) not in inserted:
            stays[by_coordinates[m[M_TOPIC], m[M_PARTITION], m[M_OFFSET]]] = (
                RejectCode.DUPLICATE_MOVEMENT_ID.value,
                f"movement_id {m[M_ID]} is already in the ledger; not applied twice")
    if applied:
        await conn.execute(_DELETE_REPLAYED, [by_coordinates[m[M_TOPIC], m[M_PARTITION], m[M_OFFSET]] for m in applied])
        await add_levels(conn, applied)
    if stays:
        ids = sorted(stays)
        await conn.execute(_RECORD_ATTEMPTS, ids, [f"{stays[i][0]}: {stays[i][1]}" for i in ids])
    report.examined += len(rows)
    report.applied += len(applied)
    report.still_rejected.update(code for code, _ in stays.values())


async def rejected_replay(settings: Settings, args: argparse.Namespace) -> int:
    if args.batch_size < 1:
        raise ConfigError("--batch-size must be >= 1")
    report = ReplayReport(still_rejected=Counter(), dry_run=bool(args.dry_run))
    conn = await _owner(settings)
    try:
        total = await conn.fetchval(
            "SELECT count(*) FROM rejected_movements WHERE $1::text IS NULL OR reason_code = $1", args.reason)
        progress = Progress("rejected replay", int(total))
        cursor = 0
        while True:
            async with transaction(conn, commit=not args.dry_run):
                rows = await conn.fetch(_CLAIM_REJECTED, cursor, args.reason, args.batch_size)
                if rows:
                    await _replay_batch(conn, rows, report)
            if not rows:
                break
            cursor = rows[-1]["id"]
            progress.advance(len(rows))
        progress.finish()
    finally:
        await conn.close()
    still = report.still_rejected or Counter()
    verb = "would apply" if args.dry_run else "applied"
    text = (f"examined {report.examined}, {verb} {report.applied}, still rejected {sum(still.values())}"
            + "".join(f"\n  {code}: {n}" for code, n in sorted(still.items())))
    _emit(report.as_dict(), text, as_json=args.json)
    return 0



# ------------------------------------------------------------------------------------------------ repair


async def repair(settings: Settings, args: argparse.Namespace) -> int:
    from stock_ledger import repair as fix  # noqa: PLC0415 - it imports this module

    if args.batch_size < 1:
        raise ConfigError("--batch-size must be >= 1")
    partitions = parse_partitions(args.partition)
    # stdout carries the report (perhaps JSON for a script); the per-partition log lines go to stderr with the
    # progress.
    for log_handler in logging.getLogger().handlers:
        if isinstance(log_handler, logging.StreamHandler):
            log_handler.setStream(sys.stderr)
    conn = await _owner(settings)
    try:
        report = await fix.repair(settings, conn, partitions=partitions, dry_run=bool(args.dry_run),
                                  batch_size=args.batch_size)
    finally:
        await conn.close()
    _emit(report.as_dict(), fix.render(report), as_json=args.json)
    return report.exit_code
