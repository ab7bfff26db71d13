"""scripts/kafka.sh, scripts/postgres.sh, scripts/pgbouncer.sh and the CA they share are shellcheck-clean (warnings
and worse)."""

from __future__ import annotations

import subprocess

import pytest

from .support import REPO, require_tool

pytestmark = pytest.mark.deploy


@pytest.mark.parametrize("script", ["kafka.sh", "postgres.sh", "pgbouncer.sh", "ca.sh"])
def test_shellcheck_clean(script: str) -> None:
    result = subprocess.run(
        [require_tool("shellcheck"), "--severity=warning", "--external-sources", f"scripts/{script}"],
        capture_output=True, text=True, timeout=60, check=False, cwd=REPO,
    )
    assert result.returncode == 0, result.stdout + result.stderr
