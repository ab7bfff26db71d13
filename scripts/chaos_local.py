"""`scripts/chaos.sh --mode local` behind the script: the supervisor of the local drill.

chaos.sh parses and checks the flags and the environment (its usage, its exit code 2) and then hands over to this
module with the checked values; it is not meant to be called by hand. Here: start --workers `stock-ledger run`
processes, wait until every one answers /readyz, produce while SIGKILLing a random worker at random gaps (and
restarting it at once, as a ReplicaSet does), restart a worker that exits on its own, run `stock-ledger verify
--wait --expect COUNT` while showing how far the stored offsets have got, then stop the workers with SIGTERM.

The contract is chaos.sh's: progress as `<time> chaos: ...` lines on stderr, one `count|distinct` line on stdout,
exit 0 only if the ledger holds exactly COUNT movements, each once; 1 if it does not or the drill failed; 130/143
on SIGINT/SIGTERM, after stopping what it started.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Final

try:
    from stock_ledger.clients.database import connect_database
    from stock_ledger.config import load_settings
    from stock_ledger.ledger.offsets import stored_offsets
except ImportError as exc:  # chaos.sh picked the python beside the CLI; say what to do instead of a traceback
    print(f"chaos.sh: --mode local needs stock_ledger importable by {sys.executable} ({exc}): run 'make venv', "
          "or pass --stock-ledger PATH of a stock-ledger installed in a venv", file=sys.stderr)
    sys.exit(2)

if TYPE_CHECKING:
    from collections.abc import Sequence


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

# A worker that dies with a configuration error (2), before the first all-Ready, or more often than this, would
# only die again: that ends the drill.
MAX_CRASHES: Final = 10
SLICE_MS: Final = 250  # how often the background processes are looked at while waiting
PROGRESS_SECONDS: Final = 5.0
COUNT_LINE: Final = re.compile(r"^[0-9]+\|[0-9]+$")


class DrillFailed(Exception):
    """The drill cannot go on, or the ledger is not exact: exit 1 with this message."""


def log(message: str) -> None:
    print(f"{datetime.now().astimezone():%Y-%m-%dT%H:%M:%S%z} chaos: {message}", file=sys.stderr, flush=True)


def seconds(ms: int) -> str:
    """Milliseconds as chaos.sh prints them: 1500 -> 1.500."""
    return f"{ms // 1000}.{ms % 1000:03d}"


def status(returncode: int) -> int:
    """An exit status as a shell reports it: death by signal N is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass(frozen=True)
class Plan:
    cli: str
    count: int
    rate: str
    kills: int
    gap_ms: tuple[int, int]
    seed: int
    workers: int
    log_dir: str
    drain_timeout: int
    ready_timeout: int


@dataclass
class Worker:
    index: int
    port: int
    generation: int = 0
    proc: subprocess.Popen[bytes] | None = None
    log: Path = Path()


