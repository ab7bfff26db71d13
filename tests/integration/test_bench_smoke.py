"""`python -m scripts.bench drain` keeps working: a short run on the real broker and database. Nothing about speed is
asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.helpers import Services

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_bench_run_exits_0_and_writes_every_measurement(services: Services, tmp_path: Path) -> None:
    """20,000 movements, a 2,000-record naive slice, 3 s of steady load and a two-size batch sweep against the
    services the tests use: the bench exits 0, prints its table beneath the command line that produced it, and
    writes JSON holding every measurement, the ratios, the targets, that command line and an SVG chart."""
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STOCK_LEDGER_")}
    env |= {"KAFKA_BOOTSTRAP_SERVERS": services.kafka, "DATABASE_URL": services.admin_url}
    done = subprocess.run(
        [sys.executable, "-m", "scripts.bench", "drain", "--count", "20000", "--naive-count", "2000",
         "--latency-seconds", "3", "--latency-rate", "2000", "--batch-sizes", "1000,5000", "--svg", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=220, check=False,
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}"
    assert "targets:" in done.stdout
    command = "python -m scripts.bench drain --count 20000 --naive-count 2000 --latency-seconds 3"
    assert done.stdout.startswith(f"$ {command}")  # the command that reproduces the table, beside it
    assert "raw consume" in done.stderr  # progress goes to stderr

    results = json.loads(out.read_text())
    assert set(results) >= {"meta", "produce", "runs", "median", "limit_rate", "ratios", "targets", "batch_sweep"}
    assert results["meta"]["options"]["count"] == 20_000
    assert results["meta"]["command"].startswith(command)
    assert set(results["median"]) >= {
        "raw_consume_rate", "raw_copy_rate", "worker_rate", "worker_steady_rate", "worker_peak_rss_mib",
        "worker_cpu_seconds_per_100k", "worker3_rate", "small_worker_peak_rss_mib", "naive_rate",
        "latency_p50_ms", "latency_p99_ms", "latency_rows",
    }
    assert results["median"]["latency_rows"] == 6_000
    assert set(results["ratios"]) >= {"worker_vs_limit", "worker_vs_naive", "rss_n_vs_n10"}
    assert len(results["targets"]) == 5
    assert all(isinstance(t["met"], bool) for t in results["targets"].values())
    assert [s["batch_max_records"] for s in results["batch_sweep"]] == [1000, 5000]
    assert out.with_suffix(".svg").read_text().startswith("<svg")
