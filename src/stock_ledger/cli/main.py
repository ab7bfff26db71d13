"""`stock-ledger <command>`: run the command cli/commands.py declares, and turn its outcome into an exit code.

Exit codes: 0 success; 1 failure (the message says what went wrong and what to do); 2 bad configuration or usage;
3 (`repair` only) some skipped records are gone from Kafka: reported and recorded in ledger_gaps, not applied;
130 interrupted; 143 stopped by SIGTERM.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

import asyncpg
import structlog
import uvloop
from aiokafka.errors import KafkaError

from stock_ledger import logs
from stock_ledger.cli.commands import chosen, needs_own_session, parser
from stock_ledger.clients.database import require_own_session
from stock_ledger.clients.dberrors import explain
from stock_ledger.config import load_settings
from stock_ledger.errors import ConfigError, OperatorError, StockLedgerError

if TYPE_CHECKING:
    import argparse
    from collections.abc import Coroutine, Sequence

    from stock_ledger.cli.commands import Command
    from stock_ledger.clients.dberrors import RunsAs
    from stock_ledger.config import Settings

log = structlog.get_logger("stock_ledger.cli")


def main(argv: Sequence[str] | None = None, *, sigterm_held: Sequence[int] = ()) -> int:
    """`sigterm_held`: a SIGTERM the entry point caught while this module was importing (entry.py)."""
    args = parser().parse_args(argv)
    # Until the event loop runs (imports, settings), a SIGTERM unwinds from wherever Python is.
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return _main(args, terminated_before=bool(sigterm_held))
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(args: argparse.Namespace, *, terminated_before: bool) -> int:  # noqa: PLR0911 - one exit per outcome
    path = chosen(args)
    name = " ".join(c.name for c in path)
    command = path[-1]
    if terminated_before:
        return _stopped_by_sigterm(args.command)
    try:
        settings = load_settings(os.environ)
        # --json promises one document on stdout that a script parses: the log lines go beside it, on stderr.
        logs.configure(settings.log_level, settings.log_format,
                       sys.stderr if getattr(args, "json", False) else None)
        if needs_own_session(path):
            require_own_session(settings, f"`stock-ledger {name}`")
        assert command.run is not None  # noqa: S101 - every leaf of COMMANDS runs something
        run = command.run(settings, args)
        if path[0].refusals_on_stderr:
            run = _refusals_on_stderr(run, name, _runs_as(path), settings)
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(_until_sigterm(run))
    except ConfigError as exc:
        print(f"stock-ledger: configuration error: {exc}", file=sys.stderr)
        return 2
    except StockLedgerError as exc:
        log.error("fatal", error=str(exc), error_type=type(exc).__name__)
        return 1
    except (asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        # After the connect (a missing privilege, no schema...): the cause and the fix, one line (dberrors.py).
        loaded = load_settings(os.environ)  # loaded once already: cannot fail now
        log.error("fatal", error=explain(exc, loaded.database_url, name, _runs_as(path), app_role=loaded.app_role,
                                         reader_role=loaded.reader_role) or str(exc),
                  error_type=type(exc).__name__, sqlstate=getattr(exc, "sqlstate", None))
        return 1
    except (KafkaError, OSError) as exc:
        # Database sessions raise our own errors for these (clients/database.py): this is Kafka, or the OS.
        log.error("fatal", error=str(exc) or repr(exc), error_type=type(exc).__name__,
                  hint="check KAFKA_BOOTSTRAP_SERVERS and that the broker is up")
        return 1
    except KeyboardInterrupt:
        return 130
    except _Terminated:
        return _stopped_by_sigterm(args.command)


def _stopped_by_sigterm(command: str) -> int:
    print(f"stock-ledger {command}: stopped by SIGTERM", file=sys.stderr)
    # A worker stopped before its own graceful handler took over has applied nothing it could lose: it stops as
    # cleanly as one that drained (its open transaction, if any, rolls back with its session).
    return 0 if command == "run" else 143


def _runs_as(path: Sequence[Command]) -> RunsAs:
    """The role the chosen command runs as: its own, else its group's, else the worker's."""
    return next((c.runs_as for c in reversed(path) if c.runs_as is not None), "worker")


async def _refusals_on_stderr(run: Coroutine[Any, Any, int], name: str, runs_as: RunsAs, settings: Settings) -> int:
    """stdout holds the command's output (perhaps JSON for a script): a refusal is one line on stderr, exit 1."""
    try:
        return await run
    except OperatorError as exc:
        print(f"stock-ledger {name}: {exc}", file=sys.stderr)
        return 1
    except asyncpg.InsufficientPrivilegeError as exc:
        problem = explain(exc, settings.database_url, name, runs_as, app_role=settings.app_role,
                          reader_role=settings.reader_role)
        print(f"stock-ledger {name}: {problem}", file=sys.stderr)
        return 1


# How long a cancelled command may take to unwind (close its connections) before it is cancelled again.
_RECANCEL_SECONDS = 2.0


class _Terminated(BaseException):
    """SIGTERM outside the worker's own handler: unwinds like Ctrl-C (transactions roll back, connections close)."""


def _raise_terminated(_signum: int, _frame: object) -> None:
    raise _Terminated


async def _until_sigterm(command: Coroutine[Any, Any, int]) -> int:
    """Runs a subcommand; SIGTERM cancels it. As a container's PID 1 the process gets no default action for
    SIGTERM (the kernel drops it), so `migrate`, `verify`, `produce` would otherwise run on until the SIGKILL at
    the end of the grace period. `run` replaces this handler with its graceful drain (worker.Worker.serve).

    One cancellation is not enough: Python 3.11's `asyncio.wait_for` loses it when the call it waits on completes
    in the same loop iteration (aiokafka and asyncpg use it); a CI run saw `verify --wait` run on past a SIGTERM to
    the SIGKILL. The command is cancelled again until it ends; unless it had already finished on its own, the
    SIGTERM ends it in 143."""
    loop = asyncio.get_running_loop()
    work = asyncio.ensure_future(command)
    terminated = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, terminated.set)
    stop = asyncio.ensure_future(terminated.wait())
    try:
        await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():  # it ended on its own (perhaps just as the SIGTERM came): its own outcome
            return work.result()
        while not work.done():
            work.cancel()
            await asyncio.wait({work}, timeout=_RECANCEL_SECONDS)
        if not work.cancelled() and work.exception() is not None:
            log.info("stopping.unwound_with_error", error=str(work.exception()))
        raise _Terminated
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        stop.cancel()
        if not work.done():  # Ctrl-C (the runner cancels this task): the command unwinds with it
            work.cancel()
            await asyncio.wait({work})
