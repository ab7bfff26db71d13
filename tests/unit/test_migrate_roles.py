"""The role names of the migrations are settings (STOCK_LEDGER_APP_ROLE, STOCK_LEDGER_READER_ROLE): the migrations
are written with the default names and `migrate` writes the configured ones in their place (migrate.Roles), so a
migration's text, and its checksum, never change. On the real server: tests/integration/test_ledger_roles.py."""

from __future__ import annotations

import hashlib
import re

import asyncpg
import pytest

from stock_ledger.clients.dberrors import explain
from stock_ledger.config import load_settings
from stock_ledger.errors import ConfigError
from stock_ledger.migrate import Roles, find_migrations_dir, load_migrations

MIGRATIONS = load_migrations(find_migrations_dir(None))
OURS = Roles("ledger_b_app", "ledger_b_reader")


def test_the_default_names_leave_every_migration_as_written() -> None:
    """A database migrated before the names were settings gets byte for byte the statements it always got."""
    for m in MIGRATIONS:
        assert Roles().apply(m.sql) == m.sql, m.name


def test_other_names_replace_every_default_name_and_nothing_else() -> None:
    """Each default name, as an identifier (quoted) or inside a literal (bare), becomes the configured one; the text
    between them is untouched, and the checksum is still the file's."""
    changed = 0
    for m in MIGRATIONS:
        sql = OURS.apply(m.sql)
        assert not re.search(r"stock_ledger_(app|reader)", sql), m.name
        back = sql
        for ours, default in (("ledger_b_app", "stock_ledger_app"), ("ledger_b_reader", "stock_ledger_reader")):
            back = back.replace(f'"{ours}"', default).replace(f"'{ours}'", f"'{default}'")
        assert back == m.sql, m.name
        assert m.checksum == hashlib.sha256(m.sql.encode()).hexdigest()
        changed += sql != m.sql
    assert changed >= 5  # 0002, 0003, 0004, 0008, 0009 and 0012 grant to the roles


def test_literals_and_identifiers_are_spelled_for_where_they_stand() -> None:
    app = next(m for m in MIGRATIONS if m.name.startswith("0002_"))
    sql = OURS.apply(app.sql)
    assert "rolname = 'ledger_b_app'" in sql
    assert 'CREATE ROLE "ledger_b_app" NOLOGIN' in sql
    assert 'GRANT SELECT, INSERT, UPDATE ON consumer_offsets, stock_levels TO "ledger_b_app";' in sql


def test_a_longer_name_that_contains_a_default_one_is_left_alone() -> None:
    text = "GRANT x TO stock_ledger_app_old, my_stock_ledger_app, stock_ledger_reader2, $stock_ledger_app;"
    assert OURS.apply(text) == text


class TestSettings:
    def test_the_defaults_are_todays_names(self) -> None:
        s = load_settings({})
        assert (s.app_role, s.reader_role) == ("stock_ledger_app", "stock_ledger_reader")

    def test_names_are_read(self) -> None:
        s = load_settings({"STOCK_LEDGER_APP_ROLE": "staging_app", "STOCK_LEDGER_READER_ROLE": "staging_reader"})
        assert (s.app_role, s.reader_role) == ("staging_app", "staging_reader")

    @pytest.mark.parametrize("name", ["Staging_App", "staging-app", "1app", "app;drop", 'a"b', "a'b", "a$b",
                                      "a" * 64])
    def test_a_name_that_could_change_the_sql_is_refused_naming_the_variable(self, name: str) -> None:
        with pytest.raises(ConfigError, match="STOCK_LEDGER_APP_ROLE"):
            load_settings({"STOCK_LEDGER_APP_ROLE": name})

    def test_the_two_roles_must_differ(self) -> None:
        with pytest.raises(ConfigError, match="must differ"):
            load_settings({"STOCK_LEDGER_APP_ROLE": "ledger_x", "STOCK_LEDGER_READER_ROLE": "ledger_x"})


def test_a_missing_grant_names_the_ledgers_own_roles() -> None:
    """A worker or reader without the grant is told the GRANT of its own ledger's role, not the default one."""
    url = "postgresql://staging_worker:pw@db:5432/staging"
    denied = asyncpg.InsufficientPrivilegeError("permission denied for table consumer_offsets")
    line = explain(denied, url, "run", app_role="staging_app", reader_role="staging_reader")
    assert line is not None
    assert "GRANT staging_app TO staging_worker;" in line
    line = explain(denied, url, "stock show", "reader", app_role="staging_app", reader_role="staging_reader")
    assert line is not None
    assert "GRANT staging_reader TO staging_worker;" in line
    assert "stock_ledger_" not in line
