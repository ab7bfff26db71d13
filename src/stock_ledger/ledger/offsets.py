"""The ledger's positions and holes: every statement that reads or writes `consumer_offsets` or `ledger_gaps`.

`consumer_offsets` holds, per (group, topic, partition), the next offset to apply (the source of truth for
positions: Kafka's committed offsets are advisory), the epoch of the claim that may write it (the fencing token),
and who claimed it under which Kafka generation. `ledger_gaps` holds every range of offsets the ledger moved past
without applying it (a hole in the log, an operator's skip), until someone acknowledges it.

Rules these statements keep, whoever calls them (the worker's claims and batches, the operator commands, repair):
- rows are locked in partition order, as every writer locks them, so a claim, a batch and an operator's move
  never deadlock;
- the stored offset moves only under the epoch that was claimed, and only from where it stands (`advance`,
  `skip`); an operator's move bumps the epoch, so a running worker is fenced and must claim again (`move`);
- a gap is recorded in the transaction that moves past it; acknowledging one names who did, and an acknowledgement
  counts only when that role may acknowledge (`_ACK_COUNTS`): the worker's role may record a gap, never skip one.
"""

from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    import asyncpg

    from stock_ledger.ledger.batch import PartitionSlice

Key = tuple[str, int]  # (topic, partition)
Run = tuple[int, int]  # offsets (first, last), both included

# ------------------------------------------------------------------------------------------ claims and batches

# The claim takes a partition only from a claim of the same or an older Kafka generation: a claim that started
# before a rebalance and reaches the database after it (it waited on a lock, a connect, a frozen process) takes
# nothing, so it can never fence the rightful newer owner. An unknown generation (NULL: aiokafka resets it to -1 on
# UnknownMemberId / IllegalGeneration until the member rejoins) takes only what no known generation holds. $6 forces
# it (a group whose generation restarted), and only with a known generation.
#
# The range whose non-record offsets the ledger knows (non_records_known_from/to, migration 0011) goes on from where
# it was only if the last move of next_offset was this version's (which moves non_records_known_to with it);
# otherwise an older version applied what lies between without recording them, and the range starts afresh here.
_CLAIM: Final = """
INSERT INTO consumer_offsets AS o (group_id, topic, partition, epoch, generation, member_id, claimed_at)
SELECT $1, $2, p, 1, $4, $5, now() FROM unnest($3::int[]) AS p ORDER BY p
ON CONFLICT (group_id, topic, partition) DO UPDATE
    SET epoch = o.epoch + 1, generation = EXCLUDED.generation, member_id = EXCLUDED.member_id, claimed_at = now(),
        non_records_known_from = CASE WHEN o.non_records_known_to = o.next_offset THEN o.non_records_known_from
                                      ELSE o.next_offset END,
        non_records_known_to = o.next_offset
    WHERE ($6 AND EXCLUDED.generation IS NOT NULL) OR o.generation IS NULL OR o.generation <= EXCLUDED.generation
RETURNING partition, epoch, next_offset
"""
# Where nothing was stored yet, the reset policy's position is stored by the claim itself: the ledger then always
# knows where it started, so a later hole below it (retention outran a worker that never committed) is found.
_RECORD_START: Final = """
UPDATE consumer_offsets AS o
   SET next_offset = r.start, non_records_known_from = r.start, non_records_known_to = r.start, updated_at = now()
  FROM unnest($3::int[], $4::bigint[]) AS r(partition, start)
 WHERE o.group_id = $1 AND o.topic = $2 AND o.partition = r.partition AND o.next_offset IS NULL
RETURNING o.partition
"""
# The ledger belongs to the one group that has rows here: movement_id and the coordinates are unique across it.
_OTHER_GROUP: Final = "SELECT group_id FROM consumer_offsets WHERE group_id <> $1 LIMIT 1"
_HELD: Final = "SELECT group_id, topic, count(*) FROM consumer_offsets GROUP BY 1, 2 ORDER BY 1, 2"

