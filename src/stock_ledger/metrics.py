"""Prometheus metrics, registered on a registry the service owns (a fresh one per test)."""

from __future__ import annotations

import bisect
import functools
import math
import platform
import threading
import time
from typing import TYPE_CHECKING, Generic, Self, TypeVar, cast, overload

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from stock_ledger.domain import RejectCode
from stock_ledger.versions import version_of

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence

_P = "stock_ledger_"
_RETRY_CAUSES = ("database", "kafka", "lock", "movement_id_race", "schema_registry")
_M = TypeVar("_M")


def _first_within(now: float, bound: float) -> int:
    """The least integer timestamp (ms) whose age at `now`, `now - ts / 1000` in float arithmetic, is at most `bound`
    seconds: the age falls as ts rises, so the estimate from one multiplication is corrected by the comparison
    itself."""
    ts = math.ceil((now - bound) * 1000)
    while now - (ts - 1) / 1000 <= bound:
        ts -= 1
    while now - ts / 1000 > bound:
        ts += 1
    return ts


class BatchHistogram(Collector):
    """A histogram fed a batch at a time: one sort and a bisect per bucket. prometheus_client's Histogram takes a
    lock and walks its buckets in Python for every value: ~2 us a record, ~10% of the worker's throughput
    (`python -m scripts.bench`)."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry) -> None:
        self._name, self._doc = name, documentation
        self._bounds = [*buckets, float("inf")]
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._lock = threading.Lock()  # the exposition may be rendered from another thread
        registry.register(self)

    def observe_ages(self, now: float, timestamps_ms: Sequence[int]) -> None:
        """Observe each timestamp's age at `now`: `max(0, now - ts / 1000)` seconds; negative timestamps ("none")
        are skipped. Without a Python step per value (a list of a batch's ages was 2-3 % of the worker's CPU): ages
        fall as timestamps rise, so the values within a bound are the timestamps from a threshold on."""
        ordered = sorted(timestamps_ms)
        ordered = ordered[bisect.bisect_left(ordered, 0):]
        n = len(ordered)
        ahead = bisect.bisect_left(ordered, _first_within(now, 0.0))  # the ones older than 0 s: the sum's terms
        with self._lock:
            below = 0
            for i, bound in enumerate(self._bounds):
                upto = n if bound == math.inf else n - bisect.bisect_left(ordered, _first_within(now, bound))
                self._counts[i] += upto - below
                below = upto
            if ahead:  # Σ (now - ts / 1000) from the oldest: exact integers but for one float term
                oldest = ordered[0]
                self._sum += ahead * (now - oldest / 1000) - (sum(ordered[:ahead]) - ahead * oldest) / 1000

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            cumulative, total = [], 0
            for bound, n in zip(self._bounds, self._counts, strict=True):
                total += n
                cumulative.append((floatToGoString(bound), total))  # type: ignore[no-untyped-call]
            family = HistogramMetricFamily(self._name, self._doc, buckets=cumulative, sum_value=self._sum)
        yield family


class LeaderOnly(Collector):
    """The gauges only the monitor leader may export (positions.py): registered on a registry of their own and
    collected only while this pod leads. A pod that lost the lease (frozen, then thawed; a failover) would otherwise
    keep exporting its last values beside the leader's, and `max by`/`min by` would keep or hide an alert."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.inner = CollectorRegistry()
        self.leading = False
        registry.register(self)

    def describe(self) -> Iterable[Metric]:
        return self.inner.collect()  # the names, so a collision with the outer registry's is refused

    def collect(self) -> Iterator[Metric]:
        if self.leading:
            yield from self.inner.collect()


class _Declared(Generic[_M]):
    """A metric declared on `Metrics`: each `Metrics` builds its own, in the order declared, on the service's registry
    or (`leader`) on the monitor leader's. `preset`: label values whose series exist before anything happens, so
    rate() and alerts see a 0, not an absence."""

    def __init__(self, build: Callable[..., _M], *, leader: bool = False, preset: Iterable[str] = ()) -> None:
        self.build, self.leader, self.preset = build, leader, tuple(preset)
        self.attr = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.attr = name

    @overload
    def __get__(self, obj: None, owner: type) -> Self: ...
    @overload
    def __get__(self, obj: Metrics, owner: type) -> _M: ...
    def __get__(self, obj: Metrics | None, owner: type) -> Self | _M:
        # Reached for the class only: the metric a `Metrics` built shadows its declaration.
        return self if obj is None else cast("_M", vars(obj)[self.attr])


def _gauge(name: str, doc: str, labels: Sequence[str] = (), *, leader: bool = False) -> _Declared[Gauge]:
    return _Declared(functools.partial(Gauge, _P + name, doc, labels), leader=leader)


def _counter(name: str, doc: str, labels: Sequence[str] = (), *, preset: Iterable[str] = ()) -> _Declared[Counter]:
    return _Declared(functools.partial(Counter, _P + name, doc, labels), preset=preset)


