"""A command's --json document is alone on stdout: its log lines (here the fatal one) go to stderr; without --json
the log stays on stdout, a pod's log. PostgreSQL on a closed port is refused by the kernel: no service needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

UNREACHABLE = {"DATABASE_URL": "postgresql://nobody@127.0.0.1:1/ledger", "STOCK_LEDGER_LOG_FORMAT": "json"}


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STOCK_LEDGER_")} | UNREACHABLE
    return subprocess.run([sys.executable, "-m", "stock_ledger", *args], capture_output=True, text=True, timeout=60,
                          check=False, env=env)


@pytest.mark.parametrize("command", [("rejected", "list"), ("gaps", "list")])
def test_json_output_keeps_the_log_on_stderr(command: tuple[str, ...]) -> None:
    done = run(*command, "--json")
    assert done.returncode == 1, done
    assert done.stdout == "", done.stdout
    fatal = json.loads(done.stderr.strip().splitlines()[-1])
    assert (fatal["event"], fatal["error_type"]) == ("fatal", "DatabaseUnreachableError"), fatal


def test_without_json_the_log_is_on_stdout() -> None:
    done = run("gaps", "list")
    assert done.returncode == 1, done
    assert json.loads(done.stdout.strip().splitlines()[-1])["event"] == "fatal", done.stdout
