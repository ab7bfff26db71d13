"""The chart's database.pooling and database.roles, offline (`helm template`): a transaction pooler for the workers
only (the migration hook and `helm test` need a session of their own), and the ledger's role names passed to
every container that migrates or explains a missing grant. The defaults render no variable of either."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from .support import (
    CHART,
    KUBE_VERSION,
    MIGRATION_SECRET,
    NAMESPACE,
    RELEASE,
    REQUIRED,
    SECRET,
    HelmResult,
    Rendered,
    env_by_name,
    pod_spec,
)

if TYPE_CHECKING:
    from collections.abc import Callable

pytestmark = pytest.mark.deploy

VARIABLES = ("STOCK_LEDGER_DATABASE_POOLING", "STOCK_LEDGER_APP_ROLE", "STOCK_LEDGER_READER_ROLE")


def _env(rendered: Rendered, kind: str, suffix: str) -> dict[str, dict[str, Any]]:
    return env_by_name(pod_spec(rendered.one(kind, suffix))["containers"][0])


def _value(env: dict[str, dict[str, Any]], name: str) -> str | None:
    return env[name].get("value") if name in env else None


def test_the_defaults_render_none_of_the_variables(render: Callable[..., Rendered]) -> None:
    rendered = render(*REQUIRED)
    for kind, suffix in (("Deployment", RELEASE + "-stock-ledger"), ("Job", "-migrate"), ("Pod", "-test")):
        assert not set(VARIABLES) & set(_env(rendered, kind, suffix)), kind


def test_transaction_pooling_is_the_workers_and_helm_test_reads_the_migration_secret(
    render: Callable[..., Rendered],
) -> None:
    """database.pooling=transaction: the workers get STOCK_LEDGER_DATABASE_POOLING=transaction; the migration hook
    does not (it refuses the setting), and `helm test`'s verify reads the migration Secret's URL, not the pooler's."""
    rendered = render(*REQUIRED, "--set", "database.pooling=transaction")
    assert _value(_env(rendered, "Deployment", RELEASE + "-stock-ledger"), VARIABLES[0]) == "transaction"
    assert VARIABLES[0] not in _env(rendered, "Job", "-migrate")
    test = _env(rendered, "Pod", "-test")
    assert VARIABLES[0] not in test
    assert test["DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {"name": MIGRATION_SECRET, "key": "DATABASE_URL"}


def test_transaction_pooling_without_a_session_url_for_helm_test_fails_naming_it(
    run_helm: Callable[..., HelmResult],
) -> None:
    result = run_helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION,
                      "--set", f"database.existingSecret={SECRET}", "--set", "migrations.enabled=false",
                      "--set", "database.pooling=transaction")
    assert result.returncode != 0
    assert "database.pooling=transaction" in result.stderr
    assert "set database.migrationSecret" in result.stderr


def test_the_ledgers_roles_reach_the_hook_the_workers_and_helm_test(render: Callable[..., Rendered]) -> None:
    rendered = render(*REQUIRED, "--set", "database.roles.app=staging_app", "--set",
                      "database.roles.reader=staging_reader")
    for kind, suffix in (("Deployment", RELEASE + "-stock-ledger"), ("Job", "-migrate"), ("Pod", "-test")):
        env = _env(rendered, kind, suffix)
        assert (_value(env, VARIABLES[1]), _value(env, VARIABLES[2])) == ("staging_app", "staging_reader"), kind


@pytest.mark.parametrize("flags", [("database.roles.app=Staging-App",), ("database.pooling=statement",),
                                   ("database.roles.owner=x",)])
def test_bad_values_fail_the_install_naming_them(run_helm: Callable[..., HelmResult], flags: tuple[str]) -> None:
    result = run_helm("template", RELEASE, str(CHART), "--kube-version", KUBE_VERSION, *REQUIRED, "--set", *flags)
    assert result.returncode != 0
    assert "/database/" in result.stderr, result.stderr
