"""The parts of `stock-ledger repair` that need no services: its exit code, its summary and range arithmetic."""

from __future__ import annotations

import uuid
from collections import Counter

from stock_ledger.audit.ranges import merged
from stock_ledger.audit.repair import EXIT_GONE, PartitionRepair, RepairReport, render


def report(*partitions: PartitionRepair, dry_run: bool = False) -> RepairReport:
    return RepairReport("warehouse.movements", "g", uuid.uuid4(), dry_run, list(partitions))


class TestExitCode:
    """0 when everything found was written, EXIT_GONE (3) while a range is gone from Kafka, 1 when a partition
    could not be repaired at all (that outranks a gone range: something needs looking at first)."""

    def test_nothing_found_or_everything_applied_is_0(self) -> None:
        assert report(PartitionRepair(0, 10, 0, 10)).exit_code == 0
        assert report(PartitionRepair(0, 10, 0, 10, missing=[(2, 3)], applied=2)).exit_code == 0

    def test_a_gone_range_is_3(self) -> None:
        assert EXIT_GONE == 3
        assert report(PartitionRepair(0, 10, 5, 10, gone=[(1, 2)])).exit_code == EXIT_GONE

    def test_a_refused_partition_is_1(self) -> None:
        refused = PartitionRepair(1, 99, 0, 10, refused="stored offset 99 is past the log end 10")
        assert report(PartitionRepair(0, 10, 5, 10, gone=[(1, 2)]), refused).exit_code == 1


def test_the_summary_names_each_partition_what_was_quarantined_and_what_is_gone() -> None:
    """Only partitions where something was found get a row; gone ranges carry their ledger_gaps ids and what to
    do; a dry run says so and says it would apply."""
    hit = PartitionRepair(5, 50, 30, 50, missing=[(30, 39)], applied=8,
                          quarantined=Counter({"invalid_field": 1, "duplicate_movement_id": 1}), gone=[(20, 29)],
                          gap_ids=[7])
    text = render(report(PartitionRepair(0, 10, 0, 10), hit))
    assert "2 partitions examined" in text
    assert [line.split()[0] for line in text.splitlines()[1:3]] == ["partition", "5"]
    assert "p5: missing 30-39" in text
    assert "p5: quarantined duplicate_movement_id 1, invalid_field 1" in text
    assert "p5: GONE from Kafka, below the log start 30: 20-29 (ledger_gaps #7)" in text
    assert "total: missing 10, applied 8, quarantined 2, already present 0, gone 10" in text
    assert "gaps ack" in text.splitlines()[-1]
    dry = render(report(PartitionRepair(5, 50, 30, 50, missing=[(30, 39)], applied=10), dry_run=True))
    assert "dry run, nothing written" in dry
    assert "would apply 10" in dry
    assert "p0" not in dry


def test_recorded_gaps_are_merged_into_disjoint_runs() -> None:
    """ledger_gaps rows may overlap or touch; the difference with them needs sorted, disjoint runs."""
    assert merged([(10, 19), (0, 4), (5, 7), (15, 25), (30, 30)]) == [(0, 7), (10, 25), (30, 30)]
    assert merged([]) == []
