"""scripts/chaos.sh: the staging chaos drill as a script, run for real in `--mode local`.

The local run uses the real broker and database and `stock-ledger` processes started by the script itself; the
ledger is then checked independently of the script and of `stock-ledger verify`. `--mode k8s` needs a cluster, so
its tests drive the script with a stand-in kubectl that records every call: they pin down that it deletes nothing
but pods matching the selector, in the given namespace, with the staging pipeline's command.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import asyncpg
import pytest

from tests.support.helpers import Env, Services

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "chaos.sh"
# The venv's console script, next to the interpreter running the tests (not resolved: a venv's python is a link).
CLI = Path(sys.executable).with_name("stock-ledger")
KILL_LINE = re.compile(r"^\S+ chaos: kill (\d+)/(\d+): pid (\d+) \(worker (\d+)\)$", re.MULTILINE)


def _base_env(**extra: str) -> dict[str, str]:
    """The caller's environment without any stock-ledger setting, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("STOCK_LEDGER_") and k not in {"KAFKA_BOOTSTRAP_SERVERS", "DATABASE_URL"}}
    env.update(extra)
    return env


async def _run_script(args: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    """Run chaos.sh in its own process group. On timeout it gets SIGTERM first, so its trap stops the workers it
    started; only if that hangs is the group (the script and its children, nothing else) killed."""
    proc = await asyncio.create_subprocess_exec(
        "bash", str(SCRIPT), *args, env=env, cwd=ROOT, start_new_session=True,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    communicate = asyncio.ensure_future(proc.communicate())
    try:
        out, err = await asyncio.wait_for(asyncio.shield(communicate), timeout)
    except TimeoutError:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = await asyncio.wait_for(communicate, 30)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = await communicate
        pytest.fail(f"chaos.sh did not finish within {timeout}s\n--- stdout\n{out.decode()}\n--- stderr\n"
                    f"{err.decode()}")
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.asyncio
@pytest.mark.timeout(240)
async def test_local_drill_kills_workers_three_times_and_the_ledger_holds_each_movement_once(
    services: Services, database: Env, topic: str, tmp_path: Path,
) -> None:
    """The staging drill, scaled down: 20,000 movements at 2,000/s into a fresh topic while two local workers are
    SIGKILLed three times, 1-3 s apart, each restarted at once. The script exits 0 and prints `20000|20000`;
    three kill lines name the pid and the worker; the ledger, read directly, holds 20,000 rows with 20,000
    distinct sources; every worker incarnation (2 + 3 restarts) logged to the log directory, none crashed."""
    assert CLI.exists(), f"{CLI} not found: run `make venv`"
    logs = tmp_path / "chaos-logs"
    env = _base_env(
        KAFKA_BOOTSTRAP_SERVERS=services.kafka,
        DATABASE_URL=database.worker_url,
        STOCK_LEDGER_TOPIC=topic,
        STOCK_LEDGER_GROUP_ID=f"stock-ledger-chaos-{uuid.uuid4().hex[:8]}",
        STOCK_LEDGER_BIN=str(CLI),
        # A killed member holds its partitions until its session expires: 6 s (as in tests/helpers.py) instead
        # of the default 10 s keeps three kills well inside the time budget.
        STOCK_LEDGER_SESSION_TIMEOUT_MS="6000",
        STOCK_LEDGER_REBALANCE_TIMEOUT_MS="20000",
        STOCK_LEDGER_LOG_FORMAT="json",
    )
    args = ["--mode", "local", "--count", "20000", "--rate", "2000", "--kills", "3", "--interval", "1-3",
            "--workers", "2", "--seed", "7", "--log-dir", str(logs)]

    code, out, err = await _run_script(args, env, timeout=150)

    context = f"\n--- stdout\n{out}\n--- stderr\n{err}"
    assert code == 0, f"chaos.sh exited {code}{context}"
    assert out.splitlines() == ["20000|20000"], context
    kills = KILL_LINE.findall(err)
    assert [(n, total) for n, total, _, _ in kills] == [("1", "3"), ("2", "3"), ("3", "3")], context
    assert all(worker in {"1", "2"} for *_, worker in kills), context
    assert "exited on its own" not in err, context
    assert len(list(logs.glob("worker-*.log"))) == 5, sorted(p.name for p in logs.iterdir())

    conn = await asyncpg.connect(database.owner_url)
    try:
        row = await conn.fetchrow("SELECT count(*), count(DISTINCT source) FROM stock_movements")
    finally:
        await conn.close()
    assert tuple(row) == (20_000, 20_000)


@pytest.mark.parametrize(("args", "message"), [
    (["--mode", "local", "--kills", "-1"], "--kills must be a whole number"),
    (["--mode", "k8s"], "--mode k8s needs an explicit --namespace"),
    (["--mode", "local", "--interval", "5-2"], "--interval 5-2: the minimum is greater than the maximum"),
    (["--mode", "local", "--interval", "3"], "--interval must be MIN-MAX seconds"),
    (["--mode", "local", "--count", "many"], "--count must be a whole number"),
    (["--mode", "local", "--rate", "0"], "--rate must be a number of movements per second > 0"),
    (["--mode", "local", "--workers", "0"], "--workers must be a whole number"),
    (["--mode", "local", "--namespace", "staging"], "--namespace applies to --mode k8s only"),
    (["--mode", "k8s", "--namespace", "staging", "--selector", "app"], "--selector must hold at least one key=value"),
    (["--mode", "k8s", "--namespace", "staging", "--workers", "2"], "--workers applies to --mode local only"),
    (["--mode", "cluster"], "--mode must be local or k8s"),
    ([], "--mode is required"),
    (["--mode", "local", "--kils", "3"], "unknown option: --kils"),
    (["--mode", "local", "--count"], "--count needs a value"),
])
def test_bad_flags_exit_2_with_a_message_before_anything_starts(args: list[str], message: str) -> None:
    """Each bad flag is refused with exit code 2 and a message naming it, on stderr; stdout stays empty (no
    count line), and nothing runs: the CLI given is one that would fail loudly if called."""
    env = _base_env(DATABASE_URL="postgresql://nobody@127.0.0.1:1/none", STOCK_LEDGER_BIN="/bin/false")
    done = subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=30,
                          check=False)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert message in done.stderr
    assert done.stdout == ""


def test_help_describes_both_modes_and_exits_0() -> None:
    """`--help` exits 0 and documents both modes and the flags the Helm chart's chaos pod passes."""
    done = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0
    for flag in ("--mode k8s", "--mode local", "--namespace", "--selector", "--count", "--rate", "--kills",
                 "--interval", "--workers", "--seed", "--stock-ledger", "--kubectl"):
        assert flag in done.stdout, flag


def test_shellcheck_is_clean() -> None:
    """The script passes shellcheck with no finding at all (info level included)."""
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.fail("shellcheck is not on PATH: run scripts/tools.sh (or `make tools`) to install it")
    done = subprocess.run([shellcheck, str(SCRIPT)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


# ------------------------------------------------------------------------------------------ k8s mode, no cluster

FAKE_KUBECTL = r"""#!/usr/bin/env bash
# Stands in for kubectl: records every call (arguments tab-separated) and plays two worker pods whose names
# change each time they are deleted, as a ReplicaSet's replacements do.
set -euo pipefail
printf '%s\t' "$@" >>"$FAKE_STATE/calls"; printf '\n' >>"$FAKE_STATE/calls"
gen=$(cat "$FAKE_STATE/gen" 2>/dev/null || echo 0)
case " $* " in
  *" auth can-i delete pods "*) echo yes ;;
  *" get pods "*) printf 'worker-%s-a||True\nworker-%s-b||True\n' "$gen" "$gen" ;;
  *" delete pod "*) printf 'pod/worker-%s-a\npod/worker-%s-b\n' "$gen" "$gen"; echo $((gen + 1)) >"$FAKE_STATE/gen" ;;
  *) echo "fake kubectl: unexpected call: $*" >&2; exit 1 ;;
esac
"""

FAKE_CLI = r"""#!/usr/bin/env bash
# Stands in for stock-ledger: `produce` takes a moment, `verify` prints a table and $FAKE_VERIFY_LINE.
printf '%s\n' "$*" >>"$FAKE_STATE/cli"
case "$1" in
  produce) sleep 0.5 ;;
  verify) printf 'check  result  detail\nexpected rows  -  -\n%s\n' "$FAKE_VERIFY_LINE"; exit "$FAKE_VERIFY_RC" ;;
  *) exit 1 ;;
esac
"""

SELECTOR = "app.kubernetes.io/name=stock-ledger,app.kubernetes.io/instance=staging"
K8S_ARGS = ["--mode", "k8s", "--namespace", "staging", "--selector", SELECTOR, "--count", "1000", "--rate", "2000",
            "--kills", "3", "--interval", "0-0.2", "--seed", "3"]


def _k8s(tmp_path: Path, verify_line: str, verify_rc: int, *extra: str,
         hostname: str = "chaos") -> tuple[subprocess.CompletedProcess[str], list[list[str]], list[str]]:
    for name, text in (("kubectl", FAKE_KUBECTL), ("stock-ledger", FAKE_CLI)):
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    env = _base_env(DATABASE_URL="postgresql://worker@db:5432/stock_ledger", FAKE_STATE=str(tmp_path),
                    FAKE_VERIFY_LINE=verify_line, FAKE_VERIFY_RC=str(verify_rc), HOSTNAME=hostname,
                    STOCK_LEDGER_BIN=str(tmp_path / "stock-ledger"))
    done = subprocess.run(["bash", str(SCRIPT), *K8S_ARGS, "--kubectl", str(tmp_path / "kubectl"), *extra],
                          env=env, capture_output=True, text=True, timeout=60, check=False)
    calls_file, cli_file = tmp_path / "calls", tmp_path / "cli"
    calls = [line.rstrip("\t").split("\t") for line in calls_file.read_text().splitlines()] \
        if calls_file.exists() else []
    cli = cli_file.read_text().splitlines() if cli_file.exists() else []
    return done, calls, cli


def test_k8s_drill_deletes_only_selected_pods_in_the_namespace_then_verifies(tmp_path: Path) -> None:
    """With a stand-in kubectl and CLI: the drill checks it may delete pods, waits for Ready pods, produces,
    force-deletes by selector exactly --kills times with the staging pipeline's flags, waits for the replacement
    pods, runs `verify --expect 1000`, prints `1000|1000` and exits 0. Every kubectl call is scoped to the
    namespace; the only mutating call is the selector delete."""
    done, calls, cli = _k8s(tmp_path, "1000|1000", 0)

    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["1000|1000"]
    assert all(c[c.index("-n") + 1] == "staging" for c in calls), calls
    verbs = [c[1] for c in calls]  # c[0] is --request-timeout
    assert set(verbs) == {"auth", "get", "delete"}, calls
    deletes = [c for c in calls if c[1] == "delete"]
    assert deletes == [["--request-timeout=30s", "delete", "pod", "-l", SELECTOR, "-n", "staging",
                        "--grace-period=0", "--force", "--wait=false", "-o", "name"]] * 3
    assert ["--request-timeout=30s", "auth", "can-i", "delete", "pods", "-n", "staging"] in calls
    assert all(c[c.index("-l") + 1] == SELECTOR for c in calls if c[1] == "get")
    assert re.findall(r"kill (\d)/3: pods worker-\d-a worker-\d-b", done.stderr) == ["1", "2", "3"]
    assert cli == ["produce --count 1000 --rate 2000 --seed 3", "verify --wait 300 --expect 1000"]


def test_k8s_drill_fails_when_the_ledger_does_not_match(tmp_path: Path) -> None:
    """verify finds 999 rows where 1000 were produced: the drill still prints the `999|999` line, says what it
    expected, and exits 1."""
    done, _, _ = _k8s(tmp_path, "999|999", 1)

    assert done.returncode == 1, done.stderr
    assert done.stdout.splitlines() == ["999|999"]
    assert "expected 1000|1000, found 999|999" in done.stderr


def test_k8s_drill_refuses_a_selector_that_matches_its_own_pod(tmp_path: Path) -> None:
    """The drill runs in a pod ($HOSTNAME) that the selector matches: it exits 2 before producing or deleting
    anything."""
    done, calls, cli = _k8s(tmp_path, "1000|1000", 0, hostname="worker-0-a")

    assert done.returncode == 2, done.stderr
    assert "matches this pod (worker-0-a)" in done.stderr
    assert not [c for c in calls if c[1] == "delete"]
    assert cli == []