def _histogram(name: str, doc: str, buckets: Sequence[float], labels: Sequence[str] = (), *,
               preset: Iterable[str] = ()) -> _Declared[Histogram]:
    return _Declared(functools.partial(Histogram, _P + name, doc, labels, buckets=buckets), preset=preset)


_PART = ["group", "topic", "partition"]


class Metrics:
    # Positions, refreshed on a timer from Kafka and PostgreSQL (positions.py).
    db_offset = _gauge("partition_db_offset", "Next offset to apply, stored in PostgreSQL.", _PART, leader=True)
    log_end_offset = _gauge("partition_log_end_offset", "Log end offset of the partition in Kafka.", _PART,
                            leader=True)
    kafka_committed_offset = _gauge("partition_kafka_committed_offset",
                                    "The group's committed offset in Kafka (advisory).", _PART, leader=True)
    lag = _gauge("partition_lag_messages", "Log end offset minus the PostgreSQL offset.", _PART, leader=True)
    drift = _gauge("partition_offset_drift_messages",
                   "PostgreSQL offset minus Kafka's committed offset; negative means the seek path is broken.", _PART,
                   leader=True)
    lag_seconds = _gauge("partition_lag_seconds",
                         "Age of the oldest unapplied record (now - its Kafka timestamp); 0 when caught up.", _PART,
                         leader=True)
    monitor_leader = _gauge("monitor_leader",
                            "1 on the one pod of the group that runs the lag/drift timer and the ledger checks (it "
                            "holds the advisory-lock lease); the partition gauges come from it.")
    gap = _gauge("partition_gap_messages",
                 "Records between the PostgreSQL offset and the log that can never be applied: below the log start "
                 "(retention, deleted records) or past its end (topic recreated). Non-zero: a hole.", _PART,
                 leader=True)
    segment_headroom = _gauge(
        "segment_headroom",
        "Segments of stock_movements made ahead of this worker's last batch of the partition (0.5 to 1.5 while the "
        "worker keeps them; below 0.25 the calls that make them are failing; at 0 batches wait for one).", _PART)
    assigned_partitions = _gauge("assigned_partitions", "Partitions claimed by this worker.")
    ready = _gauge("ready", "1 when connected and every assigned partition is claimed.")
    last_commit = _gauge("last_commit_timestamp_seconds", "Unix time of the last batch commit.")
    # Work.
    applied = _counter("movements_applied", "Movements applied to the ledger.")
    rejected = _counter("movements_rejected", "Records quarantined in rejected_movements.", ["reason"],
                        preset=[code.value for code in RejectCode])
    batches = _counter("batches_committed", "Batch transactions committed.")
    fenced = _counter("batches_fenced", "Batches rolled back because another claim owns a partition.")
    offset_mismatches = _counter(
        "offset_mismatches",
        "Partitions whose stored offset was not where this worker left it, claimed again and re-applied from Kafka: "
        "behind (the database went back in time: a failover that lost commits, a restore) or ahead (moved by someone "
        "else).", ["direction"], preset=["behind", "ahead"])
    coordinate_conflicts = _counter(
        "coordinate_conflicts",
        "Records of a batch whose coordinates the ledger already held although the offset guard let the batch "
        "through (written outside it: a repair racing an offsets set, a tool, a partial restore): left as found, "
        "not written again; the rest of the batch was applied.")
    rebalances = _counter("rebalances", "Partition assignments received from the group.")
    claims = _counter("partition_claims", "Partitions claimed in PostgreSQL.")
    retries = _counter("retries", "Retried operations by cause.", ["cause"], preset=_RETRY_CAUSES)
    schema_requests = _counter(
        "schema_registry_requests",
        "Requests to the schema registry by outcome: fetched (one per schema id and process, never per record), "
        "not_found (an id it does not know yet), error (down, timeout, 5xx: the records wait).", ["outcome"],
        preset=["fetched", "not_found", "error"])
    # Input the ledger survives rather than stops on (issue 9).
    kafka_timestamps_out_of_range = _counter(
        "kafka_timestamps_out_of_range",
        "Records whose Kafka timestamp is negative (not -1) or past year 9999: stored with a NULL kafka_timestamp.")
    batch_bisections = _counter(
        "batch_bisections",
        "Splits of a batch chunk PostgreSQL refused, to isolate and quarantine the refused records.")
    # Latency.
    batch_duration = _histogram("batch_duration_seconds", "Duration of the batch transaction.",
                                (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
    batch_records = _histogram("batch_records", "Records per batch.",
                               (1, 10, 50, 100, 500, 1000, 2500, 5000, 10000, 25000))
    end_to_end = _Declared(functools.partial(
        BatchHistogram, _P + "end_to_end_latency_seconds", "Kafka record timestamp to PostgreSQL commit.",
        (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)))
    # Ledger invariants, on a slow timer (positions.py, invariants.py).
    coordinates_unique = _gauge(
        "ledger_coordinates_unique",
        "1 while the unique constraint on (kafka_topic, kafka_partition, kafka_offset) is present and valid.",
        leader=True)
    partitions_ahead = _gauge("ledger_partitions_ahead_of_offset",
                              "Partitions holding a row at or beyond their stored next offset.", leader=True)
    invariant_check = _histogram("invariant_check_duration_seconds", "Duration of an invariant check, by scope.",
                                 (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300), ["scope"],
                                 preset=["baseline", "incremental", "full"])
    level_mismatches = _gauge("ledger_stock_level_mismatches",
                              "stock_levels rows that differ from the sum of their movements.", leader=True)
    missing_records = _gauge("ledger_missing_records",
                             "Records below a stored offset in neither stock_movements nor rejected_movements (Kafka "
                             "holds them: a hole in the ledger), as last found.", leader=True)
    # Warehouse signals, on the position timer from the partial index of negative levels (positions.py).
    # The leader exports the whole-ledger value: aggregate with max.
    negative_stock_levels = _gauge("negative_stock_levels", "(warehouse, sku) pairs whose on_hand is below zero.",
                                   leader=True)
    negative_stock_units = _gauge("negative_stock_units",
                                  "Sum of the deficits of the pairs below zero, as a positive number.", leader=True)
    closing_age_seconds = _gauge("closing_age_seconds",
                                 "Age of the newest closing balance (`stock show --at` reads from it; taken every "
                                 "STOCK_LEDGER_CLOSING_SECONDS).", leader=True)
    brin_ranges_behind = _gauge("brin_ranges_behind",
                                "BRIN block ranges the monitor's summarizing pass has still to check (2,048 a closings "
                                "tick); each may be read by every query through its index until then.", leader=True)
    build_info = _gauge("build_info", "Versions of stock-ledger and its drivers.",
                        ["version", "python", "aiokafka", "asyncpg"])

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._leader = LeaderOnly(registry)
        # The process (RSS, CPU, open files) and Python's garbage collector, as every client_python service has.
        ProcessCollector(registry=registry)
        GCCollector(registry=registry)
        PlatformCollector(registry=registry)
        for declared in vars(Metrics).values():
            if isinstance(declared, _Declared):
                metric = declared.build(registry=self._leader.inner if declared.leader else registry)
                for value in declared.preset:
                    metric.labels(value)
                setattr(self, declared.attr, metric)
        self.build_info.labels(version_of("stock-ledger"), platform.python_version(), version_of("aiokafka"),
                               version_of("asyncpg")).set(1)
        self._reset_leader_view()

    def lead(self, *, leading: bool) -> None:
        """Whether this pod holds the monitor lease: its gauges are exported only while it does. On every change
        the leader's gauges start afresh (nothing from an earlier term, nor from a refresh that finished after the
        lease was lost, is exported as current)."""
        self.monitor_leader.set(1 if leading else 0)
        if leading != self._leader.leading:
            self._reset_leader_view()
            self._leader.leading = leading

    def _reset_leader_view(self) -> None:
        for gauge in (self.db_offset, self.log_end_offset, self.kafka_committed_offset, self.lag, self.drift,
                      self.lag_seconds, self.gap):
            gauge.clear()
        for value in (self.partitions_ahead, self.level_mismatches, self.missing_records,
                      self.negative_stock_levels, self.negative_stock_units, self.closing_age_seconds,
                      self.brin_ranges_behind):
            value.set(0)
        self.coordinates_unique.set(1)  # until a check says otherwise: absent is not broken

    def partitions_owned(self, owned: Collection[tuple[str, int]]) -> None:
        """Drop this worker's series of the (topic, partition)s it does not own (any more): their owner exports them,
        and a frozen low headroom would hold StockLedgerSegmentsRunningOut (a min over the pods) firing."""
        kept = {(topic, str(partition)) for topic, partition in owned}
        for family in self.segment_headroom.collect():
            for s in family.samples:
                if (s.labels["topic"], s.labels["partition"]) not in kept:
                    self.segment_headroom.remove(s.labels["group"], s.labels["topic"], s.labels["partition"])

    def batch_committed(self, applied: int, rejected: Mapping[str, int], records: int, seconds: float,
                        timestamps_ms: Sequence[int]) -> None:
        self.applied.inc(applied)
        for code, n in rejected.items():
            self.rejected.labels(code).inc(n)
        self.batches.inc()
        self.batch_duration.observe(seconds)
        self.batch_records.observe(records)
        now = time.time()
        self.last_commit.set(now)
        self.end_to_end.observe_ages(now, timestamps_ms)

    def count_input_anomalies(self, bad_timestamps: int, bisections: int) -> None:
        """Per committed batch: out-of-range Kafka timestamps stored as NULL, and splits to isolate refused rows."""
        self.kafka_timestamps_out_of_range.inc(bad_timestamps)
        self.batch_bisections.inc(bisections)
