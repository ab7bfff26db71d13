"""Every command block the README shows runs, as written.

Each fenced `sh` or `sql` block of README.md is preceded by `<!-- readme-block: NAME -->`, and this module runs
each NAME: the laptop quick start and the `kill -9` walkthrough through `make` against the real broker and
database, the database roles of the Kubernetes quick start on a PostgreSQL cluster of their own (then a real
worker logs in as the role the grant made), the chart's install flags through `helm template` (which validates
the same schema and templates `helm upgrade --install` does). `kubectl` and `helm test` need a cluster; what of
them can be checked without one is.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import yaml
from scripts import bench

from stock_ledger.config import load_settings
from tests.deploy.support import require_tool
from tests.support.helpers import Env, Services, WorkerPool, assert_exact, movement, send_raw, wait_drained
from tests.support.services import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"<!-- readme-block: ([a-z-]+) -->\n\s*```(\w+)\n(.*?)\n\s*```", re.DOTALL)
RUN_HERE = {"laptop", "walkthrough", "roles", "secrets", "helm"}


def blocks() -> dict[str, str]:
    """NAME -> the block's text, each line unindented (the Kubernetes steps are indented list items)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return {name: "\n".join(line.strip() for line in body.splitlines())
            for name, _lang, body in BLOCK.findall(text)}


