"""The configuration reference, generated from `config.VARIABLES` into the pages that show it.

`python -m stock_ledger.reference --write` rewrites the block between `<!-- config:<form>:start -->` and
`<!-- config:<form>:end -->` in README.md (form `brief`) and docs/configuration.md (form `full`); `--check` exits 1
naming each stale page. tests/unit/test_reference.py runs the check, so a variable cannot be added, renamed or
re-defaulted without its documentation following.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path
from typing import Literal

from stock_ledger.config import VARIABLES, Settings, Variable

Form = Literal["brief", "full"]
PAGES: dict[str, Form] = {"README.md": "brief", "docs/configuration.md": "full"}


def default_of(v: Variable) -> str:
    """The default as an operator would type it: `60`, not `60.0`; unset rather than None."""
    if v.shown_default is not None:
        return v.shown_default
    if v.attr is None:
        return "unset"
    value = {f.name: f.default for f in dataclasses.fields(Settings)}[v.attr]
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`"


def table(form: Form) -> str:
    """The markdown table of every variable, in declaration order."""
    if form == "brief":
        rows = ["| variable | default | meaning |", "|---|---|---|"]
        rows += [f"| `{v.name}` | {default_of(v)} | {v.meaning} |" for v in VARIABLES]
    else:
        rows = ["| variable | default | accepts | meaning |", "|---|---|---|---|"]
        rows += [f"| `{v.name}` | {default_of(v)} | {v.parse.accepts} | {v.meaning} |" for v in VARIABLES]
    return "\n".join(rows)


def _markers(form: Form) -> tuple[str, str]:
    return f"<!-- config:{form}:start -->", f"<!-- config:{form}:end -->"


def render(text: str, form: Form) -> str:
    """`text` with its generated block replaced by the current table; ValueError if the markers are missing."""
    start, end = _markers(form)
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if not pattern.search(text):
        raise ValueError(f"the markers {start} ... {end} are missing")
    return pattern.sub(lambda _: f"{start}\n{table(form)}\n{end}", text, count=1)


def stale(root: Path) -> list[str]:
    """The pages whose generated block differs from what the settings object says now."""
    return [page for page, form in PAGES.items()
            if render((root / page).read_text(encoding="utf-8"), form) != (root / page).read_text(encoding="utf-8")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stock_ledger.reference", description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the repository (default: .)")
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true", help="rewrite the generated blocks")
    action.add_argument("--check", action="store_true", help="exit 1 if a page is stale")
    args = parser.parse_args(argv)
    if args.check:
        pages = stale(args.root)
        for page in pages:
            print(f"{page}: the configuration reference is stale: run python -m stock_ledger.reference --write",
                  file=sys.stderr)
        return 1 if pages else 0
    for page, form in PAGES.items():
        path = args.root / page
        path.write_text(render(path.read_text(encoding="utf-8"), form), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
