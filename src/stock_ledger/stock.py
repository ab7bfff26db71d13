"""The ledger in the warehouse's language: on-hand now or as of a time, negative stock, movement history.

Read-only: every statement runs in a READ ONLY transaction, so `stock_ledger_reader` (SELECT only) is enough.

Two clocks, never mixed:
- business time: `occurred_at`, when the movement happened on the floor (what the producer says). `--at T` sums
  the movements that occurred at or before T, whatever order they reached the ledger in.
- application order: the order the ledger applied movements, which is Kafka's offset order within a partition.
  The topic is keyed by SKU, so all movements of a SKU sit in one partition and (kafka_topic, kafka_partition,
  kafka_offset) is that SKU's application order. `movements` lists rows in this order, and its running on-hand
  (per warehouse) is what `stock_levels` held after each row. `went_negative_at` is application time too: the
  commit of the batch that took the level below zero.

Cost on a large ledger (scripts/bench.py signals, README "Warehouse signals"): the now-queries read
`stock_levels` by its primary key or by the partial index on negative levels (milliseconds); `--at` and
`movements` read `stock_movements`, which has no index on (sku, warehouse): one cost the ingest path +29 % (the
budget is 10 %), so they scan the table, 4-8 s per 20M movements.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final

from stock_ledger.errors import StockLedgerError

if TYPE_CHECKING:
    import uuid
    from collections.abc import Sequence

    import asyncpg

# --------------------------------------------------------------------------------------------- the statements

# The metric (positions.py): a read of the partial index stock_levels_negative_idx and the negative rows only.
NEGATIVE_TOTALS: Final = """
SELECT count(*) AS levels, coalesce(-sum(on_hand), 0)::bigint AS units
  FROM stock_levels WHERE went_negative_at IS NOT NULL
"""
LEVELS: Final = """
SELECT warehouse_id, sku, on_hand, went_negative_at FROM stock_levels WHERE warehouse_id = $1 ORDER BY sku
"""
LEVEL: Final = """
SELECT warehouse_id, sku, on_hand, went_negative_at FROM stock_levels WHERE warehouse_id = $1 AND sku = $2
"""
NEGATIVE_LEVELS: Final = """
SELECT warehouse_id, sku, on_hand, went_negative_at FROM stock_levels
 WHERE warehouse_id = $1 AND went_negative_at IS NOT NULL ORDER BY sku
"""
# As of business time T. "Since when" is not known at T without replaying the history: NULL.
LEVELS_AT: Final = """
SELECT warehouse_id, sku, sum(qty)::bigint AS on_hand, NULL::timestamptz AS went_negative_at
  FROM stock_movements WHERE warehouse_id = $1 AND occurred_at <= $2
 GROUP BY warehouse_id, sku ORDER BY sku
"""
LEVEL_AT: Final = """
SELECT $1::text AS warehouse_id, $2::text AS sku, coalesce(sum(qty), 0)::bigint AS on_hand,
       NULL::timestamptz AS went_negative_at
  FROM stock_movements WHERE warehouse_id = $1 AND sku = $2 AND occurred_at <= $3
"""
WAREHOUSE_KNOWN: Final = "SELECT EXISTS (SELECT FROM stock_levels WHERE warehouse_id = $1)"

# The running on-hand is computed over the whole history of each (warehouse, sku) before --since and --limit
# cut it, so every row shows what the level really was after it. The newest `limit` rows are kept; `matching`
# counts the rows --since selected.
_HISTORY: Final = """
SELECT h.*, count(*) OVER () AS matching FROM (
    SELECT occurred_at, applied_at, warehouse_id, sku, kind, qty, movement_id,
           kafka_topic, kafka_partition, kafka_offset,
           sum(qty) OVER (PARTITION BY warehouse_id ORDER BY kafka_topic, kafka_partition, kafka_offset)::bigint
               AS on_hand
      FROM stock_movements WHERE sku = $1 {warehouse}
) AS h
 WHERE {since} IS NULL OR h.occurred_at >= {since}
 ORDER BY kafka_topic DESC, kafka_partition DESC, kafka_offset DESC
 LIMIT {limit}
