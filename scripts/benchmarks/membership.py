"""membership: partition downtime during a rolling restart, for each group-membership model the chart could use.

For each model, on the real broker and database: --workers `stock-ledger run` workers share a fresh topic while a
producer writes a steady stream to every partition; then each worker in turn gets SIGTERM, exits, and is replaced
by a new process, started as soon as the old one exited (what a rollout does to a pod; the new process has its
imports done beforehand, so Python's start-up time is not counted), and the next one waits until the replacement
is ready. A sampler polls `consumer_offsets` every 50 ms; a partition's downtime is the longest time its stored
offset did not move while records were waiting (the producer never stops, so every partition always has some).

Models:
  changing  static membership keyed on a name that changes on every restart (a Deployment's pod names)
  stable    static membership keyed on a name that survives the restart (a StatefulSet's pod names)
  dynamic   no static membership (STOCK_LEDGER_GROUP_INSTANCE_ID unset): SIGTERM sends LeaveGroup

aiokafka sends no LeaveGroup for a static member (its `_maybe_leave_group` skips it when `group_instance_id` is
set), so a departed static member keeps its partitions until the session timeout expires or a member with its
instance id rejoins. About a minute per model; it measures, it asserts nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import signal
import time
import uuid
from typing import TYPE_CHECKING, Any, Final

from benchkit import Bench, check_alive, connection, say
from localservices import WorkerProcess, start_worker, wait_until

from stock_ledger.produce import produce
from stock_ledger.sink import stored_offsets

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable, Sequence

MODES: Final = {"changing": "static, changing names (Deployment)", "stable": "static, stable names (StatefulSet)",
                "dynamic": "no static membership (Deployment)"}
SAMPLE_SECONDS: Final = 0.05
SETTLE_SECONDS: Final = 3.0


def register(add: Callable[..., argparse.ArgumentParser]) -> None:
    p = add("membership", __doc__, measure)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--workers", type=int, default=3, help="workers in the group (default 3)")
    p.add_argument("--partitions", type=int, default=12, help="partitions of the topic (default 12)")
    p.add_argument("--rate", type=float, default=600, help="movements per second during the restart (default 600)")
    p.add_argument("--session-timeout-ms", type=int, default=10_000, help="the chart's default (10000)")


class Sampler:
    """Polls the stored offsets; per partition, the longest stretch without a change."""

    def __init__(self, url: str, group: str, topic: str) -> None:
        self._url, self._group, self._topic = url, group, topic
        self._last: dict[int, tuple[int, float]] = {}
        self._gaps: dict[int, float] = {}

    def reset_gaps(self) -> None:
        now = time.monotonic()
        self._last = {p: (off, now) for p, (off, _) in self._last.items()}
        self._gaps = {}

    def max_gaps(self) -> dict[int, float]:
        now = time.monotonic()
        return {p: max(self._gaps.get(p, 0.0), now - since) for p, (_, since) in self._last.items()}

    async def run(self) -> None:
        async with connection(self._url) as conn:
            while True:
                stored = await stored_offsets(conn, self._group, self._topic)
                now = time.monotonic()
                for p, next_offset in stored.items():
                    last, since = self._last.get(p, (None, now))
                    if (next_offset or 0) != last:
                        self._gaps[p] = max(self._gaps.get(p, 0.0), now - since)
                        self._last[p] = (next_offset or 0, now)
                await asyncio.sleep(SAMPLE_SECONDS)


async def wait_ready(workers: Sequence[WorkerProcess], within: float = 60) -> None:
    async def ready() -> bool:
        return all(await asyncio.gather(*(asyncio.to_thread(w.ready) for w in workers)))

    await wait_until(ready, within, f"workers not ready within {within:g}s", check=lambda: check_alive(workers))


async def rolling_restart(a: argparse.Namespace, mode: str, bench: Bench, topic: str) -> dict[str, Any]:
    group, spawned = f"bench-{bench.run_id}-{mode}", itertools.count(1)

    def spawn(slot: int) -> WorkerProcess:
        # A Deployment pod's name is new on every replacement; a StatefulSet's is the slot's.
        instance = {"dynamic": None, "stable": f"worker-{slot}"}.get(mode, f"worker-{slot}-{uuid.uuid4().hex[:5]}")
        extra = {"STOCK_LEDGER_SESSION_TIMEOUT_MS": str(a.session_timeout_ms)}
        extra |= {"STOCK_LEDGER_GROUP_INSTANCE_ID": instance} if instance else {}
        return start_worker(bench.worker_env(topic, group, **extra), bench.logs / f"{mode}-{slot}-{next(spawned)}.log",
                            gated=True)

    workers = [spawn(slot) for slot in range(a.workers)]
    producer = asyncio.create_task(produce(bench.services.kafka, topic, 10_000_000, rate=a.rate, skus=1000, seed=7,
                                           show_progress=False))
    sampler = Sampler(bench.owner_url, group, topic)
    sampling = None
    try:
        for w in workers:
            w.go()
        await wait_ready(workers)
        await asyncio.sleep(SETTLE_SECONDS)
        sampling = asyncio.create_task(sampler.run())
        await asyncio.sleep(2)  # a baseline: the normal gap between commits
        baseline = sampler.max_gaps()
        sampler.reset_gaps()
        started, steps = time.monotonic(), []
        for slot in range(a.workers):
            old, new = workers[slot], spawn(slot)
            await asyncio.sleep(3)  # its imports
            t0 = time.monotonic()
            old.signal(signal.SIGTERM)
            await asyncio.to_thread(old.wait, 60)
            t_exit = time.monotonic()
            new.go()
            workers[slot] = new
            await wait_ready([new])
            t_ready = time.monotonic()
            say(f"  {mode}: worker {slot} stopped in {t_exit - t0:.1f}s, replacement ready after "
                f"{t_ready - t_exit:.1f}s")
            steps.append({"stop_seconds": t_exit - t0, "ready_seconds": t_ready - t_exit})
            await asyncio.sleep(SETTLE_SECONDS)
        await asyncio.sleep(2)
        gaps, elapsed = sampler.max_gaps(), time.monotonic() - started
    finally:
        for task in (producer, sampling):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for w in workers:
            if w.alive():
                w.kill()
    per_partition = [round(gaps.get(p, elapsed), 2) for p in range(a.partitions)]
    return {"mode": mode, "per_partition_max_seconds": per_partition, "max_seconds": max(per_partition),
            "mean_seconds": sum(per_partition) / len(per_partition),
            "baseline_max_seconds": max(baseline.values(), default=0.0), "restart_window_seconds": elapsed,
            "steps": steps}


async def measure(bench: Bench, a: argparse.Namespace) -> str:
    modes = [m for m in a.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        raise SystemExit(f"membership: --modes must name some of {', '.join(MODES)}")
    results = bench.results["results"] = []
    for mode in modes:
        say(f"membership model {mode!r}")
        database = await bench.create_database(mode)
        results.append(await rolling_restart(a, mode, bench, await bench.create_topic(mode, a.partitions)))
        await bench.drop_database(database)
        say(f"  {mode}: max {results[-1]['max_seconds']:.1f}s, per partition "
            f"{results[-1]['per_partition_max_seconds']}")
    return "\n".join([
        (f"rolling restart of {a.workers} workers, {a.partitions} partitions, {a.rate:g} movements/s, "
         f"session timeout {a.session_timeout_ms} ms"),
        "| model | max downtime of a partition | mean over partitions | normal max gap |", "|---|---:|---:|---:|",
        *(f"| {MODES[r['mode']]} | {r['max_seconds']:.1f} s | {r['mean_seconds']:.1f} s | "
          f"{r['baseline_max_seconds']:.1f} s |" for r in results)])
