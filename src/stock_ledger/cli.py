"""`stock-ledger run|migrate|create-topic|produce|verify|repair|gaps|offsets|rejected|stock show|movements`.

Exit codes: 0 success; 1 failure (the message says what went wrong and what to do); 2 bad configuration or usage;
3 (`repair` only) some skipped records are gone from Kafka: reported and recorded in ledger_gaps, not applied.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import signal
import sys
from typing import TYPE_CHECKING, Any, Final

import asyncpg
import structlog
from aiokafka.errors import KafkaError

from stock_ledger import logs
from stock_ledger.config import Settings, load_settings
from stock_ledger.errors import ConfigError, StockLedgerError

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine, Sequence

log = structlog.get_logger("stock_ledger.cli")

# Every database failure (a refused login, an unknown database, a missing GRANT, no schema, an unreachable server)
# exits 1 with one line from dberrors.explain; `run` against a database `migrate` has not prepared exits 2.
EXIT_CODES: Final = ("exit codes: 0 success; 1 failure, one line saying the cause and the fix (every database "
                     "error included: refused login, unknown database, missing GRANT, unreachable server); 2 bad "
                     "configuration or usage; 3 `repair` only: some records are gone from Kafka; 130 interrupted; "
                     "143 stopped by SIGTERM")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stock-ledger", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("run", help="run the worker in the foreground (SIGTERM/SIGINT: graceful stop)")
    sub.add_parser("migrate", help="apply database migrations (as the owner role); idempotent")
    topic = sub.add_parser("create-topic", help="create STOCK_LEDGER_TOPIC if absent")
    topic.add_argument("--partitions", type=int, default=24)
    topic.add_argument("--replication-factor", type=int, default=1)
    produce = sub.add_parser("produce", help="produce deterministic movements (idempotent producer)")
    produce.add_argument("--count", type=int, required=True)
    produce.add_argument("--rate", type=float, default=None, help="movements per second (default: as fast as possible)")
    produce.add_argument("--skus", type=int, default=1000)
    produce.add_argument("--warehouses", type=int, default=4)
    produce.add_argument("--seed", type=int, default=1)
    verify = sub.add_parser("verify", help="check the ledger against the topic; exit 0 only if all checks hold")
    verify.add_argument("--expect", type=int, default=None, help="expected number of rows in stock_movements")
    verify.add_argument("--wait", type=float, default=0.0, help="first wait up to this many seconds for lag 0")
    verify.add_argument("--json", action="store_true",
                        help="one JSON document on stdout instead of the table: ok, rows, distinct_sources, checks "
                             "(name, ok, detail) and per-partition findings (missing, repeated, phantoms); same exit "
                             "code")
    gaps = sub.add_parser("gaps", help="holes in the log the ledger moved past (ledger_gaps)",
                          description="Holes are offsets Kafka deleted (retention, delete-records) before they were "
                          "applied. `verify` fails while one is unacknowledged. Acknowledge after reconciling the "
                          "stock those records moved, as a role that may UPDATE ledger_gaps (the owner).")
    gaps_sub = gaps.add_subparsers(dest="gaps_command", required=True)
    gaps_list = gaps_sub.add_parser("list", help="list unacknowledged gaps (--all: acknowledged ones too)")
    gaps_list.add_argument("--all", action="store_true", help="include acknowledged gaps")
    gaps_list.add_argument("--json", action="store_true", help="one JSON object per line")
    gaps_ack = gaps_sub.add_parser("ack", help="acknowledge a gap after reconciling stock by hand")
    gaps_ack.add_argument("id", type=int)
    gaps_ack.add_argument("--note", required=True, help="what was reconciled, by whom (kept with the gap)")
    _add_signal_parsers(sub)
    _operator_commands(parser, sub)
    verify.add_argument("--partition", action="append", default=[], metavar="P[,P...]",
                        help="check only these partitions (repeatable, or a comma-separated list)")
    verify.add_argument("--since", default=None, metavar="TIME",
                        help="check only records from the first one applied since TIME (ISO 8601, or a duration "
                             "back from now: 15m, 6h, 2d) to the log end: gaps, overlaps, rows not in the topic, "
                             "the unique constraint, open ledger_gaps, stored offsets vs log start and drift. Not "
                             "covered: older offsets, stock_levels = sum(movements) (needs the whole ledger) and "
                             "lag (left to the lag alert); the last line counts only the rows checked")
    return parser


# --- operator commands, --version and the environment in --help (issue 13) ------------------------------------
_COMMON_ENV: Final = ("STOCK_LEDGER_LOG_LEVEL", "STOCK_LEDGER_LOG_FORMAT")
# What each command reads (besides the log settings); `<command> --help` lists it.
_ENVIRONMENT: Final[dict[str, tuple[str, ...]]] = {
    "run": ("KAFKA_BOOTSTRAP_SERVERS", "DATABASE_URL (the worker role)",
            "STOCK_LEDGER_*: every variable of README 'Configuration' except STOCK_LEDGER_MIGRATE_*"),
    "migrate": ("DATABASE_URL (the owner role)", "STOCK_LEDGER_MIGRATIONS_DIR", "STOCK_LEDGER_MIGRATE_DEADLINE_SECONDS",
                "STOCK_LEDGER_MIGRATE_LOCK_TIMEOUT_MS", "STOCK_LEDGER_MIGRATE_STATEMENT_TIMEOUT_MS"),
    "create-topic": ("KAFKA_BOOTSTRAP_SERVERS", "STOCK_LEDGER_TOPIC"),
    "produce": ("KAFKA_BOOTSTRAP_SERVERS", "STOCK_LEDGER_TOPIC"),
    "verify": ("KAFKA_BOOTSTRAP_SERVERS", "DATABASE_URL", "STOCK_LEDGER_TOPIC", "STOCK_LEDGER_GROUP_ID"),
    "gaps": ("DATABASE_URL (ack: a role that may UPDATE ledger_gaps, e.g. the owner)",),
    "stock": ("DATABASE_URL (read-only is enough: a member of stock_ledger_reader)",),
    "movements": ("DATABASE_URL (read-only is enough: a member of stock_ledger_reader)",),
}


def _operator_commands(parser: argparse.ArgumentParser, sub: argparse._SubParsersAction[argparse.ArgumentParser],
                       ) -> None:
    from stock_ledger.metrics import _version  # noqa: PLC0415 - one place that reads the version
    from stock_ledger.operate import ENVIRONMENT, add_commands, environment_epilog  # noqa: PLC0415

    parser.add_argument("--version", action="version", version=f"stock-ledger {_version('stock-ledger')}")
    add_commands(sub)
    for name, names in _ENVIRONMENT.items():
        sub.choices[name].epilog = environment_epilog((*names, *_COMMON_ENV))
    parser.epilog = "environment variables read by each command (see `stock-ledger <command> --help`):\n" + "\n".join(
        f"  {name}: {', '.join(names)}" for name, names in {**_ENVIRONMENT, **ENVIRONMENT}.items())
    parser.epilog += "\n\n" + EXIT_CODES
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
# ----------------------------------------------------------------------------------------------------------------


def _runner() -> Callable[[Coroutine[Any, Any, int]], int]:
    try:
        import uvloop  # noqa: PLC0415 - optional speed-up

        return lambda coro: asyncio.Runner(loop_factory=uvloop.new_event_loop).run(coro)
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run


async def _run(settings: Settings) -> int:
    from stock_ledger.service import serve  # noqa: PLC0415 - keep `--help` and config errors fast

    settings.require_database_url()
    # What is imported now lives as long as the process: keep it out of every full collection, and collect the
    # young generation less often (a batch allocates a few tracked objects per record). +5% in scripts/bench.py.
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)
    return await serve(settings)


async def _migrate(settings: Settings) -> int:
    from stock_ledger.clients import check_sslmode  # noqa: PLC0415
    from stock_ledger.migrate import MigrateOptions, find_migrations_dir, migrate  # noqa: PLC0415

    options = MigrateOptions(settings.migrate_deadline_seconds, settings.migrate_lock_timeout_ms,
                             settings.migrate_statement_timeout_ms)
    applied = await migrate(check_sslmode(settings), find_migrations_dir(settings.migrations_dir), options)
    print(f"migrations applied: {', '.join(applied) or 'none (already up to date)'}")
    return 0


async def _create_topic(settings: Settings, args: argparse.Namespace) -> int:
    from stock_ledger.clients import check_kafka, kafka_options  # noqa: PLC0415
    from stock_ledger.topics import ensure_topic  # noqa: PLC0415

    await check_kafka(settings)
    created = await ensure_topic(settings.kafka_bootstrap_servers, settings.topic, args.partitions,
                                 args.replication_factor, options=kafka_options(settings))
    print(f"topic {settings.topic}: {'created' if created else 'already exists'}")
    return 0


async def _produce(settings: Settings, args: argparse.Namespace) -> int:
    from stock_ledger.clients import check_kafka, kafka_options  # noqa: PLC0415
    from stock_ledger.produce import produce  # noqa: PLC0415
    from stock_ledger.topics import ensure_topic  # noqa: PLC0415

    if args.count < 0 or (args.rate is not None and args.rate <= 0) or args.skus < 1 or args.warehouses < 1:
        raise ConfigError("--count must be >= 0, --rate > 0, --skus and --warehouses >= 1")
    await check_kafka(settings)
    await ensure_topic(settings.kafka_bootstrap_servers, settings.topic, options=kafka_options(settings))
    await produce(settings.kafka_bootstrap_servers, settings.topic, args.count, rate=args.rate, skus=args.skus,
                  warehouses=args.warehouses, seed=args.seed, options=kafka_options(settings))
    return 0


async def _verify(settings: Settings, args: argparse.Namespace) -> int:
    from stock_ledger.clients import check_kafka  # noqa: PLC0415
    from stock_ledger.verify import Scope, parse_partitions, parse_since, verify, wait_for_drain  # noqa: PLC0415

    settings.require_database_url()
    scope = Scope(parse_partitions(args.partition), parse_since(args.since) if args.since else None)
    await check_kafka(settings)
    if args.wait > 0 and not await wait_for_drain(settings, args.wait):
        print(f"verify: the ledger did not catch up within {args.wait:g}s; checking anyway", file=sys.stderr)
    report = await verify(settings, args.expect, scope=scope)
    print(json.dumps(report.as_dict()) if args.json else report.render())
    return 0 if report.ok else 1


async def _gaps(settings: Settings, args: argparse.Namespace) -> int:
    from stock_ledger.clients import connect_database  # noqa: PLC0415
    from stock_ledger.gaps import acknowledge, list_gaps  # noqa: PLC0415

    conn = await connect_database(settings, application_name="stock-ledger-gaps")
    try:
        if args.gaps_command == "ack":
            if not args.note.strip():
                raise ConfigError("--note must say what was reconciled")
            if not await acknowledge(conn, args.id, args.note):
                print(f"gap {args.id}: no such unacknowledged gap (see `stock-ledger gaps list --all`)",
                      file=sys.stderr)
                return 1
            print(f"gap {args.id}: acknowledged")
            return 0
        rows = await list_gaps(conn, include_acknowledged=args.all)
    finally:
        await conn.close()
    if args.json:
        for r in rows:
            print(json.dumps(r, default=str))
    elif not rows:
        print("no gaps" if args.all else "no unacknowledged gaps")
    for r in [] if args.json else rows:
        state = f"acknowledged {r['acknowledged_at']:%Y-%m-%d %H:%M} by {r['acknowledged_by']}: {r['note']}" \
            if r["acknowledged_at"] else "UNACKNOWLEDGED"
        detected = f"{r['detected_at']:%Y-%m-%d %H:%M:%S}"
        print(f"#{r['id']} {r['group_id']} {r['topic']}/{r['partition']} offsets {r['first_offset']}-"
              f"{r['last_offset']} ({r['records']} records, {r['reason']}, detected {detected}) {state}")
    return 0
class _Terminated(BaseException):
    """SIGTERM outside the worker's own handler: unwinds like Ctrl-C (transactions roll back, connections close)."""


