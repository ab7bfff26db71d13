"""Segments ahead of the writes: `stock_movements` is partitioned by Kafka coordinates (migrations/0014_segments.sql),
and a row whose offsets no segment holds is refused. So before a batch, each of its partitions is given a whole
segment of headroom past the batch's end, by `stock_ledger_ensure_segments` (SECURITY DEFINER: the worker may not
run DDL). Once per half a segment per partition: a dictionary lookup per batch otherwise.

The headroom each partition has left (in segments: 1.5 just after a call, 0.5 just before the next) is what the
worker exports as stock_ledger_segment_headroom; below 0.25 for long means the calls keep failing (the alert
StockLedgerSegmentsRunningOut), long before a batch would be refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Mapping

    import asyncpg

_ENSURE: Final = "SELECT kafka_partition, end_offset, segment_offsets FROM stock_ledger_ensure_segments($1, $2)"


@dataclass(slots=True)
class Segments:
    """Where each Kafka partition's last segment ends, as far as this session has learned."""

    ends: dict[int, int] = field(default_factory=dict)
    size: int | None = None

    def needed(self, through: Mapping[int, int]) -> dict[int, int]:
        """The partitions of `through` (partition -> the next offset a write reaches) with less than half a segment
        of headroom left, or not known yet."""
        size = self.size
        return {p: n for p, n in through.items()
                if size is None or p not in self.ends or self.ends[p] - n < size // 2}

    async def ensure(self, conn: asyncpg.Connection, through: Mapping[int, int], *, force: bool = False) -> None:
        """Give each partition of `through` a whole segment of headroom past its offset (in its own transaction:
        call it outside the batch's). `force`: ask even for partitions this session thinks are covered (a write
        found none: someone else's DDL, a restore)."""
        todo = dict(through) if force else self.needed(through)
        if not todo:
            return
        parts = sorted(todo)
        for r in await conn.fetch(_ENSURE, parts, [todo[p] for p in parts]):
            self.ends[r[0]] = r[1]
            self.size = r[2]

    def headroom(self, partition: int, next_offset: int) -> float | None:
        """Segments of headroom past `next_offset` (None until known)."""
        if self.size is None or partition not in self.ends:
            return None
        return (self.ends[partition] - next_offset) / self.size