# The exact guard: the row moves only if we still hold its epoch and it stands exactly where this worker believes
# the ledger stands (`expected`). The batch's first record may lie past that (transaction markers, aborted records),
# so the stored value is compared with `expected`, never with the first record: a stored offset behind it means
# the database went back in time (a failover to a standby that lost commits, a restore), one ahead of it that
# someone else moved it; either way the batch is never written past it. Rows are locked first, in partition order,
# as claims lock them, so a batch and a claim can never deadlock.
_ADVANCE: Final = """
WITH locked AS (
    SELECT partition FROM consumer_offsets
     WHERE group_id = $1 AND topic = $2 AND partition = ANY($3::int[])
     ORDER BY partition FOR UPDATE
)
UPDATE consumer_offsets AS o
   SET next_offset = b.next_offset, non_records_known_to = b.next_offset, updated_at = now()
  FROM unnest($3::int[], $4::bigint[], $5::bigint[], $6::bigint[]) AS b(partition, epoch, expected, next_offset)
  JOIN locked USING (partition)
 WHERE o.group_id = $1 AND o.topic = $2 AND o.partition = b.partition
   AND o.epoch = b.epoch
   AND o.next_offset = b.expected
RETURNING o.partition
"""
_CURRENT: Final = """
SELECT partition, epoch, next_offset FROM consumer_offsets
 WHERE group_id = $1 AND topic = $2 AND partition = ANY($3::int[])
"""
_STORED: Final = "SELECT partition, next_offset FROM consumer_offsets WHERE group_id = $1 AND topic = $2"
_OWNERS: Final = """
SELECT partition, member_id FROM consumer_offsets WHERE group_id = $1 AND topic = $2 AND partition = ANY($3::int[])
"""
# Moving past a hole in the log (STOCK_LEDGER_ON_GAP=record): the offset moves only under our epoch and only from
# where it stood, and the skipped range is written in the same transaction.
_SKIP: Final = """
UPDATE consumer_offsets SET next_offset = $6, non_records_known_to = $6, updated_at = now()
 WHERE group_id = $1 AND topic = $2 AND partition = $3 AND epoch = $4 AND next_offset = $5
RETURNING partition
"""
# The offsets of a slice that held no data record, in the batch transaction: one row per slice that has any, its
# runs as (first, last) pairs in one array (a batch writes at most one row per partition, however many producer
# transactions it spans). A row is written again only if a stored offset went back below it and the row survived,
# which nothing does (a move's floor counts these offsets; a database that goes back in time loses them with the
# offsets): ON CONFLICT keeps the first, which is a fact about Kafka's log.
_RECORD_NON_RECORDS: Final = """
INSERT INTO non_record_offsets (kafka_topic, kafka_partition, first_offset, last_offset, runs)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT DO NOTHING
"""


async def other_group(conn: asyncpg.Connection, group_id: str) -> str | None:
    """A group other than `group_id` whose ledger this database holds, if any."""
    other = await conn.fetchval(_OTHER_GROUP, group_id)
    return None if other is None else str(other)


async def held(conn: asyncpg.Connection) -> list[tuple[str, str, int]]:
    """Every (group, topic) this database stores offsets of, with how many partitions."""
    return [(r[0], r[1], r[2]) for r in await conn.fetch(_HELD)]


async def claim(  # noqa: PLR0913 - the claim's whole input, as stored beside it
    conn: asyncpg.Connection, group_id: str, topic: str, partitions: Sequence[int], *, generation: int | None,
    member_id: str | None, force: bool,
) -> list[asyncpg.Record]:
    """Bump each partition's epoch (rows `partition, epoch, next_offset`) where this generation may take it."""
    return list(await conn.fetch(_CLAIM, group_id, topic, sorted(partitions), generation, member_id, force))


async def record_start(conn: asyncpg.Connection, group_id: str, topic: str, starts: Mapping[int, int]) -> None:
    """Store each partition's reset position where nothing is stored yet (in the claim's transaction)."""
    await conn.fetch(_RECORD_START, group_id, topic, list(starts), list(starts.values()))


async def advance(conn: asyncpg.Connection, group_id: str, topic: str, slices: Sequence[PartitionSlice]) -> set[int]:
    """The exact guard (see _ADVANCE): move each slice's partition from its `expected` offset to its next offset,
    under its epoch; the partitions that moved."""
    moved = await conn.fetch(_ADVANCE, group_id, topic, [x.partition for x in slices], [x.epoch for x in slices],
                             [x.expected for x in slices], [x.next_offset for x in slices])
    return {r["partition"] for r in moved}


async def current(conn: asyncpg.Connection, group_id: str, topic: str,
                  partitions: Iterable[int]) -> dict[int, tuple[int, int | None]]:
    """partition -> (epoch, next offset) as stored now; a partition without a row is absent."""
    return {r["partition"]: (r["epoch"], r["next_offset"])
            for r in await conn.fetch(_CURRENT, group_id, topic, list(partitions))}


