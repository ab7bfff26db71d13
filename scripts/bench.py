"""stock-ledger's benchmarks: one entry point, one subcommand per question, one kit (scripts/benchkit.py).

    .venv/bin/python scripts/bench.py drain
    .venv/bin/python scripts/bench.py soak --minutes 10 --rate 5000
    .venv/bin/python scripts/bench.py SUBCOMMAND --help      # what it measures, and its options

Each prints its table on stdout beneath the command line that produced it, progress on stderr, and writes JSON
(the options, the machine, every measurement) to --out, by default bench-results/<subcommand>-<time>.json, with
its charts beside it. Services: KAFKA_BOOTSTRAP_SERVERS / DATABASE_URL if set, else the project's scripts
(127.0.0.1:9092 and `scripts/postgres.sh url`), like the tests. Everything a run creates is dropped at its end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shlex
import signal
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the kit beside this file, run as a script or imported
from benchkit import ROOT, STARTED, Bench, environment, say
from benchmarks import drain, growth, membership, peers, signals, soak
from localservices import discover

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    Measure = Callable[[Bench, argparse.Namespace], Awaitable[str]]


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="scripts/bench.py", description=__doc__.split("\n", 1)[0],
                                  formatter_class=argparse.RawDescriptionHelpFormatter,
                                  epilog=__doc__.split("\n\n", 1)[1])
    sub = top.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")

    def add(name: str, doc: str, measure: Measure, summary: str | None = None) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=summary or doc.split("\n", 1)[0].split(": ", 1)[-1], description=doc,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--out", type=Path, default=None,
                       help=f"JSON results (default bench-results/{name}-<time>.json)")
        p.set_defaults(measure=measure)
        return p

    for module in (drain, peers, growth, soak, membership, signals):
        module.register(add)
    return top


async def main(args: argparse.Namespace, argv: Sequence[str]) -> int:
    # stdout is for the table: the library's own log lines (migrations) go to stderr, warnings and above only.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
                        logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    command = shlex.join(["python", "scripts/bench.py", *argv])
    out: Path = args.out or ROOT / "bench-results" / f"{args.command}-{datetime.now(UTC):%Y%m%dT%H%M%SZ}.json"
    bench = Bench(discover())
    say(f"{command}: run {bench.run_id}, kafka {bench.services.kafka} ({bench.services.origin}), logs {bench.logs}")
    try:
        report = await args.measure(bench, args)
        bench.results["meta"] |= {"services": await bench.versions()}
    except BaseException:
        bench.keep_logs = True
        write(out.with_name(out.stem + "-partial.json"), bench.results)
        say(f"failed: what was measured so far is in {out.with_name(out.stem + '-partial.json')}")
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
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")


def run(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    # SIGTERM (a CI timeout, kill) ends the run like Ctrl-C: the finally blocks drop the databases and the topics.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        import uvloop  # noqa: PLC0415 - optional on some platforms; the worker runs on it, so the limits are too
    except ImportError:
        return asyncio.run(main(args, argv))
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main(args, argv))


if __name__ == "__main__":
    sys.exit(run())
