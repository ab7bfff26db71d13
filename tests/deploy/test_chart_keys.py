"""The chart keys platform teams reach for: sidecars, initContainers, commonLabels, commonAnnotations,
podSecurityContext / containerSecurityContext (the old securityContext still honoured, with a deprecation note),
global.imageRegistry; the schema stays strict (a key it does not know, or one that would weaken the pods' security,
fails the install by name). tests/deploy/values-all.yaml sets them all: test_chart_validation validates that render
against the Kubernetes schemas."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from .support import APP_VERSION, CHART, REQUIRED, Rendered, kn, pod_labels, pod_spec
from .test_chart_properties import WORKERS, containers, render_notes, workloads

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from .support import HelmResult

pytestmark = pytest.mark.deploy

DRILL = ("--set", "chaos.enabled=true", "--set", "chaos.database.existingSecret=drill-db")
EVERYTHING = (*REQUIRED, *DRILL, "--set", "metrics.podMonitor.enabled=true", "--set",
              "metrics.prometheusRule.enabled=true", "--set", "grafana.dashboard.enabled=true", "--set",
              "networkPolicy.enabled=true", "--set", "serviceAccount.create=true", "--set", "test.postSync=true",
              "--set", "archive.enabled=true")


def by_name(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in containers(manifest)}


class TestSidecarsAndInitContainers:
    def test_they_join_the_worker_pod_with_the_charts_security_as_default(self, all_render: Rendered) -> None:
        """values-all: an init container and a sidecar in the worker pod (only there), each with the chart's
        container securityContext under its own fields (the sidecar's runAsUser wins)."""
        spec = pod_spec(all_render.one("Deployment", WORKERS))
        assert [c["name"] for c in spec["initContainers"]] == ["wait-for-proxy"]
        assert [c["name"] for c in spec["containers"]] == ["worker", "proxy"]
        worker, proxy = spec["containers"]
        assert proxy["args"] == ["--port", "5432"]
        assert proxy["securityContext"] == {**worker["securityContext"], "runAsUser": 20002}
        assert spec["initContainers"][0]["securityContext"] == worker["securityContext"]
        for manifest in workloads(all_render):
            if manifest is not all_render.one("Deployment", WORKERS):
                assert not {"proxy", "wait-for-proxy"} & set(by_name(manifest)), kn(manifest)

    @pytest.mark.parametrize(("flags", "where"), [
        (("--set", "sidecars[0].name=worker", "--set", "sidecars[0].image=x:1"), "/sidecars/0/name"),
        (("--set", "initContainers[0].name=init"), "/initContainers/0"),
        (("--set", "sidecar[0].name=x"), "sidecar"),
    ], ids=["name-clash", "no-image", "typo"])
    def test_the_schema_refuses_what_cannot_run(self, run_helm: Callable[..., HelmResult], flags: tuple[str, ...],
                                                where: str) -> None:


        result = run_helm("template", "ledger", str(CHART), *REQUIRED, *flags)
        assert result.returncode != 0
        assert where in result.stderr, result.stderr


class TestCommonLabelsAndAnnotations:
    def test_every_object_and_pod_carries_them(self, render: Callable[..., Rendered]) -> None:
        """commonLabels on every object and every pod template, commonAnnotations on every object; the objects' own
        annotations (Helm and Argo CD hooks) are kept; selectors do not change."""
        rendered = render(*EVERYTHING, "--set", "commonLabels.cost-center=inv-42",
                          "--set", "commonAnnotations.example\\.com/contact=oncall")
        assert len(rendered.manifests) >= 15
        for manifest in rendered.manifests:
            assert manifest["metadata"]["labels"]["cost-center"] == "inv-42", kn(manifest)
            assert manifest["metadata"]["annotations"]["example.com/contact"] == "oncall", kn(manifest)
        for manifest in workloads(rendered):
            assert pod_labels(manifest)["cost-center"] == "inv-42", kn(manifest)
        assert rendered.one("Job", "-migrate")["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
        assert rendered.one("Deployment", WORKERS)["spec"]["selector"]["matchLabels"] == {
            "app.kubernetes.io/name": "stock-ledger", "app.kubernetes.io/instance": "ledger"}

    def test_pod_labels_win_over_common_labels_on_the_pods(self, render: Callable[..., Rendered]) -> None:
        rendered = render(*REQUIRED, "--set", "commonLabels.team=platform", "--set", "podLabels.team=inventory")
        deployment = rendered.one("Deployment", WORKERS)
        assert pod_labels(deployment)["team"] == "inventory"
        assert deployment["metadata"]["labels"]["team"] == "platform"

    @pytest.mark.parametrize("key", ["app\\.kubernetes\\.io/instance", "helm\\.sh/chart"])
    def test_the_charts_own_labels_cannot_be_overridden(self, run_helm: Callable[..., HelmResult], key: str) -> None:


        result = run_helm("template", "ledger", str(CHART), *REQUIRED, "--set", f"commonLabels.{key}=x")
        assert result.returncode != 0
        assert "/commonLabels" in result.stderr, result.stderr


class TestSecurityContexts:
    def test_the_new_names_set_ids_and_more(self, all_render: Rendered) -> None:
        """podSecurityContext's extra fields reach every pod, containerSecurityContext's every container of the
        chart; the chart's restrictions stay."""
        for manifest in workloads(all_render):
            context = pod_spec(manifest)["securityContext"]
            assert context["supplementalGroups"] == [4000], kn(manifest)
            assert context["runAsNonRoot"] is True
            for container in containers(manifest):
                assert container["securityContext"]["seLinuxOptions"] == {"level": "s0:c123,c456"}, kn(manifest)
                assert container["securityContext"]["readOnlyRootFilesystem"] is True

    def test_the_deprecated_name_still_works_and_says_so(self, render: Callable[..., Rendered],
                                                        run_helm: Callable[..., HelmResult], tmp_path: Path) -> None:
        """securityContext (before 0.2.0) renders exactly what podSecurityContext does, and the notes name it."""
        old = render(*REQUIRED, *DRILL, "--set", "securityContext.runAsUser=null", "--set",
                     "securityContext.runAsGroup=null", "--set", "securityContext.fsGroup=null")
        new = render(*REQUIRED, *DRILL, "--set", "podSecurityContext.runAsUser=null", "--set",
                     "podSecurityContext.runAsGroup=null")
        assert old.manifests == new.manifests
        assert "runAsUser" not in pod_spec(new.one("Deployment", WORKERS))["securityContext"]
        uid = render(*REQUIRED, "--set", "securityContext.runAsUser=4242")
        assert pod_spec(uid.one("Deployment", WORKERS))["securityContext"]["runAsUser"] == 4242
        notes = render_notes(run_helm, tmp_path, "--set", "securityContext.runAsUser=4242")
        assert "DEPRECATED: securityContext.runAsUser still applies" in notes.stdout, notes.stderr
        assert "DEPRECATED" not in render_notes(run_helm, tmp_path / "new", "--set",
                                                "podSecurityContext.runAsUser=4242").stdout

    @pytest.mark.parametrize(("flag", "where"), [
        ("podSecurityContext.runAsNonRoot=false", "/podSecurityContext/runAsNonRoot"),
        ("podSecurityContext.runAsUser=0", "/podSecurityContext/runAsUser"),
        ("podSecurityContext.seccompProfile.type=Unconfined", "/podSecurityContext/seccompProfile/type"),
        ("containerSecurityContext.privileged=true", "/containerSecurityContext/privileged"),
        ("containerSecurityContext.readOnlyRootFilesystem=false", "/containerSecurityContext/readOnlyRootFilesystem"),
        ("containerSecurityContext.allowPrivilegeEscalation=true",
         "/containerSecurityContext/allowPrivilegeEscalation"),
        ("containerSecurityContext.capabilities.add[0]=NET_ADMIN", "/containerSecurityContext/capabilities/add"),
        ("containerSecurityContext.runAsUserr=5", "runAsUserr"),
    ])
    def test_nothing_weakens_the_pods(self, run_helm: Callable[..., HelmResult], flag: str, where: str) -> None:


        result = run_helm("template", "ledger", str(CHART), *REQUIRED, "--set", flag)
        assert result.returncode != 0, flag
        assert where in result.stderr, result.stderr


class TestGlobalImageRegistry:
    def test_it_moves_every_image_of_the_chart(self, render: Callable[..., Rendered]) -> None:
        """global.imageRegistry wins over image.registry and chaos.image.registry (Bitnami's convention: one
        value moves every chart to a mirror); sidecars keep the image they name."""
        rendered = render(*REQUIRED, *DRILL, "--set", "global.imageRegistry=mirror.example.com:5000",
                          "--set", "image.registry=registry.example.com", "--set", "chaos.image.repository=chaos",
                          "--set", "chaos.image.registry=other.example.com",
                          "--set", "sidecars[0].name=proxy", "--set", "sidecars[0].image=proxy.example.com/p:1")
        images = {c["image"] for m in workloads(rendered) for c in containers(m) if c["name"] != "proxy"}
        assert images == {f"mirror.example.com:5000/stock-ledger:{APP_VERSION}",
                          f"mirror.example.com:5000/chaos:{APP_VERSION}"}
        assert by_name(rendered.one("Deployment", WORKERS))["proxy"]["image"] == "proxy.example.com/p:1"

    def test_a_bad_registry_is_refused(self, run_helm: Callable[..., HelmResult]) -> None:


        result = run_helm("template", "ledger", str(CHART), *REQUIRED, "--set", "global.imageRegistry=https://x")
        assert result.returncode != 0
        assert "/global/imageRegistry" in result.stderr, result.stderr
