"""The versions this build reports: `stock-ledger --version` and the stock_ledger_build_info metric."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def version_of(dist: str) -> str:
    """The installed version of a distribution (this one: "stock-ledger"), or "unknown"."""
    try:
        return version(dist)
    except PackageNotFoundError:
        return "unknown"
