"""`stock-ledger stock show` and `stock-ledger movements`: the ledger in the warehouse's language, read-only
(ledger/stock.py holds the statements and says what each clock means)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stock_ledger.cli.archive import require_pyarrow
from stock_ledger.cli.args import table
from stock_ledger.clients.database import reader_session
from stock_ledger.errors import ConfigError
from stock_ledger.ledger import stock
from stock_ledger.ledger.stock import ORDER, History, Level, LevelsAt

if TYPE_CHECKING:
    import argparse
    from collections.abc import Awaitable, Callable, Sequence
    from datetime import datetime

    import asyncpg

    from stock_ledger.config import Settings


async def say_when_slow(after: float) -> None:
    # `movements` scans stock_movements (no index on it for a SKU: docs/performance.md, "Warehouse signals"); `--at`
    # sums the movements between T and the nearest closing, or the whole history before the first one.
    await asyncio.sleep(after)
    print(f"stock-ledger: still reading stock_movements after {after:g}s (`movements` and `--at` before the first "
          "closing balance read the whole history: 4-8 s per 20M movements; docs/performance.md)",
          file=sys.stderr, flush=True)


async def show(settings: Settings, args: argparse.Namespace) -> int:
    """`stock show`: on-hand now, or as of --at."""
    async def read(conn: asyncpg.Connection) -> str:
        levels = await stock.levels(conn, args.warehouse, sku=args.sku, negative=args.negative, at=args.at)
        found = with_archived(settings, levels, args.warehouse, args.at)
        if args.negative:
            found = [x for x in found if x.on_hand < 0]
        options = {"at": args.at, "negative": args.negative}
        return (json.dumps(levels_json(found, args.warehouse, **options)) if args.json
                else render_levels(found, args.warehouse, **options))
    return await _read(settings, read)


def with_archived(settings: Settings, found: LevelsAt, warehouse: str, at: datetime | None) -> list[Level]:
    """The levels with the movements up to `at` of each (warehouse, sku) whose archived movements in a segment lie on
    both sides of it, read from the segment's file (archived_sums count a pair's movements of a segment whole)."""
    if at is None or not found.straddling:
        return found.levels
    if not settings.archive_dir:
        raise ConfigError(f"the stock as of {at.isoformat()} needs movements archived in "
                          f"{', '.join(found.straddling)} (they occurred on both sides of it): set "
                          "STOCK_LEDGER_ARCHIVE_DIR to the archive directory (`stock-ledger archive list`)")
    require_pyarrow()
    from stock_ledger.archive import parquet  # noqa: PLC0415 - pyarrow: the archive extra only

    directory = Path(settings.archive_dir)
    on_hand = {x.sku: x.on_hand for x in found.levels}
    for segment, skus in found.straddling.items():
        for s, qty in parquet.sums_until(parquet.paths(directory, segment)[0], warehouse, skus, at).items():
            on_hand[s] = on_hand.get(s, 0) + qty
    return [Level(warehouse, s, q, None) for s, q in sorted(on_hand.items())]


async def history(settings: Settings, args: argparse.Namespace) -> int:
    """`movements`: a SKU's history with the running on-hand."""
    async def read(conn: asyncpg.Connection) -> str:
        found = await stock.history(conn, args.sku, warehouse=args.warehouse, since=args.since, limit=args.limit)
        options = {"warehouse": args.warehouse, "since": args.since, "limit": args.limit}
        return (json.dumps(history_json(found, args.sku, **options)) if args.json
                else render_history(found, args.sku, **options))
    return await _read(settings, read)


async def _read(settings: Settings, read: Callable[[asyncpg.Connection], Awaitable[str]]) -> int:
    conn = await reader_session(settings)
    notice = asyncio.create_task(say_when_slow(3.0))
    try:
        out = await read(conn)
    except stock.NotFoundError as exc:
        print(f"stock-ledger: {exc}", file=sys.stderr)
        return 1
    finally:
        notice.cancel()
        await conn.close()
    print(out)
    return 0


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def render_levels(found: Sequence[Level], warehouse: str, *, at: datetime | None, negative: bool) -> str:
    basis = (f"as of {at.isoformat()} (business time: Σ of movements with occurred_at <= it)" if at is not None
             else "now (stock_levels)")
    title = f"{'negative stock' if negative else 'stock'} in warehouse {warehouse}, {basis}"
    if not found:
        return f"{title}: none"
    header = ["sku", "on_hand"] if at is not None else ["sku", "on_hand", "went_negative_at"]
    rows = [[x.sku, x.on_hand] + ([] if at is not None else [_iso(x.went_negative_at)]) for x in found]
    lines = [title, table(header, rows, frozenset({1}), rule=True)]
    if at is None and any(x.went_negative_at for x in found):
        lines.append("went_negative_at: when the ledger applied the batch that took the level below zero")
    return "\n".join(lines)


def levels_json(found: Sequence[Level], warehouse: str, *, at: datetime | None, negative: bool) -> dict[str, Any]:
    return {
        "warehouse_id": warehouse,
        "as_of": _iso(at),
        "basis": "movements with occurred_at <= as_of" if at is not None else "stock_levels",
        "negative_only": negative,
        "levels": [{"warehouse_id": x.warehouse_id, "sku": x.sku, "on_hand": x.on_hand,
                    "went_negative_at": _iso(x.went_negative_at)} for x in found],
    }


def render_history(found: History, sku: str, *, warehouse: str | None, since: datetime | None, limit: int) -> str:
    where = f" in warehouse {warehouse}" if warehouse else ""
    since_text = f" that occurred at or after {since.isoformat()}" if since is not None else ""
    title = f"movements of {sku}{where}{since_text}, in application order ({ORDER})"
    if not found.movements:
        return f"{title}: none"
    header = ["applied_at", "occurred_at", "warehouse", "kind", "qty", "on_hand", "movement_id", "kafka"]
    rows = [[m.applied_at.isoformat(), m.occurred_at.isoformat(), m.warehouse_id, m.kind, m.qty, m.on_hand,
             m.movement_id, m.source] for m in found.movements]
    lines = [title, table(header, rows, frozenset({4, 5}), rule=True)]
    if found.matching > len(found.movements):
        lines.append(f"showing the newest {len(found.movements)} of {found.matching}: raise --limit (now {limit}) "
                     "or narrow with --since")
    lines.append("on_hand: the warehouse's on-hand of this SKU right after the row was applied")
    if found.archived:
        lines.append(f"{found.archived} older movements of this SKU are archived (`stock-ledger archive list`): "
                     "on_hand counts them, this list does not")
    return "\n".join(lines)


def history_json(found: History, sku: str, *, warehouse: str | None, since: datetime | None,
                 limit: int) -> dict[str, Any]:
    return {
        "sku": sku,
        "warehouse_id": warehouse,
        "since": _iso(since),
        "limit": limit,
        "matching": found.matching,
        "archived": found.archived,
        "order": ORDER,
        "movements": [
            {"applied_at": m.applied_at.isoformat(), "occurred_at": m.occurred_at.isoformat(),
             "warehouse_id": m.warehouse_id, "sku": m.sku, "kind": m.kind, "qty": m.qty, "on_hand": m.on_hand,
             "movement_id": str(m.movement_id),
             "kafka": {"topic": m.kafka_topic, "partition": m.kafka_partition, "offset": m.kafka_offset}}
            for m in found.movements
        ],
    }
