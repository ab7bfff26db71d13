"""A release, end to end, against a real OCI registry: Debian's docker-registry (CNCF distribution 2.8) started by
scripts/oci-registry.sh on a free loopback port.

`make release VERSION=<pyproject's> REGISTRY=... PLAIN_HTTP=1` builds the wheel, the sdist, the image and the chart
and pushes the last two; then everything a user gets is read back from the registry only: `helm show chart` and
`helm template` of oci://.../charts/stock-ledger, and the image the rendered Deployment names, pulled afresh and run
against the real Kafka and PostgreSQL. The image layers are the ones `make containers` built (same build
arguments), so the release costs the wheel build and the pushes.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import tarfile
import tomllib
import urllib.request
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.support.helpers import Env, Services, assert_exact, eventually, free_port
from tests.support.services import produce

from .chart import helm_binary
from .support import Containers, podman
from .test_image import ledger_rows, settings_env, stop

pytestmark = pytest.mark.container

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
VERSION = PROJECT["version"]


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A docker-registry of this test's own (its own port and storage), stopped at the end."""
    env = {**os.environ, "STOCK_LEDGER_STATE": str(tmp_path_factory.mktemp("state")),
           "STOCK_LEDGER_REGISTRY_PORT": str(free_port())}
    started = subprocess.run(["scripts/oci-registry.sh", "start"], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=600, check=False)
    assert started.returncode == 0, started.stderr
    address = subprocess.run(["scripts/oci-registry.sh", "address"], cwd=ROOT, env=env, capture_output=True, text=True,
                             check=True).stdout.strip()
    yield address
    subprocess.run(["scripts/oci-registry.sh", "stop"], cwd=ROOT, env=env, capture_output=True, check=False)


