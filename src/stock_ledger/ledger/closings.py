"""Closing balances: what `stock show --at` starts from instead of summing the whole history (migrations 0016 and 0017).

A closing is `stock_levels` copied in one snapshot with the stored offsets, its *cut*. The batch writes a
partition's rows, its level deltas and its next offset in one transaction, so the copy holds exactly the movements
whose coordinates lie below the cut (archived ones included): the closing's meaning is in offsets, not in time, and
a movement that arrives late, whatever its `occurred_at`, lands above the cut of every closing taken before it.
Its place in business time (`positioned_at`, the Kafka timestamp of the newest movements it counts) only chooses
which closing a read starts from.

Two writers put rows *below* a cut after the fact: `repair` (a hole filled) and `rejected replay` (a quarantined
record applied at its own coordinates). Each calls `include` in its own transaction. `take` and `include` order
themselves through a lock on ledger_closings: a closing taken before an `include` sees the closing and adds to it;
one taken after sees its rows in `stock_levels`. A worker never writes below a stored offset; moving one back
(`offsets move`) forgets the closings it would make wrong (`forget_above`).

Nothing here runs in the batch: the monitor's leader takes a closing every STOCK_LEDGER_CLOSING_SECONDS
(worker/monitor.py). How `stock show --at` reads them: ledger/stock.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from stock_ledger.ledger.batch import M_OFFSET, M_PARTITION, M_QTY, M_SKU, M_TOPIC, M_WAREHOUSE

if TYPE_CHECKING:
    from collections.abc import Sequence
    from datetime import datetime

    import asyncpg

    from stock_ledger.faults import Faults
    from stock_ledger.ledger.movements import Row

# take waits out every include in flight, and includes wait for a take: SHARE ROW EXCLUSIVE conflicts with itself
# and with ROW EXCLUSIVE; two includes (ROW EXCLUSIVE) do not wait for each other. Batches never take it.
_TAKE_LOCK: Final = "LOCK TABLE ledger_closings IN SHARE ROW EXCLUSIVE MODE"
_INCLUDE_LOCK: Final = "LOCK TABLE ledger_closings IN ROW EXCLUSIVE MODE"

# What the summarizing pass has still to do, in ranges (an upgrade from 0016 starts with every range of the ledger).
_RANGES_BEHIND: Final = """
SELECT coalesce(sum((blocks_behind + pages_per_range - 1) / pages_per_range), 0) FROM brin_backlog
"""

_NEWEST: Final = "SELECT max(taken_at) FROM ledger_closings WHERE kafka_topic = $1"
# The monitor's gauge (NULL: none yet).
AGE: Final = "SELECT extract(epoch FROM now() - max(taken_at))::float8 FROM ledger_closings WHERE kafka_topic = $1"
NOT_DUE: Final = "the newest closing is"
_OTHER_TOPICS: Final = """
SELECT DISTINCT topic FROM consumer_offsets WHERE topic <> $1 AND next_offset IS NOT NULL ORDER BY 1
"""
# Every partition the ledger has rows in has segments; its cut is its stored offset (0 if it has none yet).
_CUTS: Final = """
SELECT p.kafka_partition, coalesce(max(o.next_offset), 0)::bigint AS next_offset
  FROM (SELECT kafka_partition FROM ledger_segments UNION SELECT partition FROM consumer_offsets WHERE topic = $1)
       AS p(kafka_partition)
  LEFT JOIN consumer_offsets AS o ON o.topic = $1 AND o.partition = p.kafka_partition
 GROUP BY 1 ORDER BY 1
"""
# A row at or past its partition's stored offset: someone moved the offset back over rows the ledger holds. The
# copy would count rows the cut says it does not: no closing until the workers are past them again. One probe of
# the coordinates' index per partition, its bounds literal so that only that partition's segments are planned.
_AHEAD: Final = """
SELECT {partition}::int AS p, {offset}::bigint AS n WHERE EXISTS (
    SELECT FROM stock_movements WHERE kafka_topic = $1 AND kafka_partition = {partition} AND kafka_offset >= {offset})
