"""The chart rendered with the helm that scripts/tools.sh pins (its cache first, whatever else is on PATH)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "stock-ledger"
RELEASE = "ledger"
NAMESPACE = "inventory"
KUBE_VERSION = "1.30.0"


def helm_binary() -> str:
    """scripts/tools.sh builds the pinned helm into the cache: an older helm earlier on PATH must not win."""
    cache = Path(os.environ.get("STOCK_LEDGER_CACHE", Path.home() / ".cache" / "stock-ledger")) / "bin" / "helm"
    if cache.is_file():
        return str(cache)
    found = shutil.which("helm")
    if found is None:
        pytest.fail("helm not found in the cache or on PATH: run scripts/tools.sh", pytrace=False)
    return found


def render(*flags: str, tmp: Path) -> list[dict[str, Any]]:
    """`helm template` of the chart as release `ledger` in namespace `inventory`."""
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp), "HELM_CACHE_HOME": str(tmp / "cache"),
           "HELM_CONFIG_HOME": str(tmp / "config"), "HELM_DATA_HOME": str(tmp / "data"),
           "KUBECONFIG": str(tmp / "no-kubeconfig")}
    done = subprocess.run([helm_binary(), "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
                           "--kube-version", KUBE_VERSION, *flags], capture_output=True, text=True, env=env,
                          timeout=120, check=False)
    assert done.returncode == 0, f"helm template failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def one(manifests: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [m for m in manifests if m["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, rendered {len(found)}"
    return found[0]
