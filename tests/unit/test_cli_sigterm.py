"""SIGTERM ends every subcommand promptly with 143 (the container tests check the same as PID 1)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stock_ledger.cli.main import _Terminated, _until_sigterm


def test_sigterm_stops_a_subcommand_waiting_on_a_silent_broker() -> None:
    """1. `create-topic` against a port that accepts and never answers (it would wait for its timeouts);
    2. SIGTERM after start-up; 3. it exits 143 within seconds and says why."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("STOCK_LEDGER_")},
               "KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{silent.getsockname()[1]}", "STOCK_LEDGER_LOG_FORMAT": "json"}
        proc = subprocess.Popen([sys.executable, "-m", "stock_ledger", "create-topic"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(3)
        assert proc.poll() is None, proc.communicate()
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 143, err
    assert time.monotonic() - started < 5
    assert "stopped by SIGTERM" in err


def _catches_sigterm(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text(encoding="ascii")
    caught = next(line for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) & (1 << (signal.SIGTERM - 1)))


def test_sigterm_while_the_worker_is_still_importing_stops_it_cleanly() -> None:
    """A pod stopped right after a (re)start: SIGTERM as soon as the process catches it at all, while its modules are
    still importing. As a container's PID 1 an uncaught SIGTERM is dropped and the worker would run on until the
    SIGKILL; here it is held, and `run` exits 0 at once (nothing started, nothing to drain) and says why."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("STOCK_LEDGER_")},
           "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1", "DATABASE_URL": "postgresql://nobody@127.0.0.1:1/ledger"}
    proc = subprocess.Popen([sys.executable, "-m", "stock_ledger", "run"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 10
    while not _catches_sigterm(proc.pid):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "SIGTERM never caught"
        time.sleep(0.001)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, (out, err)
    assert "stock-ledger run: stopped by SIGTERM" in err
    assert "worker.starting" not in out, "the worker started although it was stopped before"


@pytest.mark.asyncio
async def test_a_command_that_loses_the_first_cancellation_still_stops() -> None:
    """Python 3.11's `asyncio.wait_for` drops a cancellation that arrives as the call it waits on completes (aiokafka
    and asyncpg use it): `verify --wait` then ran on past SIGTERM until the SIGKILL. Here the command swallows the
    first cancellation outright; SIGTERM must still end it, as `_Terminated` (exit 143), within seconds."""
    swallowed = []

    async def command() -> int:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            swallowed.append(True)
        await asyncio.sleep(3600)
        return 0

    asyncio.get_running_loop().call_later(0.2, os.kill, os.getpid(), signal.SIGTERM)
    started = time.monotonic()
    with pytest.raises(_Terminated):
        await asyncio.wait_for(_until_sigterm(command()), 15)
    assert swallowed, "the SIGTERM never reached the command"
    assert time.monotonic() - started < 5
