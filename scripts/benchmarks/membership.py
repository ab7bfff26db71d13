"""membership: partition downtime in a rolling restart of --workers workers under a steady produce, per --modes:
changing (static membership, names new at every restart: a Deployment), stable (names that survive it: a
StatefulSet), dynamic (none). Downtime of a partition: the longest time its stored offset did not move.
How and why: docs/performance.md and docs/design.md, "Membership".
"""

import argparse
import asyncio
import contextlib
import itertools
import signal
import time
import uuid
from collections.abc import Sequence
from typing import Any, Final

from scripts import benchkit as kit
from tests.support.services import WorkerProcess, produce, start_worker, wait_until

MODES: Final = {"changing": "static, changing names (Deployment)", "stable": "static, stable names (StatefulSet)",
                "dynamic": "no static membership (Deployment)"}
SETTLE_SECONDS: Final = 3.0
NOW: Final = "SELECT clock_timestamp()"
# Per partition, how long its stored offset did not move in [$2, $3]: the widest gap between its batches' applied_at.
_DOWNTIME: Final = """
SELECT p, max(extract(epoch FROM t - previous)) FROM (
  SELECT p, t, lag(t) OVER (PARTITION BY p ORDER BY t) AS previous FROM (
    SELECT DISTINCT kafka_partition, applied_at FROM stock_movements WHERE applied_at BETWEEN $2 AND $3
    UNION SELECT p, unnest(ARRAY[$2, $3]::timestamptz[]) FROM generate_series(0, $1 - 1) AS p) AS b(p, t)) AS g
 GROUP BY p
"""


async def wait_ready(workers: Sequence[WorkerProcess], within: float = 60) -> None:
    async def ready() -> bool:
        return all(await asyncio.gather(*(asyncio.to_thread(w.ready) for w in workers)))

    await wait_until(ready, within, f"workers not ready within {within:g}s", check=lambda: kit.check_alive(workers))


async def rolling_restart(a: argparse.Namespace, mode: str, bench: kit.Bench, topic: str) -> dict[str, Any]:
    group, spawned = f"bench-{bench.run_id}-{mode}", itertools.count(1)

    def spawn(slot: int) -> WorkerProcess:
        # A Deployment pod's name is new on every replacement; a StatefulSet's is the slot's.
        instance = {"dynamic": None, "stable": f"worker-{slot}"}.get(mode, f"worker-{slot}-{uuid.uuid4().hex[:5]}")
        extra = {"STOCK_LEDGER_SESSION_TIMEOUT_MS": str(a.session_timeout_ms)}
        extra |= {"STOCK_LEDGER_GROUP_INSTANCE_ID": instance} if instance else {}
        return start_worker(bench.worker_env(topic, group, **extra), bench.logs / f"{mode}-{slot}-{next(spawned)}.log",
                            gated=True)

    workers, steps = [spawn(slot) for slot in range(a.workers)], []
    producer = asyncio.create_task(produce(bench.services.kafka, topic, 10_000_000, rate=a.rate, skus=1000, seed=7,
                                           show_progress=False))
    async with bench.owner() as conn:
        try:
            for w in workers:
                w.go()
            await wait_ready(workers)
            await asyncio.sleep(SETTLE_SECONDS)
            marks = [await conn.fetchval(NOW)]
            await asyncio.sleep(2)  # a baseline: the normal gap between commits
            marks.append(await conn.fetchval(NOW))
            for slot in range(a.workers):
                old, new = workers[slot], spawn(slot)
                await asyncio.sleep(3)  # its imports
                t0 = time.monotonic()
                old.signal(signal.SIGTERM)
                await asyncio.to_thread(old.wait, 60)
                t_exit, workers[slot] = time.monotonic(), new
                new.go()
                await wait_ready([new])
                steps.append({"stop_seconds": t_exit - t0, "ready_seconds": time.monotonic() - t_exit})
                kit.say(f"  {mode}: worker {slot} stopped, replacement ready: {steps[-1]}")
                await asyncio.sleep(SETTLE_SECONDS)
            await asyncio.sleep(2)
            marks.append(await conn.fetchval(NOW))
        finally:
            producer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await producer
            for w in workers:
                w.kill()  # a no-op on one that has exited
        baseline, gaps = [dict(await conn.fetch(_DOWNTIME, a.partitions, *marks[i:i + 2])) for i in (0, 1)]
    per_partition = [round(float(gaps[p]), 2) for p in range(a.partitions)]
    return {"mode": mode, "per_partition_max_seconds": per_partition, "max_seconds": max(per_partition),
            "mean_seconds": sum(per_partition) / len(per_partition), "baseline_max_seconds": float(max(
                baseline.values())), "restart_window_seconds": (marks[2] - marks[1]).total_seconds(), "steps": steps}


async def measure(bench: kit.Bench, a: argparse.Namespace) -> str:
    if not (modes := [m for m in a.modes.split(",") if m]) or set(modes) - set(MODES):
        raise SystemExit(f"membership: --modes must name some of {', '.join(MODES)}")
    results = bench.results["results"] = []
    for mode in modes:
        kit.say(f"membership model {mode!r}")
        database = await bench.create_database(mode)
        results.append(await rolling_restart(a, mode, bench, await bench.create_topic(mode, a.partitions)))
        await bench.drop_database(database)
        kit.say(f"  {mode}: per partition {results[-1]['per_partition_max_seconds']}")
    return "\n".join([
        (f"rolling restart of {a.workers} workers, {a.partitions} partitions, {a.rate:g} movements/s, "
         f"session timeout {a.session_timeout_ms} ms"),
        "| model | max downtime of a partition | mean over partitions | normal max gap |", "|---|---:|---:|---:|",
        *(f"| {MODES[r['mode']]} | {r['max_seconds']:.1f} s | {r['mean_seconds']:.1f} s | "
          f"{r['baseline_max_seconds']:.1f} s |" for r in results)])
