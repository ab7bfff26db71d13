"""Offline checks of the Prometheus alert rules shipped in the Helm chart.

- `promtool check rules` on the rules the chart renders from helm/stock-ledger/files/prometheus-rules.yaml
  (syntax, PromQL, templates);
- `promtool test rules` on tests/promtool/alerts_test.yaml against those rules, rendered for release `ledger` in
  namespace `shop` (each alert fires on synthetic series, stays quiet where it must, and never on another
  release's or namespace's series);
- scope: every selector of every expression is the release's own ({SCOPE}), every aggregation keeps the namespace
  and the release;
- structure: every alert has a severity and templated summary/description annotations with a runbook hint;
- every `stock_ledger_*` metric named in the rules (expressions and annotations) and in the synthetic
  series is one of the metrics fixed by the contract.

promtool comes from Debian's `prometheus` package; scripts/tools.sh installs it. A missing promtool is a
failure, never a skip: these tests are the only guard on the alert rules.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from .support import CHART, REQUIRED

if TYPE_CHECKING:
    from collections.abc import Callable

    from .support import HelmResult

pytestmark = pytest.mark.deploy

REPO_ROOT = Path(__file__).resolve().parents[2]
RULES_FILE = REPO_ROOT / "helm" / "stock-ledger" / "files" / "prometheus-rules.yaml"
PROMTOOL_TESTS = REPO_ROOT / "tests" / "promtool" / "alerts_test.yaml"

# The metric names fixed by the stock-ledger contract (docs: "Metrics"). Keep in sync with it.
CONTRACT_GAUGES = frozenset(
    {
        "stock_ledger_partition_db_offset",
        "stock_ledger_partition_log_end_offset",
        "stock_ledger_partition_kafka_committed_offset",
        "stock_ledger_partition_lag_messages",
        "stock_ledger_partition_offset_drift_messages",
        "stock_ledger_partition_gap_messages",
        "stock_ledger_monitor_leader",
        "stock_ledger_assigned_partitions",
        "stock_ledger_ready",
        "stock_ledger_last_commit_timestamp_seconds",
        "stock_ledger_ledger_coordinates_unique",
        "stock_ledger_ledger_partitions_ahead_of_offset",
        "stock_ledger_ledger_stock_level_mismatches",
        "stock_ledger_ledger_missing_records",
        "stock_ledger_negative_stock_levels",
        "stock_ledger_negative_stock_units",
        "stock_ledger_segment_headroom",
        "stock_ledger_closing_age_seconds",
        "stock_ledger_build_info",
    }
)
CONTRACT_COUNTERS = frozenset(
    {
        "stock_ledger_movements_applied_total",
        "stock_ledger_movements_rejected_total",
        "stock_ledger_batches_committed_total",
        "stock_ledger_batches_fenced_total",
        "stock_ledger_rebalances_total",
        "stock_ledger_partition_claims_total",
        "stock_ledger_retries_total",
        "stock_ledger_offset_mismatches_total",
        "stock_ledger_coordinate_conflicts_total",
    }
)
CONTRACT_HISTOGRAMS = frozenset(
    {
        "stock_ledger_batch_duration_seconds",
        "stock_ledger_batch_records",
        "stock_ledger_end_to_end_latency_seconds",
    }
)
CONTRACT_METRICS = CONTRACT_GAUGES | CONTRACT_COUNTERS | CONTRACT_HISTOGRAMS
HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")

# The alerts issues 4 and 16 ask for; more may be added, none of these may disappear.
REQUIRED_ALERTS = frozenset(
    {
        "StockLedgerLagHigh",
        "StockLedgerStalled",
        "StockLedgerOffsetDriftNegative",
        "StockLedgerBatchFenced",
        "StockLedgerRejectedMovementsRising",
        "StockLedgerTargetDown",
        "StockLedgerLedgerInvariantBroken",
        "StockLedgerNegativeStock",
    }
)
SEVERITIES = frozenset({"warning", "critical"})

METRIC_RE = re.compile(r"\bstock_ledger_\w+")
PROMTOOL_TIMEOUT_S = 120
# What tests/promtool/alerts_test.yaml expects the rules to be rendered for.
UNIT_TEST_RENDER = ("--namespace", "shop", "--set", "metrics.prometheusRule.enabled=true",
                    "--set", "metrics.prometheusRule.runbookUrl=https://runbooks.example.com/stock-ledger.md")


@pytest.fixture(scope="module")
def rendered_rules(run_helm: Callable[..., HelmResult], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The chart's PrometheusRule for release `ledger` in namespace `shop`, as a rule file (rules.yaml) beside a
    copy of tests/promtool/alerts_test.yaml."""
    result = run_helm("template", "ledger", str(CHART), *REQUIRED, *UNIT_TEST_RENDER,
                      "--show-only", "templates/prometheusrule.yaml")
    assert result.returncode == 0, result.stderr
    directory = tmp_path_factory.mktemp("promtool")
    (directory / "rules.yaml").write_text(yaml.safe_dump(yaml.safe_load(result.stdout)["spec"]))
    shutil.copy(PROMTOOL_TESTS, directory / PROMTOOL_TESTS.name)
    return directory / "rules.yaml"


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool not found on PATH: run scripts/tools.sh (it installs Debian's `prometheus` package, "
            "which ships /usr/bin/promtool)",
            pytrace=False,
        )
    return path


