"""Metric names and types: the contract's list, and Prometheus naming rules checked on the exposition itself."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from stock_ledger.domain import RejectCode
from stock_ledger.metrics import BatchHistogram, Metrics

if TYPE_CHECKING:
    from collections.abc import Callable

PART = {"group", "topic", "partition"}
# name in the exposition -> (type, label names), as the contract lists them.
CONTRACT = {
    "stock_ledger_partition_db_offset": ("gauge", PART),
    "stock_ledger_partition_log_end_offset": ("gauge", PART),
    "stock_ledger_partition_kafka_committed_offset": ("gauge", PART),
    "stock_ledger_partition_lag_messages": ("gauge", PART),
    "stock_ledger_partition_offset_drift_messages": ("gauge", PART),
    "stock_ledger_partition_gap_messages": ("gauge", PART),
    "stock_ledger_partition_lag_seconds": ("gauge", PART),
    "stock_ledger_monitor_leader": ("gauge", set()),
    "stock_ledger_assigned_partitions": ("gauge", set()),
    "stock_ledger_ready": ("gauge", set()),
    "stock_ledger_last_commit_timestamp_seconds": ("gauge", set()),
    "stock_ledger_ledger_coordinates_unique": ("gauge", set()),
    "stock_ledger_ledger_partitions_ahead_of_offset": ("gauge", set()),
    "stock_ledger_invariant_check_duration_seconds": ("histogram", {"scope"}),
    "stock_ledger_ledger_stock_level_mismatches": ("gauge", set()),
    "stock_ledger_ledger_missing_records": ("gauge", set()),
    "stock_ledger_negative_stock_levels": ("gauge", set()),
    "stock_ledger_negative_stock_units": ("gauge", set()),
    "stock_ledger_segment_headroom": ("gauge", PART),
    "stock_ledger_closing_age_seconds": ("gauge", set()),
    "stock_ledger_brin_ranges_behind": ("gauge", set()),
    "stock_ledger_build_info": ("gauge", {"version", "python", "aiokafka", "asyncpg"}),
    "stock_ledger_movements_applied_total": ("counter", set()),
    "stock_ledger_movements_rejected_total": ("counter", {"reason"}),
    "stock_ledger_batches_committed_total": ("counter", set()),
    "stock_ledger_batches_fenced_total": ("counter", set()),
    "stock_ledger_offset_mismatches_total": ("counter", {"direction"}),
    "stock_ledger_coordinate_conflicts_total": ("counter", set()),
    "stock_ledger_rebalances_total": ("counter", set()),
    "stock_ledger_partition_claims_total": ("counter", set()),
    "stock_ledger_retries_total": ("counter", {"cause"}),
    "stock_ledger_schema_registry_requests_total": ("counter", {"outcome"}),
    "stock_ledger_kafka_timestamps_out_of_range_total": ("counter", set()),
    "stock_ledger_batch_bisections_total": ("counter", set()),
    "stock_ledger_batch_duration_seconds": ("histogram", set()),
    "stock_ledger_batch_records": ("histogram", set()),
    "stock_ledger_end_to_end_latency_seconds": ("histogram", set()),
}
_TYPE = re.compile(r"^# TYPE (\S+) (\S+)$", re.MULTILINE)
# client_python's standard process, GC and platform collectors (the operations issue asks for them).
STANDARD = ("process_", "python_")


@pytest.fixture
def metrics() -> Metrics:
    return Metrics(CollectorRegistry())


def exposition(metrics: Metrics) -> str:
    """Every labelled family gets one child so its samples (and label names) appear in the text; as the monitor
    leader, which alone exports the partition and ledger gauges."""
    metrics.lead(leading=True)
    for gauge in (
        metrics.db_offset,
        metrics.log_end_offset,
        metrics.kafka_committed_offset,
        metrics.lag,
        metrics.drift,
        metrics.gap,
        metrics.lag_seconds,
        metrics.segment_headroom,
    ):
        gauge.labels("stock-ledger", "warehouse.movements", "0").set(1)
    return generate_latest(metrics.registry).decode()


def types(text: str) -> dict[str, str]:
    return dict(_TYPE.findall(text))


def label_names(text: str, name: str) -> set[str]:
    found: set[str] = set()
    for line in text.splitlines():
        if line.startswith((name + "{", name + "_bucket{")) and not line.startswith(name + "_created"):
            found |= set(re.findall(r'(\w+)="', line.split("{", 1)[1].rsplit("}", 1)[0])) - {"le"}
    return found


def test_every_contract_metric_is_exported_with_its_type_and_labels(metrics: Metrics) -> None:
    """Dashboards and alerts are written against the contract's names: each exists, with its type and labels."""
    text = exposition(metrics)
    exported = types(text)
    for name, (kind, labels) in CONTRACT.items():
        assert exported.get(name) == kind, f"{name}: expected a {kind}, exported {exported.get(name)}"
        assert label_names(text, name) == labels, name


