"""The consumer half of the guarantee: which partitions this worker may write, and from which offset.

Plain synchronous state, driven by five events, so every interleaving can be tested without Kafka:

    assigned(ps)        Kafka gave us ps (the listener has paused them): they wait for a claim, nothing is applied
    revoked(ps)         Kafka took ps away: forget their claims; a claim still running for them is stale
    begin_claim()       the main loop claims the pending partitions; returns a ticket (the assignment version)
    claimed(ticket, …)  the claim committed: if no rebalance happened meanwhile, seek to the stored offsets and
                        accept records of these partitions from exactly those offsets
    fenced(ps)          the database says another worker claimed ps since: stop writing them at once
    reclaim(ps)         ps must be claimed again: a fetch fell outside the log, or a halted partition is rechecked

`accept(fetched, tails)` then says which fetched records may go into a batch (claimed partitions only, from the
expected offset on), which partitions to seek again, and how far past its records (or, with none, past where it
stands) each partition's batch ends: the consumer's position may have passed offsets that hold no data record
(transaction markers, aborted records) after the last record it returned. The main loop builds batch N+1 while
batch N's transaction runs: `dispatched(next_offsets)` moves the offset the next batch starts from,
`committed(next_offsets)` the offset the ledger holds, and `stale(slices)`, asked just before a batch's
transaction, names what a fence, revocation or reclaim since it was built took away (its records are dropped; the
next claim seeks them again).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence


class HasOffset(Protocol):
    @property
    def offset(self) -> int: ...


class Slice(Protocol):
    """One partition's part of a built batch (batch.PartitionSlice)."""

    @property
    def partition(self) -> int: ...
    @property
    def epoch(self) -> int: ...
    @property
    def first_offset(self) -> int: ...


R = TypeVar("R", bound=HasOffset)


@dataclass(frozen=True, slots=True)
class ClaimTicket:
    version: int
    partitions: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Accepted(Generic[R]):
    records: dict[int, list[R]]  # partition -> records to apply, in offset order
    reseek: dict[int, int]       # partition -> offset to seek to again (fetched before our seek took effect)
    # partition -> where its part of the batch ends, past its last record (or past where it stands, with no record):
    # the offsets between held no data record. Only where that is further than the last record + 1.
    tails: dict[int, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Held:
    epoch: int
    expected: int  # the next offset the ledger holds: where the next transaction must start
    reseeked: bool = False
    ahead: int | None = None  # the next offset after a batch built but not yet committed: where the next build starts

    @property
    def position(self) -> int:
        return self.expected if self.ahead is None else self.ahead


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

    def dispatched(self, next_offsets: Mapping[int, int]) -> None:
        """A batch ending at these offsets was built; the next one starts there (its transaction has not run)."""
        for p, offset in next_offsets.items():
            held = self._held.get(p)
            if held is not None:
                held.ahead = offset

    def committed(self, next_offsets: Mapping[int, int]) -> None:
        for p, offset in next_offsets.items():
            held = self._held.get(p)
            if held is not None:
                held.expected, held.reseeked = offset, False
                if held.ahead is not None and held.ahead <= offset:
                    held.ahead = None

    def stale(self, slices: Iterable[Slice]) -> tuple[set[int], dict[int, int]]:
        """Asked under the batch lock just before a built batch's transaction: the partitions it must leave out
        (fenced, revoked or reclaimed since it was built: no longer held, or under another epoch), and of those the
        ones still held, with the offset to seek them back to (their records were consumed into the dropped part).
        The offsets are not compared here: a slice starting before the stored offset is a replay, which the
        database's exact guard refuses (OffsetMismatchError: claimed again), never something to drop quietly."""
        drop: set[int] = set()
        reseek: dict[int, int] = {}
        for x in slices:
            held = self._held.get(x.partition)
            if held is not None and held.epoch == x.epoch:
                continue
            drop.add(x.partition)
            if held is not None:
                held.ahead = None
                reseek[x.partition] = held.expected
        return drop, reseek

    # ------------------------------------------------------------------ questions

    @property
    def epochs(self) -> dict[int, int]:
        return {p: h.epoch for p, h in self._held.items()}

    @property
    def committed_positions(self) -> dict[int, tuple[int, int]]:
        """partition -> (epoch, the next offset the ledger holds as far as this worker knows: its last commit)."""
        return {p: (h.epoch, h.expected) for p, h in self._held.items()}

    @property
    def positions(self) -> dict[int, int]:
        """partition -> the stored next offset the next built batch continues (the batch guard's expected value)."""
        return {p: h.position for p, h in self._held.items()}

    def expected(self, partition: int) -> int | None:
        held = self._held.get(partition)
        return None if held is None else held.expected

    def accept(self, fetched: Mapping[int, Sequence[R]], tails: Mapping[int, int] | None = None) -> Accepted[R]:
        """Keep only records of partitions we hold, from the offset we expect.

        A first record past the expected offset is normal after read_committed skipped transaction markers or
        aborted records; once per claim it may also be a fetch that started before our seek took effect, so the
        partition is sought again once. Holes (offsets below the log start) never arrive here: the consumer runs
        with auto_offset_reset=none, so the broker's OFFSET_OUT_OF_RANGE surfaces as an error instead.

        `tails`: partition -> the consumer's position right after the fetch that returned these records, before any
        seek. It is past every data record the consumer returned and before any it did not (aiokafka moves it past a
        returned record, and past transaction markers and aborted batches only on its way to the next record), so
        offsets between a partition's last record (or where it stands) and it held no data record: the batch ends
        there. A partition sought again meanwhile has a position at or below where it stands: never used."""
        records: dict[int, list[R]] = {}
        reseek: dict[int, int] = {}
        ends: dict[int, int] = {}
        tails = tails or {}
        for p, held in self._held.items():
            recs = fetched.get(p)
            position = held.position
            if recs:
                if recs[0].offset != position and not held.reseeked:
                    held.reseeked = True
                    reseek[p] = position
                    continue
                fresh = [r for r in recs if r.offset >= position]
                if not fresh:
                    continue
                records[p] = fresh
                position = fresh[-1].offset + 1
            tail = tails.get(p)
            if tail is not None and tail > position:
                ends[p] = tail
        return Accepted(records, reseek, ends)

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
