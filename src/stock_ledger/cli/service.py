"""`stock-ledger run|migrate|create-topic|produce`: the worker, and what it needs in place before it runs."""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

from stock_ledger.clients.database import check_sslmode
from stock_ledger.clients.kafka import check_kafka
from stock_ledger.errors import ConfigError
from stock_ledger.migrate import MigrateOptions, Roles, find_migrations_dir, migrate
from stock_ledger.produce import produce
from stock_ledger.topics import ensure_topic
from stock_ledger.worker import serve

if TYPE_CHECKING:
    import argparse

    from stock_ledger.config import Settings


async def run(settings: Settings, _args: argparse.Namespace) -> int:
    settings.require_database_url()
    # What is imported now lives as long as the process: keep it out of every full collection, and collect the
    # young generation less often (a batch allocates a few tracked objects per record): docs/performance.md.
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)
    return await serve(settings)


async def run_migrate(settings: Settings, _args: argparse.Namespace) -> int:
    options = MigrateOptions(settings.migrate_deadline_seconds, settings.migrate_lock_timeout_ms,
                             settings.migrate_statement_timeout_ms)
    applied = await migrate(check_sslmode(settings), find_migrations_dir(settings.migrations_dir), options,
                            Roles(settings.app_role, settings.reader_role))
    print(f"migrations applied: {', '.join(applied) or 'none (already up to date)'}")
    return 0


async def create_topic(settings: Settings, args: argparse.Namespace) -> int:
    await check_kafka(settings)
    created = await ensure_topic(settings, args.partitions, args.replication_factor)
    print(f"topic {settings.topic}: {'created' if created else 'already exists'}")
    return 0


async def run_produce(settings: Settings, args: argparse.Namespace) -> int:
    if args.count < 0 or (args.rate is not None and args.rate <= 0) or args.skus < 1 or args.warehouses < 1:
        raise ConfigError("--count must be >= 0, --rate > 0, --skus and --warehouses >= 1")
    await check_kafka(settings)
    await ensure_topic(settings)
    await produce(settings, args.count, rate=args.rate, skus=args.skus, warehouses=args.warehouses, seed=args.seed)
    return 0
