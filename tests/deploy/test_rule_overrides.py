"""Alert thresholds, `for:`, labels and runbook links are set from chart values, and the result is still a valid
rule file.

tests/promtool keeps testing files/prometheus-rules.yaml itself (the defaults); here the chart's PrometheusRule
is rendered with overrides and checked against the file and with `promtool check rules`.
"""

from __future__ import annotations

import subprocess
from typing import TYPE_CHECKING, Any

import pytest

from .support import CHART, REQUIRED, HelmResult, Rendered, require_tool, shipped_groups

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

pytestmark = pytest.mark.deploy

BASE = (*REQUIRED, "--set", "metrics.prometheusRule.enabled=true")
RUNBOOK = "https://git.example.com/inventory/stock-ledger/blob/v1/docs/runbook.md"


def alerts(rendered: Rendered) -> list[dict[str, Any]]:
    rule = rendered.one("PrometheusRule")
    return [r for group in rule["spec"]["groups"] for r in group["rules"] if "alert" in r]


def shipped(_yaml_module: Any, runbook: str | None = None) -> list[dict[str, Any]]:
    return [r for group in shipped_groups(runbook=runbook) for r in group["rules"] if "alert" in r]


def test_defaults_embed_the_file_scoped(render: Callable[..., Rendered], yaml_module: Any) -> None:
    """Without overrides the rules are the file's, scoped to the release, each linking its runbook section at the
    chart's home and version, an absolute URL."""
    rules = alerts(render(*BASE))
    assert rules == shipped(yaml_module)
    chart = yaml_module.safe_load((CHART / "Chart.yaml").read_text())
    for rule in rules:
        assert rule["annotations"]["runbook_url"] == (
            f"{chart['home']}/blob/v{chart['appVersion']}/docs/runbook.md#{rule['alert'].lower()}")
        assert rule["annotations"]["runbook_url"].startswith("https://")
        assert 'namespace="inventory",app_kubernetes_io_instance="ledger"' in rule["expr"]


def test_overrides_apply(render: Callable[..., Rendered], tmp_path: Path, yaml_module: Any) -> None:
    """threshold replaces the number compared against (and in the description), for and labels are set,
    enabled: false drops the alert, runbookUrl prefixes every link; promtool accepts the result."""
    rendered = render(
        *BASE,
        "--set", f"metrics.prometheusRule.runbookUrl={RUNBOOK}",
        "--set", "metrics.prometheusRule.alerts.StockLedgerLagHigh.threshold=50000",
        "--set", "metrics.prometheusRule.alerts.StockLedgerLagHigh.for=15m",
        "--set", "metrics.prometheusRule.alerts.StockLedgerLagHigh.labels.team=inventory",
        "--set", "metrics.prometheusRule.alerts.StockLedgerLagHigh.labels.severity=critical",
        "--set", "metrics.prometheusRule.alerts.StockLedgerBatchFenced.enabled=false",
    )
    rules = alerts(rendered)
    lag = next(r for r in rules if r["alert"] == "StockLedgerLagHigh")
    assert lag["expr"].strip().endswith("> 50000")
    assert "10000" not in lag["expr"]
    assert "more than 50000 messages" in lag["annotations"]["description"]
    assert lag["for"] == "15m"
    assert lag["labels"] == {"severity": "critical", "team": "inventory"}
    assert "StockLedgerBatchFenced" not in {r["alert"] for r in rules}
    assert len(rules) == len(shipped(yaml_module)) - 1
    assert all(r["annotations"]["runbook_url"] == f"{RUNBOOK}#{r['alert'].lower()}" for r in rules)
    others = [r for r in rules if r["alert"] != "StockLedgerLagHigh"]
    assert others == [r for r in shipped(yaml_module, RUNBOOK)
                      if r["alert"] not in {"StockLedgerLagHigh", "StockLedgerBatchFenced"}]
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(yaml_module.safe_dump(rendered.one("PrometheusRule")["spec"]))
    checked = subprocess.run([require_tool("promtool"), "check", "rules", str(rules_file)], capture_output=True,
                             text=True, timeout=60, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        pytest.param(("metrics.prometheusRule.alerts.StockLedgerLagHgh.for=5m",),
                     "metrics.prometheusRule.alerts.StockLedgerLagHgh: no such alert", id="typo"),
        pytest.param(("metrics.prometheusRule.alerts.StockLedgerTargetDown.threshold=3",),
                     "does not end in a comparison with a number", id="no-threshold"),
        pytest.param(("metrics.prometheusRule.alerts.StockLedgerLagHigh.for=ten",),
                     "/metrics/prometheusRule/alerts/StockLedgerLagHigh/for", id="bad-duration"),
    ],
)
def test_bad_overrides_fail_naming_the_value(run_helm: Callable[..., HelmResult], flags: tuple[str, ...],
                                             message: str) -> None:
    sets = [arg for flag in flags for arg in ("--set", flag)]
    result = run_helm("template", "ledger", str(CHART), *BASE, *sets)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
