"""Smoke test of the chart's pod spec: the rendered Deployment, run by `podman kube play`, drains a topic.

What this proves: the image starts under the chart's securityContext (uid 10001, read-only root, no
capabilities, RuntimeDefault seccomp), with its env (the DATABASE_URL from a Secret, every STOCK_LEDGER_*
setting, the pod name as static group instance id), its emptyDir on /tmp and its memory limit, and works.
What it does not: no Kubernetes API, scheduler or kubelet. The edits podman needs (host networking instead of
the pod network, so no `ports:`; numeric probe ports) are applied; podman ignores the probes, the
PodDisruptionBudget, topology spread, the hooks (the migration Job: the test migrates) and
terminationGracePeriodSeconds. Rollouts, evictions and probe-driven restarts are not exercised here.
"""

from __future__ import annotations

import base64
import copy
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.helpers import Env, Services, assert_exact, free_port, wait_drained
from tests.support.services import produce

from .chart import one, render
from .support import IMAGE, podman

pytestmark = [pytest.mark.container, pytest.mark.integration, pytest.mark.asyncio]

SECRET_KEY = "worker-url"  # noqa: S105 - the name of a key in the Secret, not a secret


def podman_ready(deployment: dict[str, Any], metrics_port: int) -> dict[str, Any]:
    """The documented edits for `podman kube play` (see the module docstring); nothing else changes."""
    edited = copy.deepcopy(deployment)
    pod = edited["spec"]["template"]["spec"]
    pod["hostNetwork"] = True  # the shared local Kafka and PostgreSQL listen on 127.0.0.1
    for container in pod["containers"]:
        container.pop("ports", None)  # host networking publishes nothing; podman rejects hostPort clashes
        for probe in ("livenessProbe", "readinessProbe"):
            if probe in container:
                container[probe]["httpGet"]["port"] = metrics_port  # named ports resolve through `ports:`
    return edited


@pytest.fixture
def secret(database: Env) -> Iterator[str]:
    """The chart's existingSecret as a podman secret: podman 4.3's kube play reads a JSON object of base64
    values (a Secret's `data`), not a Secret manifest."""
    name = f"sl-test-db-{uuid.uuid4().hex[:8]}"
    body = {SECRET_KEY: base64.b64encode(database.worker_url.encode()).decode()}
    podman("secret", "create", name, "-", input_text=json.dumps(body))
    yield name
    podman("secret", "rm", name, check=False)


@pytest.mark.timeout(300)
async def test_the_rendered_deployment_runs_under_podman_kube_play_and_drains_a_topic(
    image: str, services: Services, database: Env, topic: str, secret: str, tmp_path: Path,
) -> None:
    """1. 3,000 movements wait on a fresh topic; 2. the chart is rendered with one replica, the local image, the
    test's Kafka, topic, group and Secret; 3. the Deployment, with the documented edits, runs under
    `podman kube play`; 4. the pod drains the topic exactly; 5. `podman kube down` removes it."""
    await produce(services.kafka, topic, 3_000, show_progress=False)
    group = f"sl-test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    repository, _, tag = IMAGE.rpartition(":")
    manifests = render(
        "--set", "replicaCount=1", "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
        "--set", f"kafka.bootstrapServers={services.kafka}", "--set", f"kafka.topic={topic}",
        "--set", f"kafka.groupId={group}", "--set", f"database.existingSecret={secret}",
        "--set", f"database.secretKey={SECRET_KEY}", "--set", f"metrics.port={port}",
        "--set", "migrations.enabled=false",  # the test migrates; without the hook no owner Secret is needed
        "--set", f"fullnameOverride={group}",
        tmp=tmp_path,
    )
    deployment = one(manifests, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    spec = tmp_path / "deployment.yaml"
    spec.write_text(yaml.safe_dump(podman_ready(deployment, port)))
    try:
        podman("kube", "play", str(spec), timeout=120)
        await wait_drained(services, database, topic, group, 120)
        await assert_exact(services, database, topic, group, rows=3_000)
        worker = json.loads(podman("inspect", "--type", "container", f"{group}-pod-0-worker").stdout)[0]
    finally:
        podman("kube", "down", str(spec), check=False, timeout=120)
    # What the chart asked for is what ran.
    assert worker["State"]["Running"]
    assert worker["Config"]["User"].split(":")[0] == "10001"
    assert worker["HostConfig"]["ReadonlyRootfs"] is True
    assert worker["HostConfig"]["Memory"] == 512 * 2**20  # values.yaml resources.limits.memory
    assert "/tmp" in {m["Destination"] for m in worker["Mounts"]}, worker["Mounts"]  # noqa: S108 - the emptyDir