async def stored_offsets(db: asyncpg.Connection | asyncpg.Pool, group_id: str, topic: str) -> dict[int, int | None]:
    """The source of truth for positions: partition -> next offset to apply (None: claimed, nothing applied)."""
    return {r[0]: r[1] for r in await db.fetch(_STORED, group_id, topic)}


async def owners(conn: asyncpg.Connection, group_id: str, topic: str, partitions: Iterable[int],
                 ) -> dict[int, str | None]:
    """partition -> the member id of its last claim."""
    return {r["partition"]: r["member_id"] for r in await conn.fetch(_OWNERS, group_id, topic, list(partitions))}


async def record_non_records(conn: asyncpg.Connection, topic: str, slices: Sequence[PartitionSlice]) -> None:
    """Write the slices' offsets that held no data record (in the batch transaction; nothing when none has any)."""
    rows = [(topic, x.partition, x.non_records[0][0], x.non_records[-1][1], list(chain.from_iterable(x.non_records)))
            for x in slices if x.non_records]
    if rows:
        await conn.executemany(_RECORD_NON_RECORDS, rows)  # one round trip: asyncpg pipelines the rows


async def skip(conn: asyncpg.Connection, group_id: str, topic: str, partition: int, *,  # noqa: PLR0913
               epoch: int, from_offset: int, to_offset: int) -> bool:
    """Move the stored offset from `from_offset` to `to_offset` under `epoch`; False if it no longer stood there
    under that epoch (a newer claim decides)."""
    return await conn.fetchval(_SKIP, group_id, topic, partition, epoch, from_offset, to_offset) is not None


# ------------------------------------------------------------------------------------------ operator moves

# The operator commands that write below a partition's stored offset (`repair`) or move it (`offsets set`) take turns
# on this transaction-scoped lock, per (group, topic, partition). A repair chunk reads the stored offset and writes
# the records below it; a move checks its floor (the highest offset in the ledger + 1) before it commits. Without one
# lock both take, a move to just below a chunk could commit between the chunk's read and its commit (its floor sees
# committed rows only), and the chunk's rows would then sit at and above the stored offset. Why an advisory lock and
# not the partition's consumer_offsets row: every batch locks that row FOR UPDATE, so a repair holding it would make
# the partition's worker wait for each chunk. Workers never take this lock, so they never wait for either command.
_OPERATOR_LOCK: Final = "SELECT pg_advisory_xact_lock(hashtext('stock-ledger repair ' || $1 || ' ' || $2), $3)"

# A partition never claimed has no row to lock: a placeholder row is inserted first (epoch 0: the move makes it 1, as
# a first claim would), so a claim of that partition (its INSERT ... ON CONFLICT) waits for this transaction and
# then bumps the epoch past ours, and a batch cannot commit between the floor check and the move. Done partition by
# partition in order, as claims and batches lock rows, so they never deadlock. A dry run rolls the row back.
_PLACEHOLD: Final = """
INSERT INTO consumer_offsets (group_id, topic, partition, epoch) VALUES ($1, $2, $3, 0)
ON CONFLICT (group_id, topic, partition) DO NOTHING
RETURNING partition
"""
_LOCK: Final = """
SELECT next_offset, epoch FROM consumer_offsets WHERE group_id = $1 AND topic = $2 AND partition = $3 FOR UPDATE
"""
# The known range of non-record offsets goes on: a forward move's skipped range is in ledger_gaps, and a move back
# never goes below the floor (which counts them), so the workers record again from the new offset.
_MOVE: Final = """
INSERT INTO consumer_offsets AS o (group_id, topic, partition, next_offset, epoch, member_id, claimed_at, updated_at,
                                   non_records_known_from, non_records_known_to)
VALUES ($1, $2, $3, $4, 1, 'operator:' || current_user, now(), now(), $4, $4)
ON CONFLICT (group_id, topic, partition) DO UPDATE
    SET next_offset = EXCLUDED.next_offset, epoch = o.epoch + 1, generation = NULL, member_id = EXCLUDED.member_id,
        claimed_at = now(), updated_at = now(),
        non_records_known_from = CASE WHEN o.non_records_known_to = o.next_offset
                                      THEN least(o.non_records_known_from, EXCLUDED.next_offset)
                                      ELSE EXCLUDED.next_offset END,
        non_records_known_to = EXCLUDED.next_offset
RETURNING epoch
"""
_SHOW: Final = """
SELECT partition, next_offset, epoch, member_id, claimed_at, updated_at FROM consumer_offsets
 WHERE group_id = $1 AND topic = $2
"""


