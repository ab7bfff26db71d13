"""The consumer half of the guarantee, as plain state: which records may be applied, from which offset.

Every promise the README makes about assignment, claims, revocation, fencing and holes is checked here on the pure
`Assignment`, including every interleaving of the events (a property test drives random event sequences against
a simple model of what the promises allow)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stock_ledger.consumer.assignment import Assignment, ClaimTicket


@dataclass(frozen=True)
class R:
    offset: int


@dataclass(frozen=True)
class S:
    partition: int
    epoch: int
    first_offset: int
    next_offset: int


def recs(*offsets: int) -> list[R]:
    return [R(o) for o in offsets]


def claimed(a: Assignment, starts: dict[int, tuple[int, int]]) -> bool:
    return a.claimed(a.begin_claim(), starts)


class TestAssignedPartitionsWaitForTheirClaim:
    def test_nothing_is_accepted_before_the_claim(self) -> None:
        """Records of an assigned but unclaimed partition (fetched from Kafka's committed offset) are never applied."""
        a = Assignment()
        a.assigned([0, 1])
        assert a.pending == {0, 1}
        assert a.accept({0: recs(5, 6)}).records == {}
        assert a.readiness() == (False, "2 assigned partitions not yet claimed")

    def test_after_the_claim_records_from_the_stored_offset_are_accepted(self) -> None:
        """Claim: epoch 3, stored offset 10. Records 10.. are accepted, with that epoch."""
        a = Assignment()
        a.assigned([0])
        assert claimed(a, {0: (3, 10)})
        assert a.epochs == {0: 3}
        assert a.accept({0: recs(10, 11)}).records == {0: recs(10, 11)}
        assert a.readiness()[0]

    def test_records_before_the_expected_offset_are_dropped(self) -> None:
        """A fetch that overlaps what we already applied: only offsets >= expected are kept."""
        a = Assignment()
        a.assigned([0])
        claimed(a, {0: (1, 10)})
        accepted = a.accept({0: recs(10, 11, 12)})
        a.committed({0: 12})
        assert accepted.records == {0: recs(10, 11, 12)}
        assert a.accept({0: recs(12, 13)}).records == {0: recs(12, 13)}


class TestReseek:
    def test_a_first_record_past_the_expected_offset_is_sought_again_once(self) -> None:
        """A fetch that began before our seek: seek once more to the expected offset, apply nothing of it."""
        a = Assignment()
        a.assigned([0])
        claimed(a, {0: (1, 10)})
        first = a.accept({0: recs(20, 21)})
        assert first.records == {}
        assert first.reseek == {0: 10}

    def test_after_the_reseek_a_later_first_offset_is_accepted(self) -> None:
        """Transaction markers and aborted records leave offsets out; after one reseek the jump is accepted (holes
        below the log start never get here: the consumer raises OFFSET_OUT_OF_RANGE for them)."""
        a = Assignment()
        a.assigned([0])
        claimed(a, {0: (1, 10)})
        a.accept({0: recs(20)})
        assert a.accept({0: recs(12, 13)}).records == {0: recs(12, 13)}

    def test_a_commit_allows_one_more_reseek(self) -> None:
        a = Assignment()
        a.assigned([0])
        claimed(a, {0: (1, 10)})
        a.accept({0: recs(11)})
        a.accept({0: recs(11)})
        a.committed({0: 12})
        assert a.accept({0: recs(14)}).reseek == {0: 12}


class TestPastOffsetsWithoutRecords:
    """The consumer's position after a fetch is past every record it returned and short of every record it did not:
    offsets between a partition's last record (or where it stands) and that position held no data record
    (transaction markers, aborted records), and the batch moves the stored offset past them."""

    def test_a_batch_ends_at_the_position_past_its_last_record(self) -> None:
        a = Assignment()
        a.assigned([0])
        claimed(a, {0: (1, 10)})
        accepted = a.accept({0: recs(10, 11)}, {0: 13})
        assert (accepted.records, accepted.tails) == ({0: recs(10, 11)}, {0: 13})

    def test_a_position_at_the_last_record_plus_one_adds_nothing(self) -> None:
        a = Assignment()
        a.assigned([0])
        claimed(a, {0: (1, 10)})
        assert a.accept({0: recs(10, 11)}, {0: 12}).tails == {}

    def test_a_partition_without_records_moves_past_a_trailing_marker(self) -> None:
        """The commit marker came in a fetch of its own: no record, the position one past where the partition
        stands, which is where the batch moves it; a partition whose position did not move gets nothing."""
        a = Assignment()
        a.assigned([0, 1])
        claimed(a, {0: (1, 10), 1: (1, 5)})
        accepted = a.accept({}, {0: 11, 1: 5})
        assert (accepted.records, accepted.tails) == ({}, {0: 11})

    def test_the_next_batch_continues_from_the_position(self) -> None:
        """Built ahead: a batch ending at the position is dispatched; the next one starts there."""
        a = Assignment()
        a.assigned([0])
        claimed(a, {0: (1, 10)})
        a.accept({0: recs(10, 11)}, {0: 14})
        a.dispatched({0: 14})
        assert a.positions == {0: 14}
        assert a.accept({}, {0: 14}).tails == {}

    def test_a_partition_sought_again_or_not_held_gets_no_tail(self) -> None:
        a = Assignment()
        a.assigned([0, 1])
        claimed(a, {0: (1, 10)})
        accepted = a.accept({0: recs(20, 21)}, {0: 25, 1: 7})
        assert (accepted.reseek, accepted.tails) == ({0: 10}, {})


class TestStaleClaims:
    def test_a_claim_that_a_rebalance_overtook_is_not_used(self) -> None:
        """assign -> claim starts -> revoke + assign (a rebalance) -> the old claim finishes: it is ignored, the
        partitions stay pending for the new claim, whose epoch supersedes it."""
        a = Assignment()
        a.assigned([0, 1])
        ticket = a.begin_claim()
        a.revoked([0, 1])
        a.assigned([1, 2])
        assert not a.claimed(ticket, {0: (1, 0), 1: (1, 0)})
        assert a.epochs == {}
        assert a.pending == {1, 2}

    def test_a_revoke_during_the_claim_voids_it(self) -> None:
        a = Assignment()
        a.assigned([0])
        ticket = a.begin_claim()
        a.revoked([0])
        assert not a.claimed(ticket, {0: (1, 0)})
        assert a.accept({0: recs(0)}).records == {}

    def test_partitions_refused_by_a_newer_generation_stay_pending(self) -> None:
        """The database refused partition 1 (a newer generation's claim owns it): 0 is claimed, 1 waits."""
        a = Assignment()
        a.assigned([0, 1])
        assert a.claimed(a.begin_claim(), {0: (2, 5)})
        assert a.pending == {1}
        assert a.accept({0: recs(5), 1: recs(5)}).records == {0: recs(5)}


class TestRevokeAndFence:
    def test_revoked_partitions_are_never_applied_again(self) -> None:
        a = Assignment()
        a.assigned([0, 1])
        claimed(a, {0: (1, 0), 1: (1, 0)})
        a.revoked([0, 1])
        assert a.accept({0: recs(0), 1: recs(0)}).records == {}
        assert a.epochs == {}

    def test_a_fenced_partition_stops_at_once_and_the_others_go_on(self) -> None:
        a = Assignment()
        a.assigned([0, 1])
        claimed(a, {0: (1, 0), 1: (1, 0)})
        a.fenced([1], now=100.0)
        assert a.accept({0: recs(0), 1: recs(0)}).records == {0: recs(0)}

    def test_a_fence_that_kafka_never_resolves_is_overdue(self) -> None:
        """Fenced at t=100 and still assigned to us at t=131 (limit 30 s): the worker must rejoin."""
        a = Assignment()
        a.assigned([0])
        claimed(a, {0: (1, 0)})
        a.fenced([0], now=100.0)
        assert a.overdue_fenced([0], now=120.0, limit=30) is None
        assert a.overdue_fenced([0], now=131.0, limit=30) == 0

    def test_a_fence_resolved_by_a_new_claim_or_by_reassignment_is_forgotten(self) -> None:
        a = Assignment()
        a.assigned([0, 1])
        claimed(a, {0: (1, 0), 1: (1, 0)})
        a.fenced([0, 1], now=100.0)
        a.assigned([0, 1])
        claimed(a, {0: (3, 0), 1: (3, 0)})
        assert a.overdue_fenced([0, 1], now=1000.0, limit=30) is None
        a.fenced([1], now=1000.0)
        assert a.overdue_fenced([0], now=2000.0, limit=30) is None  # 1 is no longer assigned to us


class TestHoles:
    def test_a_halted_partition_is_not_ready_and_says_why(self) -> None:
        a = Assignment()
        a.assigned([0, 1])
        assert a.claimed(a.begin_claim(), {0: (1, 0)}, {1: "offsets 5-9 were deleted"})
        ok, detail = a.readiness()
        assert not ok
        assert "partition 1: offsets 5-9 were deleted" in detail
        assert a.accept({1: recs(10)}).records == {}

    def test_reclaim_makes_a_partition_pending_again(self) -> None:
        """A fetch out of range, or the periodic recheck of a halted partition: claim it again."""
        a = Assignment()
        a.assigned([0, 1])
        a.claimed(a.begin_claim(), {0: (1, 0)}, {1: "hole"})
        a.reclaim([0, 1])
        assert a.pending == {0, 1}
        assert a.halted == {}
        assert a.accept({0: recs(0)}).records == {}
        assert claimed(a, {0: (2, 0), 1: (2, 10)})
        assert a.readiness()[0]


class TestPipeline:
    """Batch N+1 is built while batch N's transaction runs; what happened meanwhile decides what N+1 may write."""

    @staticmethod
    def _two_built(a: Assignment) -> tuple[list[S], list[S]]:
        a.assigned([0, 1])
        claimed(a, {0: (1, 10), 1: (1, 20)})
        first = a.accept({0: recs(10, 11), 1: recs(20)}).records
        a.dispatched({0: 12, 1: 21})
        second = a.accept({0: recs(12, 13), 1: recs(21)}).records  # from where the first batch ends
        a.dispatched({0: 14, 1: 22})
        assert first == {0: recs(10, 11), 1: recs(20)}
        assert second == {0: recs(12, 13), 1: recs(21)}
        return [S(0, 1, 10, 12), S(1, 1, 20, 21)], [S(0, 1, 12, 14), S(1, 1, 21, 22)]

    def test_the_next_batch_continues_where_the_one_in_flight_ends(self) -> None:
        a = Assignment()
        batch_n, batch_n1 = self._two_built(a)
        assert a.stale(batch_n) == (set(), {})
        a.committed({0: 12, 1: 21})
        assert a.stale(batch_n1) == (set(), {})
        a.committed({0: 14, 1: 22})
        assert a.accept({0: recs(14)}).records == {0: recs(14)}

    def test_a_partition_fenced_in_flight_is_left_out_of_the_next_batch(self) -> None:
        """Batch N was fenced on partition 1: batch N+1, already built, must not write it (its claim seeks again)."""
        a = Assignment()
        _, batch_n1 = self._two_built(a)
        a.fenced([1], now=0.0)
        a.committed({0: 12})
        assert a.stale(batch_n1) == ({1}, {})

    def test_a_revocation_in_flight_leaves_everything_out(self) -> None:
        a = Assignment()
        _, batch_n1 = self._two_built(a)
        a.revoked([0, 1])
        assert a.stale(batch_n1) == ({0, 1}, {})

    def test_a_held_partition_under_another_epoch_is_sought_back(self) -> None:
        """Never the case in the worker (a claim waits for the batch in flight), but if it were: the dropped
        records were consumed, so the partition is sought back to the stored offset, not skipped."""
        a = Assignment()
        _, batch_n1 = self._two_built(a)
        a.reclaim([0])
        claimed(a, {0: (2, 12)})
        assert a.stale(batch_n1) == ({0}, {0: 12})


# ---------------------------------------------------------------------------------------------- every interleaving

EVENTS = st.lists(
    st.one_of(
        st.tuples(st.just("assign"), st.frozensets(st.integers(0, 3), min_size=1)),
        st.tuples(st.just("revoke"), st.just(frozenset())),
        st.tuples(st.just("begin_claim"), st.just(frozenset())),
        st.tuples(st.just("finish_claim"), st.just(frozenset())),
        st.tuples(st.just("fence"), st.frozensets(st.integers(0, 3))),
        st.tuples(st.just("fetch_commit"), st.frozensets(st.integers(0, 3))),
        st.tuples(st.just("build"), st.frozensets(st.integers(0, 3))),
        st.tuples(st.just("commit_built"), st.just(frozenset())),
        st.tuples(st.just("reclaim"), st.frozensets(st.integers(0, 3))),
    ),
    max_size=30,
)


class Model:
    """What the promises allow, kept by hand beside the real Assignment, event by event."""

    def __init__(self) -> None:
        self.a = Assignment()
        self.assigned: set[int] = set()
        self.tickets: list[ClaimTicket] = []
        self.valid: dict[int, int] = {}     # partition -> epoch of the claim allowed to write it
        self.expected: dict[int, int] = {}  # partition -> next offset it may write
        self.epoch = 0
        # The pipeline: batches built (accepted, dispatched) whose transaction has not run yet, oldest first; the
        # consumer's fetch position of each partition; the ledger's stored (epoch, next offset) per partition.
        self.built: list[list[S]] = []
        self.position: dict[int, int] = {}
        self.ledger: dict[int, tuple[int, int]] = {}

    def assign(self, ps: frozenset[int]) -> None:
        self.revoke(ps)
        self.assigned = set(ps)
        self.a.assigned(self.assigned)

    def revoke(self, _ps: frozenset[int]) -> None:
        self.a.revoked(self.assigned)
        self.valid.clear()
        self.assigned = set()

    def begin_claim(self, _ps: frozenset[int]) -> None:
        self.tickets.append(self.a.begin_claim())

    def finish_claim(self, _ps: frozenset[int]) -> None:
        if not self.tickets:
            return
        ticket = self.tickets.pop(0)
        self.epoch += 1
        current = ticket.version == self.a.version
        assert self.a.claimed(ticket, dict.fromkeys(ticket.partitions, (self.epoch, 100 * self.epoch))) == current
        if current:
            for p in set(ticket.partitions) & self.assigned:
                self.valid[p], self.expected[p] = self.epoch, 100 * self.epoch
                self.position[p] = 100 * self.epoch  # the claim seeks
        for p in ticket.partitions:  # the claim commits in the database even when a rebalance made it stale here
            self.ledger[p] = (self.epoch, 100 * self.epoch)

    def fence(self, ps: frozenset[int]) -> None:
        self.a.fenced(ps, now=0.0)
        for p in ps:
            self.valid.pop(p, None)

    def reclaim(self, ps: frozenset[int]) -> None:
        self.a.reclaim(ps & self.assigned)
        for p in ps:
            self.valid.pop(p, None)

    def fetch_commit(self, ps: frozenset[int]) -> None:
        accepted = self.a.accept({p: recs(self.expected.get(p, 0), self.expected.get(p, 0) + 1) for p in ps})
        assert set(accepted.records) <= set(self.valid), (accepted.records, self.valid)
        for p, rs in accepted.records.items():
            assert rs[0].offset >= self.expected[p]
            assert self.a.epochs[p] == self.valid[p]
        committed = {p: rs[-1].offset + 1 for p, rs in accepted.records.items()}
        if self.built:
            return  # with batches in flight the worker never takes this unpipelined path
        self.a.committed(committed)
        self.expected.update(committed)
        for p, (epoch, _) in [(p, self.ledger[p]) for p in committed]:
            self.ledger[p] = (epoch, committed[p])
            self.position[p] = committed[p]

    def build(self, ps: frozenset[int]) -> None:
        """Fetch two records of each partition from the consumer's position, accept them, dispatch the batch."""
        fetched = {p: recs(self.position.get(p, 0), self.position.get(p, 0) + 1) for p in ps}
        for p in ps:
            self.position[p] = self.position.get(p, 0) + 2
        accepted = self.a.accept(fetched)
        self.position.update(accepted.reseek)
        assert set(accepted.records) <= set(self.valid), (accepted.records, self.valid)
        batch = [S(p, self.a.epochs[p], rs[0].offset, rs[-1].offset + 1) for p, rs in accepted.records.items()]
        if batch:
            self.a.dispatched({x.partition: x.next_offset for x in batch})
            self.built.append(batch)

    def commit_built(self, _ps: frozenset[int]) -> None:
        """The oldest built batch's transaction: what `stale` keeps must pass the database's guard exactly (the
        stored epoch, from the stored offset on), so nothing is skipped, replayed, or refused as a regression."""
        if not self.built:
            return
        batch = self.built.pop(0)
        drop, reseek = self.a.stale(batch)
        self.position.update(reseek)
        kept = [x for x in batch if x.partition not in drop]
        for x in kept:
            assert self.valid.get(x.partition) == x.epoch
            assert self.ledger[x.partition] == (x.epoch, x.first_offset), (x, self.ledger[x.partition])
            self.ledger[x.partition] = (x.epoch, x.next_offset)
        self.a.committed({x.partition: x.next_offset for x in kept})
        self.expected.update({x.partition: x.next_offset for x in kept})
        # A partition still held that the guard would have refused is never silently skipped: it is sought back.
        for x in batch:
            if x.partition in drop and x.partition in self.a.epochs:
                assert self.position[x.partition] == self.ledger[x.partition][1]


@settings(max_examples=1500, deadline=None)
@given(EVENTS)
def test_every_interleaving_keeps_the_promises(events: list[tuple[str, frozenset[int]]]) -> None:
    """For any sequence of assign / revoke / claim started / claim finished / fenced / fetched+committed / reclaim:
    1. records are accepted only for partitions that are assigned, claimed by a claim that started under the current
       assignment, and neither fenced nor halted since;
    2. they are accepted only from the expected offset on, and the expected offset never goes backwards under one
       claim (no replay, no regression);
    3. the epoch used is the one of the latest claim that was accepted;
    4. with batches built ahead of their transaction (the pipeline), every slice that reaches its transaction starts
       at the ledger's stored offset under the stored epoch, and a held partition whose built slice was dropped is
       sought back to the stored offset."""
    model = Model()
    for kind, ps in events:
        getattr(model, kind)(ps)
    assert all(model.a.epochs[p] == model.valid[p] for p in model.a.epochs)


@pytest.mark.parametrize("halted", [{}, {1: "hole"}])
def test_readiness_reports_the_claimed_count(halted: dict[int, str]) -> None:
    a = Assignment()
    assert a.readiness() == (False, "not yet a member of the consumer group")
    a.assigned([0, 1])
    a.claimed(a.begin_claim(), {0: (1, 0), **({} if halted else {1: (1, 0)})}, halted)
    assert a.readiness()[0] is (not halted)