def _raise_terminated(_signum: int, _frame: object) -> None:
    raise _Terminated


async def _until_sigterm(command: Coroutine[Any, Any, int]) -> int:
    """Runs a subcommand; SIGTERM cancels it. As a container's PID 1 the process gets no default action for
    SIGTERM (the kernel drops it), so `migrate`, `verify`, `produce` would otherwise run on until the SIGKILL at
    the end of the grace period. `run` replaces this handler with its graceful drain (service.serve)."""
    task = asyncio.current_task()
    assert task is not None  # noqa: S101 - always inside the runner's main task
    terminated = False

    def on_sigterm() -> None:
        nonlocal terminated
        terminated = True
        task.cancel()

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    try:
        return await command
    except asyncio.CancelledError:
        if terminated:
            raise _Terminated from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
# ---- warehouse signals (issue 16): `stock show`, `movements`; read-only, see stock.py ------------------------

def _add_signal_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from stock_ledger.stock import positive_int, rfc3339  # noqa: PLC0415 - the block stays self-contained

    time_help = "RFC 3339 with an offset, e.g. 2026-11-29T10:00:00+01:00"
    stock = sub.add_parser("stock", help="on-hand per (warehouse, sku): now, or as of a time (read-only)")
    show = stock.add_subparsers(dest="stock_command", required=True).add_parser(
        "show", help="on-hand of a warehouse's SKUs, now or as of --at",
        description="On-hand now (from stock_levels), or as of --at T: the sum of the movements whose occurred_at "
                    "is <= T. That is business time (when the movement happened, as the producer says), not the "
                    "order the ledger applied movements in: a late-arriving movement that occurred before T counts.")
    show.add_argument("--warehouse", required=True, help="warehouse_id (exact)")
    show.add_argument("--sku", help="one SKU only")
    show.add_argument("--negative", action="store_true",
                      help="only levels below zero; now: with when each went negative (when the ledger applied it)")
    show.add_argument("--at", type=rfc3339, metavar="T", help=f"as of business time T ({time_help})")
    show.add_argument("--json", action="store_true", help="one JSON document on stdout")
    moves = sub.add_parser(
        "movements", help="a SKU's movement history with running on-hand and Kafka coordinates (read-only)",
        description="A SKU's movements in application order: Kafka offset order within the SKU's partition (the "
                    "topic is keyed by SKU), i.e. the order the ledger applied them; on_hand is the warehouse's "
                    "running on-hand right after each row. Each row names its Kafka record (topic/partition/offset) "
                    "so it can be traced to the producer.")
    moves.add_argument("--sku", required=True, help="the SKU (exact)")
    moves.add_argument("--warehouse", help="one warehouse only (default: every warehouse, on_hand per warehouse)")
    moves.add_argument("--since", type=rfc3339, metavar="T",
                       help=f"only movements that occurred at or after T, business time ({time_help})")
    moves.add_argument("--limit", type=positive_int, default=100, metavar="N",
                       help="show the newest N of the selected rows (default 100)")
    moves.add_argument("--json", action="store_true", help="one JSON document on stdout")


