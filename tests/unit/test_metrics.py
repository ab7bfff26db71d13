"""Metric names and types: the contract's list, and Prometheus naming rules checked on the exposition itself."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from stock_ledger.domain import RejectCode
from stock_ledger.metrics import Metrics

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
    "stock_ledger_negative_stock_levels": ("gauge", set()),
    "stock_ledger_negative_stock_units": ("gauge", set()),
    "stock_ledger_build_info": ("gauge", {"version", "python", "aiokafka", "asyncpg"}),
    "stock_ledger_movements_applied_total": ("counter", set()),
    "stock_ledger_movements_rejected_total": ("counter", {"reason"}),
    "stock_ledger_batches_committed_total": ("counter", set()),
    "stock_ledger_batches_fenced_total": ("counter", set()),
    "stock_ledger_rebalances_total": ("counter", set()),
    "stock_ledger_partition_claims_total": ("counter", set()),
    "stock_ledger_retries_total": ("counter", {"cause"}),
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
    """Every labelled family gets one child so its samples (and label names) appear in the text."""
    for gauge in (
        metrics.db_offset,
        metrics.log_end_offset,
        metrics.kafka_committed_offset,
        metrics.lag,
        metrics.drift,
        metrics.gap,
        metrics.lag_seconds,
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


def test_two_workers_in_one_process_do_not_collide() -> None:
    """Metrics live on an injected registry: two instances (two test workers) can coexist."""
    a, b = Metrics(CollectorRegistry()), Metrics(CollectorRegistry())
    a.applied.inc(5)
    assert a.registry.get_sample_value("stock_ledger_movements_applied_total") == 5
    assert b.registry.get_sample_value("stock_ledger_movements_applied_total") == 0
