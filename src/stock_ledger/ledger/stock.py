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

Cost on a large ledger (docs/performance.md): the now-queries read `stock_levels` by its primary key or by the
partial index on negative levels (milliseconds). `--at` starts from a closing balance (ledger/closings.py) and
reads only the movements on the wrong side of its cut: those in step with their Kafka timestamp through a BRIN on
(occurred_at, kafka_offset), the others through a B-tree on kafka_offset (`python -m scripts.bench reads`).
`movements` scans a SKU's rows: `stock_movements` has no index on (sku, warehouse), which would cost the ingest
path +29-86 % (the budget is 10 %): 4-8 s per 20M movements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from stock_ledger.errors import StockLedgerError

if TYPE_CHECKING:
    import uuid
    from collections.abc import Sequence
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
# As of business time T: Σ qty of the movements with occurred_at <= T, read one of three ways (`levels_at`), all
# exact and in one snapshot, the cheapest the closings allow. "Since when" is not known at T without replaying the
# history: NULL. Archived segments count through archived_sums: whole where all their movements of the pair
# occurred at or before T; those with movements on both sides of T are `STRADDLING`, and the caller sums their
# archive files up to T. SKUs whose on-hand at T is zero are left out. {sku} narrows to one SKU ($3, or $5 from a
# closing).
#
# In step: occurred_at within 15 minutes before to 5 minutes after the record's Kafka timestamp (or the time the
# ledger applied it), as migration 0016 defines it. Those are found by the BRIN on (occurred_at, kafka_offset), which
# holds only them; the rest ("out of step": back-dated by more, future-dated, written late by repair) by a B-tree
# that holds only them. Every read of a time window is the two, each with the same condition as its index.
IN_STEP: Final = ("(occurred_at - coalesce(kafka_timestamp, applied_at)) "
                  "BETWEEN interval '-15 minutes' AND interval '5 minutes'")


def _both(select: str) -> str:
    """`select` (with `{step}` where the condition goes) for the in-step movements and for the others."""
    return f"{select.replace('{step}', IN_STEP)}\n    UNION ALL\n{select.replace('{step}', f'NOT ({IN_STEP})')}"


# The archived movements of the warehouse that occurred at or before T: the segments' sums whose movements all did.
_ARCHIVED_UP_TO: Final = "SELECT sku, qty FROM archived_sums WHERE warehouse_id = $1 AND last_occurred_at <= $2 {sku}"

# forward: the online movements up to T. Used when no closing was taken before T: T lies before the closings began.
_FORWARD_AT: Final = """
SELECT warehouse_id, sku, sum(q)::bigint AS on_hand, NULL::timestamptz AS went_negative_at FROM (
""" + _both("    SELECT warehouse_id, sku, qty AS q FROM stock_movements\n"
            "     WHERE warehouse_id = $1 AND occurred_at <= $2 {sku} AND {step}") + """
    UNION ALL
    SELECT warehouse_id, sku, qty FROM archived_sums WHERE warehouse_id = $1 AND last_occurred_at <= $2 {sku}
) AS m GROUP BY warehouse_id, sku HAVING sum(q) <> 0 ORDER BY sku
"""
# back from now: stock_levels (every movement), less the archived ones, less the online ones that occurred after
# T, plus the archived ones up to T. Used when T is later than every closing: few movements occurred after it.
_BACK_FROM_NOW_AT: Final = """
SELECT $1::text AS warehouse_id, sku, sum(q)::bigint AS on_hand, NULL::timestamptz AS went_negative_at FROM (
    SELECT sku, on_hand AS q FROM stock_levels WHERE warehouse_id = $1 {sku}
    UNION ALL
    SELECT sku, -qty FROM archived_sums WHERE warehouse_id = $1 {sku}
    UNION ALL
""" + _both("    SELECT sku, -qty FROM stock_movements\n"
            "     WHERE warehouse_id = $1 AND occurred_at > $2 {sku} AND {step}") + """
    UNION ALL
    """ + _ARCHIVED_UP_TO + """
) AS m GROUP BY sku HAVING sum(q) <> 0 ORDER BY sku
"""
# from a closing ($3; its topic $4): its balance counts exactly the movements below its cut, archived ones included
# (a closing whose cut lies inside an archived segment is never chosen). Less the archived ones, less those below
# the cut that occurred after T, plus those at or past the cut that occurred up to T (`_WRONG_SIDE`, per partition),
# plus the archived ones up to T.
_FROM_CLOSING_AT: Final = """
SELECT $1::text AS warehouse_id, sku, sum(q)::bigint AS on_hand, NULL::timestamptz AS went_negative_at FROM (
    SELECT sku, on_hand AS q FROM stock_closings WHERE closing_id = $3 AND warehouse_id = $1 {sku}
    UNION ALL
    SELECT sku, -qty FROM archived_sums WHERE warehouse_id = $1 {sku}
    UNION ALL
    """ + _ARCHIVED_UP_TO + """
    {wrong_side}
) AS m GROUP BY sku HAVING sum(q) <> 0 ORDER BY sku
"""
# A partition's movements on the wrong side of the cut, as literal bounds: each subquery then reads only its
# partition's segments, through their BRIN on (occurred_at, kafka_offset), only the block ranges that hold both its
# offsets and its times: the movements that arrived around T, and the rare ones back- or future-dated.
_WRONG_SIDE: Final = """
    UNION ALL
""" + _both("""    SELECT sku, {sign}qty FROM stock_movements
     WHERE kafka_topic = $4 AND kafka_partition = {partition} AND kafka_offset {offsets} {cut}
       AND occurred_at {times} $2 AND warehouse_id = $1 {sku} AND {step}""")
