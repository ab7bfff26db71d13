"""The worker's fetch loop: a batch taken from the consumer in chunks. Its bookkeeping is pure logic, tested here
against a consumer that plays scripted answers; the real consumer and broker run it in tests/integration and
tests/chaos (every drain, crash and rebalance test goes through it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import OffsetOutOfRangeError
from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs

from stock_ledger.ledger.batch import Record
from stock_ledger.worker import Worker
from stock_ledger.worker.intake import take


@dataclass(frozen=True)
class _Rec:
    offset: int


class _ScriptedConsumer:
    """Plays getmany's answers from a script (a chunk of records per partition, or an exception to raise) and
    records seeks: the fetch loop's bookkeeping is pure logic; the real consumer runs in tests/integration."""

    def __init__(self, script: list[dict[TopicPartition, list[Any]] | Exception], assigned: set[TopicPartition],
                 ) -> None:
        self.script = script
        self.assigned = assigned
        self.calls: list[tuple[int, int]] = []
        self.seeks: list[tuple[TopicPartition, int]] = []
        self.positions: dict[TopicPartition, int] = {}  # what `position` answers

    async def getmany(self, *, timeout_ms: int, max_records: int) -> dict[TopicPartition, list[Any]]:
        self.calls.append((timeout_ms, max_records))
        step = self.script.pop(0) if self.script else {}
        if isinstance(step, Exception):
            raise step
        assert sum(map(len, step.values())) <= max_records, "the script hands out no more than asked"
        return step

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.seeks.append((tp, offset))

    def assignment(self) -> set[TopicPartition]:
        return self.assigned

    async def position(self, tp: TopicPartition) -> int:
        """As scripted: aiokafka's is past the records returned so far and past the offsets after them that held no
        data record."""
        return self.positions[tp]

    def play(self, w: Worker, monkeypatch: pytest.MonkeyPatch) -> _ScriptedConsumer:
        """In place of the worker's (unstarted) consumer's own methods, so its fixture still closes it."""
        for name in ("getmany", "seek", "assignment", "position"):
            monkeypatch.setattr(w.consumer, name, getattr(self, name))
        return self


def _recs(first: int, n: int) -> list[_Rec]:
    return [_Rec(o) for o in range(first, first + n)]


TP0, TP1 = TopicPartition("t", 0), TopicPartition("t", 1)


