"""Offsets as runs: the compression and the set arithmetic `verify` relies on, checked against plain sets."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stock_ledger.audit.compare import Window, compare, gone_or_unknown, history_start, runs_from_boundaries, unread
from stock_ledger.audit.ranges import Found, Runs, clip, difference, union
from stock_ledger.cli.args import parse_partitions, past_time
from stock_ledger.errors import ConfigError

offsets = st.sets(st.integers(0, 300), max_size=120)


def expand(runs: object) -> set[int]:
    return {o for first, last in runs for o in range(first, last + 1)}  # type: ignore[attr-defined]


class TestRuns:
    """A partition's offsets, given in order, become runs of consecutive offsets."""

    def test_consecutive_offsets_are_one_run_and_markers_split_them(self) -> None:
        """0-4, a marker at 5, 6-8: two runs of eight offsets."""
        runs = Runs.of([0, 1, 2, 3, 4, 6, 7, 8])
        assert list(runs) == [(0, 4), (6, 8)]
        assert (runs.count, len(runs), runs.last) == (8, 2, 8)

    def test_an_offset_out_of_order_is_refused(self) -> None:
        runs = Runs.of([3, 4])
        with pytest.raises(ValueError, match="must increase"):
            runs.add(4)

    def test_add_run_merges_an_adjacent_run(self) -> None:
        runs = Runs()
        runs.add_run(0, 9)
        runs.add_run(10, 19)
        runs.add_run(30, 30)
        assert list(runs) == [(0, 19), (30, 30)]
        assert runs.count == 21

    @given(offsets)
    def test_runs_hold_exactly_the_offsets(self, values: set[int]) -> None:
        runs = Runs.of(sorted(values))
        assert expand(runs) == values
        assert runs.count == len(values)
        assert all(b[0] > a[1] + 1 for a, b in zip(list(runs), list(runs)[1:], strict=False))


class TestDifference:
    @given(offsets, offsets)
    def test_difference_is_the_set_difference(self, a: set[int], b: set[int]) -> None:
        """For any two sets, runs(a) - runs(b) holds exactly a - b, as sorted disjoint runs."""
        result = list(difference(Runs.of(sorted(a)), Runs.of(sorted(b))))
        assert expand(result) == a - b
        assert result == list(Runs.of(sorted(a - b)))

    def test_a_long_run_of_b_covering_several_runs_of_a(self) -> None:
        assert list(difference([(0, 2), (5, 7), (9, 12)], [(1, 10)])) == [(0, 0), (11, 12)]

    @given(offsets, st.integers(0, 300), st.integers(0, 300))
    def test_clip_keeps_the_parts_in_range(self, a: set[int], low: int, high: int) -> None:
        assert expand(clip(Runs.of(sorted(a)), low, high)) == {o for o in a if low <= o <= high}


class TestUnion:
    @given(offsets, offsets)
    def test_union_is_the_set_union_with_adjacent_runs_joined(self, a: set[int], b: set[int]) -> None:
        together = list(union(Runs.of(sorted(a)), Runs.of(sorted(b))))
        assert expand(together) == a | b
        assert all(first <= last for first, last in together)
        assert all(x[1] + 1 < y[0] for x, y in itertools.pairwise(together))  # disjoint, not adjacent


class TestBelowTheLogStart:
    """Offsets Kafka can no longer read: what the ledger knows decides (compare.unread, gone_or_unknown); verify,
    repair and the invariant checks all judge them with these."""

    def test_a_marker_the_worker_recorded_is_not_a_candidate(self) -> None:
        """Rows 0-8 and 10-18, 9 and 19 recorded as holding no record: nothing below 20 is a candidate; a row lost
        at 12 is."""
        ledger = Runs.of([*range(9), *range(10, 19)])
        assert unread(ledger, [(9, 9), (19, 19)], 0, 19) == []
        lost = Runs.of([*range(9), 10, 11, *range(13, 19)])
        assert unread(lost, [(9, 9), (19, 19)], 0, 19) == [(12, 12)]

    def test_inside_the_known_range_a_candidate_is_gone_outside_unknown(self) -> None:
        """Known from 100: candidates at 50 and 120-121 are unknown and gone."""
        assert gone_or_unknown([(50, 50), (120, 121)], (100, 199)) == ([(120, 121)], [(50, 50)])
        assert gone_or_unknown([(50, 50), (120, 121)], None) == ([], [(50, 50), (120, 121)])
        assert gone_or_unknown([(95, 105)], (100, 199)) == ([(100, 105)], [(95, 99)])

    def test_history_starts_at_the_first_thing_the_ledger_knows(self) -> None:
        assert history_start(Runs.of([5, 6]), [(3, 4)], (10, 20)) == 3
        assert history_start(Runs.of([5, 6]), [], (0, 20)) == 0
        assert history_start(Runs(), [], None) is None

    @given(offsets, offsets, st.integers(0, 300), st.integers(0, 300))
    def test_unread_is_the_range_without_rows_and_non_records(self, rows: set[int], markers: set[int], low: int,
                                                             high: int) -> None:
        markers -= rows
        got = unread(Runs.of(sorted(rows)), list(Runs.of(sorted(markers))), low, high)
        assert expand(got) == set(range(low, high + 1)) - rows - markers


