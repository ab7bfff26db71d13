"""scripts/tools.sh, the installer of this suite's tools, is shellcheck-clean and valid bash."""

from __future__ import annotations

import subprocess

import pytest

from .support import REPO, require_tool

pytestmark = pytest.mark.deploy

SCRIPT = REPO / "scripts" / "tools.sh"


def test_shellcheck_clean() -> None:
    result = subprocess.run(
        [require_tool("shellcheck"), "--severity=style", str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_executable_bash_with_strict_mode() -> None:
    text = SCRIPT.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text
    assert SCRIPT.stat().st_mode & 0o111, "scripts/tools.sh must be executable"