async def operator_lock(conn: asyncpg.Connection, group_id: str, topic: str, partition: int) -> None:
    """Wait for (then hold, until this transaction ends) the lock `repair` and `offsets set` take turns on."""
    await conn.execute(_OPERATOR_LOCK, group_id, topic, partition)


async def lock_for_move(conn: asyncpg.Connection, group_id: str, topic: str,
                        partition: int) -> tuple[bool, int | None, int]:
    """Lock the partition for an operator's move: the operators' lock (a repair chunk of it has committed or not
    started), then its row, inserting a placeholder where none exists: (whether it was fresh, its next offset, its
    epoch)."""
    await operator_lock(conn, group_id, topic, partition)
    fresh = await conn.fetchval(_PLACEHOLD, group_id, topic, partition) is not None
    locked = await conn.fetchrow(_LOCK, group_id, topic, partition)
    assert locked is not None  # noqa: S101 - the row exists: inserted above or before
    return fresh, locked["next_offset"], locked["epoch"]


async def move(conn: asyncpg.Connection, group_id: str, topic: str, partition: int, target: int) -> int:
    """Set the partition's next offset to `target` and bump its epoch (running workers are fenced); the new epoch."""
    return int(await conn.fetchval(_MOVE, group_id, topic, partition, target))


async def show(conn: asyncpg.Connection, group_id: str, topic: str) -> dict[int, asyncpg.Record]:
    """Each stored partition's row as `offsets show` lists it."""
    return {r["partition"]: r for r in await conn.fetch(_SHOW, group_id, topic)}


# ------------------------------------------------------------------------------------------ the watermarks

# Per (topic, partition), whatever the group: a second group on the same topic and database could only re-apply
# rows (refused by the unique constraint), so the furthest stored offset is the watermark.
_WATERMARKS: Final = "SELECT topic, partition, max(next_offset) FROM consumer_offsets GROUP BY 1, 2"
_AHEAD: Final = """
SELECT count(*) FROM consumer_offsets AS c
 WHERE EXISTS (SELECT FROM stock_movements AS m WHERE m.kafka_topic = c.topic AND m.kafka_partition = c.partition
                  AND m.kafka_offset >= coalesce(c.next_offset, 0))
    OR EXISTS (SELECT FROM rejected_movements AS r WHERE r.kafka_topic = c.topic AND r.kafka_partition = c.partition
                  AND r.kafka_offset >= coalesce(c.next_offset, 0))
"""


async def watermarks(conn: asyncpg.Connection) -> dict[Key, int]:
    """(topic, partition) -> the furthest stored next offset (0 where nothing is stored)."""
    return {(r[0], r[1]): r[2] or 0 for r in await conn.fetch(_WATERMARKS)}


async def partitions_ahead(conn: asyncpg.Connection) -> int:
    """Partitions holding a row at or beyond their stored next offset: rows and offsets came apart."""
    return int(await conn.fetchval(_AHEAD))


# ------------------------------------------------------------------------------------------ offsets without a record

# Per range [lo, hi) of a partition, the recorded rows of offsets that held no data record which meet it (their runs
# are clipped to the range by the caller).
_NON_RECORDS: Final = """
SELECT w.topic, w.p, w.lo, w.hi, n.runs
  FROM unnest($1::text[], $2::int[], $3::bigint[], $4::bigint[]) AS w(topic, p, lo, hi)
 CROSS JOIN LATERAL (
       SELECT first_offset, runs FROM non_record_offsets
        WHERE kafka_topic = w.topic AND kafka_partition = w.p AND first_offset < w.hi AND last_offset >= w.lo
       ) AS n
 ORDER BY w.topic, w.p, n.first_offset
"""
# Per (topic, partition), whatever the group (one database holds one group's ledger): the range of offsets whose
# non-record offsets are all recorded, [from, to).
_NON_RECORDS_KNOWN: Final = """
SELECT topic, partition, non_records_known_from, non_records_known_to FROM consumer_offsets
 WHERE non_records_known_from IS NOT NULL AND non_records_known_to > non_records_known_from
"""
_NON_RECORDS_EXIST: Final = "SELECT to_regclass('non_record_offsets') IS NOT NULL"


