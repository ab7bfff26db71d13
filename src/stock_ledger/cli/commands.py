"""Every command of `stock-ledger`, declared once: its name, help, flags, the environment variables it reads (shown
in its --help and in the top-level --help), whose database role it runs as (the advice a missing privilege gets)
and the function that runs it. `parser()` builds argparse from this table; `main.py` runs the chosen command."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from stock_ledger.cli import archive, audit, completion, offsets, rejected, service, stock
from stock_ledger.cli.args import positive_int, rfc3339
from stock_ledger.domain import RejectCode
from stock_ledger.versions import version_of

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine, Iterator, Sequence

    from stock_ledger.clients.dberrors import RunsAs
    from stock_ledger.config import Settings


EXIT_CODES: Final = ("exit codes: 0 success; 1 failure, one line saying the cause and the fix (every database "
                     "error included: refused login, unknown database, missing GRANT, unreachable server); 2 bad "
                     "configuration or usage; 3 `repair` only: some records are gone from Kafka; 130 interrupted; "
                     "143 stopped by SIGTERM")


@dataclass(frozen=True)
class Arg:
    """One `add_argument` call."""

    flags: tuple[str, ...]
    options: dict[str, Any]


def arg(*flags: str, **options: Any) -> Arg:  # noqa: ANN401 - argparse's own keyword arguments
    return Arg(flags, options)


@dataclass(frozen=True)
class OneOf:
    """A mutually exclusive group of arguments."""

    args: tuple[Arg, ...]
    required: bool = False


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    run: Callable[[Settings, argparse.Namespace], Coroutine[Any, Any, int]] | None = None
    description: str | None = None
    arguments: tuple[Arg | OneOf, ...] = ()
    environment: tuple[str, ...] = ()  # shown in its --help (a subcommand without one shows none)
    runs_as: RunsAs | None = None  # whose DATABASE_URL it needs (None: its group's, else the worker's): the advice
    # a missing privilege gets
    subcommands: tuple[Command, ...] = ()
    dest: str = ""  # where argparse stores the chosen subcommand's name
    raw: bool = False  # its description keeps its own line breaks
    refusals_on_stderr: bool = False  # a refusal is one line on stderr, exit 1: stdout may carry JSON
    # It works through a pooler that shares server sessions per transaction (STOCK_LEDGER_DATABASE_POOLING=
    # transaction): `run` only. Every other command that reads DATABASE_URL refuses there, before doing anything.
    shared_sessions: bool = False


LOG_ENV: Final = ("STOCK_LEDGER_LOG_LEVEL", "STOCK_LEDGER_LOG_FORMAT")
_KAFKA_ENV: Final = ("KAFKA_BOOTSTRAP_SERVERS", "STOCK_LEDGER_TOPIC", "STOCK_LEDGER_GROUP_ID")
_OWNER_ENV: Final = ("DATABASE_URL (the owner role)", "STOCK_LEDGER_LOCK_TIMEOUT_MS")
_READER_ENV: Final = ("DATABASE_URL (read-only is enough: a member of stock_ledger_reader)", *LOG_ENV)
_JSON: Final = arg("--json", action="store_true", help="one JSON document on stdout")
_TIME_HELP: Final = "RFC 3339 with an offset, e.g. 2026-11-29T10:00:00+01:00"
_PARTITIONS: Final = "P[,P...]"

_OFFSETS_ENV: Final = (*_KAFKA_ENV, *_OWNER_ENV, *LOG_ENV)
_OFFSETS: Final = Command(
    "offsets", "show or move the partitions' stored offsets (the source of truth, in PostgreSQL)",
    description="Offsets live in PostgreSQL; Kafka's --reset-offsets changes nothing here.",
    environment=_OFFSETS_ENV, runs_as="owner", dest="action", raw=True, refusals_on_stderr=True, subcommands=(
        # It reads only: a role the migrations granted stock_ledger_app may run it too.
        Command("show", "per partition: stored offset, epoch, owner, log start/end, lag, any gap", offsets.show,
                arguments=(_JSON,), environment=_OFFSETS_ENV, raw=True, runs_as="worker"),
        Command(
            "set", "move partitions' stored offsets (skip a hole, skip records, or go back to unapplied ones)",
            offsets.move, description=(
                "Moves each named partition's next offset in consumer_offsets and bumps its epoch, so running workers\n"
                "are fenced and re-read it. Refuses while the group has live members unless --force. Moving forward\n"
                "records the skipped range in ledger_gaps as acknowledged by you (reason operator_skip, --note).\n"
                "Moving below the highest applied or quarantined offset + 1 is refused: those records would be\n"
                "applied twice. Refused for a group whose database holds another group's ledger (a typo would stop\n"
                "every worker). Prints the plan, then the result; one refused partition moves none. Several\n"
                'partitions (--partition 1,2,5, or repeated): --json gives {"changes": [...]}. Run it as the owner '
                "role."),
            environment=_OFFSETS_ENV, raw=True, arguments=(
                arg("--partition", action="append", required=True, metavar=_PARTITIONS,
                    help="the partition(s) to move (repeatable, or a comma-separated list)"),
                OneOf(required=True, args=(
                    arg("--offset", type=int, help="the next offset to apply"),
                    arg("--to-log-start", action="store_true", help="the partition's current log start offset"),
                    arg("--to-log-end", action="store_true",
                        help="the partition's current log end offset (skips everything not yet applied)"),
                    arg("--to-timestamp", metavar="T", help="the first offset with a record timestamp >= T (RFC "
                        "3339, e.g. 2026-11-30T08:00:00Z)"),
                )),
                arg("--note", default=None, help="why (required when skipping records; stored in ledger_gaps)"),
                arg("--force", action="store_true",
                    help="act although workers are in the group (they are fenced, exit and re-claim)"),
                arg("--dry-run", action="store_true", help="show the plan, change nothing"),
                _JSON,
            )),
    ))

_REJECTED_ENV: Final = (*_OWNER_ENV, *LOG_ENV)
_REASON_CODES: Final = [c.value for c in RejectCode]
_REJECTED: Final = Command(
    "rejected", "list, show and replay quarantined records (rejected_movements)", environment=_REJECTED_ENV,
    runs_as="owner", dest="action", raw=True, refusals_on_stderr=True, subcommands=(
        Command("list", "quarantined records, oldest first", rejected.list_rejected, environment=_REJECTED_ENV,
                raw=True, arguments=(
                    arg("--reason", metavar="CODE", choices=_REASON_CODES, help="only this reason_code"),
                    arg("--since", metavar="T", help="rejected at or after T: RFC 3339, or an age such as 30m, 6h, 7d"),
                    arg("--limit", type=int, default=100, help="at most this many rows (default 100)"),
                    _JSON)),
        Command("show", "one quarantined record, raw key and value included", rejected.show_rejected,
                environment=_REJECTED_ENV, raw=True, arguments=(
                    arg("id", type=int, help="the row's id (first column of `rejected list`)"), _JSON)),
        Command(
            "replay", "re-parse quarantined records with this version's parser and apply those now valid",
            rejected.replay, environment=_REJECTED_ENV, raw=True, description=(
                "Each batch is one transaction: valid records go to stock_movements with their original Kafka\n"
                "coordinates and into stock_levels, and leave rejected_movements; the others stay, with the attempt\n"
                "recorded (replay_attempts, last_replay_at, last_replay_reason). A movement_id already in the ledger\n"
                "stays rejected. Safe to run twice at once (rows are locked FOR UPDATE SKIP LOCKED)."),
            arguments=(
                arg("--reason", metavar="CODE", choices=_REASON_CODES, help="only rows with this reason_code"),
                arg("--dry-run", action="store_true", help="report what would be applied, change nothing"),
                arg("--batch-size", type=int, default=500, help="rows per transaction (default 500)"),
                _JSON)),
    ))

_REPAIR: Final = Command(
    "repair", "re-apply from Kafka the records an earlier version skipped (verify's gaps), exactly once",
    audit.run_repair, environment=(*_KAFKA_ENV, *_OWNER_ENV, *LOG_ENV), runs_as="owner", raw=True,
    refusals_on_stderr=True, description=(
        "Finds the records below each partition's stored offset that are in the topic and in neither\n"
        "stock_movements nor rejected_movements (what `verify` reports as gaps) and applies them as the worker\n"
        "would: the same parser, bad records quarantined with their reason and raw bytes, a movement_id already\n"
        "in the ledger quarantined as duplicate_movement_id, a record PostgreSQL refuses quarantined as\n"
        "database_rejected, stock_levels updated in the same transaction, one\n"
        "transaction per --batch-size records, each recorded in ledger_repairs. Never moves consumer_offsets.\n"
        "Safe while workers run and beside another repair. Ranges acknowledged in ledger_gaps (by a role that\n"
        "may acknowledge: not the worker's) are left alone.\n"
        "Records below the log start that the ledger knows it lost are gone: reported and recorded as\n"
        "unacknowledged ledger_gaps, never invented; offsets there applied before the ledger recorded which held\n"
        "no record (transaction markers) are reported as unknown. Run it as the owner role.\n\n"
        "exit codes: 0 every missing record applied (or quarantined) and nothing gone; 3 some range is gone from\n"
        "Kafka (reconcile that stock by hand, then `stock-ledger gaps ack`); 1 failure or a partition not\n"
        "repaired (the message says why); 2 bad usage or configuration."),
    arguments=(
        arg("--partition", action="append", default=[], metavar=_PARTITIONS,
            help="repair only these partitions (repeatable, or a comma-separated list)"),
        arg("--dry-run", action="store_true",
            help="find and count exactly what would be written (each chunk rolled back), change nothing"),
        arg("--batch-size", type=int, default=500, help="records per transaction (default 500)"),
        _JSON))


_ARCHIVE_ENV: Final = ("STOCK_LEDGER_ARCHIVE_DIR", *_OWNER_ENV, "STOCK_LEDGER_READER_ROLE", *LOG_ENV)
_ARCHIVE_RUN_ENV: Final = (*_KAFKA_ENV, "STOCK_LEDGER_RETENTION_DAYS", *_ARCHIVE_ENV)
_SEGMENT: Final = "a segment's name, as `archive list` shows it (stock_movements_p<P>_o<offset>)"
_ARCHIVE: Final = Command(
    "archive", "retention: old segments of stock_movements to Parquet archives; list, verify, restore them",
    environment=_ARCHIVE_RUN_ENV, runs_as="owner", dest="action", raw=True, refusals_on_stderr=True, description=(
        "stock_movements is kept in segments of Kafka offsets (ledger_segments). `archive run` writes each segment\n"
        "that has been online for STOCK_LEDGER_RETENTION_DAYS and that nothing still needs to\n"
        "STOCK_LEDGER_ARCHIVE_DIR as Parquet with a manifest, reads it back, checks it against the segment under a\n"
        "lock, records it (ledger_archives, per-(warehouse, sku) sums in archived_sums), then detaches and drops the\n"
        "segment. stock_levels, `stock show --at`, `movements` and `verify` stay exact. Run it as the owner role."),
    subcommands=(
        Command("run", "archive every segment that may leave (the chart's CronJob runs this)", archive.run,
                environment=_ARCHIVE_RUN_ENV, raw=True, description=(
                    "A segment leaves only when the group's stored offset has passed its end, Kafka no longer holds\n"
                    "its offsets (verify compares what Kafka holds), its newest movement was applied more than\n"
                    "STOCK_LEDGER_RETENTION_DAYS ago, no gap in it awaits acknowledgement and none of its offsets is\n"
                    "a hole; per Kafka partition the oldest first, stopping at the first that must stay (the report\n"
                    "says why). Safe to interrupt and to run again: it finishes what an earlier run recorded."),
                arguments=(
                    arg("--dry-run", action="store_true", help="say what would be archived and why the rest stays"),
                    arg("--limit", type=positive_int, default=None, metavar="N", help="archive at most N segments"),
                    _JSON)),
        Command("list", "the archives this ledger recorded", archive.list_archives, environment=_ARCHIVE_ENV,
                raw=True, arguments=(_JSON,)),
        Command("verify", "check archives against their manifests and the ledger's record (exit 1 on a problem)",
                archive.verify, environment=_ARCHIVE_ENV, raw=True, arguments=(
                    arg("segment", nargs="*", help=f"{_SEGMENT} (default: every archive)"), _JSON)),
        Command("restore", "load one archive into the table restored_<segment> for an audit (never into the ledger)",
                archive.restore, environment=_ARCHIVE_ENV, raw=True, arguments=(
                    arg("segment", help=_SEGMENT), _JSON)),
    ))


async def _completion(_settings: Settings, args: argparse.Namespace) -> int:
    print(completion.script(parser(), args.shell), end="")
    return 0


_COMPLETION: Final = Command(
    "completion", "print the shell completion script for bash or zsh (generated from this parser)", _completion,
    raw=True, description=(
        "Prints a completion script for every command and flag of this version. Install it once:\n"
        "  bash: stock-ledger completion bash > ~/.local/share/bash-completion/completions/stock-ledger\n"
        "        (or, without bash-completion: source <(stock-ledger completion bash) in ~/.bashrc)\n"
        '  zsh:  stock-ledger completion zsh > "${fpath[1]}/_stock-ledger" (any directory on $fpath),\n'
        "        then start a new shell (compinit must run in ~/.zshrc)"),
    arguments=(arg("shell", choices=completion.SHELLS, help="the shell to complete for"),))

COMMANDS: Final[tuple[Command, ...]] = (
    Command("run", "run the worker in the foreground (SIGTERM/SIGINT: graceful stop)", service.run,
            shared_sessions=True, environment=(
        "KAFKA_BOOTSTRAP_SERVERS", "DATABASE_URL (the worker role)",
        "STOCK_LEDGER_*: every variable of docs/configuration.md except STOCK_LEDGER_MIGRATE_*", *LOG_ENV)),
    Command("migrate", "apply database migrations (as the owner role); idempotent", service.run_migrate,
            runs_as="owner", environment=(
                "DATABASE_URL (the owner role)", "STOCK_LEDGER_MIGRATIONS_DIR", "STOCK_LEDGER_MIGRATE_DEADLINE_SECONDS",
                "STOCK_LEDGER_MIGRATE_LOCK_TIMEOUT_MS", "STOCK_LEDGER_MIGRATE_STATEMENT_TIMEOUT_MS",
                "STOCK_LEDGER_APP_ROLE", "STOCK_LEDGER_READER_ROLE", *LOG_ENV)),
    Command("create-topic", "create STOCK_LEDGER_TOPIC if absent", service.create_topic,
            environment=("KAFKA_BOOTSTRAP_SERVERS", "STOCK_LEDGER_TOPIC", *LOG_ENV), arguments=(
                arg("--partitions", type=int, default=24), arg("--replication-factor", type=int, default=1))),
    Command("produce", "produce deterministic movements (idempotent producer)", service.run_produce,
            environment=("KAFKA_BOOTSTRAP_SERVERS", "STOCK_LEDGER_TOPIC", *LOG_ENV), arguments=(
                arg("--count", type=int, required=True),
                arg("--rate", type=float, default=None, help="movements per second (default: as fast as possible)"),
                arg("--skus", type=int, default=1000), arg("--warehouses", type=int, default=4),
                arg("--seed", type=int, default=1))),
    Command("verify", "check the ledger against the topic; exit 0 only if all checks hold", audit.run_verify,
            environment=("KAFKA_BOOTSTRAP_SERVERS", "DATABASE_URL", "STOCK_LEDGER_TOPIC", "STOCK_LEDGER_GROUP_ID",
                         *LOG_ENV), refusals_on_stderr=True, arguments=(
                arg("--expect", type=int, default=None,
                    help="expected number of movements in the ledger (archived ones included)"),
                arg("--wait", type=float, default=0.0, help="first wait up to this many seconds for lag 0"),
                arg("--json", action="store_true",
                    help="one JSON document on stdout instead of the table: ok, rows, distinct_sources, checks "
                         "(name, ok, detail) and per-partition findings (missing, repeated, phantoms); same exit "
                         "code"),
                arg("--partition", action="append", default=[], metavar=_PARTITIONS,
                    help="check only these partitions (repeatable, or a comma-separated list)"),
                arg("--since", default=None, metavar="TIME",
                    help="check only records from the first one applied since TIME (ISO 8601, or a duration "
                         "back from now: 15m, 6h, 2d) to the log end: gaps, overlaps, rows not in the topic, "
                         "the unique constraint, open ledger_gaps, stored offsets vs log start and drift. Not "
                         "covered: older offsets, stock_levels = sum(movements) (needs the whole ledger) and "
                         "lag (left to the lag alert); the last line counts only the rows checked"))),
    Command(
        "gaps", "holes in the log the ledger moved past (ledger_gaps)", dest="gaps_command",
        description="Holes are offsets Kafka deleted (retention, delete-records) before they were applied. `verify` "
                    "fails while one is unacknowledged. Acknowledge after reconciling the stock those records moved, "
                    "as a role that may UPDATE ledger_gaps (the owner): an acknowledgement counts only when its "
                    "acknowledged_by is such a role (one by the worker's role is listed as unacknowledged).",
        environment=("DATABASE_URL (ack: a role that may UPDATE ledger_gaps, e.g. the owner)", *LOG_ENV),
        subcommands=(
            Command("list", "list unacknowledged gaps (--all: acknowledged ones too)", audit.gaps_list, arguments=(
                arg("--all", action="store_true", help="include acknowledged gaps"),
                arg("--json", action="store_true", help="one JSON object per line"))),
            Command("ack", "acknowledge a gap after reconciling stock by hand", audit.gaps_ack, runs_as="owner",
                    arguments=(arg("id", type=int),
                               arg("--note", required=True, help="what was reconciled, by whom (kept with the gap)"))),
        )),
    Command(
        "stock", "on-hand per (warehouse, sku): now, or as of a time (read-only)", dest="stock_command",
        environment=_READER_ENV, runs_as="reader", subcommands=(
            Command(
                "show", "on-hand of a warehouse's SKUs, now or as of --at", stock.show, runs_as="reader",
                description="On-hand now (from stock_levels), or as of --at T: the sum of the movements whose "
                            "occurred_at is <= T. That is business time (when the movement happened, as the "
                            "producer says), not the order the ledger applied movements in: a late-arriving "
                            "movement that occurred before T counts. SKUs at zero as of T are not listed. It starts "
                            "from the closing balance taken nearest T (STOCK_LEDGER_CLOSING_SECONDS) and reads only "
                            "the movements between the two.",
                arguments=(
                    arg("--warehouse", required=True, help="warehouse_id (exact)"),
                    arg("--sku", help="one SKU only"),
                    arg("--negative", action="store_true",
                        help="only levels below zero; now: with when each went negative (when the ledger applied it)"),
                    arg("--at", type=rfc3339, metavar="T", help=f"as of business time T ({_TIME_HELP})"),
                    _JSON)),
        )),
    Command(
        "movements", "a SKU's movement history with running on-hand and Kafka coordinates (read-only)", stock.history,
        runs_as="reader", environment=_READER_ENV,
        description="A SKU's movements in application order: Kafka offset order within the SKU's partition (the "
                    "topic is keyed by SKU), i.e. the order the ledger applied them; on_hand is the warehouse's "
                    "running on-hand right after each row. Each row names its Kafka record (topic/partition/offset) "
                    "so it can be traced to the producer.",
        arguments=(
            arg("--sku", required=True, help="the SKU (exact)"),
            arg("--warehouse", help="one warehouse only (default: every warehouse, on_hand per warehouse)"),
            arg("--since", type=rfc3339, metavar="T",
                help=f"only movements that occurred at or after T, business time ({_TIME_HELP})"),
            arg("--limit", type=positive_int, default=100, metavar="N",
                help="show the newest N of the selected rows (default 100)"),
            _JSON)),
    _OFFSETS,
    _REJECTED,
    _REPAIR,
    _ARCHIVE,
    _COMPLETION,
)


def parser() -> argparse.ArgumentParser:
    """argparse for every command of COMMANDS."""
    top = argparse.ArgumentParser(
        prog="stock-ledger", description=f"`stock-ledger {'|'.join(_names())}`.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="environment variables read by each command (see `stock-ledger <command> --help`):\n"
        + "\n".join(f"  {c.name}: {', '.join(c.environment)}" for c in COMMANDS) + "\n\n" + EXIT_CODES)
    top.add_argument("--version", action="version", version=f"stock-ledger {version_of('stock-ledger')}")
    _add_subcommands(top, COMMANDS, "command")
    return top


def chosen(args: argparse.Namespace) -> list[Command]:
    """The path of commands `args` chose, top level first (`offsets`, `set`)."""
    path = [next(c for c in COMMANDS if c.name == args.command)]
    while path[-1].subcommands:
        name = getattr(args, path[-1].dest)
        path.append(next(c for c in path[-1].subcommands if c.name == name))
    return path


def needs_own_session(path: Sequence[Command]) -> bool:
    """Whether the chosen command opens database sessions that must be its own (it reads DATABASE_URL, and is not
    declared to work through a transaction pooler)."""
    uses_database = any(e.startswith("DATABASE_URL") for c in path for e in c.environment)
    return uses_database and not path[-1].shared_sessions


def _names() -> Iterator[str]:
    """run|migrate|...|stock show|movements|... as the usage line lists them."""
    for c in COMMANDS:
        yield f"{c.name} show" if c.name == "stock" else c.name


def _add_subcommands(parent: argparse.ArgumentParser, commands: Sequence[Command], dest: str) -> None:
    sub = parent.add_subparsers(dest=dest, required=True)
    for c in commands:
        p = sub.add_parser(c.name, help=c.help, description=c.description,
                           epilog=f"environment: {', '.join(c.environment)}" if c.environment else None,
                           formatter_class=argparse.RawDescriptionHelpFormatter if c.raw else argparse.HelpFormatter)
        for a in c.arguments:
            if isinstance(a, OneOf):
                group = p.add_mutually_exclusive_group(required=a.required)
                for x in a.args:
                    group.add_argument(*x.flags, **x.options)
            else:
                p.add_argument(*a.flags, **a.options)
        if c.subcommands:
            _add_subcommands(p, c.subcommands, c.dest)
