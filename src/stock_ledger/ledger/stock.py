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

Cost on a large ledger (`python -m scripts.bench signals`, docs/performance.md): the now-queries read
`stock_levels` by its primary key or by the partial index on negative levels (milliseconds); `--at` and
`movements` read `stock_movements`, which has no index on (sku, warehouse): one cost the ingest path +29 % (the
budget is 10 %), so they scan the table, 4-8 s per 20M movements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from stock_ledger.errors import StockLedgerError

if TYPE_CHECKING:
    import uuid
    from datetime import datetime

    import asyncpg

# --------------------------------------------------------------------------------------------- the statements

# The metric (worker/monitor.py): a read of the partial index stock_levels_negative_idx and the negative rows only.
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
# As of business time T. "Since when" is not known at T without replaying the history: NULL. Archived segments
# count through archived_sums: whole where all their movements of the pair occurred at or before T; those with
# movements on both sides of T are `STRADDLING`, and the caller sums their archive files up to T.
LEVELS_AT: Final = """
SELECT warehouse_id, sku, sum(q)::bigint AS on_hand, NULL::timestamptz AS went_negative_at FROM (
    SELECT warehouse_id, sku, qty AS q FROM stock_movements WHERE warehouse_id = $1 AND occurred_at <= $2
    UNION ALL
    SELECT warehouse_id, sku, qty FROM archived_sums WHERE warehouse_id = $1 AND last_occurred_at <= $2
) AS m GROUP BY warehouse_id, sku ORDER BY sku
"""
LEVEL_AT: Final = """
SELECT $1::text AS warehouse_id, $2::text AS sku,
       (coalesce((SELECT sum(qty) FROM stock_movements WHERE warehouse_id = $1 AND sku = $2 AND occurred_at <= $3), 0)
        + coalesce((SELECT sum(qty) FROM archived_sums
                     WHERE warehouse_id = $1 AND sku = $2 AND last_occurred_at <= $3), 0))::bigint AS on_hand,
       NULL::timestamptz AS went_negative_at
"""
STRADDLING: Final = """
SELECT segment, sku FROM archived_sums
 WHERE warehouse_id = $1 AND ($2::text IS NULL OR sku = $2) AND first_occurred_at <= $3 AND last_occurred_at > $3
 ORDER BY 1, 2
"""
WAREHOUSE_KNOWN: Final = "SELECT EXISTS (SELECT FROM stock_levels WHERE warehouse_id = $1)"

# The running on-hand is computed over the whole history of each (warehouse, sku) before --since and --limit
# cut it, so every row shows what the level really was after it. The newest `limit` rows are kept; `matching`
# counts the rows --since selected.
# Archived movements precede every online one of the SKU in application order (segments are archived oldest first
# per Kafka partition): the running on-hand starts from their sum.
_HISTORY: Final = """
SELECT h.*, count(*) OVER () AS matching FROM (
    SELECT m.occurred_at, m.applied_at, m.warehouse_id, m.sku, m.kind, m.qty, m.movement_id,
           m.kafka_topic, m.kafka_partition, m.kafka_offset,
           (sum(m.qty) OVER (PARTITION BY m.warehouse_id ORDER BY m.kafka_topic, m.kafka_partition, m.kafka_offset)
            + coalesce(a.qty, 0))::bigint AS on_hand
      FROM stock_movements AS m
      LEFT JOIN (SELECT warehouse_id, sum(qty) AS qty FROM archived_sums WHERE sku = $1 GROUP BY 1) AS a
             ON a.warehouse_id = m.warehouse_id
     WHERE m.sku = $1 {warehouse}
) AS h
 WHERE {since} IS NULL OR h.occurred_at >= {since}
 ORDER BY kafka_topic DESC, kafka_partition DESC, kafka_offset DESC
 LIMIT {limit}
"""
HISTORY: Final = _HISTORY.format(warehouse="", since="$2::timestamptz", limit="$3")
HISTORY_IN_WAREHOUSE: Final = _HISTORY.format(warehouse="AND m.warehouse_id = $2", since="$3::timestamptz",
                                              limit="$4")
SKU_KNOWN: Final = "SELECT EXISTS (SELECT FROM stock_levels WHERE sku = $1)"
ARCHIVED_OF_SKU: Final = """
SELECT coalesce(sum(rows), 0)::bigint FROM archived_sums WHERE sku = $1 AND ($2::text IS NULL OR warehouse_id = $2)
"""
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
    archived: int = 0  # movements of the SKU (in the warehouse) in archived segments: counted in on_hand, not listed


@dataclass(frozen=True, slots=True)
class LevelsAt:
    levels: list[Level]
    # archived segment -> the SKUs (of the warehouse) it holds movements of on both sides of `at`: not counted in
    # `levels`, the caller sums them from the segment's file
    straddling: dict[str, list[str]]


# --------------------------------------------------------------------------------------------- the reads


async def levels(
    conn: asyncpg.Connection, warehouse: str, *, sku: str | None = None, negative: bool = False,
    at: datetime | None = None,
) -> LevelsAt:
    """On-hand now (stock_levels) or as of business time `at` (Σ qty of movements with occurred_at <= at: online
    rows, archived sums, and the archived segments `straddling` at, which the caller must add)."""
    straddling: dict[str, list[str]] = {}
    async with conn.transaction(readonly=True, isolation="repeatable_read"):
        if at is not None:
            for segment, pair_sku in await conn.fetch(STRADDLING, warehouse, sku, at):
                straddling.setdefault(segment, []).append(pair_sku)
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
        if (all(x.on_hand == 0 for x in found) and not straddling
                and not await conn.fetchval(WAREHOUSE_KNOWN, warehouse)):
            raise NotFoundError(f"the ledger has no stock for warehouse {warehouse!r}: check the id (exact match, "
                                "case-sensitive) and DATABASE_URL")
    if sku is not None and at is None and not found:
        raise NotFoundError(f"the ledger has no stock level for SKU {sku!r} in warehouse {warehouse!r}: check the "
                            "SKU (exact match, case-sensitive), or try `stock-ledger movements --sku`")
    return LevelsAt([x for x in found if x.on_hand < 0] if negative and at is None else found, straddling)


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
        archived = int(await conn.fetchval(ARCHIVED_OF_SKU, sku, warehouse))
    movements = [Movement(r["occurred_at"], r["applied_at"], r["warehouse_id"], r["sku"], r["kind"], r["qty"],
                          r["on_hand"], r["movement_id"], r["kafka_topic"], r["kafka_partition"], r["kafka_offset"])
                 for r in reversed(rows)]
    return History(movements, rows[0]["matching"] if rows else 0, archived)