def helm(*args: str, home: Path) -> str:
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home), "HELM_CACHE_HOME": str(home / "cache"),
           "HELM_CONFIG_HOME": str(home / "config"), "HELM_DATA_HOME": str(home / "data")}
    done = subprocess.run([helm_binary(), *args], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 0, f"helm {' '.join(args)}:\n{done.stderr}"
    return done.stdout


def catalog(registry: str) -> set[str]:
    with urllib.request.urlopen(f"http://{registry}/v2/_catalog", timeout=10) as response:
        return set(json.load(response)["repositories"])


def tags(registry: str, repository: str) -> set[str]:
    with urllib.request.urlopen(f"http://{registry}/v2/{repository}/tags/list", timeout=10) as response:
        return set(json.load(response)["tags"])


def check_distributions(dist: Path) -> None:
    """The wheel and the sdist carry the version and the licence."""
    with zipfile.ZipFile(dist / f"stock_ledger-{VERSION}-py3-none-any.whl") as wheel:
        metadata = wheel.read(f"stock_ledger-{VERSION}.dist-info/METADATA").decode()
        assert f"stock_ledger-{VERSION}.dist-info/licenses/LICENSE" in wheel.namelist()
    assert f"\nVersion: {VERSION}\n" in metadata
    assert "\nLicense-Expression: Apache-2.0\n" in metadata
    with tarfile.open(dist / f"stock_ledger-{VERSION}.tar.gz") as sdist:
        names = sdist.getnames()
    assert {f"stock_ledger-{VERSION}/LICENSE", f"stock_ledger-{VERSION}/pyproject.toml"} <= set(names)


def check_labels(image: str) -> None:
    """The OCI labels: pyproject's version, Source and licence, and the commit built."""
    labels = json.loads(podman("image", "inspect", image).stdout)[0]["Labels"]
    revision = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    assert labels["org.opencontainers.image.version"] == VERSION
    assert re.fullmatch(rf"{revision}(-dirty)?", labels["org.opencontainers.image.revision"])
    assert labels["org.opencontainers.image.source"] == PROJECT["urls"]["Source"]
    assert labels["org.opencontainers.image.licenses"] == PROJECT["license"] == "Apache-2.0"


@pytest.mark.asyncio
@pytest.mark.timeout(900)
async def test_make_release_publishes_what_installs_and_runs(
    registry: str, tmp_path: Path, services: Services, blank_database: Env, topic_name: str,
) -> None:
    """1. `make release` builds and pushes; the wheel and sdist carry the version and the licence.
    2. The registry serves the chart: `helm show chart` has version = appVersion = pyproject's version.
    3. `helm template` from the registry names the image published beside it.
       With archive.enabled its CronJob names the archive image published beside it (VERSION-archive), which
       pulls from the registry with the same labels.
    4. That image, removed locally and pulled from the registry, has the OCI labels (version, revision, source,
       licenses), reports the version, and migrates, creates the topic and drains 2,000 movements exactly."""
    dist = tmp_path / "dist"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    done = subprocess.run(["make", "--no-print-directory", "release", f"VERSION={VERSION}", f"REGISTRY={registry}",
                           "PLAIN_HTTP=1", f"DIST={dist}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    check_distributions(dist)

    # 2. The chart, from the registry.
    chart_ref = f"oci://{registry}/charts/stock-ledger"
    home = tmp_path / "helm"
    chart = yaml.safe_load(helm("show", "chart", chart_ref, "--version", VERSION, "--plain-http", home=home))
    assert (chart["version"], chart["appVersion"]) == (VERSION, VERSION)
    assert chart["sources"] == [PROJECT["urls"]["Source"]]

    # 3. What it installs.
    manifests = [d for d in yaml.safe_load_all(helm(
        "template", "ledger", chart_ref, "--version", VERSION, "--plain-http", "--namespace", "inventory",
        "--set", "database.existingSecret=db", "--set", "database.migrationSecret=db-owner", home=home)) if d]
    [deployment] = [m for m in manifests if m["kind"] == "Deployment"]
    image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == f"{registry}/stock-ledger:{VERSION}"
    assert await asyncio.to_thread(catalog, registry) == {"stock-ledger", "charts/stock-ledger"}
    # ... and the archive CronJob's image, published beside it.
    [cronjob] = [d for d in yaml.safe_load_all(helm(
        "template", "ledger", chart_ref, "--version", VERSION, "--plain-http", "--namespace", "inventory",
        "--set", "database.existingSecret=db", "--set", "database.migrationSecret=db-owner",
        "--set", "archive.enabled=true", home=home)) if d and d["kind"] == "CronJob"]
    archive_image = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["image"]
    assert archive_image == f"{registry}/stock-ledger:{VERSION}-archive"
    assert await asyncio.to_thread(tags, registry, "stock-ledger") == {VERSION, f"{VERSION}-archive"}
    podman("rmi", "-f", archive_image)
    podman("pull", "-q", "--tls-verify=false", archive_image, timeout=300)
    check_labels(archive_image)
    podman("rmi", "-f", archive_image)

    # 4. The image, from the registry only.
    podman("rmi", "-f", image)
    podman("pull", "-q", "--tls-verify=false", image, timeout=300)
    check_labels(image)
    containers = Containers(image=image)
    try:
        assert containers.once("--version").strip() == f"stock-ledger {VERSION}"
        group = f"sl-test-{uuid.uuid4().hex[:8]}"
        containers.env = settings_env(services, topic_name, group)
        containers.once("migrate", env={"DATABASE_URL": blank_database.owner_url})
        containers.once("create-topic", "--partitions", "24")
        await produce(services.kafka, topic_name, 2_000, show_progress=False)
        worker = containers.start("run", env={"DATABASE_URL": blank_database.worker_url,
                                              "STOCK_LEDGER_METRICS_PORT": str(free_port())})

        async def drained() -> bool:
            return await ledger_rows(blank_database) == 2_000

        await eventually(drained, 90, "the pulled image's worker applying 2,000 movements")
        assert stop(containers, worker)[1] == 0, containers.logs(worker)
        report = containers.once("verify", "--expect", "2000", env={"DATABASE_URL": blank_database.owner_url})
        assert "2000" in report.replace(",", ""), report
        state = await assert_exact(services, blank_database, topic_name, group, rows=2_000)
        assert (state.rows, state.distinct_sources) == (2_000, 2_000)
    finally:
        containers.remove_all()
        podman("rmi", "-f", image, check=False)


def test_the_versions_are_in_step() -> None:
    """pyproject.toml is the one source: the chart's version and appVersion, the CHANGELOG's newest release and the
    chart's home/sources follow it (scripts/release.sh refuses a release otherwise)."""
    chart = yaml.safe_load((ROOT / "helm" / "stock-ledger" / "Chart.yaml").read_text())
    assert (chart["version"], chart["appVersion"]) == (VERSION, VERSION)
    assert chart["home"] == PROJECT["urls"]["Source"]
    assert chart["sources"] == [PROJECT["urls"]["Source"]]
    releases = re.findall(r"^## \[(\d[^\]]*)\] - \d{4}-\d{2}-\d{2}$", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert releases[0] == VERSION
    assert "Apache License\n                           Version 2.0" in (ROOT / "LICENSE").read_text()


def test_a_release_out_of_step_is_refused(tmp_path: Path) -> None:
    """A VERSION that is not the declared one stops before anything is built, naming each file and the fix."""
    done = subprocess.run(["scripts/release.sh", "9.9.9", "--dist", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 1
    assert f"pyproject.toml declares version {VERSION}" in done.stderr
    assert "Chart.yaml has appVersion" in done.stderr
    assert "CHANGELOG.md has no section '## [9.9.9] - YYYY-MM-DD'" in done.stderr
    assert "run scripts/release.sh bump 9.9.9" in done.stderr
    assert not list(tmp_path.iterdir())
