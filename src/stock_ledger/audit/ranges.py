"""Sets of Kafka offsets as sorted runs of consecutive offsets, so `verify` compares ranges, never coordinates.

A partition's offsets are consecutive except where a transaction marker or an aborted record sits, so a topic of
hundreds of millions of records compresses to a handful of runs per partition; the memory they take grows with
the number of breaks, not with the ledger. A run is `(first, last)`, both included.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

Run = tuple[int, int]
SAMPLE: Final = 5


class Runs:
    """Sorted, disjoint runs built from offsets given in increasing order (two int64 per run)."""

    __slots__ = ("_bounds", "count")

    def __init__(self) -> None:
        self._bounds = array("q")
        self.count = 0  # offsets held

    def add(self, offset: int) -> None:
        """Add an offset greater than every one added before (a fetch returns a partition's records in order)."""
        bounds = self._bounds
        if bounds and offset == bounds[-1] + 1:
            bounds[-1] = offset
        elif bounds and offset <= bounds[-1]:
            msg = f"offsets must increase: {offset} after {bounds[-1]}"
            raise ValueError(msg)
        else:
            bounds.append(offset)
            bounds.append(offset)
        self.count += 1

    def add_run(self, first: int, last: int) -> None:
        """Add a run that starts after every offset added before (it merges with an adjacent last run)."""
        if first > last:
            msg = f"empty run ({first}, {last})"
            raise ValueError(msg)
        bounds = self._bounds
        if bounds and first <= bounds[-1]:
            msg = f"runs must increase: ({first}, {last}) after {bounds[-1]}"
            raise ValueError(msg)
        if bounds and first == bounds[-1] + 1:
            bounds[-1] = last
        else:
            bounds.append(first)
            bounds.append(last)
        self.count += last - first + 1

    @classmethod
    def of(cls, offsets: Iterable[int]) -> Runs:
        runs = cls()
        for offset in offsets:
            runs.add(offset)
        return runs

    def __iter__(self) -> Iterator[Run]:
        b = self._bounds
        return ((b[i], b[i + 1]) for i in range(0, len(b), 2))

    def __len__(self) -> int:
        return len(self._bounds) // 2

    @property
    def last(self) -> int | None:
        return self._bounds[-1] if self._bounds else None

    def __repr__(self) -> str:
        return f"Runs({list(self)})"


def difference(a: Iterable[Run], b: Iterable[Run]) -> Iterator[Run]:
    """The runs of `a` not covered by `b`; both sorted and disjoint. One pass over each, O(1) memory."""
    others = iter(b)
    cur = next(others, None)
    for first, last in a:
        start = first
        while cur is not None and cur[1] < start:
            cur = next(others, None)
        while cur is not None and cur[0] <= last:
            if cur[0] > start:
                yield start, cur[0] - 1
            start = max(start, cur[1] + 1)
            if cur[1] > last:
                break  # `cur` reaches into the next run of `a`: keep it
            cur = next(others, None)
        if start <= last:
            yield start, last


def union(a: Iterable[Run], b: Iterable[Run]) -> Iterator[Run]:
    """The runs covering the offsets of `a` or `b` (each sorted and disjoint), sorted, disjoint and with adjacent
    runs joined. One pass over each, O(1) memory."""
    left, right = iter(a), iter(b)
    x, y = next(left, None), next(right, None)
    current: Run | None = None
    while x is not None or y is not None:
        if y is None or (x is not None and x[0] <= y[0]):
            run, x = x, next(left, None)
        else:
            run, y = y, next(right, None)
        assert run is not None  # noqa: S101 - one of the two is not None
        if current is not None and run[0] <= current[1] + 1:
            current = (current[0], max(current[1], run[1]))
        else:
            if current is not None:
                yield current
            current = run
    if current is not None:
        yield current


def merged(ranges: Iterable[Run]) -> list[Run]:
    """Sorted, disjoint runs covering the same offsets as `ranges` (which may overlap)."""
    out: list[Run] = []
    for first, last in sorted(ranges):
        if out and first <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], last))
        else:
            out.append((first, last))
    return out


def clip(runs: Iterable[Run], low: int, high: int) -> Iterator[Run]:
    """The parts of `runs` within [low, high]."""
    for first, last in runs:
        if last >= low and first <= high:
            yield max(first, low), min(last, high)


@dataclass
class Found:
    """How many offsets a comparison found, in how many runs, and the first few runs (for the report)."""

    offsets: int = 0
    runs: int = 0
    sample: list[Run] = field(default_factory=list)

    def add(self, run: Run) -> None:
        self.offsets += run[1] - run[0] + 1
        self.runs += 1
        if len(self.sample) < SAMPLE:
            self.sample.append(run)

    def extend(self, runs: Iterable[Run]) -> Found:
        for run in runs:
            self.add(run)
        return self

    def __bool__(self) -> bool:
        return self.offsets > 0


def describe(run: Run) -> str:
    first, last = run
    return str(first) if first == last else f"{first}-{last}"
