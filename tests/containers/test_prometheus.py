"""The chart's alert rules on a real Prometheus (Debian's `prometheus`), scraping real workers.

`promtool test rules` (tests/promtool) feeds the rules synthetic series; here Prometheus evaluates them against
what the workers really export, with the labels a PodMonitor adds (namespace, pod, container, job
`<namespace>/<podmonitor>`, and the chart's podTargetLabels app_kubernetes_io_instance and app_kubernetes_io_name,
which every rule selects its release by). The rules are the chart's rendered PrometheusRule with every `for:` and
range window shortened (one minute -> one second); the expressions are otherwise the same, which the test checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import yaml
from aiokafka import AIOKafkaProducer

from tests.support.helpers import Env, Services, WorkerPool, WorkerProcess, free_port, movement

from .chart import NAMESPACE, RELEASE, ROOT, one, render

pytestmark = [pytest.mark.container, pytest.mark.integration, pytest.mark.asyncio]

JOB = f"{NAMESPACE}/{RELEASE}-stock-ledger"  # the job label the Prometheus Operator gives a PodMonitor's targets
SECONDS_PER_MINUTE = 1  # rules for the test: `for: 5m` -> 5s, `[10m]` -> 10s (scraped and evaluated every 1s)
DURATION = re.compile(r"\b(\d+)m\b")
# Labels every alert expression aggregates by or selects on, beside the metrics' own.
TARGET_LABELS = ("namespace", "pod", "job", "instance", "app_kubernetes_io_instance", "app_kubernetes_io_name")

# The hole alert (StockLedgerLedgerHole...) comes with the hardening branch. When it lands, its scenario goes
# HERE, as test_the_hole_alert_fires_on_a_retention_hole: STOCK_LEDGER_ON_GAP=record on the workers, a hole made
# with AIOKafkaAdminClient.delete_records (RecordsToDelete(before_offset=...)) while they are stopped, then the
# alert must fire after restart and resolve once the gap is acknowledged.


def documented_families() -> dict[str, set[str]]:
    """Metric family -> its labels, from the Observability table of docs/operations.md (the documented contract)."""
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split("## Observability", 1)[1].split("\n## ", 1)[0]
    families: dict[str, set[str]] = {}
    for cell in re.findall(r"^\| (.+?) \|", section, flags=re.MULTILINE):
        for name, labels in re.findall(r"`(stock_ledger_[a-z_{},]+?)(?:\{([a-z_,]+)\})?`", cell):
            head, _, rest = name.partition("{")
            variants = [head + v + rest.split("}", 1)[1] for v in rest.split("}", 1)[0].split(",")] if rest \
                else [name]
            for variant in variants:
                families[variant] = set(labels.split(",")) if labels else set()
    assert len(families) >= 20, f"the metric table of docs/operations.md parsed into only {sorted(families)}"
    return families


def labels_the_rules_use(rules: Path) -> dict[str, set[str]]:
    """Metric -> the labels an alert aggregates it by (`max by (namespace, topic, partition) (metric...)`)."""
    used: dict[str, set[str]] = {}
    for group in yaml.safe_load(rules.read_text())["groups"]:
        for item in group["rules"]:
            expr = " ".join(item["expr"].split())
            for labels, metric in re.findall(r"by \(([^)]*)\) \((?:\w+\()?(stock_ledger_\w+)", expr):
                used.setdefault(metric, set()).update(label.strip() for label in labels.split(","))
    assert used, "no `by (...)` aggregation of a stock_ledger metric found in the rules"
    return used


def shortened(expr_or_duration: str) -> str:
    return DURATION.sub(lambda m: f"{int(m.group(1)) * SECONDS_PER_MINUTE}s", expr_or_duration)


def shortened_rules(tmp_path: Path) -> Path:
    """The chart's PrometheusRule groups, windows shortened, written as a Prometheus rule file."""
    manifests = render("--set", "metrics.prometheusRule.enabled=true", "--set", "database.existingSecret=db",
                       "--set", "database.migrationSecret=db-owner", tmp=tmp_path)
    groups = one(manifests, "PrometheusRule")["spec"]["groups"]
    for group in groups:
        group["interval"] = "1s"
        for item in group["rules"]:
            original = item["expr"]
            item["expr"] = shortened(original)
            assert re.sub(r"\b\d+s\b", "W", item["expr"]) == DURATION.sub("W", original), "only windows change"
            if "for" in item:
                item["for"] = shortened(item["for"])
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path


