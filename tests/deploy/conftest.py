"""Fixtures for the offline deployment checks (see tests/deploy/support.py for the helpers).

No cluster and no network: the chart is rendered with `helm template`, manifests are validated against the
Kubernetes JSON schemas bundled with kubernetes-validate, and rules with promtool. The tools come from
scripts/tools.sh; a missing tool fails the test, it is never skipped.
"""

from __future__ import annotations

import os
import subprocess
from typing import TYPE_CHECKING, Any

import pytest

from .support import (
    CHART,
    KUBE_VERSION,
    NAMESPACE,
    RELEASE,
    REQUIRED,
    VALUES_ALL,
    HelmResult,
    Rendered,
    require_tool,
)

if TYPE_CHECKING:
    from collections.abc import Callable


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "deploy: offline checks of the Dockerfile, Helm chart and tooling")


@pytest.fixture(scope="session")
def yaml_module() -> Any:
    try:
        import yaml  # noqa: PLC0415 - a missing PyYAML must fail the tests that need it, not the collection
    except ImportError:
        pytest.fail("PyYAML is missing from the venv: run scripts/tools.sh", pytrace=False)
    return yaml


@pytest.fixture(scope="session")
def run_helm(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., HelmResult]:
    """Runs helm with a private, empty home: no user repositories, plugins or kubeconfig leak in."""
    helm = require_tool("helm")
    home = tmp_path_factory.mktemp("helm-home")
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(home),
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
        "KUBECONFIG": str(home / "no-kubeconfig"),
    }

    def run(*args: str) -> HelmResult:
        proc = subprocess.run(
            [helm, *args], capture_output=True, text=True, env=env, timeout=120, check=False
        )
        return HelmResult(proc.returncode, proc.stdout, proc.stderr)

    return run


@pytest.fixture(scope="session")
def render(run_helm: Callable[..., HelmResult], yaml_module: Any) -> Callable[..., Rendered]:
    """Renders the chart as release `ledger` in namespace `inventory`; extra helm flags pass through."""

    def do_render(*flags: str) -> Rendered:
        result = run_helm(
            "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION, *flags
        )
        assert result.returncode == 0, f"helm template failed:\n{result.stderr}"
        return Rendered([doc for doc in yaml_module.safe_load_all(result.stdout) if doc])

    return do_render


@pytest.fixture(scope="session")
def default_render(render: Callable[..., Rendered]) -> Rendered:
    """The chart's defaults plus the one required value."""
    return render(*REQUIRED)


@pytest.fixture(scope="session")
def all_render(render: Callable[..., Rendered]) -> Rendered:
    """Every optional feature on: tests/deploy/values-all.yaml."""
    return render("--values", str(VALUES_ALL))


@pytest.fixture(params=["default", "all"])
def rendered(request: pytest.FixtureRequest) -> Rendered:
    """Each of the two renders in turn, for properties that must hold whatever is enabled."""
    result: Rendered = request.getfixturevalue(f"{request.param}_render")
    return result