class TestLedgerRuns:
    """The boundary rows PostgreSQL returns (offset, previous, next) rebuild the ledger's runs."""

    @staticmethod
    def boundaries(values: list[int]) -> list[tuple[int, int | None, int | None]]:
        rows = [(o, values[i - 1] if i else None, values[i + 1] if i + 1 < len(values) else None)
                for i, o in enumerate(values)]
        return [r for r in rows if r[1] is None or r[2] is None or r[0] - r[1] != 1 or r[2] - r[0] != 1]

    @given(st.lists(st.integers(0, 200), max_size=100))
    def test_runs_and_repeats_from_boundary_rows(self, values: list[int]) -> None:
        """Any multiset of offsets: the runs hold each distinct offset once, the repeats count the extra copies."""
        ordered = sorted(values)
        runs, repeated = runs_from_boundaries(self.boundaries(ordered))
        assert expand(runs) == set(ordered)
        assert repeated.offsets == len(ordered) - len(set(ordered))

    def test_only_boundaries_leave_the_server(self) -> None:
        """A million consecutive offsets are two boundary rows."""
        assert len(self.boundaries(list(range(1_000_000)))) == 2


class TestCompare:
    def test_missing_is_only_below_the_stored_offset_and_phantoms_only_at_or_above_the_log_start(self) -> None:
        """Topic 0-99 minus a marker at 50; ledger lacks 10 and 95 (95 not yet applied: stored 90), holds 50 (not a
        record) and 3 below the log start of 5 (deleted by retention, not comparable) and 130 (beyond the log end
        read after the snapshot), and 105 (produced during the run, between the two end reads)."""
        topic = Runs.of([o for o in range(5, 100) if o != 50])
        ledger = Runs.of(sorted({3, *(o for o in range(5, 90) if o != 10), 50, 105, 130}))
        missing, phantoms = compare(topic, ledger, Window(start=0, log_start=5, end=100, end_after=110, stored=90))
        assert missing.sample == [(10, 10)]
        assert phantoms.sample == [(50, 50), (130, 130)]
        assert (missing.offsets, phantoms.offsets) == (1, 2)

    def test_found_keeps_a_sample_and_counts_everything(self) -> None:
        found = Found().extend([(i * 10, i * 10 + 1) for i in range(20)])
        assert (found.offsets, found.runs, len(found.sample)) == (40, 20, 5)


class TestArguments:
    def test_since_takes_durations_and_iso_times(self) -> None:
        now = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
        assert past_time("15m", "--since", now) == datetime(2026, 11, 30, 11, 45, tzinfo=UTC)
        assert past_time("2d", "--since", now) == datetime(2026, 11, 28, 12, 0, tzinfo=UTC)
        assert past_time("2026-11-30T10:00:00", "--since", now) == datetime(2026, 11, 30, 10, 0, tzinfo=UTC)
        assert past_time("2026-11-30T10:00:00+01:00", "--since").utcoffset() is not None
        with pytest.raises(ConfigError, match="--since 'yesterday'"):
            past_time("yesterday", "--since")

    def test_partitions_repeatable_and_comma_separated(self) -> None:
        assert parse_partitions([]) is None
        assert parse_partitions(["3", "5,7"]) == frozenset({3, 5, 7})
        with pytest.raises(ConfigError, match="--partition 'x'"):
            parse_partitions(["1,x"])
        with pytest.raises(ConfigError, match="negative"):
            parse_partitions(["-1"])
