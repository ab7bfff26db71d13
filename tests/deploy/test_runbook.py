"""docs/runbook.md has a section for every alert, and every alert's runbook_url points at its section."""

from __future__ import annotations

import re

import pytest
import yaml

from .support import CHART, REPO

pytestmark = pytest.mark.deploy

RUNBOOK = REPO / "docs" / "runbook.md"
PARTS = ("**Meaning.**", "**Confirm.**", "**Act.**", "**Verify the fix.**")


def sections() -> dict[str, str]:
    """Level-2 headings (alert names) to their text."""
    text = RUNBOOK.read_text()
    found = re.split(r"^## ", text, flags=re.MULTILINE)[1:]
    return {chunk.split("\n", 1)[0].strip(): chunk for chunk in found}


def alerts() -> list[dict[str, object]]:
    doc = yaml.safe_load((CHART / "files" / "prometheus-rules.yaml").read_text())
    return [r for group in doc["groups"] for r in group["rules"] if "alert" in r]


def test_every_alert_has_a_section_with_the_four_parts() -> None:
    found = sections()
    for rule in alerts():
        name = str(rule["alert"])
        assert name in found, f"docs/runbook.md has no '## {name}' section"
        body = found[name]
        assert f'<a id="{name.lower()}"></a>' in body, f"{name}: no explicit anchor {name.lower()}"
        for part in PARTS:
            assert part in body, f"{name}: section lacks {part}"


def test_runbook_urls_point_at_their_sections() -> None:
    for rule in alerts():
        annotations = rule["annotations"]
        assert isinstance(annotations, dict)
        assert annotations["runbook_url"] == f"docs/runbook.md#{str(rule['alert']).lower()}"


def test_no_section_for_an_alert_that_does_not_exist() -> None:
    names = {str(r["alert"]) for r in alerts()}
    assert set(sections()) <= names, sorted(set(sections()) - names)