def test_every_command_block_of_the_readme_is_named_and_run_here() -> None:
    """A new block the README gains without a test here fails: its commands would be unchecked."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    fences = re.findall(r"^\s*```(sh|bash|sql|console)\s*$", text, flags=re.MULTILINE)
    assert len(fences) == len(blocks()), "a ```sh/```sql block without <!-- readme-block: NAME --> before it"
    assert set(blocks()) == RUN_HERE


def test_the_laptop_commands_are_the_makefile_targets_ci_runs() -> None:
    """`make test` is what .ci/run runs (so CI runs it on every change); `make run` runs in the walkthrough."""
    assert blocks()["laptop"].splitlines()[0].split("#")[0].strip() == "make run"
    assert blocks()["laptop"].splitlines()[1].split("#")[0].strip() == "make test"
    assert re.search(r"^make test$", (ROOT / ".ci" / "run").read_text(), flags=re.MULTILINE)


def _workdir(tmp_path: Path) -> Path:
    """A directory that looks like the checkout to make (its logs land here, not in the repository)."""
    work = tmp_path / "checkout"
    work.mkdir()
    for name in ("Makefile", ".venv", "scripts", "pyproject.toml", "migrations", "src"):
        (work / name).symlink_to(ROOT / name)
    return work


def test_the_walkthrough_survives_its_kill_minus_9_exactly(services: Services, database: Env, topic: str,
                                                           tmp_path: Path) -> None:
    """The walkthrough, run by bash as written, on a topic and database of its own: it ends with `verify`
    exiting 0, and the independent check finds 50,000 movements exactly once."""
    if subprocess.run(["pgrep", "-f", "stock-ledger run"], check=False, capture_output=True).returncode == 0:
        pytest.fail("another `stock-ledger run` is running on this machine: the walkthrough's pkill would kill it")
    # A user's shell, not make's child: no MAKELEVEL (it would make the nested make print its directories).
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("STOCK_LEDGER_") and k not in {"MAKELEVEL", "MAKEFLAGS", "MFLAGS"}} | {
        "KAFKA_BOOTSTRAP_SERVERS": services.kafka, "DATABASE_URL": database.owner_url, "STOCK_LEDGER_TOPIC": topic,
        "STOCK_LEDGER_METRICS_PORT": str(free_port()), "NO_COLOR": "1",
    }
    work = _workdir(tmp_path)
    # From a file, with job control as in a terminal: `bash -c TEXT` would carry the pkill pattern in its own
    # command line, and pkill would kill the script itself.
    (tmp_path / "walkthrough.sh").write_text("set -m\n" + blocks()["walkthrough"] + "\n")
    # Output to files, not pipes: the restarted worker outlives the script and keeps its stderr open.
    with (tmp_path / "out").open("w") as out, (tmp_path / "err").open("w") as err:
        done = subprocess.run(["bash", str(tmp_path / "walkthrough.sh")], check=False, cwd=work, env=env,
                              stdout=out, stderr=err, timeout=240)
    stdout, stderr = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
    log = (work / "worker.log").read_text(errors="replace") if (work / "worker.log").exists() else ""
    subprocess.run(["pkill", "-TERM", "-f", "stock-ledger run"], check=False)
    assert done.returncode == 0, f"exit {done.returncode}\n{stdout[-3000:]}\n{stderr[-3000:]}\n{log[-3000:]}"
    assert stdout.rstrip().endswith("50000|50000"), stdout[-3000:]
    assert log.count("worker.starting") >= 2, log[-2000:]  # killed once, started again
    asyncio.run(assert_exact(services, database, topic, "stock-ledger", rows=50_000))


@contextlib.contextmanager
def own_cluster() -> Iterator[tuple[int, Path]]:
    """A PostgreSQL cluster of the test's own (trust auth on 127.0.0.1), so the block can create its roles and
    database as written without touching the shared server's."""
    bin_dir = max(Path("/usr/lib/postgresql").glob("*/bin"))
    base = Path(tempfile.mkdtemp(prefix="sl-readme-pg-"))
    as_pg: list[str] = []
    if os.geteuid() == 0:  # initdb refuses root
        shutil.chown(base, "postgres")
        as_pg = ["runuser", "-u", "postgres", "--"]
    port = free_port()
    data = base / "data"
    subprocess.run([*as_pg, str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres"],
                   check=True, capture_output=True, timeout=120)
    subprocess.run([*as_pg, str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(base / "log"), "-w", "-o",
                    f"-p {port} -k {base} -c listen_addresses=127.0.0.1 -c fsync=off", "start"],
                   check=True, capture_output=True, timeout=120)
    try:
        yield port, bin_dir
    finally:
        subprocess.run([*as_pg, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                       check=False, capture_output=True, timeout=120)
        shutil.rmtree(base, ignore_errors=True)


def test_the_database_roles_as_written_let_a_real_worker_drain(services: Services, topic: str,
                                                               tmp_path: Path) -> None:
    """The SQL of step 2, by psql as a superuser on an empty cluster; then the owner migrates (as the chart's hook
    does) and a worker logging in as `stock_ledger_worker` claims every partition and applies 500 movements
    exactly. Without the block's GRANT the same worker cannot read the ledger."""
    sql = tmp_path / "roles.sql"
    sql.write_text(blocks()["roles"] + "\n")
    with own_cluster() as (port, bin_dir):
        psql = [str(bin_dir / "psql"), "-X", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1", "-p", str(port), "-U",
                "postgres", "-d", "postgres"]
        subprocess.run([*psql, "-f", str(sql)], check=True, capture_output=True, timeout=60)
        password = quote("…")
        owner = f"postgresql://stock_ledger:{password}@127.0.0.1:{port}/stock_ledger"
        worker = f"postgresql://stock_ledger_worker:{password}@127.0.0.1:{port}/stock_ledger"
        env = {k: v for k, v in os.environ.items() if not k.startswith("STOCK_LEDGER_")} | {"DATABASE_URL": owner}
        subprocess.run([str(ROOT / ".venv" / "bin" / "stock-ledger"), "migrate"], env=env, check=True,
                       capture_output=True, timeout=240)
        db = Env(owner_url=owner, worker_url=worker, name="stock_ledger")
        pool = WorkerPool(services, db, topic, group=f"readme-{uuid.uuid4().hex[:8]}", logs=tmp_path)
        try:
            pool.start()
            sent = asyncio.run(send_raw(services.kafka, topic, [
                (f"SKU-{i % 50}".encode(), json.dumps(movement(f"SKU-{i % 50}")).encode()) for i in range(500)]))
            assert sent == 500
            asyncio.run(wait_drained(services, db, topic, pool.group, timeout=90))
            asyncio.run(assert_exact(services, db, topic, pool.group, rows=500))
        finally:
            pool.kill_all()
        subprocess.run([*psql, "-c", "REVOKE stock_ledger_app FROM stock_ledger_worker"], check=True,
                       capture_output=True, timeout=60)
        refused = subprocess.run([*psql[:-2], "-U", "stock_ledger_worker", "-d", "stock_ledger", "-c",
                                  "SELECT count(*) FROM consumer_offsets"], check=False, capture_output=True, text=True,
                                 timeout=60)
        assert refused.returncode != 0
        assert "permission denied" in refused.stderr


def _helm_flags() -> list[str]:
    lines = blocks()["helm"].replace("\\\n", " ").splitlines()
    install = shlex.split(lines[0])
    assert install[:3] == ["helm", "upgrade", "--install"], lines[0]
    assert lines[1] == f"helm test {install[3]} -n inventory --logs"
    return install[3:]


def test_the_secrets_are_the_ones_the_install_names_and_their_urls_are_accepted() -> None:
    """kubectl needs a cluster: checked here are the Secret names `helm upgrade` refers to, their key, and that
    each URL is one the worker's settings accept."""
    commands = [shlex.split(c) for c in blocks()["secrets"].replace("\\\n", " ").splitlines()]
    created = {c[6]: c[7] for c in commands if c[:6] == ["kubectl", "-n", "inventory", "create", "secret", "generic"]}
    assert len(created) == len(commands) == 2
    flags = " ".join(_helm_flags())
    for name, literal in created.items():
        assert f"={name} " in flags + " ", name
        key, _, url = literal.removeprefix("--from-literal=").partition("=")
        assert key == "DATABASE_URL"
        assert load_settings({"DATABASE_URL": url}).database_url == url


def test_the_install_flags_render_a_release_helm_accepts() -> None:
    """The flags of step 4 through `helm template` (the schema and the templates' own checks, as `helm install`
    runs them): the workers use the first Secret, the migration hook the second, the image its registry."""
    args = _helm_flags()
    rendered = subprocess.run([require_tool("helm"), "template", *args], check=False, cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
    assert rendered.returncode == 0, rendered.stderr
    docs = [d for d in yaml.safe_load_all(rendered.stdout) if d]
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    deployment = next(d for (kind, _), d in by_kind.items() if kind == "Deployment")
    job = next(d for (kind, _), d in by_kind.items() if kind == "Job" and "migrat" in d["metadata"]["name"])
    assert "stock-ledger-db" in str(deployment["spec"]["template"]["spec"])
    assert "stock-ledger-db-owner" in str(job["spec"]["template"]["spec"])
    assert "stock-ledger-db-owner" not in str(deployment["spec"]["template"]["spec"])
    image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == "registry.example.com/inventory/stock-ledger:0.1.0"


def _table_commands(section: str) -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    first_cells = re.findall(r"^\| (`.+?`) \|", body, flags=re.MULTILINE)
    return [command for cell in first_cells for command in re.findall(r"`([^`]+)`", cell)]


def test_every_command_of_the_cli_table_exists_with_the_flags_it_shows() -> None:
    """Each row's command is a real subcommand whose `--help` lists every flag the row uses."""
    rows = _table_commands("CLI")
    assert len(rows) >= 12
    for row in rows:
        words = shlex.split(row)
        assert words[0] == "stock-ledger", row
        path = [w for w in words[1:3] if not w.startswith("-") and not w.isupper()]
        path = path[:1] if path[:1] not in (["offsets"], ["gaps"], ["rejected"], ["stock"]) else path[:2]
        help_text = subprocess.run([str(ROOT / ".venv" / "bin" / "stock-ledger"), *path, "--help"], check=True,
                                   capture_output=True, text=True, timeout=60).stdout
        for flag in (w for w in words if w.startswith("--")):
            assert flag in help_text, f"{row}: `stock-ledger {' '.join(path)} --help` does not list {flag}"


def test_every_make_command_of_the_development_table_is_a_target() -> None:
    """`make -n` (print, do not run) accepts each: the targets and variables exist; CI runs `make test` itself."""
    commands = [shlex.split(c) for c in _table_commands("Development")]
    assert len(commands) >= 4
    for words in commands:
        assert words[0] == "make", words
        done = subprocess.run(["make", "-n", *words[1:]], check=False, cwd=ROOT, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, f"{words}: {done.stderr}"


def test_the_headline_command_is_the_bench_invocation_the_json_records() -> None:
    """The headline's reproduce command parses as written, and it is the command the cited JSON recorded (the run
    takes minutes and fetches Kafka Connect, so CI runs only its smoke test, tests/integration/test_bench_smoke.py)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    command = re.search(r"Reproduce:\n\n {4}(python -m scripts\.bench .+)\n", text)
    assert command, "the headline's reproduce line"
    words = shlex.split(command.group(1))
    args = bench.parser().parse_args(words[3:])
    assert args.command == "peers"
    evidence = re.search(r"JSON: `(docs/bench/[^`]+\.json)`", text)
    assert evidence, "the headline names its JSON"
    recorded = json.loads((ROOT / evidence.group(1)).read_text())["meta"]["command"]
    assert recorded.split(" --out ")[0] == command.group(1)
