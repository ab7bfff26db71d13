"""`stock-ledger archive run|list|verify|restore` (archive/ does the work; docs/operations.md, "Retention and
archival")."""

from __future__ import annotations

import importlib.util
import logging
import sys
from typing import TYPE_CHECKING, Any

from stock_ledger.cli.args import emit, table
from stock_ledger.clients.database import operator_session, reader_session
from stock_ledger.clients.kafka import check_kafka
from stock_ledger.errors import ConfigError
from stock_ledger.ledger import archives, pgtime

if TYPE_CHECKING:
    import argparse

    from stock_ledger.config import Settings


def require_pyarrow() -> None:
    """pyarrow (Parquet) comes with the `archive` extra only: the worker never loads it, and the image leaves it out."""
    if importlib.util.find_spec("pyarrow") is None:
        raise ConfigError("the archive needs pyarrow, which this installation lacks: run the archive image "
                          "(stock-ledger:<version>-archive, the chart's archive.image) or pip install "
                          "'stock-ledger[archive]'; the worker's image ships without it (docs/operations.md, "
                          '"Retention and archival")')


def _logs_to_stderr() -> None:
    # stdout carries the report (perhaps JSON); log lines and progress go to stderr.
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(sys.stderr)


async def run(settings: Settings, args: argparse.Namespace) -> int:
    require_pyarrow()
    from stock_ledger.archive import run as archival  # noqa: PLC0415 - pyarrow: the archive extra only

    _logs_to_stderr()
    await check_kafka(settings)
    conn = await operator_session(settings)
    try:
        await pgtime.install(conn)
        report = await archival.run(settings, conn, dry_run=bool(args.dry_run), limit=args.limit)
    finally:
        await conn.close()
    emit({"dry_run": bool(args.dry_run), "finished": report.finished,
          "archived": [m.as_dict() | {"sums": len(m.summary.keys)} for m in report.archived],
          "decisions": [{"segment": d.segment.table, "partition": d.segment.partition,
                         "first_offset": d.segment.first_offset, "end_offset": d.segment.end_offset,
                         "archive": d.archive, "why": d.why} for d in report.decisions]},
         report.render(dry_run=bool(args.dry_run)), as_json=args.json)
    return 0


async def list_archives(settings: Settings, args: argparse.Namespace) -> int:
    # Read-only: a member of stock_ledger_reader (an auditor) may list and verify; run and restore need the owner.
    conn = await reader_session(settings)
    try:
        rows = await archives.archives(conn)
    finally:
        await conn.close()
    found: list[dict[str, Any]] = [dict(r) for r in rows]
    text = "no archives" if not found else table(
        ["segment", "partition", "offsets", "rows", "occurred_at", "archived_at", "state", "file"],
        [[r["segment"], r["kafka_partition"], f"[{r['first_offset']}, {r['end_offset']})", r["rows"],
          f"{_day(r['first_occurred_at'])} .. {_day(r['last_occurred_at'])}", _day(r["archived_at"]),
          "dropped" if r["dropped_at"] else "recorded, not yet dropped", r["file"]] for r in found],
        frozenset({1, 3}), rule=True)
    emit({"archives": found}, text, as_json=args.json)
    return 0


async def verify(settings: Settings, args: argparse.Namespace) -> int:
    require_pyarrow()
    from stock_ledger.archive import check  # noqa: PLC0415 - pyarrow: the archive extra only

    conn = await reader_session(settings)
    try:
        segments = args.segment or [r["segment"] for r in await archives.archives(conn)]
        verdicts = [await check.verify(settings, conn, s) for s in segments]
    finally:
        await conn.close()
    text = "\n".join(f"{v.segment}: {'ok' if v.ok else 'FAIL'} ({v.rows} movements)"
                     + "".join(f"\n  {p}" for p in v.problems) for v in verdicts) or "no archives"
    emit({"ok": all(v.ok for v in verdicts),
          "archives": [{"segment": v.segment, "ok": v.ok, "rows": v.rows, "problems": v.problems} for v in verdicts]},
         text, as_json=args.json)
    return 0 if all(v.ok for v in verdicts) else 1


async def restore(settings: Settings, args: argparse.Namespace) -> int:
    require_pyarrow()
    from stock_ledger.archive import check  # noqa: PLC0415 - pyarrow: the archive extra only

    conn = await operator_session(settings)
    try:
        await pgtime.install(conn)
        name, rows = await check.restore(settings, conn, args.segment)
    finally:
        await conn.close()
    emit({"segment": args.segment, "table": name, "rows": rows},
         f"restored {rows} movements of {args.segment} into {name} (readable by the readers' role; not part of the "
         "ledger: drop it when the audit is done)", as_json=args.json)
    return 0


def _day(value: Any) -> str:  # noqa: ANN401 - a datetime or None from a record
    return "-" if value is None else value.strftime("%Y-%m-%d")