@dataclass
class Prometheus:
    port: int
    config: Path
    rules: Path
    proc: subprocess.Popen[bytes] | None = None

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - a local URL built here
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def scrape(self, workers: list[tuple[str, WorkerProcess]]) -> None:
        """Scrape these workers (pod name, process), like a PodMonitor would, and reload."""
        configs = [{"targets": [f"127.0.0.1:{w.port}"],
                    "labels": {"namespace": NAMESPACE, "pod": pod, "container": "stock-ledger",
                               "app_kubernetes_io_instance": RELEASE, "app_kubernetes_io_name": "stock-ledger"}}
                   for pod, w in workers]
        self.config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
            "rule_files": [str(self.rules)],
            "scrape_configs": [{"job_name": JOB, "static_configs": configs}],
        }))
        if self.proc is not None:
            request = urllib.request.Request(f"http://127.0.0.1:{self.port}/-/reload", method="POST")
            with urllib.request.urlopen(request, timeout=10):  # noqa: S310 - a local URL built here
                pass

    def alerts(self) -> list[dict[str, Any]]:
        return list(self.api("alerts")["alerts"])

    def firing(self) -> set[tuple[str, str]]:
        return {(a["labels"]["alertname"], a["labels"].get("pod", "")) for a in self.alerts()
                if a["state"] == "firing"}

    def value(self, query: str) -> float | None:
        result = self.api("query", query=query)["result"]
        return float(result[0]["value"][1]) if result else None


@contextlib.contextmanager
def running_prometheus(tmp_path: Path, rules: Path) -> Iterator[Prometheus]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is not installed: run scripts/containers.sh install", pytrace=False)
    prometheus = Prometheus(free_port(), tmp_path / "prometheus.yml", rules)
    prometheus.scrape([])
    log = (tmp_path / "prometheus.log").open("wb")
    prometheus.proc = subprocess.Popen(
        [binary, f"--config.file={prometheus.config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prometheus.port}", "--web.enable-lifecycle",
         "--storage.tsdb.retention.time=1h"],
        stdout=log, stderr=subprocess.STDOUT)
    proc = prometheus.proc
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                prometheus.api("status/buildinfo")
                break
            except OSError:
                assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "prometheus did not answer within 60 s"
                time.sleep(0.3)
        yield prometheus
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


