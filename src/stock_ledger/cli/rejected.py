"""`stock-ledger rejected list|show|replay`: the quarantine (`rejected_movements`), as the owner role.

`rejected replay` moves a record from `rejected_movements` to `stock_movements` (with its ORIGINAL Kafka
coordinates) and adds it to `stock_levels` in one transaction per batch, over rows locked FOR UPDATE SKIP LOCKED:
every record stays in exactly one table, and two replays at once never apply a record twice.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stock_ledger.cli.args import emit, past_time, table
from stock_ledger.clients.database import operator_session, transaction
from stock_ledger.domain import Movement, RejectCode, parse
from stock_ledger.errors import ConfigError, OperatorError
from stock_ledger.formats.resolver import Formats
from stock_ledger.ledger import closings, movements, pgtime
from stock_ledger.ledger.batch import M_ID, M_OFFSET, M_PARTITION, M_TOPIC, headers_of
from stock_ledger.progress import Progress

if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence

    import asyncpg

    from stock_ledger.config import Settings


def _text(raw: bytes | None) -> str | None:
    return None if raw is None else raw.decode("utf-8", errors="backslashreplace")


async def list_rejected(settings: Settings, args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise ConfigError("--limit must be >= 1")
    since = past_time(args.since, "--since") if args.since else None
    conn = await operator_session(settings)
    try:
        rows = await movements.list_rejected(conn, args.reason, since, args.limit)
    finally:
        await conn.close()
    text = table(["id", "topic", "partition", "offset", "reason_code", "rejected_at", "replays", "reason"],
                 [[r["id"], r["kafka_topic"], r["kafka_partition"], r["kafka_offset"], r["reason_code"],
                   r["rejected_at"].isoformat(timespec="seconds"), r["replay_attempts"], r["reason"][:80]]
                  for r in rows])
    emit({"rejected": rows}, text + f"\n({len(rows)} row(s))", as_json=args.json)
    return 0


async def show_rejected(settings: Settings, args: argparse.Namespace) -> int:
    conn = await operator_session(settings)
    try:
        row = await movements.one_rejected(conn, args.id)
    finally:
        await conn.close()
    if row is None:
        raise OperatorError(f"no rejected movement with id {args.id} (it may have been replayed); "
                            "see `stock-ledger rejected list`")
    document = dict(row)
    document["key"], document["value"] = _text(row["key"]), _text(row["value"])
    text = "\n".join(f"{name:>18}: {value}" for name, value in document.items())
    emit(document, text, as_json=args.json)
    return 0


@dataclass
class ReplayReport:
    examined: int = 0
    applied: int = 0
    still_rejected: Counter[str] | None = None
    dry_run: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"examined": self.examined, "applied": self.applied,
                "still_rejected": dict(self.still_rejected or {}), "dry_run": self.dry_run}


@dataclass(frozen=True, slots=True)
class _Quarantined:
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]


async def _replay_batch(conn: asyncpg.Connection, rows: Sequence[asyncpg.Record], report: ReplayReport,
                        formats: Formats) -> None:
    """One transaction's worth (the caller holds it): apply the now-valid rows, record an attempt on the rest.
    A declared format is decoded with the current mapping and schemas (the registry is asked for any id it did not
    know before), with the record's headers as quarantine kept them."""
    assert report.still_rejected is not None  # noqa: S101
    valid: list[tuple[Any, ...]] = []
    by_coordinates: dict[tuple[str, int, int], int] = {}
    stays: dict[int, tuple[str, str]] = {}
    records = [_Quarantined(r["key"], r["value"], headers_of(r["headers"])) for r in rows]
    decode = await formats.decoder_for(records)
    for r, record in zip(rows, records, strict=True):
        parsed = parse(r["key"], r["value"]) if decode is None else decode(r["key"], r["value"], record.headers)
        if isinstance(parsed, Movement):
            valid.append((parsed.movement_id, parsed.warehouse_id, parsed.sku, parsed.qty, parsed.kind,
                          parsed.occurred_at, r["kafka_topic"], r["kafka_partition"], r["kafka_offset"],
                          r["kafka_timestamp"]))
            by_coordinates[r["kafka_topic"], r["kafka_partition"], r["kafka_offset"]] = r["id"]
        else:
            stays[r["id"]] = (parsed.code.value, parsed.reason)
    inserted = await movements.insert_replayed(conn, valid)
    applied = [m for m in valid if (m[M_TOPIC], m[M_PARTITION], m[M_OFFSET]) in inserted]
    for m in valid:
        if (m[M_TOPIC], m[M_PARTITION], m[M_OFFSET]) not in inserted:
            stays[by_coordinates[m[M_TOPIC], m[M_PARTITION], m[M_OFFSET]]] = (
                RejectCode.DUPLICATE_MOVEMENT_ID.value,
                f"movement_id {m[M_ID]} is already in the ledger; not applied twice")
    if applied:
        await movements.delete_replayed(conn, [by_coordinates[m[M_TOPIC], m[M_PARTITION], m[M_OFFSET]]
                                               for m in applied])
        await movements.add_levels(conn, applied)
        await closings.include(conn, applied)  # at their own coordinates, below the cuts of recent closings
    if stays:
        await movements.record_attempts(conn, {i: f"{code}: {reason}" for i, (code, reason) in stays.items()})
    report.examined += len(rows)
    report.applied += len(applied)
    report.still_rejected.update(code for code, _ in stays.values())


async def replay(settings: Settings, args: argparse.Namespace) -> int:
    if args.batch_size < 1:
        raise ConfigError("--batch-size must be >= 1")
    report = ReplayReport(still_rejected=Counter(), dry_run=bool(args.dry_run))
    formats = Formats(settings)
    conn = await operator_session(settings)
    try:
        await pgtime.install(conn)  # a replayed movement keeps its exact time, as the worker writes it
        progress = Progress("rejected replay", await movements.count_rejected(conn, args.reason))
        cursor = 0
        while True:
            async with transaction(conn, commit=not args.dry_run):
                rows = await movements.lock_rejected(conn, cursor, args.reason, args.batch_size)
                if rows:
                    await _replay_batch(conn, rows, report, formats)
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
    emit(report.as_dict(), text, as_json=args.json)
    return 0