def _run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_promtool(), *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=PROMTOOL_TIMEOUT_S,
        check=False,
    )


def _load_yaml(path: Path) -> Any:
    with path.open(encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def _alert_rules() -> list[dict[str, Any]]:
    doc = _load_yaml(RULES_FILE)
    return [rule for group in doc["groups"] for rule in group["rules"] if "alert" in rule]


def _contract_name(metric: str) -> str:
    """Map a histogram's series name (`_bucket`, `_count`, `_sum`) to the histogram's name."""
    for suffix in HISTOGRAM_SUFFIXES:
        base = metric.removesuffix(suffix)
        if base != metric and base in CONTRACT_HISTOGRAMS:
            return base
    return metric


def _unknown_metrics(text: str) -> set[str]:
    return {m for m in METRIC_RE.findall(text) if _contract_name(m) not in CONTRACT_METRICS}


def test_promtool_check_rules(rendered_rules: Path) -> None:
    result = _run_promtool("check", "rules", "--lint-fatal", str(rendered_rules))
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"promtool check rules failed (exit {result.returncode}):\n{output}"


def test_promtool_unit_tests(rendered_rules: Path) -> None:
    result = _run_promtool("test", "rules", str(rendered_rules.parent / PROMTOOL_TESTS.name))
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"promtool test rules failed (exit {result.returncode}):\n{output}"
    assert "SUCCESS" in output, output


def test_every_expression_judges_its_own_release_only() -> None:
    """Every metric selected is {SCOPE}'d (the chart makes it this release's namespace, instance and name), and
    every `by`/`on` keeps namespace and release: one release's alert never counts another's series."""
    problems: list[str] = []
    for rule in _alert_rules():
        expr = rule["expr"]
        problems += [f"{rule['alert']}: {m.group(0)} is not scoped" for m in
                     re.finditer(r"\b(stock_ledger_\w+|up)\b(?!\{SCOPE\})(?=[\s{\[)])", expr)]
        problems += [f"{rule['alert']}: {clause}" for clause in re.findall(r"\b(?:by|on) \([^)]*\)", expr)
                     if not clause.split("(", 1)[1].startswith("namespace, app_kubernetes_io_instance")]
        if "{SCOPE}" not in expr:
            problems.append(f"{rule['alert']}: selects nothing of its own")
    assert not problems, "\n".join(problems)
    assert re.search(r"\b(stock_ledger_\w+|up)\b(?!\{SCOPE\})(?=[\s{\[)])", "max(up{job='x'})"), "the check must bite"


def test_rule_file_is_a_plain_prometheus_rule_file() -> None:
    # The chart embeds this file into a PrometheusRule's spec: top-level `groups:` and nothing else.
    doc = _load_yaml(RULES_FILE)
    assert isinstance(doc, dict), "rule file must be a mapping"
    assert set(doc) == {"groups"}, f"unexpected top-level keys: {sorted(set(doc) - {'groups'})}"
    assert doc["groups"], "no rule groups"
    for group in doc["groups"]:
        assert group.get("name"), f"group without a name: {group}"
        assert group.get("rules"), f"group {group.get('name')} has no rules"


def test_required_alerts_are_defined() -> None:
    names = {rule["alert"] for rule in _alert_rules()}
    missing = REQUIRED_ALERTS - names
    assert not missing, f"alerts missing from {RULES_FILE.name}: {sorted(missing)}"
    assert all(name.startswith("StockLedger") for name in names), sorted(names)


def test_every_alert_has_severity_summary_description_and_runbook() -> None:
    problems: list[str] = []
    for rule in _alert_rules():
        name = rule["alert"]
        labels = rule.get("labels") or {}
        annotations = rule.get("annotations") or {}
        if labels.get("severity") not in SEVERITIES:
            problems.append(f"{name}: severity label {labels.get('severity')!r} not in {sorted(SEVERITIES)}")
        summary = str(annotations.get("summary", "")).strip()
        description = str(annotations.get("description", "")).strip()
        if not summary:
            problems.append(f"{name}: no summary annotation")
        if not description:
            problems.append(f"{name}: no description annotation")
        if "runbook" not in description.lower():
            problems.append(f"{name}: description has no runbook hint")
        # Everything but absent() has labels or a value to show; absent() has neither.
        templated = "$labels." in description or "$value" in description
        if not templated and not rule["expr"].lstrip().startswith("absent("):
            problems.append(f"{name}: description is not templated with $labels / $value")
    assert not problems, "\n".join(problems)


def test_rules_use_only_contract_metric_names() -> None:
    problems: list[str] = []
    used: set[str] = set()
    for rule in _alert_rules():
        expr_metrics = set(METRIC_RE.findall(rule["expr"]))
        used |= expr_metrics
        if unknown := _unknown_metrics(rule["expr"]):
            problems.append(f"{rule['alert']}: expression uses unknown metrics {sorted(unknown)}")
        # Runbook hints that point at a metric must point at a real one.
        for key, text in (rule.get("annotations") or {}).items():
            if unknown := _unknown_metrics(str(text)):
                problems.append(f"{rule['alert']}: annotation {key} names unknown metrics {sorted(unknown)}")
    assert not problems, "\n".join(problems)
    assert used, "no stock_ledger_* metric found in the rule expressions: is the regex still right?"


def test_contract_name_mapping_for_histograms() -> None:
    for histogram in CONTRACT_HISTOGRAMS:
        for suffix in HISTOGRAM_SUFFIXES:
            assert _contract_name(histogram + suffix) == histogram
    # A suffix only maps to a histogram of the contract, never to an arbitrary base name.
    assert _contract_name("stock_ledger_ready_count") == "stock_ledger_ready_count"
    assert not _unknown_metrics("histogram_quantile(0.99, rate(stock_ledger_batch_records_bucket[5m]))")
    assert _unknown_metrics("stock_ledger_lag_total + stock_ledger_ready_count") == {
        "stock_ledger_lag_total",
        "stock_ledger_ready_count",
    }


def test_every_alert_has_firing_and_quiet_unit_tests() -> None:
    doc = _load_yaml(PROMTOOL_TESTS)
    assert doc["rule_files"] == ["rules.yaml"], f"{PROMTOOL_TESTS.name} must load the rendered rules (rules.yaml)"

    fires: set[str] = set()
    quiet: set[str] = set()
    series_problems: list[str] = []
    for case in doc["tests"]:
        for series in case.get("input_series", []):
            metric = series["series"].split("{", 1)[0].strip()
            if metric != "up" and _contract_name(metric) not in CONTRACT_METRICS:
                series_problems.append(f"{case.get('name')}: synthetic series of unknown metric {metric}")
        for check in case.get("alert_rule_test", []):
            (fires if check.get("exp_alerts") else quiet).add(check["alertname"])
            series_problems.extend(
                f"{case.get('name')}: expected {check['alertname']} without exp_annotations"
                for alert in check.get("exp_alerts") or []
                if not alert.get("exp_annotations")
            )
    assert not series_problems, "\n".join(series_problems)

    names = {rule["alert"] for rule in _alert_rules()}
    assert not names - fires, f"alerts with no unit test where they fire: {sorted(names - fires)}"
    assert not names - quiet, f"alerts with no unit test where they must not fire: {sorted(names - quiet)}"


@pytest.mark.parametrize("flags", [(), ("--set", "fullnameOverride=inventory-ledger"),
                                   ("--set", "nameOverride=ledger-worker")], ids=["default", "fullname", "name"])
@pytest.mark.parametrize("scraping", ["podMonitor", "serviceMonitor", "annotations"])
def test_the_rules_select_the_labels_the_chart_puts_on_its_targets(
    run_helm: Callable[..., HelmResult], flags: tuple[str, ...], scraping: str,
) -> None:
    """Whatever the names (fullnameOverride, nameOverride) and however Prometheus finds the pods, the rules'
    matchers are the worker pods' own namespace, instance and name labels, and the scraping carries those labels:
    the operator's monitors as podTargetLabels (sanitized to app_kubernetes_io_*), annotation scraping through the
    pod labels themselves (the usual labelmap)."""
    enable = () if scraping == "annotations" else ("--set", f"metrics.{scraping}.enabled=true")
    result = run_helm("template", "ledger", str(CHART), "--namespace", "shop", *REQUIRED, *flags, *enable,
                      "--set", "metrics.prometheusRule.enabled=true")
    assert result.returncode == 0, result.stderr
    manifests = [d for d in yaml.safe_load_all(result.stdout) if d]
    [deployment] = [m for m in manifests if m["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["metadata"]
    expected = (f'{{namespace="shop",app_kubernetes_io_instance="{pod["labels"]["app.kubernetes.io/instance"]}",'
                f'app_kubernetes_io_name="{pod["labels"]["app.kubernetes.io/name"]}"}}')
    [rule] = [m for m in manifests if m["kind"] == "PrometheusRule"]
    exprs = [r["expr"] for group in rule["spec"]["groups"] for r in group["rules"]]
    assert all(expected in expr for expr in exprs), (expected, exprs[0])
    if scraping == "annotations":
        assert pod["annotations"]["prometheus.io/scrape"] == "true"
    else:
        [monitor] = [m for m in manifests if m["kind"] == scraping[0].upper() + scraping[1:]]
        assert monitor["spec"]["podTargetLabels"] == ["app.kubernetes.io/instance", "app.kubernetes.io/name"]