_PARTITIONS: Final = """
SELECT p.kafka_partition, coalesce(c.next_offset, 0) AS next_offset
  FROM (SELECT kafka_partition FROM ledger_segments
        UNION SELECT kafka_partition FROM closing_cuts WHERE closing_id = $1) AS p(kafka_partition)
  LEFT JOIN closing_cuts AS c ON c.closing_id = $1 AND c.kafka_partition = p.kafka_partition
 ORDER BY 1
"""
# The usable closings nearest T on each side (by their place in business time), and now: a closing whose cut lies
# inside an archived segment cannot be read (archived_sums hold a segment's sums whole).
CLOSINGS_AROUND: Final = """
WITH usable AS (
    SELECT k.closing_id, k.kafka_topic, k.positioned_at FROM ledger_closings AS k
     WHERE NOT EXISTS (SELECT FROM ledger_archives AS a
                        WHERE a.kafka_topic = k.kafka_topic
                          AND a.end_offset > coalesce((SELECT c.next_offset FROM closing_cuts AS c
                                                        WHERE c.closing_id = k.closing_id
                                                          AND c.kafka_partition = a.kafka_partition), 0))
), before AS (
    SELECT * FROM usable WHERE positioned_at < $1 ORDER BY positioned_at DESC LIMIT 1
), after AS (
    SELECT * FROM usable WHERE positioned_at >= $1 ORDER BY positioned_at LIMIT 1
)
SELECT (SELECT closing_id FROM before) AS before_id, (SELECT kafka_topic FROM before) AS before_topic,
       (SELECT positioned_at FROM before) AS before_at, (SELECT closing_id FROM after) AS after_id,
       (SELECT kafka_topic FROM after) AS after_topic, (SELECT positioned_at FROM after) AS after_at, now() AS now
"""


def from_closing_at(cuts: Sequence[tuple[int, int]], *, sku: bool) -> str:
    """`_FROM_CLOSING_AT` for a closing's cuts ((partition, first offset not counted) of every partition)."""
    narrow = "AND sku = $5" if sku else ""
    wrong = "".join(
        _WRONG_SIDE.format(sign=sign, partition=int(partition), offsets=offsets, cut=int(cut), times=times, sku=narrow)
        for partition, cut in cuts
        for sign, offsets, times in (("-", "<", ">"), ("", ">=", "<="))
        if offsets == ">=" or cut > 0)
    return _FROM_CLOSING_AT.format(sku=narrow, wrong_side=wrong)


FORWARD_AT: Final = _FORWARD_AT.format(sku="")
FORWARD_AT_SKU: Final = _FORWARD_AT.format(sku="AND sku = $3")
BACK_FROM_NOW_AT: Final = _BACK_FROM_NOW_AT.format(sku="")
BACK_FROM_NOW_AT_SKU: Final = _BACK_FROM_NOW_AT.format(sku="AND sku = $3")
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
        else:
            rows = await levels_at(conn, warehouse, at, sku)
        found = [Level(r["warehouse_id"], r["sku"], r["on_hand"], r["went_negative_at"]) for r in rows]
        if at is not None and sku is not None and not found:
            found = [Level(warehouse, sku, 0, None)]  # 0 before its first movement, or back to 0 by T
        # An unknown warehouse must still be said.
        if (all(x.on_hand == 0 for x in found) and not straddling
                and not await conn.fetchval(WAREHOUSE_KNOWN, warehouse)):
            raise NotFoundError(f"the ledger has no stock for warehouse {warehouse!r}: check the id (exact match, "
                                "case-sensitive) and DATABASE_URL")
    if sku is not None and at is None and not found:
        raise NotFoundError(f"the ledger has no stock level for SKU {sku!r} in warehouse {warehouse!r}: check the "
                            "SKU (exact match, case-sensitive), or try `stock-ledger movements --sku`")
    return LevelsAt([x for x in found if x.on_hand < 0] if negative and at is None else found, straddling)


async def levels_at(conn: asyncpg.Connection, warehouse: str, at: datetime,
                    sku: str | None) -> list[asyncpg.Record]:
    """The rows of `_FORWARD_AT`, `_BACK_FROM_NOW_AT` or `_FROM_CLOSING_AT`, whichever reads least: from the closing
    taken nearest `at` (the movements read are those that arrived between the two), or back from now if now is
    nearer; forward when `at` precedes every closing (the history before them has none). The caller holds the
    transaction: one snapshot with the closings."""
    # A read of many small per-partition scans costs enough for JIT, whose compiling (a few hundred ms) is most of it.
    await conn.execute("SET LOCAL jit = off")
    around = await conn.fetchrow(CLOSINGS_AROUND, at)
    one = () if sku is None else (sku,)
    if around["before_id"] is None:
        return list(await conn.fetch(FORWARD_AT if sku is None else FORWARD_AT_SKU, warehouse, at, *one))
    distance = {"before": at - around["before_at"], "now": around["now"] - at}
    if around["after_id"] is not None:
        distance["after"] = around["after_at"] - at
    nearest = min(distance, key=lambda k: distance[k])
    if nearest == "now":
        return list(await conn.fetch(BACK_FROM_NOW_AT if sku is None else BACK_FROM_NOW_AT_SKU, warehouse, at, *one))
    closing, topic = around[f"{nearest}_id"], around[f"{nearest}_topic"]
    cuts = [(r["kafka_partition"], r["next_offset"]) for r in await conn.fetch(_PARTITIONS, closing)]
    return list(await conn.fetch(from_closing_at(cuts, sku=sku is not None), warehouse, at, closing, topic, *one))


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
