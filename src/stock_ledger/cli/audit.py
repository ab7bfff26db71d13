"""`stock-ledger verify|repair|gaps`: the topic compared with the ledger, what an earlier version skipped put back,
and the holes the ledger moved past."""

from __future__ import annotations

import json
import logging
import sys
from typing import TYPE_CHECKING

from stock_ledger.audit import repair as fix
from stock_ledger.audit.verify import Scope, verify, wait_for_drain
from stock_ledger.cli.args import emit, parse_partitions, past_time
from stock_ledger.clients.database import connect_database, operator_session
from stock_ledger.clients.kafka import check_kafka
from stock_ledger.errors import ConfigError
from stock_ledger.ledger import offsets, pgtime

if TYPE_CHECKING:
    import argparse

    from stock_ledger.config import Settings


async def run_verify(settings: Settings, args: argparse.Namespace) -> int:
    settings.require_database_url()
    scope = Scope(parse_partitions(args.partition), past_time(args.since, "--since") if args.since else None)
    await check_kafka(settings)
    if args.wait > 0 and not await wait_for_drain(settings, args.wait):
        print(f"verify: the ledger did not catch up within {args.wait:g}s; checking anyway", file=sys.stderr)
    report = await verify(settings, args.expect, scope=scope)
    print(json.dumps(report.as_dict()) if args.json else report.render())
    return 0 if report.ok else 1


async def run_repair(settings: Settings, args: argparse.Namespace) -> int:
    if args.batch_size < 1:
        raise ConfigError("--batch-size must be >= 1")
    partitions = parse_partitions(args.partition)
    # stdout carries the report (perhaps JSON for a script); the per-partition log lines go to stderr with the
    # progress.
    for log_handler in logging.getLogger().handlers:
        if isinstance(log_handler, logging.StreamHandler):
            log_handler.setStream(sys.stderr)
    conn = await operator_session(settings)
    try:
        await pgtime.install(conn)  # rows carry timestamps in the wire form the worker writes
        report = await fix.repair(settings, conn, partitions=partitions, dry_run=bool(args.dry_run),
                                  batch_size=args.batch_size)
    finally:
        await conn.close()
    emit(report.as_dict(), fix.render(report), as_json=args.json)
    return report.exit_code


async def gaps_ack(settings: Settings, args: argparse.Namespace) -> int:
    if not args.note.strip():
        raise ConfigError("--note must say what was reconciled")
    conn = await connect_database(settings, application_name="stock-ledger-gaps")
    try:
        acknowledged = await offsets.acknowledge(conn, args.id, args.note)
    finally:
        await conn.close()
    if not acknowledged:
        print(f"gap {args.id}: no such gap awaiting acknowledgement (see `stock-ledger gaps list --all`)",
              file=sys.stderr)
        return 1
    print(f"gap {args.id}: acknowledged")
    return 0


async def gaps_list(settings: Settings, args: argparse.Namespace) -> int:
    conn = await connect_database(settings, application_name="stock-ledger-gaps")
    try:
        rows = await offsets.list_gaps(conn, include_acknowledged=args.all)
    finally:
        await conn.close()
    if args.json:
        for r in rows:
            print(json.dumps(r, default=str))
        return 0
    if not rows:
        print("no gaps" if args.all else "no unacknowledged gaps")
    for r in rows:
        state = "UNACKNOWLEDGED"
        if r["acknowledged_at"]:
            state = f"acknowledged {r['acknowledged_at']:%Y-%m-%d %H:%M} by {r['acknowledged_by']}: {r['note']}"
            if not r["acknowledgement_counts"]:
                state = (f"UNACKNOWLEDGED ({state}; does not count: {r['acknowledged_by']} may not acknowledge "
                         "gaps)")
        detected = f"{r['detected_at']:%Y-%m-%d %H:%M:%S}"
        print(f"#{r['id']} {r['group_id']} {r['topic']}/{r['partition']} offsets {r['first_offset']}-"
              f"{r['last_offset']} ({r['records']} records, {r['reason']}, detected {detected}) {state}")
    return 0