async def non_records(conn: asyncpg.Connection, ranges: Sequence[tuple[Key, int, int]]) -> dict[Key, list[Run]]:
    """Per partition, the recorded runs of offsets that held no data record meeting `ranges` ((key, lo, hi):
    [lo, hi)), in offset order; nothing on a database migrated before they were recorded."""
    found: dict[Key, list[Run]] = {}
    if ranges and await conn.fetchval(_NON_RECORDS_EXIST):
        rows = await conn.fetch(_NON_RECORDS, [k[0] for k, _, _ in ranges], [k[1] for k, _, _ in ranges],
                                [lo for _, lo, _ in ranges], [hi for _, _, hi in ranges])
        for topic, partition, lo, hi, runs in rows:
            found.setdefault((topic, partition), []).extend(
                (max(first, lo), min(last, hi - 1)) for first, last in zip(runs[::2], runs[1::2], strict=True)
                if last >= lo and first < hi)
    return found


async def non_records_known(conn: asyncpg.Connection) -> dict[Key, Run]:
    """(topic, partition) -> the offsets [first, last] whose non-record offsets the ledger recorded, all of them."""
    if not await conn.fetchval(_NON_RECORDS_EXIST):
        return {}
    return {(r[0], r[1]): (r[2], r[3] - 1) for r in await conn.fetch(_NON_RECORDS_KNOWN)}


# ------------------------------------------------------------------------------------------ ledger_gaps

# Whether row `g`'s acknowledgement counts (issue 38): only when acknowledged_by names a role that may UPDATE
# ledger_gaps.acknowledged_at, as `gaps ack` does: the owner, a superuser, a role granted it. Migration 0010 keeps the
# worker's role from writing these columns; before it, that role could insert a row already "acknowledged" in any
# name, and PostgreSQL does not record who inserted a row, so the name is judged by what its role may do now. The
# worker's and the reader's roles never had that privilege, and a name no role has (made up, or a dropped role)
# counts for nothing: such a row is open until someone who may acknowledge it does (`_ACK`).
_ACK_COUNTS: Final = """(g.acknowledged_at IS NOT NULL AND EXISTS (
    SELECT FROM pg_catalog.pg_roles AS r
     WHERE r.rolname = g.acknowledged_by
       AND pg_catalog.has_column_privilege(r.oid, 'public.ledger_gaps', 'acknowledged_at', 'UPDATE')))"""
_RECORD_GAP: Final = """
INSERT INTO ledger_gaps (group_id, topic, partition, first_offset, last_offset, reason)
VALUES ($1, $2, $3, $4, $5, $6) RETURNING id
"""
# An operator's skip is acknowledged by the operator who made it, in the same statement.
_RECORD_SKIP: Final = """
INSERT INTO ledger_gaps (group_id, topic, partition, first_offset, last_offset, reason, acknowledged_at,
                         acknowledged_by, note)
VALUES ($1, $2, $3, $4, $5, $6, now(), current_user, $7)
RETURNING id, acknowledged_by
"""
# A gap whose acknowledgement does not count is acknowledged afresh; the claim it replaces stays in the note.
_ACK: Final = f"""
UPDATE ledger_gaps AS g SET acknowledged_at = now(), acknowledged_by = current_user,
       note = CASE WHEN g.acknowledged_at IS NULL THEN $2::text
                   ELSE format('%s (replaces an acknowledgement that did not count, by %s at %s: %s)', $2::text,
                               g.acknowledged_by, g.acknowledged_at, g.note) END
 WHERE g.id = $1 AND NOT {_ACK_COUNTS}
RETURNING g.id
"""
_LIST: Final = f"""
SELECT id, group_id, topic, partition, first_offset, last_offset, last_offset - first_offset + 1 AS records,
       reason, detected_at, acknowledged_at, acknowledged_by, note, {_ACK_COUNTS} AS acknowledgement_counts
  FROM ledger_gaps AS g WHERE ($1 OR NOT {_ACK_COUNTS}) ORDER BY id
"""
# Open gaps: never acknowledged, or acknowledged by a role that may not (acknowledged_by names it).
_UNACKNOWLEDGED: Final = f"""
SELECT id, partition, first_offset, last_offset, reason, acknowledged_by FROM ledger_gaps AS g
 WHERE NOT {_ACK_COUNTS} AND group_id = $1 AND topic = $2 ORDER BY id
"""
# Ranges an operator (or `gaps ack`) acknowledged: their records stay in the topic, skipped on purpose.
_ACKNOWLEDGED: Final = f"""
SELECT partition, first_offset, last_offset, acknowledged_by, note FROM ledger_gaps AS g
 WHERE {_ACK_COUNTS} AND group_id = $1 AND topic = $2 ORDER BY partition, first_offset
"""
_OF_PARTITION: Final = f"""
SELECT id, first_offset, last_offset, {_ACK_COUNTS} AS acknowledged FROM ledger_gaps AS g
 WHERE group_id = $1 AND topic = $2 AND partition = $3 ORDER BY first_offset
"""
_COUNTS: Final = f"""
SELECT partition, count(*) FILTER (WHERE NOT {_ACK_COUNTS}) AS open, count(*) AS total
  FROM ledger_gaps AS g WHERE group_id = $1 AND topic = $2 GROUP BY partition
"""
_GAPS_EXIST: Final = "SELECT to_regclass('ledger_gaps') IS NOT NULL"
# Every recorded range, whoever recorded it and whether acknowledged or not: the invariant checks leave them to
# `verify` (which fails on an unacknowledged one).
_GAP_RANGES: Final = "SELECT topic, partition, first_offset, last_offset FROM ledger_gaps ORDER BY 1, 2, 3"