# Read-only at the session too: with an owner's DATABASE_URL these commands still cannot write. No JIT: on a
# 20M-movement ledger it spent 1.5-2.4 s compiling each 4-9 s scan, and the scans took as long without it
# (scripts/bench.py signals explain, README "Warehouse signals"): CPU for nothing on a shared server.
# SET after connecting, not sent as startup parameters (PgBouncer refuses those: clients.connect_database).
CLI_SESSION: Final = {"default_transaction_read_only": "on", "jit": "off"}


async def _read_only(settings: Settings) -> asyncpg.Connection:
    from stock_ledger.clients import connect_database  # noqa: PLC0415

    # guard on: a read-only session of an operator is still one a planted object must not reach (schemaguard).
    return await connect_database(settings, application_name="stock-ledger-cli", session=CLI_SESSION)


async def _say_when_slow(after: float) -> None:
    # `--at` and `movements` scan stock_movements (no index on it for them: README, "Warehouse signals").
    await asyncio.sleep(after)
    print(f"stock-ledger: still reading stock_movements after {after:g}s (a full scan: 4-8 s per 20M movements "
          'measured; README, "Warehouse signals")', file=sys.stderr, flush=True)


async def _signal_command(settings: Settings, args: argparse.Namespace) -> int:
    import json  # noqa: PLC0415 - the block stays self-contained

    from stock_ledger import stock  # noqa: PLC0415

    conn = await _read_only(settings)
    notice = asyncio.create_task(_say_when_slow(3.0))
    try:
        if args.command == "stock":
            found = await stock.levels(conn, args.warehouse, sku=args.sku, negative=args.negative, at=args.at)
            options = {"at": args.at, "negative": args.negative}
            out = (json.dumps(stock.levels_json(found, args.warehouse, **options)) if args.json
                   else stock.render_levels(found, args.warehouse, **options))
        else:
            history = await stock.history(conn, args.sku, warehouse=args.warehouse, since=args.since,
                                          limit=args.limit)
            options = {"warehouse": args.warehouse, "since": args.since, "limit": args.limit}
            out = (json.dumps(stock.history_json(history, args.sku, **options)) if args.json
                   else stock.render_history(history, args.sku, **options))
    except stock.NotFoundError as exc:
        print(f"stock-ledger: {exc}", file=sys.stderr)
        return 1
    finally:
        notice.cancel()
        await conn.close()
    print(out)
    return 0

