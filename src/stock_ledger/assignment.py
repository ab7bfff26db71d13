"""The consumer half of the guarantee: which partitions this worker may write, and from which offset.

Plain synchronous state, driven by five events, so every interleaving can be tested without Kafka:

    assigned(ps)        Kafka gave us ps (the listener has paused them): they wait for a claim, nothing is applied
    revoked(ps)         Kafka took ps away: forget their claims; a claim still running for them is stale
    begin_claim()       the main loop claims the pending partitions; returns a ticket (the assignment version)
    claimed(ticket, …)  the claim committed: if no rebalance happened meanwhile, seek to the stored offsets and
                        accept records of these partitions from exactly those offsets
    fenced(ps)          the database says another worker claimed ps since: stop writing them at once
    reclaim(ps)         ps must be claimed again: a fetch fell outside the log, or a halted partition is rechecked

`accept(fetched)` then says which fetched records may go into a batch (claimed partitions only, from the
expected offset on) and which partitions to seek again. `committed(next_offsets)` moves the expected offsets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence


class HasOffset(Protocol):
    @property
    def offset(self) -> int: ...


R = TypeVar("R", bound=HasOffset)


@dataclass(frozen=True, slots=True)
class ClaimTicket:
    version: int
    partitions: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Accepted(Generic[R]):
    records: dict[int, list[R]]  # partition -> records to apply, in offset order
    reseek: dict[int, int]       # partition -> offset to seek to again (fetched before our seek took effect)


@dataclass(slots=True)
class _Held:
    epoch: int
    expected: int  # the next offset we may apply
    reseeked: bool = False


@dataclass
class Assignment:
    version: int = 0
    joined: bool = False
    pending: set[int] = field(default_factory=set)
    _held: dict[int, _Held] = field(default_factory=dict)
    _fenced_at: dict[int, float] = field(default_factory=dict)
    halted: dict[int, str] = field(default_factory=dict)

    # ------------------------------------------------------------------ events

    def assigned(self, partitions: Iterable[int]) -> None:
        self.version += 1
        self.joined = True
        self.pending = set(partitions)
        self.halted = {p: r for p, r in self.halted.items() if p in self.pending}

    def revoked(self, partitions: Iterable[int]) -> None:
        self.version += 1
        self.pending.clear()
        for p in partitions:
            self._held.pop(p, None)
            self.halted.pop(p, None)

    def begin_claim(self) -> ClaimTicket:
        return ClaimTicket(self.version, tuple(sorted(self.pending)))

    def claimed(self, ticket: ClaimTicket, starts: Mapping[int, tuple[int, int]],
                halted: Mapping[int, str] | None = None) -> bool:
        """`starts`: partition -> (epoch, offset to seek to); `halted`: partition -> why it stays paused (a hole).
        Partitions of the ticket in neither stay pending (a newer generation's claim owns them: claim again).
        False: a rebalance made the claim stale; a newer claim (a newer epoch) supersedes it, none of it is used."""
        if ticket.version != self.version:
            return False
        for p, (epoch, offset) in starts.items():
            self._held[p] = _Held(epoch, offset)
            self._fenced_at.pop(p, None)
            self.halted.pop(p, None)
        self.halted.update(halted or {})
        self.pending -= {*starts, *(halted or {})}
        return True

    def reclaim(self, partitions: Iterable[int]) -> None:
        """These must be claimed again (a fetch fell outside the log, or a halted partition is rechecked)."""
        for p in partitions:
            self._held.pop(p, None)
            self.halted.pop(p, None)
            self.pending.add(p)

    def fenced(self, partitions: Iterable[int], now: float) -> None:
        for p in partitions:
            self._held.pop(p, None)
            self._fenced_at.setdefault(p, now)

    def committed(self, next_offsets: Mapping[int, int]) -> None:
        for p, offset in next_offsets.items():
            held = self._held.get(p)
            if held is not None:
                held.expected, held.reseeked = offset, False

    # ------------------------------------------------------------------ questions

    @property
    def epochs(self) -> dict[int, int]:
        return {p: h.epoch for p, h in self._held.items()}

    def expected(self, partition: int) -> int | None:
        held = self._held.get(partition)
        return None if held is None else held.expected

    def accept(self, fetched: Mapping[int, Sequence[R]]) -> Accepted[R]:
        """Keep only records of partitions we hold, from the offset we expect.

        A first record past the expected offset is normal after read_committed skipped transaction markers or
        aborted records; once per claim it may also be a fetch that started before our seek took effect, so the
        partition is sought again once. Holes (offsets below the log start) never arrive here: the consumer runs
        with auto_offset_reset=none, so the broker's OFFSET_OUT_OF_RANGE surfaces as an error instead."""
        records: dict[int, list[R]] = {}
        reseek: dict[int, int] = {}
        for p, recs in fetched.items():
            held = self._held.get(p)
            if held is None or not recs:
                continue  # revoked, fenced, halted or not yet claimed: its next claim seeks again
            if recs[0].offset != held.expected and not held.reseeked:
                held.reseeked = True
                reseek[p] = held.expected
                continue
            fresh = [r for r in recs if r.offset >= held.expected]
            if fresh:
                records[p] = fresh
        return Accepted(records, reseek)

    def overdue_fenced(self, assigned: Iterable[int], now: float, limit: float) -> int | None:
        """A partition fenced off us that Kafka still assigns to us after `limit` seconds: nobody else will claim
        it, so this worker must rejoin. Forgets fences that resolved (claimed again, or no longer assigned)."""
        still = set(assigned)
        for p, since in list(self._fenced_at.items()):
            if p in self._held or p not in still:
                del self._fenced_at[p]
            elif now - since > limit:
                return p
        return None

    def readiness(self) -> tuple[bool, str]:
        if not self.joined:
            return False, "not yet a member of the consumer group"
        if self.pending:
            return False, f"{len(self.pending)} assigned partitions not yet claimed"
        if self.halted:
            detail = "; ".join(f"partition {p}: {r}" for p, r in sorted(self.halted.items()))
            return False, f"{len(self.halted)} partitions halted on a hole in the log ({detail})"
        return True, f"{len(self._held)} partitions claimed"
