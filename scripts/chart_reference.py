"""The chart's values reference, generated from helm/stock-ledger/values.yaml into its README.

Every value, its default and what it means: the comment above the key in values.yaml (the one place values are
explained), else the description values.schema.json gives it. `python -m scripts.chart_reference --write` rewrites
the block between `<!-- values:start -->` and `<!-- values:end -->` of helm/stock-ledger/README.md; `--check` exits 1
when it is stale. tests/deploy/test_chart_reference.py runs the check: a value cannot be added, renamed or
re-defaulted without the README following.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = Path("helm") / "stock-ledger"
START, END = "<!-- values:start -->", "<!-- values:end -->"
KEY = re.compile(r"^(\s*)([A-Za-z][\w.-]*):(\s|$)")


COMMENTED = re.compile(r"^(\s*)# ([A-Za-z][\w.-]*): (\S.*)$")


def keys(values_text: str) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """Every key path in the order of values.yaml, the comment lines right above each (joined), and the keys that
    are commented out (`# fsGroup: 10001`: no default, the value shown is an example)."""
    order: list[str] = []
    explained: dict[str, str] = {}
    examples: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    pending: list[str] = []

    def enter(indent: int, key: str) -> str:
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([*(k for _, k in stack), key])
        order.append(path)
        if pending:
            explained[path] = " ".join(pending)
        pending.clear()
        return path

    for line in values_text.splitlines():
        stripped = line.strip()
        if commented := COMMENTED.match(line):
            examples[enter(len(commented.group(1)), commented.group(2))] = commented.group(3)
            continue
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip())
            continue
        match = KEY.match(line)
        if match:
            stack_path = enter(len(match.group(1)), match.group(2))
            stack.append((len(match.group(1)), stack_path.rsplit(".", 1)[-1]))
        elif not stripped:
            pending.clear()
    return order, explained, examples


def schema_descriptions(schema: dict[str, Any], prefix: str = "") -> dict[str, str]:
    found: dict[str, str] = {}
    for key, sub in (schema.get("properties") or {}).items():
        path = f"{prefix}{key}"
        if isinstance(sub, dict):
            if sub.get("description"):
                found[path] = sub["description"]
            found |= schema_descriptions(sub, f"{path}.")
    return found


def leaves(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Every value down to its leaves; a list, an empty map or a scalar is a leaf."""
    found: dict[str, Any] = {}
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            found |= leaves(value, f"{path}.")
        else:
            found[path] = value
    return found


def table(root: Path) -> str:
    values_text = (root / CHART / "values.yaml").read_text(encoding="utf-8")
    order, comments, examples = keys(values_text)
    explained = schema_descriptions(json.loads((root / CHART / "values.schema.json").read_text(encoding="utf-8")))
    explained |= comments
    values = leaves(yaml.safe_load(values_text))

    def meaning(path: str) -> str:
        parts = path.split(".")
        # The nearest explanation: the key's own, else its parent's (a group described once above it).
        for depth in range(len(parts), 0, -1):
            text = explained.get(".".join(parts[:depth]))
            if text:
                return text if depth == len(parts) else f"(see `{'.'.join(parts[:depth])}`)"
        return ""

    rows = ["| value | default | meaning |", "|---|---|---|"]
    for path in dict.fromkeys(order):
        if path in values:
            default = f"`{json.dumps(values[path], separators=(', ', ': '))}`"
        elif path in examples:
            default = f"unset (e.g. `{examples[path]}`)"
        else:
            continue  # a map with values below it, or a key inside a list item
        cell = meaning(path).replace("|", "\\|")
        rows.append(f"| `{path}` | {default} | {cell} |")
    missing = set(values) - set(order)
    if missing:
        raise ValueError(f"values.yaml keys the reader missed: {sorted(missing)}")
    return "\n".join(rows)


def render(readme: str, root: Path) -> str:
    pattern = re.compile(re.escape(START) + r".*?" + re.escape(END), re.DOTALL)
    if not pattern.search(readme):
        raise ValueError(f"the markers {START} ... {END} are missing")
    return pattern.sub(lambda _: f"{START}\n{table(root)}\n{END}", readme, count=1)


def stale(root: Path) -> bool:
    readme = (root / CHART / "README.md").read_text(encoding="utf-8")
    return render(readme, root) != readme


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.chart_reference", description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this one)")
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true", help="rewrite the generated block")
    action.add_argument("--check", action="store_true", help="exit 1 if the README is stale")
    args = parser.parse_args(argv)
    readme = args.root / CHART / "README.md"
    if args.check:
        if stale(args.root):
            print(f"{readme}: the values reference is stale: run python -m scripts.chart_reference --write",
                  file=sys.stderr)
            return 1
        return 0
    readme.write_text(render(readme.read_text(encoding="utf-8"), args.root), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