@dataclass
class Drill:
    plan: Plan
    workdir: Path
    workers: list[Worker] = field(default_factory=list)
    producer: subprocess.Popen[bytes] | None = None
    produce_started: float = 0.0
    verifier: subprocess.Popen[bytes] | None = None
    crashes: int = 0
    killed: int = 0
    starting: bool = True

    # ------------------------------------------------------------------------------------ the processes

    def start_worker(self, worker: Worker) -> None:
        worker.generation += 1
        env = os.environ | {"STOCK_LEDGER_METRICS_PORT": str(worker.port)}
        if instance := os.environ.get("STOCK_LEDGER_GROUP_INSTANCE_ID"):
            # One id per incarnation, as the chart derives it from the pod name.
            env["STOCK_LEDGER_GROUP_INSTANCE_ID"] = f"{instance}-{worker.index}-{worker.generation}"
        worker.log = self.workdir / f"worker-{worker.index}.{worker.generation}.log"
        with worker.log.open("wb") as out:
            worker.proc = subprocess.Popen([self.plan.cli, "run"], env=env, stdin=subprocess.DEVNULL, stdout=out,
                                           stderr=subprocess.STDOUT)

    def cli(self, *args: str, stdout: IO[bytes] | int) -> subprocess.Popen[bytes]:
        return subprocess.Popen([self.plan.cli, *args], stdin=subprocess.DEVNULL, stdout=stdout)

    def supervise(self) -> None:
        """Reap the producer and restart workers that exited on their own (the worker exits on purpose in a few
        unrecoverable states, counting on exactly that)."""
        if self.producer is not None and (rc := self.producer.poll()) is not None:
            self.producer = None
            if rc != 0:
                raise DrillFailed(f"the producer exited with status {status(rc)}")
            log(f"producer: done after {int(time.monotonic() - self.produce_started)}s")
        for worker in self.workers:
            if worker.proc is None or (rc := worker.proc.poll()) is None:
                continue
            pid, worker.proc = worker.proc.pid, None
            self.crashes += 1
            said = f"worker {worker.index} (pid {pid}) exited on its own with status {status(rc)}"
            if self.starting or rc == 2 or self.crashes > MAX_CRASHES:  # 2: a configuration error
                log(f"last lines of {worker.log}:")
                sys.stderr.write("".join(worker.log.read_text(errors="replace").splitlines(keepends=True)[-5:]))
                raise DrillFailed(f"{said} (crash {self.crashes})")
            log(f"{said}, see {worker.log}; restarting it")
            self.start_worker(worker)

    async def pause(self, ms: int) -> None:
        """Wait `ms` milliseconds in short slices, watching the background processes between them."""
        deadline = time.monotonic() + ms / 1000
        while (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(left, SLICE_MS / 1000))
            self.supervise()

    async def wait_ready(self) -> None:
        deadline = time.monotonic() + self.plan.ready_timeout
        while pending := [w.index for w in self.workers if not await asyncio.to_thread(ready, w.port)]:
            if time.monotonic() >= deadline:
                raise DrillFailed(f"workers {' '.join(map(str, pending))} not ready after "
                                  f"{self.plan.ready_timeout}s; logs in {self.workdir}")
            await self.pause(500)
        self.starting = False
        log(f"all {self.plan.workers} workers ready")

    def kill_one(self, n: int, rng: random.Random) -> None:
        worker = self.workers[rng.randint(1, self.plan.workers) - 1]
        assert worker.proc is not None  # noqa: S101 - supervise() restarts a worker the moment it is reaped
        pid = worker.proc.pid
        worker.proc.kill()
        worker.proc.wait()
        self.killed += 1
        log(f"kill {n}/{self.plan.kills}: pid {pid} (worker {worker.index})")
        self.start_worker(worker)
        log(f"restarted worker {worker.index}: pid {worker.proc.pid} (log {worker.log})")

    def stop_workers(self, grace: float) -> int:
        """SIGTERM, then up to `grace` seconds for a clean exit, then SIGKILL; how many did not exit 0."""
        running = [w for w in self.workers if w.proc is not None]
        for worker in running:
            assert worker.proc is not None  # noqa: S101 - filtered above
            worker.proc.terminate()
        deadline, unclean = time.monotonic() + grace, 0
        for worker in running:
            assert worker.proc is not None  # noqa: S101 - filtered above
            try:
                rc = worker.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log(f"worker {worker.index} (pid {worker.proc.pid}) ignored SIGTERM for {grace:g}s: SIGKILL")
                worker.proc.kill()
                rc = worker.proc.wait()
            if rc != 0:
                log(f"worker {worker.index} (pid {worker.proc.pid}) exited with status {status(rc)}, not 0 as "
                    f"after SIGTERM; see {worker.log}")
                unclean += 1
            worker.proc = None
        return unclean

    def end_all(self) -> None:
        """On any exit: the producer and verify are ended, the workers stopped with a short grace (a clean stop
        keeps their logs readable)."""
        for proc in (self.producer, self.verifier):
            if proc is not None and proc.poll() is None:
                proc.terminate()
        if any(w.proc is not None for w in self.workers):
            log("stopping the workers still running")
            self.stop_workers(10)
        for proc in (self.producer, self.verifier):
            if proc is not None:
                proc.wait()

    # ------------------------------------------------------------------------------------ the steps

    async def run(self) -> None:
        await self.start()
        await self.produce_and_kill()
        line = await self.verify()
        print(line, flush=True)
        p = self.plan
        if line != f"{p.count}|{p.count}":
            raise DrillFailed(f"expected {p.count}|{p.count}, found {line}")
        assert self.verifier is not None  # noqa: S101 - verify() ran it
        if rc := status(self.verifier.wait()):
            raise DrillFailed(f"verify found a problem (status {rc}): see the table above")
        log(f"ok: {line}")
        log("stopping the workers (SIGTERM)")
        unclean = self.stop_workers(30)
        if self.crashes:
            log(f"note: workers exited on their own {self.crashes} time(s) and were restarted")
        if unclean:
            raise DrillFailed(f"{unclean} worker(s) did not stop cleanly on SIGTERM")
        log(f"done: {self.killed} kills, ledger exact")

    async def start(self) -> None:
        """Say the plan, create the topic, start the workers and wait until all of them are ready."""
        p, env = self.plan, os.environ
        for i in range(1, p.workers + 1):
            self.workers.append(Worker(i, unused_port({w.port for w in self.workers})))
        log(f"plan: --mode local, {p.workers} worker(s) of {p.cli}, group "
            f"{env.get('STOCK_LEDGER_GROUP_ID') or 'stock-ledger'}, topic {topic()} at "
            f"{env.get('KAFKA_BOOTSTRAP_SERVERS') or 'localhost:9092'}")
        log(f"plan: produce {p.count} movements at {p.rate}/s; SIGKILL a random worker {p.kills} times, "
            f"{seconds(p.gap_ms[0])}-{seconds(p.gap_ms[1])}s apart, restarting it at once; seed {p.seed}")
        log(f"logs: {self.workdir} (metrics ports {' '.join(str(w.port) for w in self.workers)})")
        if rc := await asyncio.to_thread(self.cli("create-topic", stdout=sys.stderr.fileno()).wait):
            raise DrillFailed(f"stock-ledger create-topic exited with status {status(rc)}")
        for worker in self.workers:
            self.start_worker(worker)
        await self.wait_ready()

    async def produce_and_kill(self) -> None:
        """The producer in the background, --kills kills at random gaps meanwhile, then the producer's end."""
        p = self.plan
        log(f"producer: {p.count} movements at {p.rate}/s (seed {p.seed}) to {topic()}")
        self.produce_started = time.monotonic()
        self.producer = self.cli("produce", "--count", str(p.count), "--rate", p.rate, "--seed", str(p.seed),
                                 stdout=sys.stderr.fileno())
        rng = random.Random(p.seed)
        for n in range(1, p.kills + 1):
            await self.pause(rng.randint(*p.gap_ms))
            self.kill_one(n, rng)
        if self.producer is not None:
            log("waiting for the producer")
        while self.producer is not None:
            await self.pause(SLICE_MS)

    async def verify(self) -> str:
        """`verify --wait` first waits for lag 0 (stored offsets at every partition's log end), then checks
        everything; meanwhile the workers stay supervised and the stored offsets are shown as they grow."""
        p = self.plan
        out = self.workdir / "verify.out"
        log(f"waiting up to {p.drain_timeout}s for lag 0, then: stock-ledger verify --expect {p.count}")
        with out.open("wb") as stdout:
            self.verifier = self.cli("verify", "--wait", str(p.drain_timeout), "--expect", str(p.count),
                                     stdout=stdout)
        progress = asyncio.create_task(show_progress(p.count))
        try:
            while self.verifier.poll() is None:
                await self.pause(SLICE_MS)
        finally:
            progress.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await progress
        text = out.read_text(errors="replace")
        sys.stderr.write(text)
        lines = [line for line in text.splitlines() if COUNT_LINE.match(line)]
        if not lines:
            raise DrillFailed(f"verify printed no count|distinct line (status {status(self.verifier.wait())})")
        return lines[-1]


