"""The chart's ci/*-values.yaml files (the chart-testing convention: `ct lint` and `ct install` run the chart once
per file) lint strictly and render manifests Kubernetes accepts, offline.

`helm lint --strict` counts warnings as failures; the built-in kinds are validated against the Kubernetes 1.30
JSON schemas bundled with kubernetes-validate, strictly (unknown fields are errors), as in test_chart_validation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from .support import CHART, KUBE_VERSION, HelmResult, Rendered, kn, pod_spec, restricted_v2_violations

if TYPE_CHECKING:
    from collections.abc import Callable

pytestmark = pytest.mark.deploy

CI_VALUES = ("default-values.yaml", "all-features-values.yaml", "openshift-values.yaml")
POD_KINDS = ("Deployment", "Job", "Pod", "CronJob")


def test_the_ci_directory_holds_the_files_tested_here() -> None:
    """A new ci/ file must be added to CI_VALUES, so that it is linted and validated too."""
    assert sorted(p.name for p in (CHART / "ci").glob("*.yaml")) == sorted(CI_VALUES)


@pytest.mark.parametrize("name", CI_VALUES)
def test_helm_lint_strict(run_helm: Callable[..., HelmResult], name: str) -> None:
    result = run_helm("lint", "--strict", "--kube-version", KUBE_VERSION, str(CHART),
                      "--values", str(CHART / "ci" / name))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout, result.stdout


@pytest.mark.parametrize("name", CI_VALUES)
def test_manifests_match_kubernetes_schemas(render: Callable[..., Rendered], name: str) -> None:
    import kubernetes_validate  # noqa: PLC0415 - the deploy extras; test_chart_validation fails clearly without

    errors = []
    for manifest in render("--values", str(CHART / "ci" / name)).manifests:
        if manifest["apiVersion"].startswith(("monitoring.coreos.com/", "keda.sh/")):
            continue  # CRDs: test_chart_validation and test_chart_autoscaling check their content
        try:
            kubernetes_validate.validate(manifest, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{kn(manifest)}: {'.'.join(map(str, e.path))}: {e.message}")
    assert not errors, "\n".join(errors)


def test_all_features_renders_every_optional_object(render: Callable[..., Rendered]) -> None:
    rendered = render("--values", str(CHART / "ci" / "all-features-values.yaml"))
    assert {"ServiceMonitor", "PrometheusRule", "NetworkPolicy", "ConfigMap", "ServiceAccount", "Role", "RoleBinding",
            "PodDisruptionBudget", "Service", "ScaledObject", "TriggerAuthentication", "CronJob",
            "PersistentVolumeClaim"} <= rendered.kinds()
    images = {c["image"] for m in rendered.manifests if m["kind"] in POD_KINDS for c in pod_spec(m)["containers"]}
    assert images == {"registry.example.com/inventory/stock-ledger:0.1.0",
                      "registry.example.com/inventory/stock-ledger:0.1.0-archive",
                      "registry.example.com/inventory/stock-ledger-chaos:0.1.0"}


def test_openshift_values_leave_every_id_to_the_platform(render: Callable[..., Rendered]) -> None:
    rendered = render("--values", str(CHART / "ci" / "openshift-values.yaml"))
    workloads: list[Any] = [m for m in rendered.manifests if m["kind"] in POD_KINDS]
    assert workloads
    violations = [v for m in workloads for v in restricted_v2_violations(m)]
    assert not violations, "\n".join(violations)