"""
# Where the closing sits in business time: the median over the partitions of the Kafka timestamp of the newest
# movement it counts (one backward probe of the coordinates' index each, literal bounds as above). The median, so
# that a partition idle for days, or one producer's clock, does not move it.
_NEWEST_COUNTED: Final = """
(SELECT coalesce(kafka_timestamp, applied_at) AS t FROM stock_movements
  WHERE kafka_topic = $1 AND kafka_partition = {partition} AND kafka_offset < {offset}
  ORDER BY kafka_offset DESC LIMIT 1)
"""
_INSERT: Final = """
INSERT INTO ledger_closings (kafka_topic, pairs, positioned_at) VALUES ($1, 0, coalesce($2, now()))
RETURNING closing_id, taken_at, positioned_at
"""
_INSERT_CUTS: Final = """
INSERT INTO closing_cuts (closing_id, kafka_partition, next_offset)
SELECT $1, p, n FROM unnest($2::int[], $3::bigint[]) AS c(p, n)
"""
# In warehouse order: one warehouse's balances lie in a few pages for `stock show --at`.
_COPY_LEVELS: Final = """
INSERT INTO stock_closings (closing_id, warehouse_id, sku, on_hand)
SELECT $1, warehouse_id, sku, on_hand FROM stock_levels WHERE on_hand <> 0 ORDER BY warehouse_id, sku
"""
_FINISH: Final = "UPDATE ledger_closings SET pairs = $2, seconds = $3 WHERE closing_id = $1"
# Closings older than `days` keep the first of each UTC day; closings whose cut lies inside an archived segment can
# no longer be read (the archive keeps a segment's sums whole, not up to an offset) and go.
_THIN: Final = """
DELETE FROM ledger_closings AS k
 WHERE k.kafka_topic = $1 AND (
       (k.taken_at < now() - make_interval(days => $2)
        AND k.closing_id <> (SELECT f.closing_id FROM ledger_closings AS f
                              WHERE f.kafka_topic = k.kafka_topic
                                AND date_trunc('day', f.taken_at, 'UTC') = date_trunc('day', k.taken_at, 'UTC')
                              ORDER BY f.taken_at LIMIT 1))
    OR EXISTS (SELECT FROM ledger_archives AS a
                WHERE a.kafka_topic = k.kafka_topic
                  AND a.end_offset > coalesce((SELECT c.next_offset FROM closing_cuts AS c
                                                WHERE c.closing_id = k.closing_id
                                                  AND c.kafka_partition = a.kafka_partition), 0)))
"""
_INCLUDE: Final = """
INSERT INTO stock_closings AS s (closing_id, warehouse_id, sku, on_hand)
SELECT c.closing_id, r.w, r.s, sum(r.q)
  FROM unnest($1::text[], $2::int[], $3::bigint[], $4::text[], $5::text[], $6::bigint[]) AS r(t, p, o, w, s, q)
  JOIN ledger_closings AS k ON k.kafka_topic = r.t
  JOIN closing_cuts AS c ON c.closing_id = k.closing_id AND c.kafka_partition = r.p AND r.o < c.next_offset
 GROUP BY 1, 2, 3
ON CONFLICT (closing_id, warehouse_id, sku) DO UPDATE SET on_hand = s.on_hand + excluded.on_hand
"""
_FORGET_ABOVE: Final = """
DELETE FROM ledger_closings AS k USING closing_cuts AS c
 WHERE k.kafka_topic = $1 AND c.closing_id = k.closing_id AND c.kafka_partition = $2 AND c.next_offset > $3
