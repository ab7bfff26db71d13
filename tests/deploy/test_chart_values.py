"""Bad values fail at install time, before anything reaches the cluster, with a message naming the value.

`helm template` runs the same values.schema.json validation and template checks as `helm install`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from .support import CHART, KUBE_VERSION, REQUIRED, HelmResult

if TYPE_CHECKING:
    from collections.abc import Callable

pytestmark = pytest.mark.deploy



@pytest.fixture
def template(run_helm: Callable[..., HelmResult]) -> Callable[..., HelmResult]:
    def run(*flags: str) -> HelmResult:
        return run_helm("template", "ledger", str(CHART), "--kube-version", KUBE_VERSION, *flags)

    return run


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        pytest.param(
            (*REQUIRED, "--set", "replicaCount=0"), ["/replicaCount", "minimum"], id="replicas-0"
        ),
        pytest.param((), ["/database", "existingSecret"], id="missing-secret"),
        pytest.param(("--set", "database.existingSecret="), ["/database/existingSecret"], id="empty-secret"),
        pytest.param((*REQUIRED, "--set", "image.tag=latest"), ["/image/tag"], id="latest-tag"),
        pytest.param((*REQUIRED, "--set", "image.repository="), ["/image/repository"], id="no-repository"),
        pytest.param((*REQUIRED, "--set", "image.digest=md5:abc"), ["/image/digest"], id="bad-digest"),
        pytest.param((*REQUIRED, "--set", "image.registry=https://r.example.com"), ["/image/registry"],
                     id="registry-with-scheme"),
        pytest.param((*REQUIRED, "--set", "image.registry=r.example.com/"), ["/image/registry"],
                     id="registry-with-slash"),
        pytest.param(
            (*REQUIRED, "--set", "config.batchSize=5"), ["/config", "batchSize"], id="unknown-config"
        ),
        pytest.param((*REQUIRED, "--set", "replicas=3"), ["replicas"], id="unknown-top-level-key"),
        pytest.param((*REQUIRED, "--set", "config.logFormat=xml"), ["/config/logFormat"], id="bad-enum"),
        pytest.param(
            (*REQUIRED, "--set", "securityContext.runAsUser=0"),
            ["/securityContext/runAsUser"],
            id="root-uid",
        ),
        pytest.param((*REQUIRED, "--set", "chaos.interval=5"), ["/chaos/interval"], id="bad-interval"),
        pytest.param(
            (*REQUIRED, "--set", "podLabels.app\\.kubernetes\\.io/name=x"),
            ["/podLabels"],
            id="label-override",
        ),
    ],
)
def test_schema_rejects(
    template: Callable[..., HelmResult], flags: tuple[str, ...], expected: list[str]
) -> None:
    """values.schema.json rejects the value, and the message names where the problem is."""
    result = template(*flags)
    assert result.returncode != 0, f"accepted {flags}"
    assert "values don't meet the specifications of the schema" in result.stderr, result.stderr
    for fragment in expected:
        assert fragment in result.stderr, f"{fragment!r} not in:\n{result.stderr}"


def test_replicas_beyond_partitions_rejected(template: Callable[..., HelmResult]) -> None:
    """A topic with fewer partitions than replicas would leave workers idle: the chart refuses."""
    result = template(*REQUIRED, "--set", "kafka.partitions=12", "--set", "replicaCount=13")
    assert result.returncode != 0
    assert "replicaCount 13 exceeds kafka.partitions 12" in result.stderr, result.stderr


def test_grace_period_must_outlast_shutdown_grace(template: Callable[..., HelmResult]) -> None:
    """SIGKILL must not land while the worker still finishes its batch (shutdown grace 8 s + closing)."""
    result = template(*REQUIRED, "--set", "terminationGracePeriodSeconds=10")
    assert result.returncode != 0
    assert "terminationGracePeriodSeconds 10 leaves too little room" in result.stderr, result.stderr


@pytest.mark.parametrize(("settings", "message"), [
    (("config.lockTimeoutMs=30000",), "config.databaseReplyTimeoutMs 30000 must exceed config.lockTimeoutMs 30000"),
    (("config.databaseReplyTimeoutMs=4000",),
     "config.databaseReplyTimeoutMs 4000 must exceed config.lockTimeoutMs 5000"),
    (("config.databaseReplyTimeoutMs=null", "config.lockTimeoutMs=40000"),
     "config.databaseReplyTimeoutMs 30000 must exceed config.lockTimeoutMs 40000"),  # null: the worker's default
])
def test_reply_timeout_must_exceed_lock_timeout(template: Callable[..., HelmResult], settings: tuple[str, ...],
                                                message: str) -> None:
    """The worker refuses to start (exit 2) with a reply timeout not above the lock timeout: the chart says so at
    install instead of a crash loop."""
    result = template(*REQUIRED, *[arg for s in settings for arg in ("--set", s)])
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_bounds_are_accepted(template: Callable[..., HelmResult]) -> None:
    """The extremes render: 1 replica, and one per partition (24 by default)."""
    for replicas in (1, 24):
        result = template(*REQUIRED, "--set", f"replicaCount={replicas}")
        assert result.returncode == 0, result.stderr
    assert "replicaCount 25 exceeds kafka.partitions 24" in template(*REQUIRED, "--set", "replicaCount=25").stderr
