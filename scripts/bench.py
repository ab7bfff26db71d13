"""stock-ledger's benchmarks: one subcommand per question (scripts/benchmarks/), one kit (scripts/benchkit.py).

From the repository root, with the project's interpreter: `python -m scripts.bench SUBCOMMAND [--help]`, e.g.
`python -m scripts.bench drain`. Each prints its table beneath the command that reproduces it, progress on stderr,
and writes JSON (the options, the machine, every measurement) to --out, charts beside it. Services:
KAFKA_BOOTSTRAP_SERVERS / DATABASE_URL if set, else the project's scripts. A run drops what it made.
"""

import argparse
import json
import logging
import shlex
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog
import uvloop
from scripts.benchkit import ROOT, STARTED, Bench, environment, ints, say
from scripts.benchmarks import drain, growth, membership, peers, reads, soak, transactional
from tests.support.services import discover

PROG = "python -m scripts.bench"
RAW = argparse.RawDescriptionHelpFormatter


def parser() -> argparse.ArgumentParser:
    """Every subcommand and its options, in the order `--help` lists them."""
    top = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=RAW)
    sub = top.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")

    def add(name: str, measure: Callable[[Bench, argparse.Namespace], Awaitable[str]], summary: str = "",
            repeat: int | None = None) -> argparse.ArgumentParser:
        doc = sys.modules[measure.__module__].__doc__ or ""
        p = sub.add_parser(name, help=summary or doc.split("\n", 1)[0].split(": ", 1)[-1], description=doc,
                           formatter_class=RAW)
        p.add_argument("--out", type=Path, help=f"JSON results (default bench-results/{name}-<time>.json)")
        if repeat is not None:
            p.add_argument("--repeat", type=int, default=repeat, help="repetitions; medians (default %(default)s)")
        p.set_defaults(measure=measure)
        return p

    p = add("drain", drain.measure, repeat=1)
    p.add_argument("--count", type=int, default=1_000_000, help="movements in the topic (default %(default)s)")
    p.add_argument("--batch-sizes", type=ints, default=[], help="also drain N once per batch size, e.g. 2000,5000")
    p.add_argument("--workers", type=int, default=3, help="the multi-worker measurement (default %(default)s)")
    p.add_argument("--latency-seconds", type=float, default=20.0, help="the steady load's length (default %(default)s)")
    p.add_argument("--latency-rate", type=int, default=5_000, help="the steady load's rate (default %(default)s)")
    p.add_argument("--naive-count", type=int, default=drain.NAIVE_COUNT, help="records of the naive loop")
    p.add_argument("--svg", action="store_true", help="chart the batch size sweep beside --out")
    p.add_argument("--formats", action="store_true", help="only the drain rate of the same N as JSON, Avro and "
                   "Protobuf through the local Schema Registry")
    p = add("peers", peers.measure, repeat=1)
    p.add_argument("--count", type=int, default=200_000, help="movements side by side (default %(default)s)")
    p.add_argument("--drill-count", type=int, default=50_000, help="movements of the kill drill (default %(default)s)")
    p.add_argument("--kills", type=int, default=5, help="SIGKILLs in each drill (default %(default)s)")
    p.add_argument("--skip-drill", action="store_true", help="only the side-by-side run")
    grow = add("growth", growth.measure_growth, "drain rate and invariant scans as the ledger grows", repeat=1)
    scale = add("scale-out", growth.measure_scaleout, "drain rate by worker count", repeat=1)
    for p in (grow, scale):
        p.add_argument("--backlog", type=int, default=500_000, help="movements in the backlog (default %(default)s)")
    grow.add_argument("--sizes", type=ints, default=[0, 1_000_000, 5_000_000, 20_000_000],
                      help="ledger sizes to preload, ascending (default 0,1000000,5000000,20000000)")
    grow.add_argument("--skip-scans", action="store_true", help="do not time the invariant scans (minutes at 20M)")
    grow.add_argument("--postgres-memory", metavar="LIMIT", help="drain with PostgreSQL's processes in a memory "
                      "cgroup of LIMIT (e.g. 3G, above shared_buffers; cgroup v1, root), page cache dropped first")
    scale.add_argument("--workers", type=ints, default=[1, 2, 3, 6], help="worker counts (default 1,2,3,6)")
    reads.add_arguments(add("reads", reads.measure, "`stock show --at T` on a large ledger, every read cold"))
    p = add("soak", soak.measure_soak, "latency, memory and invariant checks under a steady load")
    p.add_argument("--minutes", type=float, required=True, help="how long the producer runs")
    p.add_argument("--rate", type=int, default=5_000, help="movements/s (default %(default)s)")
    p.add_argument("--soak-env", action="append", default=[], metavar="VAR=VALUE",
                   help="an environment variable for the worker (repeatable), e.g. to compare settings")
    p = add("verify", soak.measure_verify, "`stock-ledger verify` and the invariant checks at N movements")
    p.add_argument("--sizes", type=ints, required=True, help="ledger sizes, e.g. 1000000,20000000")
    p.add_argument("--records", choices=("tiny", "sparse"), default="tiny", help="the topic's records (default tiny)")
    p.add_argument("--rate", type=int, default=5_000, help="movements/s of the simulated minutes (default %(default)s)")
    p = add("membership", membership.measure)
    p.add_argument("--modes", default=",".join(membership.MODES), help="comma-separated (default %(default)s)")
    p.add_argument("--workers", type=int, default=3, help="workers in the group (default %(default)s)")
    p.add_argument("--partitions", type=int, default=12, help="partitions of the topic (default %(default)s)")
    p.add_argument("--rate", type=float, default=600, help="movements/s during the restart (default %(default)s)")
    p.add_argument("--session-timeout-ms", type=int, default=10_000, help="the chart's default (%(default)s)")
    p = add("transactional", transactional.measure, repeat=3)
    p.add_argument("--count", type=int, default=100_000, help="movements committed (default %(default)s)")
    p.add_argument("--per-transaction", type=int, default=50, help="movements per transaction (default %(default)s)")
    p.add_argument("--abort-every", type=int, default=10, help="every Nth transaction aborted (default %(default)s)")
    return top