"""
HISTORY: Final = _HISTORY.format(warehouse="", since="$2::timestamptz", limit="$3")
HISTORY_IN_WAREHOUSE: Final = _HISTORY.format(warehouse="AND warehouse_id = $2", since="$3::timestamptz",
                                              limit="$4")
SKU_KNOWN: Final = "SELECT EXISTS (SELECT FROM stock_levels WHERE sku = $1)"
ORDER: Final = "kafka_topic, kafka_partition, kafka_offset"


class NotFoundError(StockLedgerError):
    """The warehouse or SKU asked for has never been seen by the ledger (likely a typo)."""


@dataclass(frozen=True, slots=True)
class Level:
    warehouse_id: str
    sku: str
    on_hand: int
    went_negative_at: datetime | None  # application time; None when not negative, or with --at


@dataclass(frozen=True, slots=True)
class Movement:
    occurred_at: datetime
    applied_at: datetime
    warehouse_id: str
    sku: str
    kind: str
    qty: int
    on_hand: int  # the warehouse's on-hand of this SKU right after this movement was applied
    movement_id: uuid.UUID
    kafka_topic: str
    kafka_partition: int
    kafka_offset: int

    @property
    def source(self) -> str:
        """Where to find the record in Kafka (the same text as stock_movements.source)."""
        return f"{self.kafka_topic}/{self.kafka_partition}/{self.kafka_offset}"


@dataclass(frozen=True, slots=True)
class History:
    movements: list[Movement]  # oldest first, in application order
    matching: int  # rows that --since selected, before --limit


# --------------------------------------------------------------------------------------------- the reads


async def levels(
    conn: asyncpg.Connection, warehouse: str, *, sku: str | None = None, negative: bool = False,
    at: datetime | None = None,
) -> list[Level]:
    """On-hand now (stock_levels) or as of business time `at` (Σ qty of movements with occurred_at <= at)."""
    async with conn.transaction(readonly=True, isolation="repeatable_read"):
        if at is None and sku is None:
            rows = await conn.fetch(NEGATIVE_LEVELS if negative else LEVELS, warehouse)
        elif at is None:
            rows = await conn.fetch(LEVEL, warehouse, sku)
        elif sku is None:
            rows = await conn.fetch(LEVELS_AT, warehouse, at)
        else:
            rows = await conn.fetch(LEVEL_AT, warehouse, sku, at)
        found = [Level(r["warehouse_id"], r["sku"], r["on_hand"], r["went_negative_at"]) for r in rows]
        # LEVEL_AT always answers (0 before the first movement): an unknown warehouse must still be said.
        if all(x.on_hand == 0 for x in found) and not await conn.fetchval(WAREHOUSE_KNOWN, warehouse):
            raise NotFoundError(f"the ledger has no stock for warehouse {warehouse!r}: check the id (exact match, "
                                "case-sensitive) and DATABASE_URL")
    if sku is not None and at is None and not found:
        raise NotFoundError(f"the ledger has no stock level for SKU {sku!r} in warehouse {warehouse!r}: check the "
                            "SKU (exact match, case-sensitive), or try `stock-ledger movements --sku`")
    return [x for x in found if x.on_hand < 0] if negative else found


async def history(
    conn: asyncpg.Connection, sku: str, *, warehouse: str | None = None, since: datetime | None = None,
    limit: int = 100,
) -> History:
    """The SKU's movements in application order with the running on-hand; the newest `limit` that occurred at or
    after `since`."""
    async with conn.transaction(readonly=True, isolation="repeatable_read"):
        if warehouse is None:
            rows = await conn.fetch(HISTORY, sku, since, limit)
        else:
            rows = await conn.fetch(HISTORY_IN_WAREHOUSE, sku, warehouse, since, limit)
        if not rows and not await conn.fetchval(SKU_KNOWN, sku):
            raise NotFoundError(f"the ledger has no movement of SKU {sku!r}: check the SKU (exact match, "
                                "case-sensitive) and DATABASE_URL")
    movements = [Movement(r["occurred_at"], r["applied_at"], r["warehouse_id"], r["sku"], r["kind"], r["qty"],
                          r["on_hand"], r["movement_id"], r["kafka_topic"], r["kafka_partition"], r["kafka_offset"])
                 for r in reversed(rows)]
    return History(movements, rows[0]["matching"] if rows else 0)


# --------------------------------------------------------------------------------------------- pure parts

_RFC3339: Final = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d{1,9})?([Zz]|[+-]\d{2}:\d{2})$")


def rfc3339(text: str) -> datetime:
    """An argparse type: an RFC 3339 time with an offset (`2026-11-29T10:00:00+01:00`, `...Z`); else exit 2."""
    if _RFC3339.match(text):
        # Python keeps microseconds: nanoseconds are cut, which only widens `<= T` by under a microsecond.
        normalized = re.sub(r"(\.\d{6})\d+", r"\1", text).replace("z", "Z").replace("t", "T")
        try:
            return datetime.fromisoformat(normalized)
        except ValueError:
            pass
    raise argparse.ArgumentTypeError(
        f"{text!r} is not an RFC 3339 time with an offset: write it like 2026-11-29T10:00:00+01:00 or "
        "2026-11-29T09:00:00Z"
    )


def positive_int(text: str) -> int:
    """An argparse type for --limit."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _table(header: Sequence[str], rows: Sequence[Sequence[object]], numeric: set[int]) -> list[str]:
    cells = [[("" if v is None else str(v)) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(header)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if i in numeric else v.ljust(w)
                         for i, (v, w) in enumerate(zip(values, widths, strict=True))).rstrip()

    return [line(header), line(["-" * w for w in widths]), *(line(r) for r in cells)]


def render_levels(found: Sequence[Level], warehouse: str, *, at: datetime | None, negative: bool) -> str:
    basis = (f"as of {at.isoformat()} (business time: Σ of movements with occurred_at <= it)" if at is not None
             else "now (stock_levels)")
    title = f"{'negative stock' if negative else 'stock'} in warehouse {warehouse}, {basis}"
    if not found:
        return f"{title}: none"
    header = ["sku", "on_hand"] if at is not None else ["sku", "on_hand", "went_negative_at"]
    rows = [[x.sku, x.on_hand] + ([] if at is not None else [_iso(x.went_negative_at)]) for x in found]
    lines = [title, *_table(header, rows, {1})]
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
    lines = [title, *_table(header, rows, {4, 5})]
    if found.matching > len(found.movements):
        lines.append(f"showing the newest {len(found.movements)} of {found.matching}: raise --limit (now {limit}) "
                     "or narrow with --since")
    lines.append("on_hand: the warehouse's on-hand of this SKU right after the row was applied")
    return "\n".join(lines)


def history_json(found: History, sku: str, *, warehouse: str | None, since: datetime | None,
                 limit: int) -> dict[str, Any]:
    return {
        "sku": sku,
        "warehouse_id": warehouse,
        "since": _iso(since),
        "limit": limit,
        "matching": found.matching,
        "order": ORDER,
        "movements": [
            {"applied_at": m.applied_at.isoformat(), "occurred_at": m.occurred_at.isoformat(),
             "warehouse_id": m.warehouse_id, "sku": m.sku, "kind": m.kind, "qty": m.qty, "on_hand": m.on_hand,
             "movement_id": str(m.movement_id),
             "kafka": {"topic": m.kafka_topic, "partition": m.kafka_partition, "offset": m.kafka_offset}}
            for m in found.movements
        ],
    }
