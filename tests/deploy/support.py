"""Shared helpers for the deployment checks: where things are, how to find the tools, rendered manifests."""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "stock-ledger"
VALUES_ALL = Path(__file__).resolve().parent / "values-all.yaml"
KUBE_VERSION = "1.30.0"
RELEASE = "ledger"
NAMESPACE = "inventory"
SECRET = "stock-ledger-db"  # noqa: S105 - the name of a Secret, not a secret
MIGRATION_SECRET = "stock-ledger-db-owner"  # noqa: S105 - the owner role's Secret, by name
# The values an install cannot do without: the worker's Secret and the migration hook's (owner) Secret.
REQUIRED = ("--set", f"database.existingSecret={SECRET}", "--set", f"database.migrationSecret={MIGRATION_SECRET}")

Manifest = dict[str, Any]
# The chart's appVersion (the release's version): the default image tag.
APP_VERSION = re.search(r'^appVersion: "(.+)"$', (CHART / "Chart.yaml").read_text(), re.MULTILINE).group(1)  # type: ignore[union-attr]


def tool_dirs() -> list[str]:
    """PATH, then the cache scripts/tools.sh installs into."""
    cache = Path(os.environ.get("STOCK_LEDGER_CACHE", Path.home() / ".cache" / "stock-ledger"))
    return [*os.environ.get("PATH", "").split(os.pathsep), str(cache / "bin")]


def require_tool(name: str) -> str:
    """The tool's path, or a failed test saying how to install it (never a skip: CI must not pass without)."""
    found = shutil.which(name, path=os.pathsep.join(tool_dirs()))
    if found is None:
        pytest.fail(f"{name} not found on PATH or in {tool_dirs()[-1]}: run scripts/tools.sh", pytrace=False)
    return found


def kn(manifest: Manifest) -> str:
    return f"{manifest['kind']}/{manifest['metadata']['name']}"


@dataclass(frozen=True)
class HelmResult:
    returncode: int
    stdout: str
    stderr: str


@dataclass(frozen=True)
class Rendered:
    """The documents of one `helm template` run, with lookups by kind."""

    manifests: list[Manifest]

    def of_kind(self, kind: str) -> list[Manifest]:
        return [m for m in self.manifests if m["kind"] == kind]

    def one(self, kind: str, name_suffix: str = "") -> Manifest:
        found = [m for m in self.of_kind(kind) if m["metadata"]["name"].endswith(name_suffix)]
        assert len(found) == 1, f"expected one {kind} named *{name_suffix}, found {[kn(m) for m in found]}"
        return found[0]

    def kinds(self) -> set[str]:
        return {m["kind"] for m in self.manifests}


def _pod_template(manifest: Manifest) -> dict[str, Any]:
    """The pod template of a workload; a CronJob's is in its jobTemplate."""
    spec = manifest["spec"]["jobTemplate"]["spec"] if manifest["kind"] == "CronJob" else manifest["spec"]
    template: dict[str, Any] = spec["template"]
    return template


def pod_spec(manifest: Manifest) -> dict[str, Any]:
    """The pod spec of a Pod, or of the pod template of a workload (a CronJob's too)."""
    if manifest["kind"] == "Pod":
        spec: dict[str, Any] = manifest["spec"]
        return spec
    template: dict[str, Any] = _pod_template(manifest)["spec"]
    return template


def pod_labels(manifest: Manifest) -> dict[str, str]:
    if manifest["kind"] == "Pod":
        labels: dict[str, str] = manifest["metadata"].get("labels", {})
        return labels
    template_labels: dict[str, str] = _pod_template(manifest)["metadata"].get("labels", {})
    return template_labels


def env_by_name(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


# What OpenShift's restricted-v2 SCC (and the Pod Security Standards' "restricted" profile) admit, as far as the
# pod spec decides it: the uid, gid and fsGroup come from the namespace's ranges, so the spec must not fix them.
RESTRICTED_VOLUME_SOURCES = {"configMap", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                             "projected", "secret"}


def restricted_v2_violations(manifest: Manifest) -> list[str]:
    """What in the pod spec of `manifest` OpenShift's restricted-v2 SCC would refuse or override, one line each."""
    spec = pod_spec(manifest)
    where = kn(manifest)
    found = [f"{where}: pod sets {key}" for key in ("runAsUser", "runAsGroup", "fsGroup", "supplementalGroups")
             if key in spec["securityContext"]]
    found += [f"{where}: {key}" for key in ("hostNetwork", "hostPID", "hostIPC") if spec.get(key)]
    for volume in spec.get("volumes", []):
        sources = set(volume) - {"name"}
        if not sources <= RESTRICTED_VOLUME_SOURCES:
            found.append(f"{where}: volume {volume['name']} is {sources}")
    for container in spec["containers"] + spec.get("initContainers", []):
        context = container["securityContext"]
        name = f"{where} container {container['name']}"
        found += [f"{name} sets {key}" for key in ("runAsUser", "runAsGroup") if key in context]
        if context.get("runAsNonRoot") is not True:
            found.append(f"{name}: runAsNonRoot is not true")
        if context.get("allowPrivilegeEscalation") is not False or context.get("privileged"):
            found.append(f"{name}: may escalate privileges")
        if context.get("capabilities") != {"drop": ["ALL"]}:
            found.append(f"{name}: capabilities {context.get('capabilities')}")
        if context.get("seccompProfile") != {"type": "RuntimeDefault"}:
            found.append(f"{name}: seccomp {context.get('seccompProfile')}")
        found += [f"{name}: hostPort" for port in container.get("ports", []) if "hostPort" in port]
    return found


def shipped_groups(namespace: str = NAMESPACE, release: str = RELEASE, runbook: str | None = None) -> list[Any]:
    """files/prometheus-rules.yaml as the chart embeds it without overrides: {SCOPE} made this release's target
    labels, every runbook_url absolute (`runbook`, else the chart's home at its version)."""
    import yaml  # noqa: PLC0415 - the tests that need it fail clearly without it (conftest's yaml_module)

    scope = (f'{{namespace="{namespace}",app_kubernetes_io_instance="{release}",'
             f'app_kubernetes_io_name="stock-ledger"}}')
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    base = runbook or f"{chart['home']}/blob/v{chart['appVersion']}/docs/runbook.md"
    text = (CHART / "files" / "prometheus-rules.yaml").read_text().replace("{SCOPE}", scope)
    groups: list[Any] = yaml.safe_load(text)["groups"]
    for group in groups:
        for rule in group["rules"]:
            rule["annotations"]["runbook_url"] = f"{base}#{rule['alert'].lower()}"
    return groups
