"""scripts/bench.py is the one benchmark tool: the subcommands the docs quote, each with a working --help.

Nothing here touches a service: --help exits before the kit discovers any."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import bench  # noqa: E402 - a script, importable once scripts/ is on the path

SUBCOMMANDS = ["drain", "peers", "growth", "scale-out", "soak", "verify", "membership", "signals"]


def test_help_lists_exactly_the_agreed_subcommands() -> None:
    """`scripts/bench.py --help` exits 0 and lists these subcommands, in this order, and no others."""
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench.py"), "--help"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    listed = done.stdout.split("positional arguments:", 1)[1].split("options:", 1)[0]
    assert re.findall(r"^    (\S+)", listed, flags=re.MULTILINE) == SUBCOMMANDS


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_each_subcommand_has_a_help_that_exits_0(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        bench.parser().parse_args([name, "--help"])
    assert exited.value.code == 0
    assert f"usage: scripts/bench.py {name}" in capsys.readouterr().out