async def record_gap(conn: asyncpg.Connection, group_id: str, topic: str, partition: int, *,  # noqa: PLR0913
                     first: int, last: int, reason: str) -> int:
    """Record the unacknowledged hole [first, last]; its id."""
    return int(await conn.fetchval(_RECORD_GAP, group_id, topic, partition, first, last, reason))


async def record_skip(conn: asyncpg.Connection, group_id: str, topic: str, partition: int, *,  # noqa: PLR0913
                      first: int, last: int, reason: str, note: str | None) -> asyncpg.Record:
    """Record an operator's skip of [first, last], acknowledged by this session's role: (id, acknowledged_by)."""
    row = await conn.fetchrow(_RECORD_SKIP, group_id, topic, partition, first, last, reason, note)
    assert row is not None  # noqa: S101 - INSERT ... RETURNING returns the row
    return row


async def acknowledge(conn: asyncpg.Connection, gap_id: int, note: str) -> bool:
    """True if the gap was open (or its acknowledgement did not count) and is now acknowledged by this role."""
    return await conn.fetchval(_ACK, gap_id, note) is not None


async def list_gaps(conn: asyncpg.Connection, *, include_acknowledged: bool) -> list[dict[str, Any]]:
    return [dict(r) for r in await conn.fetch(_LIST, include_acknowledged)]


async def unacknowledged(conn: asyncpg.Connection, group_id: str, topic: str) -> list[asyncpg.Record]:
    """Open gaps: `id, partition, first_offset, last_offset, reason, acknowledged_by` (not None: an acknowledgement
    that does not count, see _ACK_COUNTS)."""
    return list(await conn.fetch(_UNACKNOWLEDGED, group_id, topic))


async def acknowledged(conn: asyncpg.Connection, group_id: str, topic: str) -> list[asyncpg.Record]:
    """Gaps whose acknowledgement counts: `partition, first_offset, last_offset, acknowledged_by, note`, by
    partition."""
    return list(await conn.fetch(_ACKNOWLEDGED, group_id, topic))


async def gaps_of(conn: asyncpg.Connection, group_id: str, topic: str, partition: int) -> list[asyncpg.Record]:
    """A partition's recorded gaps: `id, first_offset, last_offset, acknowledged` (whether it counts), in offset
    order."""
    return list(await conn.fetch(_OF_PARTITION, group_id, topic, partition))


async def gap_counts(conn: asyncpg.Connection, group_id: str, topic: str) -> dict[int, asyncpg.Record]:
    """partition -> (open, total) recorded gaps."""
    return {r["partition"]: r for r in await conn.fetch(_COUNTS, group_id, topic)}


async def gaps_table_exists(conn: asyncpg.Connection) -> bool:
    """Whether ledger_gaps exists (a database migrated before it was added has none)."""
    return bool(await conn.fetchval(_GAPS_EXIST))


async def gap_ranges(conn: asyncpg.Connection) -> dict[Key, list[Run]]:
    """(topic, partition) -> every range recorded in ledger_gaps, in offset order (they may overlap)."""
    found: dict[Key, list[Run]] = {}
    for r in await conn.fetch(_GAP_RANGES):
        found.setdefault((r[0], r[1]), []).append((r[2], r[3]))
    return found
