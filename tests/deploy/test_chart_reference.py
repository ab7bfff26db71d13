"""The chart README's values table is generated from values.yaml (scripts/chart_reference.py) and cannot fall
behind it."""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING

import pytest
from scripts import chart_reference

from .support import REPO

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.deploy


def test_the_readme_shows_the_table_values_yaml_generates_now() -> None:
    assert not chart_reference.stale(REPO), "run: .venv/bin/python -m scripts.chart_reference --write"


def test_every_value_is_a_row(tmp_path: Path) -> None:
    """A value added to values.yaml (documented or not) makes the README stale until --write adds its row, with
    its default and the comment above it; a commented-out key shows as unset with its example."""
    chart = tmp_path / "helm" / "stock-ledger"
    shutil.copytree(REPO / "helm" / "stock-ledger", chart)
    values = chart / "values.yaml"
    values.write_text(values.read_text() + "\n# How many widgets.\nwidgets: 7\n  # spare: 3\n")
    assert chart_reference.stale(tmp_path)
    assert chart_reference.main(["--root", str(tmp_path), "--check"]) == 1
    assert chart_reference.main(["--root", str(tmp_path), "--write"]) == 0
    assert not chart_reference.stale(tmp_path)
    readme = (chart / "README.md").read_text()
    assert "| `widgets` | `7` | How many widgets. |" in readme
    assert "| `widgets.spare` | unset (e.g. `3`) |" in readme
