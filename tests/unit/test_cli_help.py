"""The CLI's self-description: `--version`, and help that names the environment variables each command reads."""

from __future__ import annotations

import subprocess
import sys


def test_version_and_help_list_the_environment() -> None:
    """`--version` prints the version; top-level and per-command help name the variables each command reads."""
    def run(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "stock_ledger", *args], capture_output=True, text=True,
                              check=True, timeout=60)
        return done.stdout

    assert run("--version").startswith("stock-ledger ")
    top = run("--help")
    for command in ("run", "migrate", "verify", "offsets", "rejected", "repair"):
        assert f"  {command}: " in top
    assert "exit codes: 0 success; 1 failure" in top
    assert "every database error included" in top
    assert "STOCK_LEDGER_MIGRATE_LOCK_TIMEOUT_MS" in run("migrate", "--help")
    assert "DATABASE_URL (the owner role)" in run("offsets", "set", "--help")
    assert "STOCK_LEDGER_GROUP_ID" in run("offsets", "show", "--help")
    assert "DATABASE_URL" in run("rejected", "replay", "--help")
    fix = run("repair", "--help")
    assert "DATABASE_URL (the owner role)" in fix
    assert "KAFKA_BOOTSTRAP_SERVERS" in fix
    assert "3 some range is gone from" in fix
    assert "--json" in run("verify", "--help")