# ---- end of warehouse signals --------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Until the event loop runs (imports, settings), a SIGTERM unwinds from wherever Python is.
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return _main(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _command_name(args: argparse.Namespace) -> str:
    """`gaps list`, `offsets set`, `repair`...: what dberrors.explain bases its advice on."""
    sub = next((getattr(args, a) for a in ("gaps_command", "action", "stock_command") if getattr(args, a, None)), "")
    return f"{args.command} {sub}".strip()


def _main(args: argparse.Namespace) -> int:  # noqa: PLR0911 - one exit per outcome
    try:
        settings = load_settings(os.environ)
        logs.configure(settings.log_level, settings.log_format)
        from stock_ledger.operate import handler  # noqa: PLC0415 - operator commands (issue 13)

        handlers: dict[str, Callable[[], Coroutine[Any, Any, int]]] = {
            "run": lambda: _run(settings),
            "migrate": lambda: _migrate(settings),
            "create-topic": lambda: _create_topic(settings, args),
            "produce": lambda: _produce(settings, args),
            "verify": lambda: _verify(settings, args),
            "gaps": lambda: _gaps(settings, args),
            "stock": lambda: _signal_command(settings, args),
            "movements": lambda: _signal_command(settings, args),
        }
        command = handler(settings, args) or handlers[args.command]
        return _runner()(_until_sigterm(command()))
    except ConfigError as exc:
        print(f"stock-ledger: configuration error: {exc}", file=sys.stderr)
        return 2
    except StockLedgerError as exc:
        log.error("fatal", error=str(exc), error_type=type(exc).__name__)
        return 1
    except (asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        # After the connect (a missing privilege, no schema...): the cause and the fix, one line (dberrors.py).
        from stock_ledger.dberrors import explain  # noqa: PLC0415

        url = load_settings(os.environ).database_url  # loaded once already: cannot fail now
        log.error("fatal", error=explain(exc, url, _command_name(args)) or str(exc),
                  error_type=type(exc).__name__, sqlstate=getattr(exc, "sqlstate", None))
        return 1
    except (KafkaError, OSError) as exc:
        # Database sessions raise our own errors for these (clients.connect_database): this is Kafka, or the OS.
        log.error("fatal", error=str(exc) or repr(exc), error_type=type(exc).__name__,
                  hint="check KAFKA_BOOTSTRAP_SERVERS and that the broker is up")
        return 1
    except KeyboardInterrupt:
        return 130
    except _Terminated:
        print(f"stock-ledger {args.command}: stopped by SIGTERM", file=sys.stderr)
        return 143


if __name__ == "__main__":
    sys.exit(main())
