"""What Prometheus and the kubelet see: the real /metrics, /healthz and /readyz of a real worker."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess

import asyncpg
import pytest

from tests.support.helpers import (
    Env,
    Services,
    WorkerPool,
    end_offsets,
    eventually,
    movement,
    send_raw,
    stored_offsets,
    wait_drained,
)
from tests.support.services import produce

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


def _sum(worker, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    _, body = worker.get("/metrics")
    return sum(s.value for f in text_string_to_metric_families(body) for s in f.samples if s.name == name)


def _per_partition(worker, name: str) -> dict[int, float]:
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    _, body = worker.get("/metrics")
    return {int(s.labels["partition"]): s.value for f in text_string_to_metric_families(body) for s in f.samples
            if s.name == name}


async def test_metrics_show_lag_drift_work_and_invariants_of_a_real_run(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """5,000 movements and 3 bad records. After draining, scraped from the worker itself: lag 0 on all 24
    partitions, database offset = log end, drift >= 0, applied = 5,000, rejected by reason as injected,
    invariants clean; and promtool accepts the exposition."""
    await produce(services.kafka, topic, 5_000, seed=21, show_progress=False)
    await send_raw(services.kafka, topic, [(b"SKU-X", b"nope"), (None, b"{}"),
                                           (b"SKU-X", json.dumps(movement("SKU-Y")).encode())])
    w = workers.start()
    await wait_drained(services, database, topic, workers.group, 60, workers)
    await eventually(lambda: len(_per_partition(w, "stock_ledger_partition_lag_messages")) == 24
                     and sum(_per_partition(w, "stock_ledger_partition_lag_messages").values()) == 0,
                     30, "lag 0 on all 24 partitions", workers)
    lag_db = _per_partition(w, "stock_ledger_partition_db_offset")
    assert lag_db == _per_partition(w, "stock_ledger_partition_log_end_offset")
    assert sum(lag_db.values()) == 5_003
    await eventually(lambda: len(_per_partition(w, "stock_ledger_partition_offset_drift_messages")) == 24, 30,
                     "drift for every partition", workers)
    assert min(_per_partition(w, "stock_ledger_partition_offset_drift_messages").values()) >= 0
    assert w.metric("stock_ledger_movements_applied_total") == 5_000
    assert w.metric("stock_ledger_movements_rejected_total", {"reason": "invalid_json"}) == 1
    assert w.metric("stock_ledger_movements_rejected_total", {"reason": "missing_key"}) == 1
    assert w.metric("stock_ledger_movements_rejected_total", {"reason": "key_mismatch"}) == 1
    assert w.metric("stock_ledger_movements_rejected_total", {"reason": "sign_mismatch"}) == 0
    assert w.metric("stock_ledger_assigned_partitions") == 24
    assert w.metric("stock_ledger_ready") == 1
    assert (w.metric("stock_ledger_batches_committed_total") or 0) >= 1
    assert w.metric("stock_ledger_end_to_end_latency_seconds_count") == 5_003
    assert (w.metric("stock_ledger_last_commit_timestamp_seconds") or 0) > 0
    assert w.metric("stock_ledger_build_info") == 1
    await eventually(lambda: (w.metric("stock_ledger_invariant_check_duration_seconds_count",
                                       {"scope": "incremental"}) or 0) >= 1
                     and w.metric("stock_ledger_ledger_coordinates_unique") == 1
                     and w.metric("stock_ledger_ledger_partitions_ahead_of_offset") == 0
                     and w.metric("stock_ledger_ledger_stock_level_mismatches") == 0, 30, "invariants", workers)

    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: run scripts/tools.sh (Debian package prometheus)"
    _, body = w.get("/metrics")
    check = subprocess.run([promtool, "check", "metrics"], input=body.encode(), capture_output=True, check=False)
    assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()


async def test_readyz_is_503_until_every_assigned_partition_is_claimed(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """A transaction holds the partitions' offset rows (as a frozen zombie would). The worker joins the group
    but cannot claim: /readyz is 503 and says why, /healthz stays 200. Once the rows are released: 200."""
    blocker = await asyncpg.connect(database.owner_url)
    try:
        await blocker.execute(
            "INSERT INTO consumer_offsets (group_id, topic, partition) SELECT $1, $2, p FROM generate_series(0, 23) p",
            workers.group, topic)
        await blocker.execute("BEGIN")
        await blocker.execute("SELECT * FROM consumer_offsets FOR UPDATE")
        w = workers.start(STOCK_LEDGER_LOCK_TIMEOUT_MS="300")
        await eventually(lambda: '"rebalance.assigned"' in w.log_text(), 60, "the assignment", workers)
        await eventually(lambda: w.get("/readyz")[0] == 503 and "not yet claimed" in w.get("/readyz")[1], 20,
                         "/readyz 503 while claims wait", workers)
        # The claim gives up on the lock after STOCK_LEDGER_LOCK_TIMEOUT_MS and retries, again and again.
        await eventually(lambda: (w.metric("stock_ledger_retries_total", {"cause": "lock"}) or 0) >= 2, 30,
                         "claim retries on the lock", workers)
        assert w.get("/readyz")[0] == 503
        assert w.get("/healthz")[0] == 200
        assert w.metric("stock_ledger_ready") == 0
        await blocker.execute("ROLLBACK")
        await eventually(lambda: w.get("/readyz")[0] == 200, 30, "/readyz 200 after claims", workers)
        assert "24 partitions claimed" in w.get("/readyz")[1]
        assert w.metric("stock_ledger_ready") == 1
    finally:
        await blocker.close()


async def test_the_ready_gauge_returns_to_1_with_readyz_after_a_database_outage(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """A drained worker is ready (gauge 1, /readyz 200). The database refuses new sessions (CONNECTION LIMIT 0) and
    the worker's sessions are terminated; movements arrive: the batch fails, /readyz 503 "PostgreSQL not
    connected" and the gauge 0. The database accepts sessions again: the batch commits, /readyz 200, and the gauge
    is 1 again (it used to stay 0 until the next claim)."""
    await produce(services.kafka, topic, 100, seed=33, show_progress=False)
    w = workers.start()
    await wait_drained(services, database, topic, workers.group, 60, workers)
    await eventually(lambda: w.get("/readyz")[0] == 200 and w.metric("stock_ledger_ready") == 1, 30, "ready",
                     workers)
    owner = await asyncpg.connect(database.owner_url)
    try:
        await owner.execute(f'ALTER DATABASE "{database.name}" CONNECTION LIMIT 0')
        # Client sessions only: an autovacuum worker on the database is a superuser process we may not terminate.
        await owner.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 "
                            "AND pid <> pg_backend_pid() AND backend_type = 'client backend'", database.name)
        await produce(services.kafka, topic, 50, seed=34, show_progress=False)
        await eventually(lambda: w.get("/readyz")[0] == 503 and w.metric("stock_ledger_ready") == 0, 30,
                         "not ready while the database refuses sessions", workers)
        assert "PostgreSQL not connected" in w.get("/readyz")[1]
        await owner.execute(f'ALTER DATABASE "{database.name}" CONNECTION LIMIT -1')
    finally:
        await owner.close()
    await wait_drained(services, database, topic, workers.group, 60, workers)
    await eventually(lambda: w.get("/readyz")[0] == 200, 30, "/readyz 200 once the database is back", workers)
    await eventually(lambda: w.metric("stock_ledger_ready") == 1, 10, "the gauge to follow /readyz", workers)


async def test_healthz_turns_503_when_the_main_loop_stalls_and_lag_keeps_growing(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """The main loop hangs after its first read (test fault hook) while the event loop lives: /healthz turns 503
    after STOCK_LEDGER_STALL_SECONDS, and the lag metric, refreshed on a timer, grows as movements keep coming.
    SIGTERM still stops the worker cleanly."""
    await produce(services.kafka, topic, 100, seed=31, show_progress=False)
    w = workers.start(STOCK_LEDGER_FAULT="after_read@1:hang", STOCK_LEDGER_STALL_SECONDS="2")
    await eventually(lambda: w.get("/healthz")[0] == 503, 30, "/healthz 503", workers)
    assert "no progress" in w.get("/healthz")[1]
    await eventually(lambda: _sum(w, "stock_ledger_partition_lag_messages") >= 100, 30, "lag 100", workers)
    await produce(services.kafka, topic, 400, seed=32, show_progress=False)
    await eventually(lambda: _sum(w, "stock_ledger_partition_lag_messages") >= 500, 30, "lag to grow", workers)
    w.signal(signal.SIGTERM)
    assert w.wait(15) == 0



async def test_one_pod_leads_the_monitors_and_another_takes_over_when_it_freezes(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """Three workers of one group: exactly one exports stock_ledger_monitor_leader 1 and the per-partition gauges
    (with the group label); the others export 0 and none. Freeze the leader (SIGSTOP: its session stays open): the
    server ends its idle lease session and another pod takes the lease and exports the gauges."""
    await produce(services.kafka, topic, 2_000, seed=23, show_progress=False)
    pool = [workers.start() for _ in range(3)]
    await wait_drained(services, database, topic, workers.group, 90, workers)

    def leaders() -> list:
        return [w for w in pool if w.alive() and w.metric("stock_ledger_monitor_leader") == 1]

    await eventually(lambda: len(leaders()) == 1 and all(w.metric("stock_ledger_monitor_leader") is not None
                                                         for w in pool), 30, "one monitor leader", workers)
    [leader] = leaders()
    await eventually(lambda: len(_per_partition(leader, "stock_ledger_partition_lag_messages")) == 24, 30,
                     "the leader's partition gauges", workers)
    await eventually(lambda: leader.metric("stock_ledger_partition_lag_messages",
                                           {"group": workers.group, "partition": "0"}) == 0, 30,
                     "the leader's gauges, labelled with the group, to show the drain", workers)
    for w in pool:
        if w is not leader:
            assert _per_partition(w, "stock_ledger_partition_lag_messages") == {}
    leader.signal(signal.SIGSTOP)  # frozen, not dead: its session stays open, but it stops touching it
    try:
        await eventually(lambda: [w for w in leaders() if w is not leader], 45,
                         "another pod to take the lease from the frozen leader", workers)
    finally:
        leader.signal(signal.SIGCONT)
    successor = next(w for w in leaders() if w is not leader)
    await eventually(lambda: len(_per_partition(successor, "stock_ledger_partition_lag_messages")) == 24, 30,
                     "the new leader's partition gauges", workers)


# The gauges only the monitor leader exports (metrics.LeaderOnly).
LEADER_ONLY = frozenset({
    "stock_ledger_partition_db_offset", "stock_ledger_partition_log_end_offset",
    "stock_ledger_partition_kafka_committed_offset", "stock_ledger_partition_lag_messages",
    "stock_ledger_partition_offset_drift_messages", "stock_ledger_partition_gap_messages",
    "stock_ledger_partition_lag_seconds", "stock_ledger_ledger_coordinates_unique",
    "stock_ledger_ledger_partitions_ahead_of_offset", "stock_ledger_ledger_stock_level_mismatches",
    "stock_ledger_ledger_missing_records", "stock_ledger_negative_stock_levels", "stock_ledger_negative_stock_units",
})


def _exported(worker) -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    _, body = worker.get("/metrics")
    return {s.name for f in text_string_to_metric_families(body) for s in f.samples}


async def test_a_former_leader_thawed_exports_none_of_the_leaders_gauges(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """Two workers drain 500 movements; only the leader exports the partition and ledger gauges, the other none.
    The leader is frozen (SIGSTOP) until the other takes the lease, then thawed, and 300 more movements are
    produced and drained: the former leader exports stock_ledger_monitor_leader 0 and none of the partition or
    ledger gauges (it used to keep its last log end offsets beside the leader's), while the new leader's show the
    log ends after the 800 movements, lag 0 and clean invariants."""
    await produce(services.kafka, topic, 500, seed=41, show_progress=False)
    pool = [workers.start() for _ in range(2)]
    await wait_drained(services, database, topic, workers.group, 90, workers)

    def leaders() -> list:
        return [w for w in pool if w.alive() and w.metric("stock_ledger_monitor_leader") == 1]

    await eventually(lambda: len(leaders()) == 1 and all(w.metric("stock_ledger_monitor_leader") is not None
                                                         for w in pool), 30, "one monitor leader", workers)
    [leader] = leaders()
    [other] = [w for w in pool if w is not leader]
    await eventually(lambda: len(_per_partition(leader, "stock_ledger_partition_log_end_offset")) == 24, 30,
                     "the leader's partition gauges", workers)
    assert not _exported(other) & LEADER_ONLY, "a pod that never led exports the leader's gauges"
    leader.signal(signal.SIGSTOP)
    try:
        await eventually(lambda: other.metric("stock_ledger_monitor_leader") == 1, 45,
                         "the other pod to take the lease from the frozen leader", workers)
    finally:
        leader.signal(signal.SIGCONT)
    await produce(services.kafka, topic, 300, seed=42, show_progress=False)
    await wait_drained(services, database, topic, workers.group, 90, workers)
    ends = await end_offsets(services.kafka, topic)
    await eventually(lambda: _per_partition(other, "stock_ledger_partition_log_end_offset") == ends
                     and sum(_per_partition(other, "stock_ledger_partition_lag_messages").values()) == 0, 30,
                     "the new leader's gauges at the new log ends", workers)
    assert sum(ends.values()) == 800
    await eventually(lambda: leader.alive() and leader.metric("stock_ledger_monitor_leader") == 0
                     and not _exported(leader) & LEADER_ONLY, 30,
                     "the former leader to export none of the leader's gauges", workers)
    assert other.metric("stock_ledger_ledger_coordinates_unique") == 1
    assert other.metric("stock_ledger_ledger_stock_level_mismatches") == 0
    assert other.metric("stock_ledger_negative_stock_levels") is not None
    assert not _exported(leader) & LEADER_ONLY


async def test_lag_in_seconds_is_the_age_of_the_oldest_unapplied_record(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """A worker frozen for a while (its monitor frozen too, so a second worker of the group, which cannot claim
    while the first holds the session, reads it): stock_ledger_partition_lag_seconds grows with the age of the
    oldest unapplied record, and is 0 once drained."""
    w = workers.start(STOCK_LEDGER_FAULT="after_read:hang")
    await send_raw(services.kafka, topic, [(b"SKU-1", json.dumps(movement("SKU-1")).encode())])
    await eventually(lambda: max(_per_partition(w, "stock_ledger_partition_lag_seconds").values() or [0]) >= 3,
                     30, "the lag in seconds to reach 3 s", workers)
    w.signal(signal.SIGTERM)
    w.wait(20)
    fresh = workers.start()
    await wait_drained(services, database, topic, workers.group, 60, workers)
    await eventually(lambda: len(_per_partition(fresh, "stock_ledger_partition_lag_seconds")) == 24
                     and max(_per_partition(fresh, "stock_ledger_partition_lag_seconds").values()) == 0,
                     30, "lag in seconds back to 0", workers)


async def test_no_phantom_hole_while_a_worker_drains_a_live_topic(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """A producer at 4,000/s and a worker committing as it goes: the positions are read while both move, yet
    stock_ledger_partition_gap_messages stays 0 on every partition on every refresh (a stored offset read after
    the log end would look like a hole past the log end and page someone)."""
    # Small batches committed often, and positions refreshed often: many chances to read the two sides apart.
    w = workers.start(STOCK_LEDGER_POSITION_REFRESH_SECONDS="0.1", STOCK_LEDGER_BATCH_MAX_WAIT_MS="5")
    producer = asyncio.create_task(produce(services.kafka, topic, 40_000, rate=4_000, seed=29, show_progress=False))
    seen: list[float] = []
    try:
        while not producer.done():
            seen += _per_partition(w, "stock_ledger_partition_gap_messages").values()
            await asyncio.sleep(0.1)
    finally:
        await producer
    assert len(seen) > 24 * 20, f"too few samples of the gap gauge\n{workers.logs_tail(15)}"
    assert max(seen) == 0


async def _kafka_committed(bootstrap: str, group: str) -> dict[int, int]:
    from aiokafka.admin import AIOKafkaAdminClient  # noqa: PLC0415

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return {tp.partition: meta.offset for tp, meta in (await admin.list_consumer_group_offsets(group)).items()}
    finally:
        await admin.close()


async def test_kafka_hears_the_stored_offsets_within_seconds_never_ahead_and_at_a_graceful_stop(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """Kafka's committed offsets are advisory (lag dashboards, kafka-consumer-groups.sh) and sent off the batch path,
    at most once a second: sampled while 20,000 movements drain in batches of 50 they never pass the stored ones;
    they reach them within seconds of the drain; and the batches committed just before a SIGTERM reach Kafka too."""
    w = workers.start(STOCK_LEDGER_BATCH_MAX_RECORDS="50")
    producing = asyncio.create_task(produce(services.kafka, topic, 20_000, seed=23, show_progress=False))
    conn = await asyncpg.connect(database.owner_url)
    try:
        samples = 0
        while not producing.done() or samples < 5:
            kafka = await _kafka_committed(services.kafka, workers.group)
            stored = await stored_offsets(conn, workers.group, topic)  # read after Kafka's: it only grows
            ahead = {p: (o, stored.get(p)) for p, o in kafka.items() if o > (stored.get(p) or 0)}
            assert not ahead, f"Kafka's committed offset passed the stored one (partition: (kafka, stored)): {ahead}"
            samples += 1
            await asyncio.sleep(0.2)
        await producing
        await wait_drained(services, database, topic, workers.group, 60, workers)
        stored = await stored_offsets(conn, workers.group, topic)

        async def told() -> bool:
            return await _kafka_committed(services.kafka, workers.group) == stored
        await eventually(told, 10, f"Kafka's committed offsets to reach the stored ones {stored}", workers)

        # More movements and, while the worker applies them, a graceful stop: whatever it committed in its last
        # second reaches Kafka by its final advisory commit (else Kafka would stay behind until the next owner's).
        before = sum(v or 0 for v in stored.values())
        await produce(services.kafka, topic, 2_000, seed=24, show_progress=False)
        while sum(v or 0 for v in (await stored_offsets(conn, workers.group, topic)).values()) == before:
            await asyncio.sleep(0.01)
        w.signal(signal.SIGTERM)
        assert await asyncio.to_thread(w.wait, 30) == 0
        assert await _kafka_committed(services.kafka, workers.group) == await stored_offsets(
            conn, workers.group, topic)
    finally:
        await conn.close()
    workers.assert_no_tracebacks()