def test_no_metric_outside_the_contract_and_its_conventions(metrics: Metrics) -> None:
    """Anything exported is either in the contract or the client library's `_created` companion series."""
    exported = types(exposition(metrics))
    extra = {n for n in exported if n not in CONTRACT and not n.endswith("_created") and not n.startswith(STANDARD)}
    assert extra == set()
    assert {"process_resident_memory_bytes", "python_gc_collections_total"} <= set(exported)


def test_naming_rules_hold_in_the_exposition(metrics: Metrics) -> None:
    """promtool-style rules, on the text Prometheus scrapes: everything is prefixed stock_ledger_; counters end in
    _total; no gauge ends in _total; histograms end in a base unit (_seconds) or count (_records)."""
    for name, kind in types(exposition(metrics)).items():
        if name.startswith(STANDARD):
            continue  # client_python's own names
        assert name.startswith("stock_ledger_"), name
        if kind == "counter":
            assert name.endswith("_total"), name
        elif kind == "gauge":
            assert not name.endswith("_total"), name
        elif kind == "histogram":
            assert name.endswith(("_seconds", "_records")), name
        else:
            pytest.fail(f"{name}: unexpected type {kind}")
        assert not re.search(r"_(milliseconds|ms|minutes|hours)(_|$)", name), f"{name}: use base units"


def test_labelled_counters_start_at_zero_for_every_value(metrics: Metrics) -> None:
    """Every rejection reason and every retry cause exists at 0 before any traffic (alerts see 0, not absence)."""
    registry = metrics.registry
    for code in RejectCode:
        assert registry.get_sample_value("stock_ledger_movements_rejected_total", {"reason": code.value}) == 0
    for cause in ("database", "kafka", "lock", "movement_id_race"):  # what retry.transient_cause returns
        assert registry.get_sample_value("stock_ledger_retries_total", {"cause": cause}) == 0
    assert registry.get_sample_value("stock_ledger_ready") == 0


LEADER_ONLY = (
    "stock_ledger_partition_db_offset", "stock_ledger_partition_log_end_offset",
    "stock_ledger_partition_kafka_committed_offset", "stock_ledger_partition_lag_messages",
    "stock_ledger_partition_offset_drift_messages", "stock_ledger_partition_gap_messages",
    "stock_ledger_partition_lag_seconds", "stock_ledger_ledger_coordinates_unique",
    "stock_ledger_ledger_partitions_ahead_of_offset", "stock_ledger_ledger_stock_level_mismatches",
    "stock_ledger_ledger_missing_records", "stock_ledger_negative_stock_levels", "stock_ledger_negative_stock_units",
)


def test_only_the_monitor_leader_exports_the_partition_and_ledger_gauges(metrics: Metrics) -> None:
    """1. A pod that never held the lease exports none of the leader's gauges (monitor_leader 0).
    2. Leading: the ledger gauges start at their defaults (coordinates_unique 1, the rest 0) and show what the
       timers set.
    3. The lease lost (a frozen leader thawed): every one of them disappears, though a refresh still sets them.
    4. Leading again: nothing of the earlier term comes back; values start afresh."""
    def names() -> set[str]:
        return set(types(generate_latest(metrics.registry).decode()))

    metrics.lead(leading=False)
    assert metrics.registry.get_sample_value("stock_ledger_monitor_leader") == 0
    assert not names() & set(LEADER_ONLY)
    metrics.lead(leading=True)
    assert metrics.registry.get_sample_value("stock_ledger_ledger_coordinates_unique") == 1
    assert metrics.registry.get_sample_value("stock_ledger_ledger_stock_level_mismatches") == 0
    metrics.lag.labels("g", "t", "0").set(93)
    metrics.level_mismatches.set(3)
    metrics.negative_stock_levels.set(2)
    assert metrics.registry.get_sample_value("stock_ledger_partition_lag_messages",
                                             {"group": "g", "topic": "t", "partition": "0"}) == 93
    metrics.lead(leading=False)
    metrics.lag.labels("g", "t", "1").set(107)  # a refresh that finished after the lease was lost
    assert metrics.registry.get_sample_value("stock_ledger_monitor_leader") == 0
    assert not names() & set(LEADER_ONLY)
    metrics.lead(leading=True)
    assert metrics.registry.get_sample_value("stock_ledger_partition_lag_messages",
                                             {"group": "g", "topic": "t", "partition": "1"}) is None
    assert metrics.registry.get_sample_value("stock_ledger_ledger_stock_level_mismatches") == 0
    assert metrics.registry.get_sample_value("stock_ledger_negative_stock_levels") == 0


