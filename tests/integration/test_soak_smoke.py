"""`python -m scripts.bench soak` and `verify` keep working: short runs on the real broker and database.
Nothing about speed is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.helpers import Services

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[2]


def test_a_one_minute_soak_and_a_small_verify_size_exit_0_and_report_every_measurement(
    services: Services, tmp_path: Path,
) -> None:
    """A 2,400-movement preloaded ledger over a topic of valid movements, one per record batch (verify, then the
    invariant checks over three simulated minutes), and a one-minute soak at 300/s: each run exits 0, prints its
    table, and writes JSON with verify's time and peak RSS, the invariant checks' durations, and per minute the
    latency quantiles, worker RSS and database size."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STOCK_LEDGER_")}
    env |= {"KAFKA_BOOTSTRAP_SERVERS": services.kafka, "DATABASE_URL": services.admin_url}

    def bench(*args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
        out = tmp_path / f"{args[0]}.json"
        done = subprocess.run([sys.executable, "-m", "scripts.bench", *args, "--out", str(out)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=200, check=False)
        assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}"
        return done, json.loads(out.read_text())

    done, verified = bench("verify", "--sizes", "2400", "--records", "sparse")
    assert "verify peak RSS MiB" in done.stdout
    done, results = bench("soak", "--minutes", "1", "--rate", "300")
    assert "verify at the end:" in done.stdout
    assert "minute 1:" in done.stderr  # the live per-minute line

    [size] = verified["verify_sizes"]
    assert size["movements"] == 2_400
    assert size["records"] == "sparse"
    assert size["verify"]["exit_code"] == 0
    assert size["verify"]["last_line"] == "2400|2400"
    assert size["verify"]["peak_rss_mib"] > 0
    assert len(size["invariants"]["incremental_seconds"]) == 3
    soak = results["soak"]
    assert soak["movements"] == 18_000
    assert soak["verify"]["last_line"] == "18000|18000"
    first = soak["per_minute"][0]
    assert set(first) >= {"minute", "p50_ms", "p95_ms", "p99_ms", "under_50ms", "worker_rss_mib", "database_mib",
                          "invariant_checks", "exact", "disk", "cpu"}
    assert first["cpu"]["worker_cpu_pct"] > 0  # a minute of 300 movements/s costs the worker some CPU
    assert (first["cpu"]["producer_cpu_pct"] or 0) > 0  # and the producer, counted apart from the worker
    if any(Path("/sys/block").glob("*/device")):  # Linux with a real disk: the minute's WAL alone is written there
        assert first["disk"]["written_mib"] > 0
    assert set(results["meta"]["host_writeback"]) >= {"dirty_expire_centisecs", "dirty_writeback_centisecs"}
    assert sum(m["exact"].get("rows", 0) for m in soak["per_minute"]) == 18_000
    for m in soak["per_minute"]:
        exact = m["exact"]
        if exact["rows"]:  # every row's latency split where the worker took it: two parts, none longer than the whole
            assert exact["to_worker"]["rows"] == exact["in_worker"]["rows"] == exact["rows"]
            assert 0 < exact["in_worker"]["max_ms"] <= exact["max_ms"]
