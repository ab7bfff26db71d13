#!/usr/bin/env python3
"""Partition downtime during a rolling restart, for each group-membership model the chart could use.

    .venv/bin/python scripts/membership_bench.py [--workers 3] [--partitions 12] [--rate 600] [--modes ...]

For each model, on the real broker and database: three `stock-ledger run` workers share a fresh topic while a
producer writes a steady stream to every partition; then each worker in turn gets SIGTERM, exits, and is replaced
by a new process, started as soon as the old one exited (what a rollout does to a pod; the new process has its
imports done beforehand, so Python's start-up time is not counted), and the next one waits until the replacement
is ready. A sampler
polls `consumer_offsets` every 50 ms; a partition's downtime is the longest time its stored offset did not move
while records were waiting (the producer never stops, so every partition always has records waiting).

Models:
  changing  static membership keyed on a name that changes on every restart (a Deployment's pod names)
  stable    static membership keyed on a name that survives the restart (a StatefulSet's pod names)
  dynamic   no static membership (STOCK_LEDGER_GROUP_INSTANCE_ID unset): SIGTERM sends LeaveGroup

aiokafka sends no LeaveGroup for a static member (its `_maybe_leave_group` skips it when `group_instance_id` is
set), so a departed static member keeps its partitions until the session timeout expires or a member with its
instance id rejoins. Results (JSON) go to bench-results/membership-<time>.json; a table is printed. Takes about a
minute per model. Not part of CI: it measures, it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit import ROOT, say
from localservices import (
    Services,
    create_migrated_database,
    create_topic,
    delete_topics,
    discover,
    drop_database,
    free_port,
    wait_until,
    worker_env,
)

from stock_ledger.produce import produce
from stock_ledger.sink import stored_offsets

if TYPE_CHECKING:
    from collections.abc import Sequence

MODES: Final = ("changing", "stable", "dynamic")
# A replacement is started with its imports done, then waits for a line on stdin: Python's start-up on a busy
# machine (seconds) would otherwise be measured as downtime of every model alike, blurring the differences.
_GATED: Final = ("import sys; from stock_ledger import cli, service; sys.stdin.readline(); "
                 "sys.exit(cli.main(['run']))")
SAMPLE_SECONDS: Final = 0.05


@dataclass
class Options:
    workers: int
    partitions: int
    rate: float
    session_timeout_ms: int
    settle: float
    modes: list[str]
    out: Path


@dataclass
class Worker:
    slot: int
    instance_id: str | None
    popen: subprocess.Popen[bytes]
    port: int
    log: Path

    def go(self) -> None:
        assert self.popen.stdin is not None  # noqa: S101
        self.popen.stdin.write(b"go\n")
        self.popen.stdin.close()

    def ready(self) -> bool:
        with contextlib.suppress(OSError), urllib.request.urlopen(
                f"http://127.0.0.1:{self.port}/readyz", timeout=1) as response:
            return bool(response.status == 200)
        return False


@dataclass
class Run:
    services: Services
    opts: Options
    mode: str
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    logs: Path = field(default_factory=lambda: Path(os.environ.get("TMPDIR", "/tmp")))  # noqa: S108
    workers: list[Worker] = field(default_factory=list)
    restarts: int = 0

    @property
    def database(self) -> str:
        return f"sl_membership_{self.run_id}"

    @property
    def topic(self) -> str:
        return f"membership.{self.mode}.{self.run_id}"

    @property
    def group(self) -> str:
        return f"membership-{self.mode}-{self.run_id}"

    async def setup(self) -> None:
        await create_migrated_database(self.services.admin_url, self.database)
        await create_topic(self.services.kafka, self.topic, self.opts.partitions)

    async def teardown(self) -> None:
        for w in self.workers:
            if w.popen.poll() is None:
                w.popen.kill()
                w.popen.wait(10)
        await drop_database(self.services.admin_url, self.database)
        await delete_topics(self.services.kafka, [self.topic])

    def instance_id(self, slot: int) -> str | None:
        if self.mode == "dynamic":
            return None
        if self.mode == "stable":
            return f"worker-{slot}"
        return f"worker-{slot}-{uuid.uuid4().hex[:5]}"  # a Deployment pod's name: new on every replacement

    def spawn(self, slot: int) -> Worker:
        port = free_port()
        env = worker_env(self.services.kafka, self.services.url_for(self.database, worker=True), self.topic,
                         self.group, STOCK_LEDGER_METRICS_PORT=str(port),
                         STOCK_LEDGER_SESSION_TIMEOUT_MS=str(self.opts.session_timeout_ms))
        instance = self.instance_id(slot)
        if instance is not None:
            env["STOCK_LEDGER_GROUP_INSTANCE_ID"] = instance
        log = self.logs / f"membership-{self.run_id}-{self.mode}-{slot}-{self.restarts}.log"
        with log.open("wb") as out:
            popen = subprocess.Popen([sys.executable, "-c", _GATED], env=env, stdin=subprocess.PIPE, stdout=out,
                                     stderr=subprocess.STDOUT)
        return Worker(slot, instance, popen, port, log)

    async def wait_ready(self, workers: Sequence[Worker], within: float = 60) -> None:
        async def ready() -> bool:
            return all(await asyncio.gather(*(asyncio.to_thread(w.ready) for w in workers)))

        def alive() -> None:
            for w in workers:
                if w.popen.poll() is not None:
                    raise RuntimeError(f"worker {w.log} exited with {w.popen.returncode}")

        logs = [str(w.log) for w in workers]
        await wait_until(ready, within, f"workers not ready within {within:g}s (logs: {logs})", check=alive)

    async def rolling_restart(self) -> list[dict[str, float]]:
        steps = []
        for slot in range(self.opts.workers):
            old = self.workers[slot]
            self.restarts += 1
            new = self.spawn(slot)
            await asyncio.sleep(3)  # its imports
            t0 = time.monotonic()
            old.popen.send_signal(signal.SIGTERM)
            await asyncio.to_thread(old.popen.wait, 60)
            t_exit = time.monotonic()
            new.go()
            self.workers[slot] = new
            await self.wait_ready([new])
            t_ready = time.monotonic()
            say(f"  {self.mode}: worker {slot} ({old.instance_id} -> {new.instance_id}): stopped in "
                f"{t_exit - t0:.1f}s, replacement ready after {t_ready - t_exit:.1f}s")
            steps.append({"stop_seconds": t_exit - t0, "ready_seconds": t_ready - t_exit})
            await asyncio.sleep(self.opts.settle)
        return steps

    async def measure(self) -> dict[str, Any]:
        await self.setup()
        producer = asyncio.create_task(produce(
            self.services.kafka, self.topic, 10_000_000, rate=self.opts.rate, skus=1000, seed=7,
            show_progress=False))
        try:
            self.workers = [self.spawn(slot) for slot in range(self.opts.workers)]
            for w in self.workers:
                w.go()
            await self.wait_ready(self.workers)
            await asyncio.sleep(self.opts.settle)
            sampler = Sampler(self.services.url_for(self.database), self.group, self.topic)
            await sampler.start()
            await asyncio.sleep(2)  # a baseline: the normal gap between commits
            baseline = sampler.max_gaps()
            sampler.reset_gaps()
            started = time.monotonic()
            steps = await self.rolling_restart()
            await asyncio.sleep(2)
            gaps = sampler.max_gaps()
            await sampler.stop()
            elapsed = time.monotonic() - started
        finally:
            producer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await producer
            await self.teardown()
        per_partition = [round(gaps.get(p, elapsed), 2) for p in range(self.opts.partitions)]
        return {
            "mode": self.mode,
            "per_partition_max_seconds": per_partition,
            "max_seconds": max(per_partition),
            "mean_seconds": sum(per_partition) / len(per_partition),
            "baseline_max_seconds": max(baseline.values(), default=0.0),
            "restart_window_seconds": elapsed,
            "steps": steps,
        }


class Sampler:
    """Polls the stored offsets; per partition, the longest stretch without a change."""

    def __init__(self, url: str, group: str, topic: str) -> None:
        self._url, self._group, self._topic = url, group, topic
        self._last: dict[int, tuple[int, float]] = {}
        self._gaps: dict[int, float] = {}
        self._task: asyncio.Task[None] | None = None
        self._conn: asyncpg.Connection | None = None

    async def start(self) -> None:
        self._conn = await asyncpg.connect(self._url)
        await self._poll()
        self.reset_gaps()
        self._task = asyncio.create_task(self._loop())

    def reset_gaps(self) -> None:
        now = time.monotonic()
        self._last = {p: (off, now) for p, (off, _) in self._last.items()}
        self._gaps = {}

    def max_gaps(self) -> dict[int, float]:
        now = time.monotonic()
        return {p: max(self._gaps.get(p, 0.0), now - since) for p, (_, since) in self._last.items()}

    async def _poll(self) -> None:
        assert self._conn is not None  # noqa: S101
        stored = await stored_offsets(self._conn, self._group, self._topic)
        now = time.monotonic()
        for p, next_offset in stored.items():
            off = next_offset or 0
            prev = self._last.get(p)
            if prev is None or off != prev[0]:
                if prev is not None:
                    self._gaps[p] = max(self._gaps.get(p, 0.0), now - prev[1])
                self._last[p] = (off, now)

    async def _loop(self) -> None:
        while True:
            await self._poll()
            await asyncio.sleep(SAMPLE_SECONDS)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._conn is not None:
            await self._conn.close()


def render(results: list[dict[str, Any]], opts: Options) -> str:
    lines = [
        (f"rolling restart of {opts.workers} workers, {opts.partitions} partitions, {opts.rate:g} movements/s, "
         f"session timeout {opts.session_timeout_ms} ms"),
        "| model | max downtime of a partition | mean over partitions | normal max gap |",
        "|---|---:|---:|---:|",
    ]
    names = {"changing": "static, changing names (Deployment)", "stable": "static, stable names (StatefulSet)",
             "dynamic": "no static membership (Deployment)"}
    lines += [f"| {names[r['mode']]} | {r['max_seconds']:.1f} s | {r['mean_seconds']:.1f} s | "
              f"{r['baseline_max_seconds']:.1f} s |" for r in results]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--partitions", type=int, default=12)
    parser.add_argument("--rate", type=float, default=600, help="movements per second during the restart")
    parser.add_argument("--session-timeout-ms", type=int, default=10_000, help="the chart's default")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds between restarts once ready")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        parser.error(f"--modes must name some of {', '.join(MODES)}")
    return Options(args.workers, args.partitions, args.rate, args.session_timeout_ms, args.settle, modes, args.out)


async def main(opts: Options) -> int:
    services = discover()
    results = []
    for mode in opts.modes:
        say(f"membership model {mode!r}")
        results.append(await Run(services, opts, mode).measure())
        last = results[-1]
        say(f"  {mode}: max {last['max_seconds']:.1f}s, per partition {last['per_partition_max_seconds']}")
    opts.out.mkdir(parents=True, exist_ok=True)
    out = opts.out / f"membership-{time.strftime('%Y%m%dT%H%M%S')}.json"
    out.write_text(json.dumps({"options": {k: str(v) for k, v in vars(opts).items()}, "results": results},
                              indent=2))
    print(render(results, opts))
    say(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