def test_two_workers_in_one_process_do_not_collide() -> None:
    """Metrics live on an injected registry: two instances (two test workers) can coexist."""
    a, b = Metrics(CollectorRegistry()), Metrics(CollectorRegistry())
    a.applied.inc(5)
    assert a.registry.get_sample_value("stock_ledger_movements_applied_total") == 5
    assert b.registry.get_sample_value("stock_ledger_movements_applied_total") == 0


# ---------------------------------------------------------------------------------------------- end-to-end latency

_BOUNDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


def _histogram(observe: Callable[[BatchHistogram], None]) -> tuple[list[float], float]:
    registry = CollectorRegistry()
    h = BatchHistogram("stock_ledger_test_seconds", "test", _BOUNDS, registry)
    observe(h)
    (family,) = h.collect()
    buckets = [s.value for s in family.samples if s.name.endswith("_bucket")]
    (total,) = [s.value for s in family.samples if s.name.endswith("_sum")]
    return buckets, total


def _one_at_a_time(now: float, timestamps_ms: list[int]) -> tuple[list[float], float]:
    """The definition, value by value: the age of each timestamp that is a time, 0 if it lies ahead."""
    ages = [max(0.0, now - ts / 1000) for ts in timestamps_ms if ts >= 0]
    return [float(sum(1 for a in ages if a <= b)) for b in (*_BOUNDS, math.inf)], sum(ages)


def _check_ages(now: float, timestamps_ms: list[int]) -> None:
    buckets, total = _histogram(lambda h: h.observe_ages(now, timestamps_ms))
    want_buckets, want_total = _one_at_a_time(now, timestamps_ms)
    assert buckets == want_buckets
    # The sum may differ by float rounding only: far below a microsecond per record.
    assert total == pytest.approx(want_total, rel=1e-12, abs=1e-6 * (1 + len(timestamps_ms)))


# A clock read in whole milliseconds is where `now - ts / 1000` rounds across a bound most often.
@given(now=st.one_of(st.floats(min_value=0, max_value=4e9), st.integers(0, 4 * 10**12).map(lambda ms: ms / 1000)),
       timestamps_ms=st.lists(st.one_of(
    st.integers(min_value=-3, max_value=4 * 10**12), st.just(-1),
    st.integers(min_value=-400_000, max_value=1_000).map(lambda d: 1_700_000_000_000 + d))))
def test_end_to_end_latency_counts_each_record_as_one_value_at_a_time_would(now: float, timestamps_ms: list[int],
                                                                         ) -> None:
    """The batch histogram observes all of a batch's ages from one sort; it must count exactly as observing each
    record's age on its own, with the same float arithmetic."""
    _check_ages(now, timestamps_ms)
    _check_ages(1_700_000_000.0 + now % 1000, timestamps_ms)  # timestamps within minutes of now


def test_end_to_end_latency_at_every_bucket_edge() -> None:
    """Timestamps within 2 ms either side of where each bucket starts and ends, for now values with and without a
    fraction: the float rounding of `now - ts / 1000` decides, exactly as for a single value."""
    for now in (1_700_000_000.0, 1_700_000_000.0105, 1_764_547_200.123456, 999.999, 0.0, 8365.173):
        now_ms = now * 1000
        edges = [math.floor(now_ms - b * 1000) + d for b in (0.0, *_BOUNDS) for d in range(-2, 3)]
        _check_ages(now, edges)
        _check_ages(now, [*edges, -1, -1, int(now_ms) + 5_000])  # "none", and a timestamp ahead of now


def test_a_partition_no_longer_owned_leaves_the_headroom_of_this_worker(metrics: Metrics) -> None:
    """Its owner exports it; a value frozen here would keep a min over the pods (the alert's) wherever it was."""
    for topic, partition in (("t", 1), ("t", 2), ("u", 1)):
        metrics.segment_headroom.labels("g", topic, str(partition)).set(0.1)
    metrics.partitions_owned({("t", 2), ("t", 7), ("u", 1)})  # 7: not written here yet
    left = {(s.labels["topic"], s.labels["partition"]) for family in metrics.segment_headroom.collect()
            for s in family.samples}
    assert left == {("t", "2"), ("u", "1")}
