"""Every relative link of the README and docs/ leads somewhere: the file exists, and so does the heading it names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "helm" / "stock-ledger" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.MULTILINE)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def test_the_slug_is_githubs() -> None:
    assert slug("Invariant checks and the monitor lease") == "invariant-checks-and-the-monitor-lease"
    assert slug("Fencing: a zombie cannot commit") == "fencing-a-zombie-cannot-commit"
    assert slug("`StockLedgerLag`") == "stockledgerlag"


def test_the_readme_headline_is_the_performance_pages() -> None:
    """The headline table the README shows is the one docs/performance.md explains, word for word."""
    def headline(page: Path) -> str:
        found = re.search(r"<!-- headline:start -->.*?<!-- headline:end -->", page.read_text(encoding="utf-8"),
                          flags=re.DOTALL)
        assert found, f"{page.relative_to(ROOT)} has no headline block"
        return found.group(0)

    assert headline(ROOT / "README.md") == headline(ROOT / "docs" / "performance.md")
