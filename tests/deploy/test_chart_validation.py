"""The chart lints cleanly and renders manifests that Kubernetes and Prometheus would accept, offline.

Built-in kinds are validated against the Kubernetes 1.30 JSON schemas bundled with kubernetes-validate, in
strict mode (unknown fields are errors). The Prometheus Operator kinds are CRDs without bundled schemas:
their rule groups go through `promtool check rules` instead, and so do the dashboard's queries.
"""

from __future__ import annotations

import json
import re
import subprocess
from typing import TYPE_CHECKING, Any

import pytest

from .support import CHART, KUBE_VERSION, REQUIRED, VALUES_ALL, HelmResult, Rendered, kn, require_tool, shipped_groups

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

pytestmark = pytest.mark.deploy

# Custom resources: validated by the checks below, not by the built-in schemas. Any other kind without a
# schema fails the schema test, so a new CRD must be added here deliberately.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "PodMonitor"), ("monitoring.coreos.com/v1", "ServiceMonitor"),
                ("monitoring.coreos.com/v1", "PrometheusRule"), ("keda.sh/v1alpha1", "ScaledObject"),
                ("keda.sh/v1alpha1", "TriggerAuthentication")}  # KEDA's: test_chart_autoscaling


@pytest.fixture(scope="module")
def kubernetes_validate() -> Any:
    try:
        import kubernetes_validate  # noqa: PLC0415 - a missing package must fail these tests, not collection
    except ImportError:
        pytest.fail("kubernetes-validate is missing from the venv: run scripts/tools.sh", pytrace=False)
    return kubernetes_validate


def promtool_check_rules(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require_tool("promtool"), "check", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    "values_args",
    [
        pytest.param(REQUIRED, id="default"),
        pytest.param(("--values", str(VALUES_ALL)), id="all"),
    ],
)
def test_helm_lint_strict(run_helm: Callable[..., HelmResult], values_args: tuple[str, ...]) -> None:
    """`helm lint --strict` passes: warnings count as failures."""
    result = run_helm("lint", "--strict", "--kube-version", KUBE_VERSION, str(CHART), *values_args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def test_manifests_match_kubernetes_schemas(rendered: Rendered, kubernetes_validate: Any) -> None:
    """Every built-in object validates strictly against the Kubernetes 1.30 schema of its kind."""
    errors = []
    for manifest in rendered.manifests:
        if (manifest["apiVersion"], manifest["kind"]) in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(manifest, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{kn(manifest)}: {'.'.join(map(str, e.path))}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            errors.append(f"{kn(manifest)}: {e.message} (a CRD? list it in CUSTOM_KINDS with its own check)")
    assert not errors, "\n".join(errors)


def test_default_render_has_no_custom_resources(default_render: Rendered) -> None:
    """Installing with defaults needs no Prometheus Operator CRDs."""
    assert not {(m["apiVersion"], m["kind"]) for m in default_render.manifests} & CUSTOM_KINDS


def test_prometheus_rule_groups_pass_promtool(all_render: Rendered, tmp_path: Path, yaml_module: Any) -> None:
    """The PrometheusRule's groups (files/prometheus-rules.yaml, embedded) form a valid rule file."""
    rule = all_render.one("PrometheusRule")
    assert rule["spec"]["groups"], "the PrometheusRule has no groups"
    assert rule["spec"]["groups"] == shipped_groups(), "the template must embed the file's groups, scoped"
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(yaml_module.safe_dump(rule["spec"]))
    result = promtool_check_rules(rules_file)
    assert result.returncode == 0, result.stdout + result.stderr


def dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    exprs: list[str] = []
    for panel in dashboard["panels"]:
        exprs.extend(target["expr"] for target in panel.get("targets", []))
    return exprs


def test_dashboard_queries_are_valid_promql(all_render: Rendered, tmp_path: Path, yaml_module: Any) -> None:
    """Every dashboard query parses as PromQL once Grafana's variables are substituted.

    promtool has no expression checker, so each query becomes a recording rule and `promtool check rules`
    parses it.
    """
    configmap = all_render.one("ConfigMap", "-dashboard")
    dashboard = json.loads(configmap["data"]["stock-ledger.json"])
    substitutions = {"$__rate_interval": "5m", "$topic": ".*", "$namespace": "inventory"}
    rules = []
    for i, expr in enumerate(dashboard_queries(dashboard)):
        for variable, value in substitutions.items():
            expr = expr.replace(variable, value)  # noqa: PLW2901 - the substituted query is what gets checked
        assert "$" not in expr, f"unsubstituted variable in {expr}"
        rules.append({"record": f"stock_ledger:dashboard_query_{i}", "expr": expr})
    rules_file = tmp_path / "dashboard-queries.yaml"
    rules_file.write_text(yaml_module.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = promtool_check_rules(rules_file)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_shows_the_required_views() -> None:
    """Lag and drift per partition, applied/rejected rates, batch and end-to-end latency, fenced batches, negative
    stock (levels and units)."""
    dashboard = json.loads((CHART / "files" / "dashboard.json").read_text())
    queries = "\n".join(dashboard_queries(dashboard))
    required = [
        r"max by \(topic, partition\) \(stock_ledger_partition_lag_messages",
        r"max by \(topic, partition\) \(stock_ledger_partition_offset_drift_messages",
        r"rate\(stock_ledger_movements_applied_total",
        r"sum by \(reason\) \(rate\(stock_ledger_movements_rejected_total",
        r"histogram_quantile\(0\.99, sum by \(le\) \(rate\(stock_ledger_batch_duration_seconds_bucket",
        r"histogram_quantile\(0\.99, sum by \(le\) \(rate\(stock_ledger_end_to_end_latency_seconds_bucket",
        r"stock_ledger_batches_fenced_total",
        r"stock_ledger_negative_stock_levels",
        r"stock_ledger_negative_stock_units",
    ]
    missing = [pattern for pattern in required if not re.search(pattern, queries)]
    assert not missing, f"dashboard lacks queries matching {missing}"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
