"""The archive commands without pyarrow (the `archive` extra, which the image leaves out): a configuration error that
says what to install, never an ImportError from deep inside, and the worker's CLI never loads pyarrow."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from stock_ledger.cli.archive import require_pyarrow
from stock_ledger.errors import ConfigError


def test_without_pyarrow_the_archive_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pyarrow" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'stock-ledger\[archive\]'"):
        require_pyarrow()


def test_the_cli_loads_without_pyarrow() -> None:
    code = "import sys, stock_ledger.cli.main, stock_ledger.cli.commands; print('pyarrow' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert done.stdout.strip() == "False", done.stdout + done.stderr
