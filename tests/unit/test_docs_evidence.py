"""The evidence under docs/bench/ and the pages that cite it stay in step.

- every `docs/bench/...` path a docs/*.md page cites exists (a glob matches at least one file, a directory exists);
- every file under docs/bench/ (but its README.md, the index) is cited by a docs/*.md page or by the index;
- the index lists every file, each once, and nothing that is not there, one line each (- `path`: what it shows,
  then links to the pages that cite it); a page an index line links to does cite that file.

A page cites a file by its path (`docs/bench/a/b.json`), by a glob (`docs/bench/a/b-*.json`), by its directory
(`docs/bench/a/`), or by a bare name in backticks (`b.json`) after a path in the same paragraph: the bare name is
then read in the directory of the path cited last.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
BENCH = DOCS / "bench"
INDEX = BENCH / "README.md"

_PATH = re.compile(r"docs/bench/[\w.*/-]*")
_BARE = re.compile(r"`([\w*-][\w.*-]*\.(?:json|txt|py|sh|svg|log|diff))`")
_TOKEN = re.compile(rf"{_PATH.pattern}|{_BARE.pattern}")
_LISTED = re.compile(r"^- `([^`]+)`(.*)$", re.MULTILINE)
_LINK = re.compile(r"\]\(\.\./([\w-]+\.md)(?:#[\w-]*)?\)")


def evidence() -> set[str]:
    """Every file under docs/bench/ but the index, relative to docs/bench/."""
    return {p.relative_to(BENCH).as_posix() for p in BENCH.rglob("*") if p.is_file() and p != INDEX}


def citations(text: str) -> list[str]:
    """The docs/bench/-relative paths, globs and directories (ending in /) that a page's text cites."""
    cited: list[str] = []
    for paragraph in re.split(r"\n\s*\n", text):
        folder = ""
        for match in _TOKEN.finditer(paragraph):
            if match.group(1) is None:
                path = match.group(0).rstrip(".").removeprefix("docs/bench").lstrip("/")
                if path:
                    cited.append(path)
                    folder = path if path.endswith("/") else str(PurePosixPath(path).parent).removeprefix(".")
            elif folder:
                cited.append(f"{folder.rstrip('/')}/{match.group(1)}")
    return cited


def matches(citation: str, files: set[str]) -> set[str]:
    if citation.endswith("/"):
        return {f for f in files if f.startswith(citation)}
    return {f for f in files if PurePosixPath(f).match(citation) and f.count("/") == citation.count("/")}


def pages() -> dict[str, str]:
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(DOCS.glob("*.md"))}


def listed() -> list[tuple[str, list[str]]]:
    """The index's lines: (a file relative to docs/bench/, the docs/*.md pages the line says cite it)."""
    return [(path, _LINK.findall(rest)) for path, rest in _LISTED.findall(INDEX.read_text(encoding="utf-8"))]


def cited_by(text: str, files: set[str]) -> set[str]:
    found: set[str] = set()
    for citation in citations(text):
        found |= matches(citation, files)
    return found


def test_citations_resolve_on_their_own() -> None:
    text = "See `docs/bench/a/x.json`, `y.txt` and `docs/bench/b/`.\n\n`z.json` alone cites nothing."
    assert citations(text) == ["a/x.json", "a/y.txt", "b/"]
    assert matches("a/x-*.json", {"a/x-1.json", "a/x-2.json", "a/y.json", "a/c/x-3.json"}) == {"a/x-1.json",
                                                                                                  "a/x-2.json"}
    assert matches("b/", {"b/1.json", "b/c/2.json", "bb/3.json"}) == {"b/1.json", "b/c/2.json"}


@pytest.mark.parametrize("page", sorted(pages()))
def test_every_cited_path_exists(page: str) -> None:
    files = evidence() | {INDEX.relative_to(BENCH).as_posix()}
    missing = [c for c in citations(pages()[page]) if not matches(c, files)]
    assert not missing, f"docs/{page} cites docs/bench/ paths that do not exist: {missing}"


def test_every_evidence_file_is_cited() -> None:
    files = evidence()
    cited = {path for path, _ in listed()}
    for text in pages().values():
        cited |= cited_by(text, files)
    uncited = sorted(files - cited)
    assert not uncited, f"files under docs/bench/ that no docs/*.md page cites and the index does not list: {uncited}"


def test_the_index_lists_every_file_once() -> None:
    paths = [path for path, _ in listed()]
    assert len(paths) == len(set(paths)), "docs/bench/README.md lists a file twice"
    files = evidence()
    assert not files - set(paths), f"files docs/bench/README.md does not list: {sorted(files - set(paths))}"
    assert not set(paths) - files, f"docs/bench/README.md lists files that are not there: {sorted(set(paths) - files)}"


def test_the_pages_the_index_names_cite_the_file() -> None:
    files, texts = evidence(), pages()
    wrong = [(path, page) for path, named in listed() for page in named
             if page not in texts or path not in cited_by(texts[page], files)]
    assert not wrong, f"docs/bench/README.md says these pages cite these files, and they do not: {wrong}"