async def main(args: argparse.Namespace, command: str) -> int:
    # stdout is for the table: the library's own log lines (migrations) go to stderr, warnings and above only.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
                        logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    out: Path = args.out or ROOT / "bench-results" / f"{args.command}-{datetime.now(UTC):%Y%m%dT%H%M%SZ}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    bench = Bench(discover())
    say(f"{command}: run {bench.run_id}, kafka {bench.services.kafka} ({bench.services.origin}), logs {bench.logs}")
    try:
        report = await args.measure(bench, args)
        bench.results["meta"] |= {"services": await bench.versions()}
    except BaseException:
        bench.keep_logs = True
        write(partial := out.with_name(out.stem + "-partial.json"), bench.results)
        say(f"failed: what was measured so far is in {partial}")
        raise
    finally:
        await bench.close()
    bench.results["meta"] = environment(vars(args)) | {"command": command, **bench.results["meta"],
                                                       "elapsed_seconds": round(time.monotonic() - STARTED, 1)}
    write(out, bench.results)
    for suffix, svg in bench.charts.items():
        out.with_name(out.stem + suffix).write_text(svg)
    print(f"$ {command}\n{report}")
    say(f"results written to {out}" + (f" (charts: {', '.join(bench.charts)})" if bench.charts else ""))
    return 0


def write(path: Path, results: dict[str, Any]) -> None:
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")


def run(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, command = parser().parse_args(argv), shlex.join([*PROG.split(), *argv])
    # SIGTERM (a CI timeout, kill) ends the run like Ctrl-C: the finally blocks drop the databases and the topics.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    return uvloop.run(main(args, command))  # the worker runs on uvloop, so the limits are measured on it too


if __name__ == "__main__":
    sys.exit(run())
