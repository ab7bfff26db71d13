"""Argo CD renders the chart with `helm template` on every sync and diffs the result with the cluster: nothing the
chart names or writes may change between renders unless a value changed; migrations run as a Helm hook (Argo CD's
PreSync) or as a Job in an earlier sync wave (migrations.mode); the read-only verify runs as a PostSync Job
(test.postSync: Argo CD ignores `helm test`), the chaos drill as PostSync hooks in its order."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import pytest

from .support import CHART, REQUIRED, VALUES_ALL, Rendered, kn, pod_labels, pod_spec
from .test_chart_properties import WORKERS

if TYPE_CHECKING:
    from collections.abc import Callable

    from .support import HelmResult

pytestmark = pytest.mark.deploy

# Template functions whose result differs between two renders of the same values (or, for .Release.Revision,
# between two syncs: `helm template` always says 1) and `lookup` (empty under `helm template`).
UNSTABLE = re.compile(r"\.Release\.Revision|\brand(AlphaNum|Alpha|Numeric|Ascii|Int|Bytes)\b|\buuidv4\b|\bnow\b|"
                      r"\bgen(CA|PrivateKey|SelfSignedCert|SignedCert)\b|\blookup\b|\bshuffle\b|\bdateInZone\b")


def test_two_renders_are_identical(run_helm: Callable[..., HelmResult]) -> None:
    """Everything on (values-all: the drill, monitors, rules, dashboard, the PostSync verify, the sync-wave Job):
    two renders are byte for byte the same."""
    args = ("template", "ledger", str(CHART), "--namespace", "inventory", "--values", str(VALUES_ALL))
    first, second = run_helm(*args), run_helm(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout


def test_no_template_uses_what_changes_between_syncs() -> None:
    """What a render-twice test cannot see: the revision (always 1 under `helm template`), random and time
    functions, cluster lookups. The drill's topic is the same at every sync (the drill re-creates it)."""
    actions = {path: re.findall(r"\{\{.*?\}\}", path.read_text(), flags=re.DOTALL)
               for path in sorted((CHART / "templates").rglob("*")) if path.is_file()}
    found = [f"{path.relative_to(CHART)}: {match.group(0)}" for path, found in actions.items() for action in found
             for match in UNSTABLE.finditer(action)]
    assert not found, found
    assert UNSTABLE.search('{{ printf "%s-r%d" .Values.chaos.topicPrefix (int .Release.Revision) }}')


class TestMigrations:
    def test_hook_mode_is_a_presync_hook(self, default_render: Rendered) -> None:
        annotations = default_render.one("Job", "-migrate")["metadata"]["annotations"]
        assert annotations["helm.sh/hook"] == "pre-install,pre-upgrade"
        assert annotations["argocd.argoproj.io/hook"] == "PreSync"

    def test_job_mode_is_an_earlier_sync_wave_than_the_workers(self, all_render: Rendered) -> None:
        """migrations.mode job: no Helm hook; sync wave -2 (values-all) before the workers' 0; Replace=true, since a
        Job's pod template cannot change in place."""
        annotations = all_render.one("Job", "-migrate")["metadata"]["annotations"]
        assert not [key for key in annotations if key.startswith(("helm.sh/", "argocd.argoproj.io/hook"))]
        assert annotations["argocd.argoproj.io/sync-wave"] == "-2"
        assert annotations["argocd.argoproj.io/sync-options"] == "Replace=true"
        workers = all_render.one("Deployment", WORKERS)["metadata"].get("annotations", {})
        assert int(workers.get("argocd.argoproj.io/sync-wave", "0")) > -2

    def test_a_wave_at_or_after_the_workers_is_refused(self, run_helm: Callable[..., HelmResult]) -> None:
        result = run_helm("template", "ledger", str(CHART), *REQUIRED, "--set", "migrations.mode=job",
                          "--set", "migrations.syncWave=0")
        assert result.returncode != 0
        assert "/migrations/syncWave" in result.stderr, result.stderr


class TestVerifyAfterSync:
    def test_the_postsync_job_runs_the_helm_test_check(self, render: Callable[..., Rendered]) -> None:
        """The same pod spec as `helm test`'s; a PostSync hook (Argo CD) and a post-upgrade hook (Helm), after the
        drill; its pods carry the test component, which the NetworkPolicy admits to the workers' metrics port."""
        all_render = render("--values", str(VALUES_ALL), "--set", "networkPolicy.enabled=true")
        job = all_render.one("Job", "-verify")
        test_pod = all_render.one("Pod", "-test")
        assert pod_spec(job) == pod_spec(test_pod)
        assert pod_spec(job)["containers"][0]["args"][0] == "verify"
        annotations = job["metadata"]["annotations"]
        assert annotations["argocd.argoproj.io/hook"] == "PostSync"
        assert annotations["helm.sh/hook"] == "post-install,post-upgrade"
        drill = all_render.one("Job", f"{WORKERS}-chaos")["metadata"]["annotations"]
        assert int(annotations["argocd.argoproj.io/sync-wave"]) > int(drill["argocd.argoproj.io/sync-wave"])
        [rule] = [r for r in all_render.one("NetworkPolicy", WORKERS)["spec"]["ingress"]
                  if "podSelector" in r["from"][0] and "namespaceSelector" not in r["from"][0]]
        assert rule["from"][0]["podSelector"]["matchLabels"].items() <= pod_labels(job).items()

    def test_off_by_default(self, default_render: Rendered) -> None:
        assert not [m for m in default_render.of_kind("Job") if m["metadata"]["name"].endswith("-verify")]


def test_the_drill_is_postsync_in_helms_order(all_render: Rendered) -> None:
    """Argo CD's hook and wave on every drill object: PostSync, wave = Helm's hook weight, deleted when it ends."""
    drill = [m for m in all_render.manifests if "chaos" in m["metadata"]["name"]]
    assert len(drill) == 6
    for manifest in drill:
        annotations = manifest["metadata"]["annotations"]
        assert annotations["argocd.argoproj.io/hook"] == "PostSync", kn(manifest)
        assert annotations["argocd.argoproj.io/sync-wave"] == annotations["helm.sh/hook-weight"], kn(manifest)
        assert annotations["argocd.argoproj.io/hook-delete-policy"] == "BeforeHookCreation,HookSucceeded"
