"""The configuration reference is generated from the one settings object and cannot fall behind it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from stock_ledger import reference
from stock_ledger.config import VARIABLES, Settings, Variable, load_settings
from stock_ledger.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "stock_ledger"
# Names of that shape in src/ that are not environment variables of ours.
NOT_VARIABLES = {"DATABASE_REJECTED"}


def test_every_page_shows_the_reference_the_settings_object_generates_now() -> None:
    """README.md and docs/configuration.md hold exactly `python -m stock_ledger.reference --write`'s output."""
    assert reference.stale(ROOT) == [], "run: .venv/bin/python -m stock_ledger.reference --write"


def test_the_check_fails_on_a_stale_page(tmp_path: Path) -> None:
    """A page whose table lost a row is reported, so the check above can fail."""
    for page in reference.PAGES:
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / page).write_text((ROOT / page).read_text(encoding="utf-8"), encoding="utf-8")
    readme = tmp_path / "README.md"
    readme.write_text(readme.read_text(encoding="utf-8").replace("| `STOCK_LEDGER_TOPIC` |", "| `TOPIC` |"))
    assert reference.stale(tmp_path) == ["README.md"]
    assert reference.main(["--root", str(tmp_path), "--check"]) == 1
    assert reference.main(["--root", str(tmp_path), "--write"]) == 0
    assert reference.stale(tmp_path) == []


def test_every_variable_named_in_the_source_is_in_the_reference() -> None:
    """A variable read anywhere in src/ (not only in config.py) must be declared, hence documented."""
    named = set()
    for path in SRC.rglob("*.py"):
        named |= set(re.findall(r"\b(?:STOCK_LEDGER|KAFKA|DATABASE)_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    declared = {v.name for v in VARIABLES}
    assert named - declared - NOT_VARIABLES == set()


def test_every_settings_field_is_set_by_exactly_one_variable() -> None:
    fields = [f.name for f in dataclasses.fields(Settings)]
    # Set by the variables config reads itself: the verbatim secrets, and the mapping (STOCK_LEDGER_MAPPING / _FILE).
    attrs = [v.attr for v in VARIABLES if v.attr is not None] + ["kafka_sasl_password", "schema_registry_password",
                                                                  "mapping"]
    assert sorted(attrs) == sorted(fields)


@pytest.mark.parametrize("v", [v for v in VARIABLES if v.attr is not None], ids=lambda v: v.name)
def test_each_variable_sets_its_field_and_refuses_nonsense(v: Variable) -> None:
    """The documented name is the one read: a bad value fails naming it (every variable that parses)."""
    if v.parse.accepts.startswith("text") or v.parse.accepts == "a file path":
        return  # free text: nothing to refuse but length
    with pytest.raises(ConfigError, match=re.escape(v.name)):
        load_settings({v.name: "not-a-valid-value-\u00e9"})


def test_defaults_shown_are_the_defaults_used() -> None:
    """The brief table's default column is the Settings default wherever no wording replaces it."""
    defaults = {f.name: f.default for f in dataclasses.fields(Settings)}
    for v in VARIABLES:
        if v.attr is None or v.shown_default is not None or defaults[v.attr] is None:
            continue
        shown = reference.default_of(v).strip("`")
        assert load_settings({v.name: shown}) == load_settings({}), v.name
