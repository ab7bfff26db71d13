"""The CLI's self-description: `--version`, and help that names the environment variables each command reads."""

from __future__ import annotations

import subprocess
import sys

from stock_ledger.cli.commands import chosen, parser
from stock_ledger.cli.main import _runs_as


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


def test_each_command_declares_the_role_whose_url_it_needs() -> None:
    """A missing privilege is explained for the role the command runs as (cli/commands.py declares it): the owner
    for what deletes, moves offsets, records or acknowledges gaps or changes the schema; a reader for the read-only
    commands; the worker's role for the rest."""
    roles = {" ".join(c.name for c in chosen(parser().parse_args(argv))): _runs_as(chosen(parser().parse_args(argv)))
             for argv in (["migrate"], ["offsets", "set", "--partition", "0", "--offset", "1"], ["offsets", "show"],
                          ["rejected", "list"], ["rejected", "show", "1"], ["rejected", "replay"], ["repair"],
                          ["gaps", "ack", "1", "--note", "n"], ["gaps", "list"], ["stock", "show", "--warehouse", "W"],
                          ["movements", "--sku", "S"], ["run"], ["verify"])}
    assert roles == {"migrate": "owner", "offsets set": "owner", "offsets show": "worker", "rejected list": "owner",
                     "rejected show": "owner", "rejected replay": "owner", "repair": "owner", "gaps ack": "owner",
                     "gaps list": "worker", "stock show": "reader", "movements": "reader", "run": "worker",
                     "verify": "worker"}
