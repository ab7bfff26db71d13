"""The archive image (`make archive-image`, the chart's archive.image): the worker's image plus pyarrow, run the way
the chart's CronJob runs it: read-only root, uid 10001, the CronJob's 1 GiB memory limit, the archive directory a
volume. And the worker's image, which has no pyarrow, refusing `archive` with exit 2 and what to use instead.

Needs `make containers` and the real local Kafka and PostgreSQL (the containers reach them over the host network).
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

import asyncpg
import pyarrow.parquet as pq
import pytest

from tests.integration.test_repair import send_to_partition
from tests.support.helpers import Env, Services, delete_records_below, eventually, free_port, movement

from .support import ARCHIVE_IMAGE, Containers, podman, require_image
from .test_image import ledger_rows, settings_env, stop

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

pytestmark = pytest.mark.container

P = 5
ARCHIVE_DIR = "/var/lib/stock-ledger/archive"  # the chart's mount path
T0 = datetime(2026, 2, 1, 6, 0, tzinfo=UTC)


@pytest.fixture(scope="module")
def archive_image() -> str:
    return require_image(ARCHIVE_IMAGE)


@pytest.fixture
def archivers(archive_image: str) -> Iterator[Containers]:
    pool = Containers(image=archive_image)
    yield pool
    pool.remove_all()


def test_the_archive_image_is_the_worker_image_with_pyarrow(archive_image: str) -> None:
    """The same locked venv without installers, pyarrow added, run as uid 10001; within its own budget (pyarrow
    alone is about 170 MiB, which is why the worker's image leaves it out)."""
    listing = podman("run", "--rm", "--network=none", "--entrypoint", "sh", archive_image, "-c",
                     "ls /opt/venv/lib/python3*/site-packages; du -s -B1 /opt/venv | cut -f1; id -u").stdout
    *packages, venv_bytes, uid = listing.split()
    names = {p.split("-")[0].lower() for p in packages}
    assert "pyarrow" in names, packages
    assert not names & {"pip", "setuptools", "wheel"}, packages
    assert int(venv_bytes) <= 256 * 2**20, f"venv is {int(venv_bytes) / 2**20:.1f} MiB (target <= 256 MiB)"
    assert uid == "10001"
    assert podman("run", "--rm", "--network=none", archive_image, "--version").stdout.startswith("stock-ledger ")


@pytest.mark.asyncio
@pytest.mark.timeout(600)
async def test_archive_run_in_the_archive_image_writes_to_the_volume_and_the_ledger_still_adds_up(
    containers: Containers, archivers: Containers, services: Services, blank_database: Env, topic_name: str,
    tmp_path: Path,
) -> None:
    """1. The worker's image migrates, creates the topic and applies 50 movements of one partition, in segments of
       20 offsets; Kafka then deletes the partition's first 45 records.
    2. The worker's image refuses `archive run` with exit 2, naming the archive image.
    3. `archive run` in the archive image, as the CronJob runs it, archives the segment below the log start into
       the volume; the file holds exactly its 40 movements (read here with pyarrow), owned by uid 10001.
    4. `archive verify` in the archive image passes; the worker's image's `verify --expect 50` counts the 40
       archived movements and the 10 online ones, and on-hand is what the 50 movements add up to."""
    group = f"sl-test-{uuid.uuid4().hex[:8]}"
    containers.env = archivers.env = settings_env(services, topic_name, group)
    owner = {"DATABASE_URL": blank_database.owner_url}
    containers.once("migrate", env=owner)
    containers.once("create-topic", "--partitions", "24")
    conn = await asyncpg.connect(blank_database.owner_url)
    try:
        await conn.execute("UPDATE ledger_layout SET segment_offsets = 20")
    finally:
        await conn.close()
    qty = [(i % 9) + 1 if i % 3 else -((i % 4) + 1) for i in range(50)]
    await send_to_partition(services.kafka, topic_name, P, [
        (b"SKU-ARC", json.dumps(movement("SKU-ARC", qty=q, kind="receipt" if q > 0 else "pick", warehouse="WH-A",
                                         occurred_at=(T0 + timedelta(minutes=i)).isoformat())).encode())
        for i, q in enumerate(qty)])
    # small batches: the segments are made as the batches reach them, 20 offsets each
    worker = containers.start("run", env={"DATABASE_URL": blank_database.worker_url,
                                          "STOCK_LEDGER_BATCH_MAX_RECORDS": "7",
                                          "STOCK_LEDGER_METRICS_PORT": str(free_port())})

    async def applied() -> bool:
        return await ledger_rows(blank_database) == 50

    await eventually(applied, 90, "the worker in the container applying 50 movements")
    assert stop(containers, worker)[1] == 0, containers.logs(worker)
    await delete_records_below(services.kafka, topic_name, P, 45)

    volume = tmp_path / "archive"
    volume.mkdir()
    volume.chmod(0o777)  # the pod's fsGroup makes a PVC writable to uid 10001; here the host directory is
    env = owner | {"STOCK_LEDGER_ARCHIVE_DIR": ARCHIVE_DIR, "STOCK_LEDGER_RETENTION_DAYS": "0"}

    refused = containers.run("archive", "run", env=env, volumes={str(volume): ARCHIVE_DIR})
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "the archive needs pyarrow" in refused.stderr, refused.stderr
    assert "stock-ledger:<version>-archive" in refused.stderr, refused.stderr
    assert not list(volume.iterdir())

    report = archivers.once("archive", "run", env=env, volumes={str(volume): ARCHIVE_DIR}, memory="1g")
    # the partition's first segment is [0, 40) (the first call makes a segment of headroom past a whole one)
    segment = f"stock_movements_p{P}_o0"
    assert f"archived {segment} (p{P} [0, 40)): 40 movements" in report, report
    assert f"kept stock_movements_p{P}_o40" in report, report
    path = volume / f"{segment}.parquet"
    assert path.stat().st_uid == 10001, path.stat()
    table = pq.read_table(path).to_pylist()
    assert [row["kafka_offset"] for row in table] == list(range(40))
    assert sum(row["qty"] for row in table) == sum(qty[:40])

    verified = archivers.once("archive", "verify", env=env, volumes={str(volume): ARCHIVE_DIR}, memory="1g")
    assert f"{segment}: ok (40 movements)" in verified, verified
    check = containers.once("verify", "--expect", "50", env=owner)
    assert f"40 movements in 1 archived segments: p{P} [0, 40)" in check, check
    conn = await asyncpg.connect(blank_database.owner_url)
    try:
        assert await conn.fetchval("SELECT count(*) FROM stock_movements") == 10
        assert await conn.fetchval("SELECT on_hand FROM stock_levels WHERE sku = 'SKU-ARC'") == sum(qty)
    finally:
        await conn.close()