def topic() -> str:
    return os.environ.get("STOCK_LEDGER_TOPIC") or "warehouse.movements"


def unused_port(taken: set[int]) -> int:
    """A port nobody listens on and no other worker of the drill was given."""
    while (port := free_port()) in taken:
        pass
    return port


def ready(port: int) -> bool:
    with contextlib.suppress(OSError), urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
        return int(r.status) == 200
    return False


async def show_progress(count: int) -> None:
    """While verify waits for lag 0: how many records the stored offsets account for, whenever that changes.
    Only a display: a database it cannot read is said once, and the drill goes on (verify decides)."""
    shown = -1
    try:
        settings = load_settings(os.environ)
        conn = await connect_database(settings, application_name="stock-ledger-chaos")
        try:
            while True:
                offsets = await stored_offsets(conn, settings.group_id, settings.topic)
                if (stored := sum(n or 0 for n in offsets.values())) != shown:
                    log(f"stored offsets account for {stored} of {count} records")
                    shown = stored
                await asyncio.sleep(PROGRESS_SECONDS)
        finally:
            await conn.close()
    except Exception as exc:  # a display: whatever it hits, verify still waits and checks
        log(f"no progress display ({type(exc).__name__}: {exc}); verify still waits and checks")


def parse_args(argv: Sequence[str]) -> Plan:
    """chaos.sh's checked values (see its --help); no checks here beyond types."""
    parser = argparse.ArgumentParser(prog="chaos_local.py", description="chaos.sh --mode local (run chaos.sh)")
    for flag in ("--count", "--kills", "--seed", "--workers", "--drain-timeout", "--ready-timeout"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--cli", required=True)
    parser.add_argument("--rate", required=True)
    parser.add_argument("--gap-ms", type=int, nargs=2, required=True, metavar=("MIN", "MAX"))
    parser.add_argument("--log-dir", default="")
    a = parser.parse_args(argv)
    return Plan(a.cli, a.count, a.rate, a.kills, (a.gap_ms[0], a.gap_ms[1]), a.seed, a.workers, a.log_dir,
                a.drain_timeout, a.ready_timeout)


def make_workdir(log_dir: str) -> Path:
    """--log-dir, or a new temporary directory (kept: the logs are the drill's evidence)."""
    if not log_dir:
        return Path(tempfile.mkdtemp(prefix="stock-ledger-chaos."))
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    return Path(log_dir)


async def main(plan: Plan, workdir: Path) -> int:
    drill = Drill(plan, workdir)
    # SIGTERM and SIGINT stop the drill where it is; what it started is stopped on the way out.
    interrupted: list[int] = []
    task, loop = asyncio.current_task(), asyncio.get_running_loop()
    assert task is not None  # noqa: S101 - main() runs as a task

    def stop(signum: int) -> None:
        interrupted.append(128 + signum)  # the shell's status for death by that signal: 130, 143
        task.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop, sig)
    code = 0
    try:
        await drill.run()
    except DrillFailed as exc:
        log(f"FAILED: {exc}")
        code = 1
    except asyncio.CancelledError:
        if not interrupted:
            raise
        code = interrupted[0]
    finally:
        drill.end_all()
    if code:
        log(f"exit {code}; logs kept in {workdir}")
    return code


if __name__ == "__main__":
    plan = parse_args(sys.argv[1:])
    sys.exit(asyncio.run(main(plan, make_workdir(plan.log_dir))))