"""


@dataclass(frozen=True, slots=True)
class Taken:
    closing_id: int | None  # None: not taken (`skipped` says why)
    taken_at: datetime | None
    positioned_at: datetime | None
    pairs: int
    seconds: float
    thinned: int
    skipped: str | None = None


@dataclass(frozen=True, slots=True)
class Summarized:
    ranges: int  # summarized by this call
    behind: int  # left for the next calls


async def take(conn: asyncpg.Connection, topic: str, *, every_seconds: float, daily_after_days: int,
               faults: Faults | None = None) -> Taken:
    """A closing of `topic`'s ledger now, unless the newest is younger than `every_seconds`; then thins the old."""
    started = time.monotonic()
    async with conn.transaction(isolation="repeatable_read"):
        # Before the first query: the snapshot is taken after every include in flight has committed.
        await conn.execute(_TAKE_LOCK)
        newest = await conn.fetchval(_NEWEST, topic)
        if newest is not None and every_seconds > 0:
            age = float(await conn.fetchval("SELECT extract(epoch FROM now() - $1::timestamptz)", newest))
            if age < every_seconds:
                return Taken(None, None, None, 0, 0.0, 0, skipped=f"{NOT_DUE} {age:.0f}s old")
        others = [r["topic"] for r in await conn.fetch(_OTHER_TOPICS, topic)]
        if others:
            return Taken(None, None, None, 0, 0.0, 0, skipped=(
                f"consumer_offsets also holds stored offsets of {', '.join(others)}: a closing copies stock_levels, "
                f"which would count their movements too; closings need a ledger of one topic ({topic})"))
        cuts = await conn.fetch(_CUTS, topic)
        partitions, offsets = [r["kafka_partition"] for r in cuts], [r["next_offset"] for r in cuts]
        ahead = await conn.fetchrow(" UNION ALL ".join(
            _AHEAD.format(partition=int(p), offset=int(n)) for p, n in zip(partitions, offsets, strict=True))
            + " LIMIT 1", topic) if partitions else None
        if ahead is not None:
            return Taken(None, None, None, 0, 0.0, 0, skipped=(
                f"partition {ahead['p']} holds movements at or past its stored offset {ahead['n']} (it was moved "
                "back): closings resume once the workers have passed them again"))
        counted = [(int(p), int(n)) for p, n in zip(partitions, offsets, strict=True) if n > 0]
        position = await conn.fetchval(
            "SELECT percentile_disc(0.5) WITHIN GROUP (ORDER BY t) FROM ("
            + " UNION ALL ".join(_NEWEST_COUNTED.format(partition=p, offset=n) for p, n in counted)
            + ") AS newest", topic) if counted else None
        row = await conn.fetchrow(_INSERT, topic, position)
        closing_id: int = row["closing_id"]
        await conn.execute(_INSERT_CUTS, closing_id, partitions, offsets)
        pairs = int((await conn.execute(_COPY_LEVELS, closing_id)).split()[-1])
        seconds = time.monotonic() - started
        await conn.execute(_FINISH, closing_id, pairs, seconds)
        if faults is not None:
            faults.reached("during_closing")
        thinned = int((await conn.execute(_THIN, topic, daily_after_days)).split()[-1])
    return Taken(closing_id, row["taken_at"], row["positioned_at"], pairs, seconds, thinned)


async def summarize(conn: asyncpg.Connection) -> Summarized:
    """Summarize again the BRIN block ranges of the ledger's tables added since the last call, whoever summarized them
    meanwhile: an unsummarized range (autosummarize's requests are dropped when autovacuum is behind) is read by every
    query through the index, and a placeholder left by a cancelled summarization makes every later range of its index
    read (migration 0017). Never waits for a table's lock; at most 2,048 ranges a call."""
    ranges = int(await conn.fetchval("SELECT stock_ledger_summarize_brins()"))
    return Summarized(ranges, int(await conn.fetchval(_RANGES_BEHIND)))


async def include(conn: asyncpg.Connection, movements: Sequence[Row]) -> None:
    """Add movements written below a stored offset (repair, rejected replay) to every closing whose cut is above
    them. In the writer's transaction, after its rows; that transaction must be READ COMMITTED (the default), so that
    this statement sees a closing committed while the writer waited for the lock."""
    if not movements:
        return
    await conn.execute(_INCLUDE_LOCK)
    columns = ([m[M_TOPIC] for m in movements], [m[M_PARTITION] for m in movements],
               [m[M_OFFSET] for m in movements], [m[M_WAREHOUSE] for m in movements],
               [m[M_SKU] for m in movements], [m[M_QTY] for m in movements])
    await conn.execute(_INCLUDE, *columns)


async def forget_above(conn: asyncpg.Connection, topic: str, partition: int, offset: int) -> int:
    """Forget the closings whose cut of `partition` lies above `offset` (a stored offset moved back to it): the
    workers may now write below their cut. Returns how many."""
    await conn.execute(_INCLUDE_LOCK)
    return int((await conn.execute(_FORGET_ABOVE, topic, partition, offset)).split()[-1])