async def until(check: Any, timeout: float, what: str) -> Any:
    """Poll check() every 0.5 s until it returns something truthy; that value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        await asyncio.sleep(0.5)
    msg = f"timed out after {timeout:g}s waiting for {what} (last: {last!r})"
    raise AssertionError(msg)


@contextlib.asynccontextmanager
async def steady_producer(services: Services, topic: str, rate: float) -> AsyncIterator[list[int]]:
    """Produces valid movements at `rate`/s to the partitions in the yielded list (editable while it runs)."""
    partitions = list(range(24))
    producer = AIOKafkaProducer(bootstrap_servers=services.kafka, enable_idempotence=True, acks="all")
    await producer.start()

    async def loop() -> None:
        n = 0
        while True:
            sku = f"SKU-{n % 50}"  # the key must be the SKU; the partition is chosen here, not by the key
            value = json.dumps(movement(sku)).encode()
            await producer.send(topic, value=value, key=sku.encode(), partition=partitions[n % len(partitions)])
            n += 1
            await asyncio.sleep(1 / rate)

    task = asyncio.create_task(loop())
    try:
        yield partitions
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await producer.stop()


def assert_quiet(prometheus: Prometheus) -> None:
    active = [(a["labels"]["alertname"], a["state"], a["labels"].get("pod", "")) for a in prometheus.alerts()]
    assert not active, f"alerts during a healthy drain: {active}"


async def observe_quiet(prometheus: Prometheus, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert_quiet(prometheus)
        await asyncio.sleep(1)


async def members(db: Env, topic: str, group: str) -> dict[str, list[int]]:
    """Static member (group.instance.id prefix of Kafka's member id) -> the partitions it claimed."""
    conn = await asyncpg.connect(db.owner_url)
    try:
        rows = await conn.fetch("SELECT partition, member_id FROM consumer_offsets WHERE group_id = $1 AND topic = $2",
                                group, topic)
    finally:
        await conn.close()
    owners: dict[str, list[int]] = {}
    for row in rows:
        owners.setdefault((row["member_id"] or "?").split("-", 1)[0], []).append(row["partition"])
    return owners


@pytest.mark.timeout(420)
async def test_rules_on_a_real_prometheus_scraping_one_then_two_workers(
    services: Services, database: Env, topic: str, workers: WorkerPool, tmp_path: Path,
) -> None:
    """1. Prometheus scrapes one worker (labels as a PodMonitor sets them) while movements flow: every
       documented metric family is there with the labels the rules use, and no alert is pending or firing.
    2. A second worker joins and is scraped too: after the rebalance, still no alert.
    3. Movements go only to worker A's partitions, and A is frozen with SIGSTOP (its partitions stay assigned:
       long session timeout): StockLedgerTargetDown fires for A and StockLedgerStalled fires (lag growing, no
       batch committed anywhere).
    4. SIGCONT: A drains its backlog and both alerts resolve; nothing is left firing."""
    slow_session = {"STOCK_LEDGER_SESSION_TIMEOUT_MS": "120000", "STOCK_LEDGER_REBALANCE_TIMEOUT_MS": "180000"}
    rules = shortened_rules(tmp_path)
    with running_prometheus(tmp_path, rules) as prometheus:
        async with steady_producer(services, topic, rate=100) as partitions:
            a = workers.start(STOCK_LEDGER_GROUP_INSTANCE_ID="wa", **slow_session)
            prometheus.scrape([("ledger-stock-ledger-a", a)])
            await until(lambda: prometheus.value(f'sum(up{{job="{JOB}"}})') == 1, 60, "worker A scraped")
            await until(lambda: prometheus.value("sum(stock_ledger_assigned_partitions)") == 24, 90,
                        "worker A holding all 24 partitions")
            await until(lambda: prometheus.value("sum(stock_ledger_movements_applied_total)"), 60, "applied > 0")

            # 1. Families and labels.
            wanted_labels = documented_families()
            for metric, labels in labels_the_rules_use(rules).items():
                assert metric in wanted_labels, f"the rules use {metric}, which docs/operations.md does not document"
                wanted_labels[metric] |= labels
            for family, labels in wanted_labels.items():
                selector = f'{{__name__=~"{family}(_bucket|_count|_sum)?"}}'
                series = prometheus.api("series", **{"match[]": selector})
                assert series, f"{family} (documented in docs/operations.md) is not in Prometheus"
                wanted = labels | set(TARGET_LABELS)
                assert all(wanted <= set(s) for s in series), f"{family}: series lack {wanted}: {series[:2]}"
            await asyncio.sleep(SECONDS_PER_MINUTE * 5)  # past every shortened window since start-up
            await observe_quiet(prometheus, 8)

            # 2. A second worker.
            b = workers.start(STOCK_LEDGER_GROUP_INSTANCE_ID="wb", **slow_session)
            prometheus.scrape([("ledger-stock-ledger-a", a), ("ledger-stock-ledger-b", b)])
            await until(lambda: prometheus.value(f'sum(up{{job="{JOB}"}})') == 2, 60, "both workers scraped")
            owners: dict[str, list[int]] = {}
            deadline = time.monotonic() + 90
            while set(owners) != {"wa", "wb"}:
                assert time.monotonic() < deadline, f"the partitions were not split between A and B: {owners}"
                await asyncio.sleep(0.5)
                owners = await members(database, topic, workers.group)
            await until(lambda: prometheus.value("sum(stock_ledger_ready)") == 2, 60, "both workers ready")
            await asyncio.sleep(SECONDS_PER_MINUTE * 10 + 2)  # the rebalance's fenced batches age out of [5m]
            await observe_quiet(prometheus, 8)

            # 3. Freeze A while its partitions keep receiving movements.
            partitions[:] = sorted(owners["wa"])
            a.signal(signal.SIGSTOP)
            try:
                wanted = {"StockLedgerTargetDown", "StockLedgerStalled"}
                firing = await until(lambda: wanted <= {n for n, _ in prometheus.firing()} and prometheus.firing(),
                                     120, "TargetDown and Stalled firing")
                assert ("StockLedgerTargetDown", "ledger-stock-ledger-a") in firing, firing
                for alert in prometheus.alerts():  # what the pager shows links the runbook's section
                    name = alert["labels"]["alertname"]
                    assert alert["annotations"].get("runbook_url", "").endswith(f"runbook.md#{name.lower()}"), alert
                assert ("StockLedgerTargetDown", "ledger-stock-ledger-b") not in firing, firing
            finally:
                a.signal(signal.SIGCONT)

            # 4. Recovery.
            await until(lambda: not prometheus.firing(), 120, "every alert resolved after SIGCONT")
            assert a.alive(), workers.logs_tail()
            assert b.alive(), workers.logs_tail()
    workers.assert_no_tracebacks()
