"""`stock-ledger run | migrate | create-topic | produce | verify`.

Exit codes: 0 success; 1 failure (the message says what went wrong and what to do); 2 bad configuration or usage.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
from typing import TYPE_CHECKING, Any

import asyncpg
import structlog
from aiokafka.errors import KafkaError

from stock_ledger import logs
from stock_ledger.config import Settings, load_settings
from stock_ledger.errors import ConfigError, StockLedgerError

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine, Sequence

log = structlog.get_logger("stock_ledger.cli")


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
    verify.add_argument("--partition", action="append", default=[], metavar="P[,P...]",
                        help="check only these partitions (repeatable, or a comma-separated list)")
    verify.add_argument("--since", default=None, metavar="TIME",
                        help="check only records from the first one applied since TIME (ISO 8601, or a duration "
                             "back from now: 15m, 6h, 2d) to the log end: gaps, overlaps, rows not in the topic, "
                             "the unique constraint, open ledger_gaps, stored offsets vs log start and drift. Not "
                             "covered: older offsets, stock_levels = sum(movements) (needs the whole ledger) and "
                             "lag (left to the lag alert); the last line counts only the rows checked")
    return parser


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
    from stock_ledger.migrate import find_migrations_dir, migrate  # noqa: PLC0415

    applied = await migrate(settings.require_database_url(), find_migrations_dir(settings.migrations_dir))
    print(f"migrations applied: {', '.join(applied) or 'none (already up to date)'}")
    return 0


async def _create_topic(settings: Settings, args: argparse.Namespace) -> int:
    from stock_ledger.topics import ensure_topic  # noqa: PLC0415

    created = await ensure_topic(settings.kafka_bootstrap_servers, settings.topic, args.partitions,
                                 args.replication_factor)
    print(f"topic {settings.topic}: {'created' if created else 'already exists'}")
    return 0


async def _produce(settings: Settings, args: argparse.Namespace) -> int:
    from stock_ledger.produce import produce  # noqa: PLC0415
    from stock_ledger.topics import ensure_topic  # noqa: PLC0415

    if args.count < 0 or (args.rate is not None and args.rate <= 0) or args.skus < 1 or args.warehouses < 1:
        raise ConfigError("--count must be >= 0, --rate > 0, --skus and --warehouses >= 1")
    await ensure_topic(settings.kafka_bootstrap_servers, settings.topic)
    await produce(settings.kafka_bootstrap_servers, settings.topic, args.count, rate=args.rate, skus=args.skus,
                  warehouses=args.warehouses, seed=args.seed)
    return 0


async def _verify(settings: Settings, args: argparse.Namespace) -> int:
    from stock_ledger.verify import Scope, parse_partitions, parse_since, verify, wait_for_drain  # noqa: PLC0415

    settings.require_database_url()
    scope = Scope(parse_partitions(args.partition), parse_since(args.since) if args.since else None)
    if args.wait > 0 and not await wait_for_drain(settings, args.wait):
        print(f"verify: the ledger did not catch up within {args.wait:g}s; checking anyway", file=sys.stderr)
    report = await verify(settings, args.expect, scope=scope)
    print(report.render())
    return 0 if report.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        settings = load_settings(os.environ)
        logs.configure(settings.log_level, settings.log_format)
        handlers: dict[str, Callable[[], Coroutine[Any, Any, int]]] = {
            "run": lambda: _run(settings),
            "migrate": lambda: _migrate(settings),
            "create-topic": lambda: _create_topic(settings, args),
            "produce": lambda: _produce(settings, args),
            "verify": lambda: _verify(settings, args),
        }
        return _runner()(handlers[args.command]())
    except ConfigError as exc:
        print(f"stock-ledger: configuration error: {exc}", file=sys.stderr)
        return 2
    except StockLedgerError as exc:
        log.error("fatal", error=str(exc), error_type=type(exc).__name__)
        return 1
    except (asyncpg.PostgresError, asyncpg.InterfaceError, KafkaError, OSError) as exc:
        # Not retriable (bad password, unknown database, unreachable for too long...): say what, not where.
        log.error("fatal", error=str(exc) or repr(exc), error_type=type(exc).__name__,
                  hint="check DATABASE_URL / KAFKA_BOOTSTRAP_SERVERS and that the services are up")
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