@pytest.mark.asyncio
class TestFetch:
    """`Intake.fetch` takes a batch in chunks so the transaction in flight is not held up; whatever it took from
    the consumer must end up in the batch or be given back by a seek: a record taken and dropped would leave a hole
    that the next fetch starts past."""

    async def test_chunks_add_up_to_a_batch_and_only_the_first_waits(
        self, make: Callable[..., Worker], monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        w = make(batch_max_records=1200, batch_max_wait_ms=300)
        fake = _ScriptedConsumer(
            [{TP0: _recs(0, 300), TP1: _recs(10, 200)}, {TP0: _recs(300, 500)}, {TP1: _recs(210, 200)}],
            {TP0, TP1}).play(w, monkeypatch)
        fetched = (await w.intake.fetch()).records
        assert [r.offset for r in fetched[TP0]] == list(range(800))
        assert [r.offset for r in fetched[TP1]] == list(range(10, 410))
        assert fake.calls == [(300, 500), (0, 500), (0, 200)]  # then the batch is full: no fourth call
        assert fake.seeks == []

    async def test_an_empty_chunk_ends_the_fetch(
        self, make: Callable[..., Worker], monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        w = make(batch_max_records=5000)
        fake = _ScriptedConsumer([{TP0: _recs(5, 3)}, {}, {TP0: _recs(8, 3)}], {TP0}).play(w, monkeypatch)
        assert {tp: [r.offset for r in rs] for tp, rs in (await w.intake.fetch()).records.items()} == {TP0: [5, 6, 7]}
        assert len(fake.calls) == 2

    async def test_a_chunk_of_empty_lists_ends_the_fetch(
        self, make: Callable[..., Worker], monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """aiokafka leaves empty lists out, but a chunk of them must not keep the loop asking without end."""
        w = make(batch_max_records=5000)
        fake = _ScriptedConsumer([{TP0: _recs(0, 2)}, *[{TP0: []}] * 50], {TP0}).play(w, monkeypatch)
        assert [r.offset for r in (await w.intake.fetch()).records[TP0]] == [0, 1]
        assert len(fake.calls) == 2

    async def test_a_chunk_sought_back_in_between_is_given_back(
        self, make: Callable[..., Worker], monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """The batch in flight found partition 0 stale and sought it back to 100 between two chunks."""
        w = make(batch_max_records=5000)
        fake = _ScriptedConsumer(
            [{TP0: _recs(100, 50), TP1: _recs(0, 50)}, {TP0: _recs(100, 20), TP1: _recs(50, 20)}, {TP1: _recs(70, 5)}],
            {TP0, TP1}).play(w, monkeypatch)
        with capture_logs() as logs:
            fetched = (await w.intake.fetch()).records
        assert [r.offset for r in fetched[TP0]] == list(range(100, 150))
        assert [r.offset for r in fetched[TP1]] == list(range(70))  # the partition that did not move keeps its chunk
        assert fake.seeks == [(TP0, 100)]
        assert len(fake.calls) == 2  # no more chunks after a give-back
        assert [e["event"] for e in logs] == ["fetch.give_back"]

    async def test_a_partition_no_longer_assigned_is_not_sought(
        self, make: Callable[..., Worker], monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        w = make(batch_max_records=5000)
        fake = _ScriptedConsumer([{TP0: _recs(7, 2)}, {TP0: _recs(7, 2)}], set()).play(w, monkeypatch)
        assert [r.offset for r in (await w.intake.fetch()).records[TP0]] == [7, 8]
        assert fake.seeks == []

    async def test_an_error_after_the_first_chunk_keeps_what_was_taken(
        self, make: Callable[..., Worker], monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """aiokafka raises a partition's fetch error only from a call that took nothing, once: the chunks taken
        before it stay in the batch, and the hole goes to the claim path as before."""
        w = make(batch_max_records=5000)
        reexamined: list[tuple[list[int], str]] = []
        monkeypatch.setattr(w.claimer, "reexamine", lambda ps, reason: reexamined.append((list(ps), reason)))
        _ScriptedConsumer(
            [{TP0: _recs(0, 10)}, OffsetOutOfRangeError({TP1: 42}), {TP0: _recs(10, 10)}],
            {TP0, TP1}).play(w, monkeypatch)
        fetched = (await w.intake.fetch()).records
        assert [r.offset for r in fetched[TP0]] == list(range(10))
        assert [ps for ps, _ in reexamined] == [[1]]


    async def test_the_positions_of_claimed_partitions_are_read_after_each_chunk(
        self, make: Callable[..., Worker], monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """Partition 0 (claimed at 10) brings records 10-11 and its position passes a marker (13); partition 1
        (claimed at 5) brings no record but its position passed a trailing marker (6): both are kept for the batch.
        A partition whose position did not move is not."""
        w = make(batch_max_records=5000, topic="t")
        w.assignment.assigned([0, 1, 2])
        w.assignment.claimed(w.assignment.begin_claim(), {0: (1, 10), 1: (1, 5), 2: (1, 3)})
        records = [Record(0, o, 1_700_000_000_000, b"k", b"{}") for o in (10, 11)]
        fake = _ScriptedConsumer([{TP0: records}], {TP0, TP1, TopicPartition("t", 2)}).play(w, monkeypatch)
        fake.positions = {TP0: 13, TP1: 6, TopicPartition("t", 2): 3}
        fetched = await w.intake.fetch()
        assert fetched.positions == {0: 13, 1: 6}
        batch = await w.intake.build(fetched)
        assert batch is not None
        assert [(x.partition, x.first_offset, x.next_offset, x.expected) for x in batch.slices] == [
            (0, 10, 13, 10), (1, 5, 6, 5)]


@given(st.lists(st.dictionaries(st.sampled_from([TP0, TP1]), st.tuples(st.integers(0, 80), st.integers(0, 8))),
                max_size=8))
def test_take_loses_no_record_and_keeps_each_partition_in_order(
    chunks: list[dict[TopicPartition, tuple[int, int]]],
) -> None:
    """Any run of chunks (a chunk: consecutive offsets from any start, as after any seek): every record taken is in
    `fetched` or at or after an offset given back for its partition; each partition's records stay increasing."""
    fetched: dict[TopicPartition, list[_Rec]] = {}
    given_back: dict[TopicPartition, list[int]] = {}
    taken: dict[TopicPartition, set[int]] = {}
    for chunk in chunks:
        got = {tp: _recs(first, n) for tp, (first, n) in chunk.items()}
        for tp, recs in got.items():
            taken.setdefault(tp, set()).update(r.offset for r in recs)
        for tp, offset in take(fetched, got).items():
            assert offset == got[tp][0].offset
            given_back.setdefault(tp, []).append(offset)
    for tp, offsets in taken.items():
        kept = [r.offset for r in fetched.get(tp, [])]
        assert kept == sorted(set(kept))
        lost = offsets - set(kept) - {o for b in given_back.get(tp, []) for o in offsets if o >= b}
        assert not lost
