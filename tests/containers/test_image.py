"""The image that ships, run the way the chart runs it: read-only root, uid 10001, a 256 MiB memory limit.

Needs `make containers` (localhost/stock-ledger:dev in podman's store) and the real local Kafka and PostgreSQL;
the containers reach them over the host network.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from stock_ledger.migrate import _LOCK_KEY
from tests.support.helpers import Env, Services, assert_atomic, assert_exact, eventually, free_port, wait_drained
from tests.support.services import produce

from .support import IMAGE, Containers, podman

pytestmark = pytest.mark.container

ROOT = Path(__file__).resolve().parents[2]
# The chart's terminationGracePeriodSeconds (values.yaml): `podman stop -t` gets the same budget.
GRACE_SECONDS = 30


def settings_env(services: Services, topic: str, group: str) -> dict[str, str]:
    return {"KAFKA_BOOTSTRAP_SERVERS": services.kafka, "STOCK_LEDGER_TOPIC": topic, "STOCK_LEDGER_GROUP_ID": group,
            "STOCK_LEDGER_LOG_FORMAT": "json"}


def base_image() -> str:
    version = next(line.split("=", 1)[1] for line in (ROOT / "Dockerfile").read_text().splitlines()
                   if line.startswith("ARG PYTHON_VERSION="))
    return f"docker.io/library/python:{version}-slim-bookworm"


def stop(containers: Containers, name: str) -> tuple[float, int]:
    """`podman stop` with the chart's grace period: (seconds it took, the container's exit code)."""
    started = time.monotonic()
    podman("stop", "-t", str(GRACE_SECONDS), name, timeout=GRACE_SECONDS + 30)
    return time.monotonic() - started, int(containers.state(name)["ExitCode"])


async def ledger_rows(db: Env) -> int:
    conn = await asyncpg.connect(db.owner_url)
    try:
        return int(await conn.fetchval("SELECT count(*) FROM stock_movements"))
    finally:
        await conn.close()


class TestContents:
    """What is inside the image: the locked venv without its installers, root-owned, run as uid 10001."""

    def test_runtime_venv_has_no_pip_or_setuptools_and_stays_small(self) -> None:
        listing = podman("run", "--rm", "--network=none", "--entrypoint", "sh", IMAGE, "-c",
                         "ls /opt/venv/lib/python3*/site-packages; du -s -B1 /opt/venv | cut -f1; id -u").stdout
        *packages, venv_bytes, uid = listing.split()
        installers = [p for p in packages if p.split("-")[0].lower() in {"pip", "setuptools", "wheel"}]
        assert not installers, f"the runtime venv still carries {installers}"
        assert int(venv_bytes) <= 50 * 2**20, f"venv is {int(venv_bytes) / 2**20:.1f} MiB (target <= 50 MiB)"
        assert uid == "10001"

    def test_nothing_of_the_application_is_writable_by_the_worker(self) -> None:
        found = podman("run", "--rm", "--network=none", "--entrypoint", "sh", IMAGE, "-c",
                       "find /opt/venv /app -writable -print -quit").stdout.strip()
        assert not found, f"{found} is writable by uid 10001"

    def test_an_arbitrary_uid_in_group_0_runs_the_cli_and_reads_every_file(self) -> None:
        """OpenShift's restricted-v2 SCC runs the image as a uid from the namespace's range with gid 0, no
        /etc/passwd entry and a read-only root (the chart's ci/openshift-values.yaml): the CLI starts, the
        migrations are readable, and every file and directory of the application is readable by any uid."""
        done = podman("run", "--rm", "--network=none", "--read-only", "--user", "1000680000:0",
                      "--entrypoint", "sh", IMAGE, "-c",
                      "id -u; stock-ledger --version; cat /app/migrations/*.sql | wc -c; "
                      "find /opt/venv /app \\( -type f ! -perm -o+r -o -type d ! -perm -o+rx \\) -print")
        uid, version, migration_bytes, *unreadable = done.stdout.splitlines()
        assert uid == "1000680000"
        assert version.startswith("stock-ledger "), version
        assert int(migration_bytes) > 0, done.stderr
        assert not unreadable, f"not readable by every uid: {unreadable[:10]}"

    def test_the_hosts_ca_bundle_mounted_into_the_build_stays_out_of_the_image(self) -> None:
        def digest(image: str) -> str:
            return podman("run", "--rm", "--network=none", "--entrypoint", "sha256sum", image,
                          "/etc/ssl/certs/ca-certificates.crt", check=False).stdout.split(" ", 1)[0]

        assert digest(IMAGE) == digest(base_image())


@contextlib.contextmanager
def silent_broker() -> Iterator[str]:
    """A port that accepts connections and never answers: a Kafka client waits on it until its timeouts."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        server.close()


@pytest.mark.asyncio
class TestSigtermAsPid1:
    """Each subcommand is the container's PID 1 (ENTRYPOINT stock-ledger): the kernel drops a SIGTERM that has
    no handler there. `podman stop` sends SIGTERM and must not have to fall back to SIGKILL."""

    async def test_run_drains_and_exits_0_within_the_grace_period(
        self, containers: Containers, services: Services, blank_database: Env, topic_name: str,
    ) -> None:
        """1. migrate and create the topic from the image; 2. a worker drains 2,000 movements;
        3. `podman stop`: the worker exits 0, well within the grace period."""
        containers.env = settings_env(services, topic_name, f"sl-test-{uuid.uuid4().hex[:8]}")
        containers.once("migrate", env={"DATABASE_URL": blank_database.owner_url})
        containers.once("create-topic", "--partitions", "24")
        await produce(services.kafka, topic_name, 2_000, show_progress=False)
        worker = containers.start("run", env={"DATABASE_URL": blank_database.worker_url,
                                              "STOCK_LEDGER_METRICS_PORT": str(free_port())})
        await eventually(lambda: ledger_rows(blank_database), 90, "the worker in the container applying movements")
        elapsed, code = stop(containers, worker)
        assert code == 0, containers.logs(worker)
        assert elapsed < GRACE_SECONDS - 5, f"stop took {elapsed:.1f}s"

    async def test_migrate_waiting_for_the_migration_lock_stops(
        self, containers: Containers, services: Services, blank_database: Env,
    ) -> None:
        """1. hold the migration advisory lock; 2. start `migrate` (it waits for the lock);
        3. `podman stop` ends it within seconds with 143, not the grace period's SIGKILL (137)."""
        holder = await asyncpg.connect(blank_database.owner_url)
        try:
            await holder.execute("SELECT pg_advisory_lock($1)", _LOCK_KEY)
            containers.env = settings_env(services, "unused", "unused")
            name = containers.start("migrate", env={"DATABASE_URL": blank_database.owner_url})

            # migrate polls the lock (pg_try_advisory_lock, a progress line per wait): waiting is in its log.
            await eventually(lambda: "migration.waiting_for_lock" in containers.logs(name), 60,
                             "migrate waiting for the migration lock")
            elapsed, code = stop(containers, name)
        finally:
            await holder.close()
        assert (code, elapsed < 10) == (143, True), f"exit {code} after {elapsed:.1f}s\n{containers.logs(name)}"

    @pytest.mark.parametrize("command", [
        ("produce", "--count", "1000000", "--rate", "50"),
        ("verify", "--wait", "600"),
        ("create-topic",),
    ], ids=lambda command: command[0])
    async def test_other_subcommands_stop(
        self, containers: Containers, services: Services, blank_database: Env, topic_name: str,
        command: tuple[str, ...],
    ) -> None:
        """`produce` mid-stream, `verify` waiting for a drain that never comes, `create-topic` waiting on a
        broker that never answers: `podman stop` ends each within seconds with 143."""
        containers.env = settings_env(services, topic_name, f"sl-test-{uuid.uuid4().hex[:8]}")
        if command[0] == "verify":
            containers.once("migrate", env={"DATABASE_URL": blank_database.owner_url})
            containers.once("create-topic", "--partitions", "24")
            await produce(services.kafka, topic_name, 100, show_progress=False)
        with silent_broker() as silent:
            env = {"DATABASE_URL": blank_database.owner_url}
            if command[0] == "create-topic":
                env["KAFKA_BOOTSTRAP_SERVERS"] = silent
            name = containers.start(*command, env=env)
            containers.wait_running(name, 30)
            await asyncio.sleep(4)  # past start-up, into the waiting part
            assert containers.state(name)["Running"], f"{command[0]} ended early:\n{containers.logs(name)}"
            elapsed, code = stop(containers, name)
        assert (code, elapsed < 10) == (143, True), f"exit {code} after {elapsed:.1f}s\n{containers.logs(name)}"


@pytest.mark.asyncio
@pytest.mark.timeout(600)
async def test_three_force_kills_of_the_worker_container_lose_and_duplicate_nothing(
    containers: Containers, services: Services, blank_database: Env, topic_name: str,
) -> None:
    """The staging drill on the image:
    1. `migrate` and `create-topic` run from the image;
    2. the worker container runs read-only as uid 10001 with 256 MiB, restart policy always (a crashed container
       comes back, as the kubelet would bring it back);
    3. the image's `produce` writes 20,000 movements at 500/s;
    4. three times, once the worker has applied more movements since it (re)started, its process is SIGKILLed
       from the host (a crash or the OOM killer, not a user stop) and the container restarts;
    5. after the drain `podman stop` exits 0 within the grace period, and the image's `verify --expect 20000`
       passes; the independent check agrees: 20,000 rows, no duplicate, no gap, levels exact."""
    group = f"sl-test-{uuid.uuid4().hex[:8]}"
    containers.env = settings_env(services, topic_name, group)
    containers.once("migrate", env={"DATABASE_URL": blank_database.owner_url})
    containers.once("create-topic", "--partitions", "24")
    worker = containers.start("run", restart=True, env={"DATABASE_URL": blank_database.worker_url,
                                                         "STOCK_LEDGER_METRICS_PORT": str(free_port())})
    pid = containers.wait_running(worker, 60)
    # 500/s: the 40 s of production outlast three restarts on a loaded machine, so every kill lands mid-stream (at
    # 2,000/s a slow restart let the worker apply all 20,000 before the third wait, which then waited for nothing).
    producer = containers.start("produce", "--count", "20000", "--rate", "500")
    for _ in range(3):
        before = await ledger_rows(blank_database)

        async def progressed(floor: int = before) -> bool:
            return await ledger_rows(blank_database) > floor

        await eventually(progressed, 90, "the worker applying movements after its (re)start")
        os.kill(pid, signal.SIGKILL)
        rows, stored = await assert_atomic(blank_database, topic_name, group)
        assert rows == stored, f"{rows} rows but stored offsets account for {stored}"
        pid = containers.wait_running(worker, 60, other_than_pid=pid)
    assert int(containers.inspect(worker)["RestartCount"]) == 3
    podman("wait", producer, timeout=120)
    assert int(containers.state(producer)["ExitCode"]) == 0, containers.logs(producer)
    await wait_drained(services, blank_database, topic_name, group, 180)
    elapsed, code = stop(containers, worker)
    assert code == 0, containers.logs(worker)
    assert elapsed < GRACE_SECONDS, f"podman stop took {elapsed:.1f}s"
    report = containers.once("verify", "--expect", "20000", env={"DATABASE_URL": blank_database.owner_url})
    assert "20000" in report.replace(",", ""), report
    state = await assert_exact(services, blank_database, topic_name, group, rows=20_000)
    assert (state.rows, state.distinct_sources) == (20_000, 20_000)
