"""The rendered chart has the properties the deployment relies on.

Each class states one property; the `rendered` fixture runs a test against both the defaults and
tests/deploy/values-all.yaml (every feature on), so a property cannot hold only with features off.
"""

from __future__ import annotations

import json
import shutil
from typing import TYPE_CHECKING, Any

import pytest

from .support import (
    APP_VERSION,
    CHART,
    KUBE_VERSION,
    MIGRATION_SECRET,
    NAMESPACE,
    RELEASE,
    REQUIRED,
    SECRET,
    HelmResult,
    Manifest,
    Rendered,
    env_by_name,
    kn,
    pod_labels,
    pod_spec,
    restricted_v2_violations,
)

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

pytestmark = pytest.mark.deploy

SELECTOR = {"app.kubernetes.io/name": "stock-ledger", "app.kubernetes.io/instance": RELEASE}
WORKERS = f"{RELEASE}-stock-ledger"  # the release's worker Deployment (the chaos drill has its own)
POD_KINDS = ("Deployment", "Job", "Pod", "CronJob")


def workloads(rendered: Rendered) -> list[Manifest]:
    return [m for m in rendered.manifests if m["kind"] in POD_KINDS]


# The sidecar and init container tests/deploy/values-all.yaml adds: the user's, not the chart's own.
USER_CONTAINERS = {"proxy", "wait-for-proxy"}


def containers(manifest: Manifest) -> list[dict[str, Any]]:
    spec = pod_spec(manifest)
    found: list[dict[str, Any]] = spec["containers"] + spec.get("initContainers", [])
    return found


def own_containers(manifest: Manifest) -> list[dict[str, Any]]:
    return [c for c in containers(manifest) if c["name"] not in USER_CONTAINERS]


def worker(rendered: Rendered) -> dict[str, Any]:
    deployment = rendered.one("Deployment", WORKERS)
    found: dict[str, Any] = containers(deployment)[0]
    return found


class TestSelectors:
    """Selectors are exactly name + instance, match the worker pods, and match nothing else."""

    def test_deployment_selector_is_name_and_instance(self, rendered: Rendered) -> None:
        deployment = rendered.one("Deployment", WORKERS)
        assert deployment["spec"]["selector"] == {"matchLabels": SELECTOR}
        assert SELECTOR.items() <= pod_labels(deployment).items()

    def test_every_selector_is_the_same(self, rendered: Rendered) -> None:
        selectors = [rendered.one("PodDisruptionBudget")["spec"]["selector"]["matchLabels"]]
        selectors += [m["spec"]["selector"]["matchLabels"] for m in rendered.of_kind("PodMonitor")]
        selectors += [m["spec"]["selector"]["matchLabels"] for m in rendered.of_kind("ServiceMonitor")]
        spread = pod_spec(rendered.one("Deployment", WORKERS)).get("topologySpreadConstraints", [])
        assert spread, "the worker pods must have topologySpreadConstraints"
        selectors += [constraint["labelSelector"]["matchLabels"] for constraint in spread]
        assert all(selector == SELECTOR for selector in selectors), selectors

    def test_selector_labels_do_not_change_between_versions(self, all_render: Rendered) -> None:
        """values-all sets another image tag: the selector (immutable on a Deployment) stays the same."""
        assert all_render.one("Deployment", WORKERS)["spec"]["selector"]["matchLabels"] == SELECTOR

    def test_no_other_pod_matches_the_worker_selector(self, rendered: Rendered) -> None:
        """Hook pods must not be adopted by the Deployment, counted by the PDB, scraped or killed by chaos."""
        for manifest in workloads(rendered):
            if manifest["kind"] == "Deployment":
                continue
            labels = pod_labels(manifest)
            assert not SELECTOR.items() <= labels.items(), f"{kn(manifest)} pods match the worker selector"
            assert labels.get("app.kubernetes.io/instance") == RELEASE


class TestReplicas:
    """Replica count follows values, within one to one per partition."""

    def test_replicas(self, default_render: Rendered, all_render: Rendered) -> None:
        assert default_render.one("Deployment", WORKERS)["spec"]["replicas"] == 3
        assert all_render.one("Deployment", WORKERS)["spec"]["replicas"] == 24

    def test_rollout_never_drops_below_requested_replicas(self, rendered: Rendered) -> None:
        strategy = rendered.one("Deployment", WORKERS)["spec"]["strategy"]
        assert strategy["rollingUpdate"]["maxUnavailable"] == 0


class TestPodDisruptionBudget:
    """A PDB limits voluntary evictions of the workers."""

    def test_default_max_unavailable(self, default_render: Rendered) -> None:
        assert default_render.one("PodDisruptionBudget")["spec"]["maxUnavailable"] == 1

    def test_not_ready_workers_may_be_evicted(self, rendered: Rendered) -> None:
        """In a database outage every worker is NotReady: drains must not stall on them."""
        assert rendered.one("PodDisruptionBudget")["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"

    def test_min_available_replaces_max_unavailable(self, all_render: Rendered) -> None:
        spec = all_render.one("PodDisruptionBudget")["spec"]
        assert spec["minAvailable"] == 20
        assert "maxUnavailable" not in spec


class TestSecurityContext:
    """Every pod of the chart runs non-root, read-only, without privileges, under RuntimeDefault seccomp."""

    def test_pod_security_context(self, rendered: Rendered) -> None:
        for manifest in workloads(rendered):
            context = pod_spec(manifest)["securityContext"]
            assert context["runAsNonRoot"] is True, kn(manifest)
            assert isinstance(context["runAsUser"], int), kn(manifest)
            assert context["runAsUser"] > 0, kn(manifest)
            assert context["seccompProfile"] == {"type": "RuntimeDefault"}, kn(manifest)

    def test_container_security_context(self, rendered: Rendered) -> None:
        for manifest in workloads(rendered):
            for container in containers(manifest):
                context = container["securityContext"]
                where = f"{kn(manifest)} container {container['name']}"
                assert context["runAsNonRoot"] is True, where
                assert isinstance(context["runAsUser"], int), where
                assert context["runAsUser"] > 0, where
                assert context["readOnlyRootFilesystem"] is True, where
                assert context["allowPrivilegeEscalation"] is False, where
                assert context["capabilities"] == {"drop": ["ALL"]}, where
                assert context["seccompProfile"] == {"type": "RuntimeDefault"}, where

    def test_fs_group_owns_the_secret_files(self, default_render: Rendered, render: Callable[..., Rendered]) -> None:
        """fsGroup defaults to runAsGroup (a non-root uid reads the 0440 Secret files through it); it can be set."""
        for manifest in workloads(default_render):
            assert pod_spec(manifest)["securityContext"]["fsGroup"] == 10001, kn(manifest)
        rendered = render(*REQUIRED, "--set", "securityContext.fsGroup=2000")
        assert {pod_spec(m)["securityContext"]["fsGroup"] for m in workloads(rendered)} == {2000}

    def test_large_ids_render_as_integers(self, render: Callable[..., Rendered], tmp_path: Path) -> None:
        """An OpenShift-range uid from a values file must not print as 1.00068e+09 (Helm reads YAML numbers as
        float64; `--set` would parse an int64 and hide it)."""
        values = tmp_path / "ids.yaml"
        values.write_text("securityContext:\n  runAsUser: 1000680000\n  runAsGroup: 1000680000\n")
        rendered = render(*REQUIRED, "--values", str(values))
        context = pod_spec(rendered.one("Deployment", WORKERS))["securityContext"]
        ids = (context["runAsUser"], context["runAsGroup"], context["fsGroup"])
        assert ids == (1000680000,) * 3
        assert all(type(i) is int for i in ids), ids

    def test_tmp_is_a_writable_empty_dir(self, rendered: Rendered) -> None:
        for manifest in workloads(rendered):
            volumes = {v["name"]: v for v in pod_spec(manifest)["volumes"]}
            for container in own_containers(manifest):
                mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
                assert "/tmp" in mounts, f"{kn(manifest)}: no /tmp mount"  # noqa: S108 - the point of the test
                assert "emptyDir" in volumes[mounts["/tmp"]], kn(manifest)  # noqa: S108

    def test_only_the_chaos_drill_talks_to_the_api(self, rendered: Rendered) -> None:
        for manifest in workloads(rendered):
            automount = pod_spec(manifest)["automountServiceAccountToken"]
            drill = manifest["kind"] == "Job" and manifest["metadata"]["name"] == f"{WORKERS}-chaos"
            assert automount is drill, kn(manifest)

    def test_resources_set(self, rendered: Rendered) -> None:
        for manifest in workloads(rendered):
            for container in own_containers(manifest):
                resources = container["resources"]
                assert {"cpu", "memory"} <= resources["requests"].keys(), kn(manifest)
                assert "memory" in resources["limits"], kn(manifest)


class TestRandomUid:
    """With securityContext.runAsUser/runAsGroup/fsGroup null every pod leaves the ids to the platform (OpenShift's
    restricted-v2 SCC assigns a uid from the namespace's range) and keeps every other restriction."""

    NULL_IDS = ("--set", "securityContext.runAsUser=null", "--set", "securityContext.runAsGroup=null",
                "--set", "securityContext.fsGroup=null")

    def test_no_pod_fixes_an_id_and_every_restriction_stays(self, render: Callable[..., Rendered]) -> None:
        rendered = render(*REQUIRED, *self.NULL_IDS, "--set", "chaos.enabled=true",
                          "--set", "chaos.database.existingSecret=drill-db", "--set", "archive.enabled=true")
        assert len(workloads(rendered)) == 7
        violations = [v for m in workloads(rendered) for v in restricted_v2_violations(m)]
        assert not violations, "\n".join(violations)

    def test_the_default_fixes_the_images_ids(self, default_render: Rendered) -> None:
        """The checker above is not vacuous: the default render pins uid 10001, which restricted-v2 refuses."""
        violations = [v for m in workloads(default_render) for v in restricted_v2_violations(m)]
        assert any("pod sets runAsUser" in v for v in violations)
        assert all("sets runAsUser" in v or "sets runAsGroup" in v or "sets fsGroup" in v for v in violations)


class TestWorkerContainer:
    """The worker's command, environment, probes and shutdown."""

    def test_runs_the_worker(self, rendered: Rendered) -> None:
        assert worker(rendered)["args"] == ["run"]

    def test_image_reference(self, default_render: Rendered, all_render: Rendered) -> None:
        assert worker(default_render)["image"] == f"stock-ledger:{APP_VERSION}"
        assert worker(all_render)["image"].startswith(
            "registry.example.com:5000/inventory/stock-ledger@sha256:"
        )

    def test_registry_prefixes_every_image_of_the_chart(self, render: Callable[..., Rendered]) -> None:
        """image.registry reaches every pod: workers, migration hook, helm test, the archive CronJob (its own image,
        the -archive tag), the drill's Jobs and workers; with a digest the reference is registry/repository@digest
        (the archive image keeps its tag: the worker's digest is not its)."""
        digest = "sha256:" + "ab" * 32
        drill = ("--set", "chaos.enabled=true", "--set", "chaos.database.existingSecret=drill-db",
                 "--set", "archive.enabled=true")
        archive = f"mirror.example.com:5000/stock-ledger:{APP_VERSION}-archive"
        for flags, expected in (
            ((), f"mirror.example.com:5000/stock-ledger:{APP_VERSION}"),
            (("--set", f"image.digest={digest}"), f"mirror.example.com:5000/stock-ledger@{digest}"),
        ):
            rendered = render(*REQUIRED, *drill, "--set", "image.registry=mirror.example.com:5000", *flags)
            images = {kn(m): {c["image"] for c in containers(m)} for m in workloads(rendered)}
            assert len(images) == 7, images  # workers, migrate, test pod, archive, drill prepare, workers, Job
            assert all(found == {archive if name.startswith("CronJob/") else expected}
                       for name, found in images.items()), images

    def test_chaos_image_registry_defaults_to_the_app_registry(self, render: Callable[..., Rendered]) -> None:
        drill = ("--set", "chaos.enabled=true", "--set", "chaos.database.existingSecret=drill-db",
                 "--set", "chaos.image.repository=inventory/chaos", "--set-string", "chaos.image.tag=2")
        rendered = render(*REQUIRED, *drill, "--set", "image.registry=mirror.example.com")
        assert containers(rendered.one("Job", f"{WORKERS}-chaos"))[0]["image"] == "mirror.example.com/inventory/chaos:2"
        rendered = render(*REQUIRED, *drill, "--set", "image.registry=mirror.example.com",
                          "--set", "chaos.image.registry=other.example.com")
        assert containers(rendered.one("Job", f"{WORKERS}-chaos"))[0]["image"] == "other.example.com/inventory/chaos:2"

    def test_database_url_from_the_existing_secret(
        self, default_render: Rendered, all_render: Rendered
    ) -> None:
        for rendered, key in ((default_render, "DATABASE_URL"), (all_render, "worker-url")):
            env = env_by_name(worker(rendered))["DATABASE_URL"]
            assert env == {
                "name": "DATABASE_URL",
                "valueFrom": {"secretKeyRef": {"name": SECRET, "key": key}},
            }

    def test_no_database_url_in_plain_text(self, rendered: Rendered) -> None:
        for manifest in workloads(rendered):
            for container in own_containers(manifest):
                env = env_by_name(container).get("DATABASE_URL")
                if container["name"] == "ready":  # helm test's readiness check talks to the workers only
                    continue
                assert env is not None, f"{kn(manifest)} has no DATABASE_URL"
                assert "value" not in env, f"{kn(manifest)} carries DATABASE_URL as a literal"

    def test_environment_from_values(self, default_render: Rendered, all_render: Rendered) -> None:
        env = {e["name"]: e.get("value") for e in worker(default_render)["env"]}
        assert env["KAFKA_BOOTSTRAP_SERVERS"] == "kafka:9092"
        assert env["STOCK_LEDGER_TOPIC"] == "warehouse.movements"
        assert env["STOCK_LEDGER_SHUTDOWN_GRACE_SECONDS"] == "8"
        assert env["STOCK_LEDGER_METRICS_PORT"] == "9108"
        env = {e["name"]: e.get("value") for e in worker(all_render)["env"]}
        assert env["STOCK_LEDGER_BATCH_MAX_RECORDS"] == "1000000", "large numbers must not render as 1e+06"
        assert env["STOCK_LEDGER_GROUP_ID"] == "stock-ledger-staging"
        assert env["STOCK_LEDGER_EXTRA"] == "1"
        names = [e["name"] for e in worker(all_render)["env"]]
        assert len(names) == len(set(names)), "duplicate environment variables"

    def test_dynamic_membership(self, rendered: Rendered) -> None:
        """One membership model, measured (docs/design.md "Membership"): a Deployment without static membership, so a
        stopping pod's LeaveGroup hands its partitions over at once."""
        assert rendered.one("Deployment", WORKERS)
        for manifest in rendered.of_kind("Deployment"):
            for container in containers(manifest):
                assert "STOCK_LEDGER_GROUP_INSTANCE_ID" not in env_by_name(container), kn(manifest)

    def test_retries_forever_by_default(self, default_render: Rendered) -> None:
        """A database outage leaves the pods NotReady but alive: no CrashLoopBackOff delaying recovery."""
        assert env_by_name(worker(default_render))["STOCK_LEDGER_RETRY_DEADLINE_SECONDS"]["value"] == "0"

    def test_probes_on_the_metrics_port(self, rendered: Rendered) -> None:
        container = worker(rendered)
        assert container["ports"] == [{"name": "metrics", "containerPort": 9108, "protocol": "TCP"}]
        assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
        assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}

    def test_termination_grace_covers_a_clean_batch_finish(self, default_render: Rendered) -> None:
        spec = pod_spec(default_render.one("Deployment", WORKERS))
        env = {e["name"]: e.get("value") for e in worker(default_render)["env"]}
        assert spec["terminationGracePeriodSeconds"] == 30
        assert spec["terminationGracePeriodSeconds"] > int(env["STOCK_LEDGER_SHUTDOWN_GRACE_SECONDS"]) + 5


class TestMigrationJob:
    """Migrations run as a pre-install/pre-upgrade hook, as the owner role, before the workers start."""

    def test_hook_annotations(self, default_render: Rendered) -> None:
        """By default (migrations.mode hook; values-all uses the Argo CD Job, test_chart_argocd.py)."""
        annotations = default_render.one("Job", "-migrate")["metadata"]["annotations"]
        assert set(annotations["helm.sh/hook"].split(",")) == {"pre-install", "pre-upgrade"}
        assert set(annotations["helm.sh/hook-delete-policy"].split(",")) == {
            "before-hook-creation",
            "hook-succeeded",
        }

    def test_runs_migrate_once(self, rendered: Rendered) -> None:
        job = rendered.one("Job", "-migrate")
        assert containers(job)[0]["args"] == ["migrate"]
        assert pod_spec(job)["restartPolicy"] == "Never"

    def test_owner_secret(self, default_render: Rendered, all_render: Rendered) -> None:
        """database.migrationSecret (key: database.migrationSecretKey, else database.secretKey) is the owner's."""
        expected = {
            id(default_render): {"name": MIGRATION_SECRET, "key": "DATABASE_URL"},
            id(all_render): {"name": "stock-ledger-db-owner", "key": "owner-url"},
        }
        for rendered in (default_render, all_render):
            env = env_by_name(containers(rendered.one("Job", "-migrate"))[0])["DATABASE_URL"]
            assert env["valueFrom"]["secretKeyRef"] == expected[id(rendered)]

    def test_never_falls_back_to_the_worker_secret(self, run_helm: Callable[..., HelmResult]) -> None:
        """Without database.migrationSecret the install fails, saying what to create and which value to set: the
        worker role cannot run DDL, so a hook run with its Secret would fail every install and upgrade."""
        result = run_helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION,
                          "--set", f"database.existingSecret={SECRET}")
        assert result.returncode != 0, "rendered a migration hook without the owner's Secret"
        message = " ".join(result.stderr.split())
        for fragment in ("database.migrationSecret is required while migrations.enabled is true", "OWNER role",
                         f"kubectl -n {NAMESPACE} create secret generic stock-ledger-db-owner",
                         "--from-literal=DATABASE_URL=", "set database.migrationSecret=stock-ledger-db-owner",
                         "migrations.enabled=false"):
            assert fragment in message, f"{fragment!r} not in:\n{result.stderr}"

    def test_the_worker_secret_and_key_are_refused(self, run_helm: Callable[..., HelmResult]) -> None:
        """Naming the worker's Secret and key explicitly is the same fallback; another key of it is fine."""
        same = ("--set", f"database.existingSecret={SECRET}", "--set", f"database.migrationSecret={SECRET}")
        result = run_helm("template", RELEASE, str(CHART), "--kube-version", KUBE_VERSION, *same)
        assert result.returncode != 0
        assert "is the worker's Secret and key" in result.stderr, result.stderr
        result = run_helm("template", RELEASE, str(CHART), "--kube-version", KUBE_VERSION, *same,
                          "--set", "database.migrationSecretKey=OWNER_URL")
        assert result.returncode == 0, result.stderr

    def test_disabled_migrations_need_no_owner_secret(self, render: Callable[..., Rendered]) -> None:
        """migrations.enabled=false: no hook, so no owner Secret in the cluster (the operator migrates)."""
        rendered = render("--set", f"database.existingSecret={SECRET}", "--set", "migrations.enabled=false")
        assert [m["metadata"]["name"] for m in rendered.of_kind("Job")] == []
        assert rendered.one("Deployment", WORKERS)

    def test_uses_no_chart_created_object(self, rendered: Rendered) -> None:
        """A pre-install hook runs before the release's objects exist: it may use none of them."""
        spec = pod_spec(rendered.one("Job", "-migrate"))
        assert "serviceAccountName" not in spec
        assert all("secret" in v or "emptyDir" in v for v in spec["volumes"])


class TestMonitoring:
    """A PodMonitor with extra labels, else scrape annotations; PrometheusRule and dashboard on request."""

    def test_scrape_annotations_without_pod_monitor(self, default_render: Rendered) -> None:
        annotations = default_render.one("Deployment", WORKERS)["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == "9108"
        assert annotations["prometheus.io/path"] == "/metrics"
        assert not default_render.kinds() & {"PodMonitor", "ServiceMonitor", "PrometheusRule", "ConfigMap"}

    def test_pod_monitor_replaces_annotations(self, all_render: Rendered) -> None:
        monitor = all_render.one("PodMonitor")
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        assert monitor["spec"]["podMetricsEndpoints"] == [
            {"port": "metrics", "path": "/metrics", "interval": "15s", "scrapeTimeout": "10s"}
        ]
        annotations = all_render.one("Deployment", WORKERS)["spec"]["template"]["metadata"]["annotations"]
        assert not [key for key in annotations if key.startswith("prometheus.io/")], "scraped twice"
        assert annotations["example.com/owner"] == "inventory"

    def test_service_monitor_scrapes_every_worker_through_the_headless_service(
        self, render: Callable[..., Rendered],
    ) -> None:
        """The ServiceMonitor selects the workers Service by its labels and the endpoints by the Service's port name;
        that Service selects exactly the worker pods, NotReady ones included. No scrape annotations, no PodMonitor."""
        rendered = render(*REQUIRED, "--set", "metrics.serviceMonitor.enabled=true",
                          "--set", "metrics.serviceMonitor.labels.release=kube-prometheus-stack",
                          "--set", "metrics.serviceMonitor.interval=15s")
        monitor = rendered.one("ServiceMonitor")
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        selector = monitor["spec"]["selector"]["matchLabels"]
        matched = [s for s in rendered.of_kind("Service") if selector.items() <= s["metadata"]["labels"].items()]
        assert [s["metadata"]["name"] for s in matched] == [f"{WORKERS}-workers"]
        service = matched[0]
        assert service["spec"]["selector"] == SELECTOR
        assert service["spec"]["publishNotReadyAddresses"] is True
        assert monitor["spec"]["endpoints"] == [
            {"port": "metrics", "path": "/metrics", "interval": "15s", "scrapeTimeout": "10s"}]
        assert [p["name"] for p in service["spec"]["ports"]] == ["metrics"]
        assert service["spec"]["ports"][0]["targetPort"] == worker(rendered)["ports"][0]["name"]
        annotations = rendered.one("Deployment", WORKERS)["spec"]["template"]["metadata"].get("annotations", {})
        assert not [key for key in annotations if key.startswith("prometheus.io/")], "scraped twice"
        assert "PodMonitor" not in rendered.kinds()

    def test_pod_monitor_and_service_monitor_exclude_each_other(self, run_helm: Callable[..., HelmResult]) -> None:
        result = run_helm("template", RELEASE, str(CHART), "--kube-version", KUBE_VERSION, *REQUIRED,
                          "--set", "metrics.podMonitor.enabled=true", "--set", "metrics.serviceMonitor.enabled=true")
        assert result.returncode != 0
        assert "enable one of them, or every worker is scraped twice" in result.stderr, result.stderr

    def test_prometheus_rule_labels(self, all_render: Rendered) -> None:
        assert all_render.one("PrometheusRule")["metadata"]["labels"]["release"] == "kube-prometheus-stack"

    def test_dashboard_configmap(self, all_render: Rendered) -> None:
        configmap = all_render.one("ConfigMap", "-dashboard")
        assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert configmap["metadata"]["annotations"] == {"grafana_folder": "Inventory",
                                                        "example.com/contact": "inventory-oncall"}
        shipped = json.loads((CHART / "files" / "dashboard.json").read_text())
        rendered = json.loads(configmap["data"]["stock-ledger.json"])
        assert rendered["panels"] == shipped["panels"]

    def test_dashboard_is_per_release_with_a_namespace_variable(
        self, run_helm: Callable[..., HelmResult], yaml_module: Any,
    ) -> None:
        """uid and title differ between releases and namespaces (Grafana keys dashboards by uid, wants titles
        unique per folder); the namespace variable defaults to the release's namespace and every query uses it."""
        dashboards = []
        for namespace, release in (("inventory", "ledger"), ("staging", "ledger"), ("inventory", "other")):
            result = run_helm("template", release, str(CHART), "--namespace", namespace, "--kube-version",
                              KUBE_VERSION, *REQUIRED,
                              "--set", "grafana.dashboard.enabled=true")
            assert result.returncode == 0, result.stderr
            rendered = Rendered([d for d in yaml_module.safe_load_all(result.stdout) if d])
            configmap = rendered.one("ConfigMap", "-dashboard")
            dashboards.append((namespace, json.loads(configmap["data"]["stock-ledger.json"])))
        assert len({d["uid"] for _, d in dashboards}) == 3
        assert len({d["title"] for _, d in dashboards}) == 3
        assert all(len(d["uid"]) <= 40 for _, d in dashboards)
        for namespace, dashboard in dashboards:
            variable = next(v for v in dashboard["templating"]["list"] if v["name"] == "namespace")
            assert variable["current"]["value"] == namespace
        exprs = [t["expr"] for p in dashboards[0][1]["panels"] for t in p.get("targets", [])]
        assert exprs
        assert all('namespace=~"$namespace"' in e for e in exprs), [e for e in exprs if "$namespace" not in e]


class TestHelmTest:
    """`helm test` is safe anywhere: it waits for readiness and runs a read-only `stock-ledger verify`."""

    def test_pod_checks_readiness_then_verifies_read_only(self, rendered: Rendered) -> None:
        pods = rendered.of_kind("Pod")
        assert [p["metadata"]["annotations"]["helm.sh/hook"] for p in pods] == ["test"]
        pod = pods[0]
        ready = pod["spec"]["initContainers"][0]
        assert ready["command"][:2] == ["python", "-c"]
        assert ready["command"][2] == (CHART / "files" / "readiness-check.py").read_text()
        env = {e["name"]: e["value"] for e in ready["env"]}
        assert env["WORKERS_HOST"] == f"{WORKERS}-workers.{NAMESPACE}.svc"
        verify = pod["spec"]["containers"][0]
        assert verify["args"][0] == "verify"
        assert "--expect" not in verify["args"]
        assert pod["spec"].get("serviceAccountName") is None
        assert pod["spec"]["automountServiceAccountToken"] is False
        env = env_by_name(verify)
        assert env["STOCK_LEDGER_TOPIC"]["value"] == "warehouse.movements"
        assert env["DATABASE_URL"]["valueFrom"]["secretKeyRef"]["name"] == SECRET

    def test_headless_service_finds_every_worker(self, rendered: Rendered) -> None:
        service = rendered.one("Service", "-workers")
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["publishNotReadyAddresses"] is True
        assert service["spec"]["selector"] == SELECTOR


class TestChaos:
    """The chaos drill: opt-in hooks on its own topic, group, database and workers; RBAC only while it runs."""

    def test_off_by_default(self, default_render: Rendered) -> None:
        assert not default_render.kinds() & {"ServiceAccount", "Role", "RoleBinding"}
        assert [m["metadata"]["name"] for m in default_render.of_kind("Job")] == [f"{WORKERS}-migrate"]
        assert [m["metadata"]["name"] for m in default_render.of_kind("Deployment")] == [WORKERS]

    def test_every_drill_object_is_a_post_install_hook_deleted_when_the_drill_ends(
        self, all_render: Rendered,
    ) -> None:
        """RBAC, the drill's workers, its prepare Job and the drill Job are post-install/post-upgrade hooks,
        ordered by weight; all carry hook-succeeded (Helm also deletes earlier hooks' hook-succeeded objects
        when a later one fails), so the pod-deleting RBAC exists only while the drill runs."""
        drill = [m for m in all_render.manifests if "chaos" in m["metadata"]["name"]]
        weights = {}
        for manifest in drill:
            annotations = manifest["metadata"]["annotations"]
            assert set(annotations["helm.sh/hook"].split(",")) == {"post-install", "post-upgrade"}, kn(manifest)
            policy = set(annotations["helm.sh/hook-delete-policy"].split(","))
            assert policy == {"before-hook-creation", "hook-succeeded"}, kn(manifest)
            weights[kn(manifest)] = int(annotations["helm.sh/hook-weight"])
        assert {k.split("/")[0] for k in weights} == {"ServiceAccount", "Role", "RoleBinding", "Job", "Deployment"}
        rbac = max(weights[f"{kind}/{WORKERS}-chaos"] for kind in ("ServiceAccount", "Role", "RoleBinding"))
        prepare = weights[f"Job/{WORKERS}-chaos-prepare"]
        workers = weights[f"Deployment/{WORKERS}-chaos-workers"]
        assert rbac < prepare < workers < weights[f"Job/{WORKERS}-chaos"]

    def test_drill_uses_its_own_topic_group_database_and_workers(self, all_render: Rendered) -> None:
        workers = all_render.one("Deployment", "-chaos-workers")
        job = all_render.one("Job", f"{WORKERS}-chaos")
        prepare = all_render.one("Job", "-chaos-prepare")
        for manifest in (workers, job, prepare):
            env = env_by_name(containers(manifest)[0])
            assert env["STOCK_LEDGER_TOPIC"]["value"] == "warehouse.movements.chaos-drill", kn(manifest)
            assert env["STOCK_LEDGER_GROUP_ID"]["value"] == "stock-ledger-chaos-drill", kn(manifest)
            assert env["DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {
                "name": "stock-ledger-chaos-db", "key": "owner-url"}, kn(manifest)
        assert workers["spec"]["replicas"] == 4
        drill_labels = workers["spec"]["selector"]["matchLabels"]
        assert drill_labels != SELECTOR
        assert not SELECTOR.items() <= pod_labels(workers).items()
        args = containers(job)[0]["args"]
        options = dict(zip(args[::2], args[1::2], strict=True))
        assert options["--selector"] == ",".join(f"{k}={v}" for k, v in drill_labels.items())
        assert containers(prepare)[0]["command"][2] == (CHART / "files" / "chaos-prepare.py").read_text()

    def test_needs_the_drill_database(self, run_helm: Callable[..., HelmResult]) -> None:
        result = run_helm("template", RELEASE, str(CHART), *REQUIRED,
                          "--set", "chaos.enabled=true")
        assert result.returncode != 0
        assert "/chaos/database/existingSecret" in result.stderr, result.stderr

    def test_never_cluster_wide(self, rendered: Rendered) -> None:
        assert not rendered.kinds() & {"ClusterRole", "ClusterRoleBinding"}

    def test_role_limited_to_pods(self, all_render: Rendered) -> None:
        role = all_render.one("Role")
        assert role["metadata"]["namespace"] == NAMESPACE
        assert len(role["rules"]) == 1
        rule = role["rules"][0]
        assert rule["apiGroups"] == [""]
        assert rule["resources"] == ["pods"]
        assert sorted(rule["verbs"]) == ["delete", "get", "list", "watch"]
        assert "resourceNames" not in rule

    def test_binding_ties_role_to_the_chaos_account(self, all_render: Rendered) -> None:
        binding = all_render.one("RoleBinding")
        account = all_render.one("ServiceAccount")
        assert binding["metadata"]["namespace"] == NAMESPACE
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": all_render.one("Role")["metadata"]["name"],
        }
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
        ]
        assert pod_spec(all_render.one("Job", f"{WORKERS}-chaos"))["serviceAccountName"] == account["metadata"]["name"]

    def test_drill_job_runs_chaos_sh(self, all_render: Rendered) -> None:
        job = all_render.one("Job", f"{WORKERS}-chaos")
        assert pod_spec(job)["restartPolicy"] == "Never", "a failed verification must fail the drill"
        assert job["spec"]["backoffLimit"] == 0
        container = containers(job)[0]
        assert container["image"] == "registry.example.com:5000/inventory/stock-ledger-chaos:1.2.3"
        assert container["command"] == ["/app/scripts/chaos.sh"]
        args = container["args"]
        options = dict(zip(args[::2], args[1::2], strict=True))
        assert options == {
            "--mode": "k8s",
            "--namespace": NAMESPACE,
            "--selector": f"app.kubernetes.io/name=stock-ledger-chaos-drill,app.kubernetes.io/instance={RELEASE}",
            "--count": "50000",
            "--rate": "2500",
            "--kills": "7",
            "--interval": "5-20",
        }
        env = env_by_name(container)
        assert env["KAFKA_BOOTSTRAP_SERVERS"]["value"] == "kafka-0.kafka:9092,kafka-1.kafka:9092"

    def test_chaos_image_defaults_to_the_app_image(self, render: Callable[..., Rendered]) -> None:
        rendered = render(*REQUIRED, "--set", "chaos.enabled=true",
                          "--set", "chaos.database.existingSecret=drill-db")
        job = rendered.one("Job", f"{WORKERS}-chaos")
        assert containers(job)[0]["image"] == worker(rendered)["image"]


def render_notes(run_helm: Callable[..., HelmResult], tmp_path: Path, *flags: str) -> HelmResult:
    """`helm template` skips NOTES.txt, so a copy of the chart renders it as a YAML block."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "NOTES.txt").unlink()
    (chart / "templates" / "notes.yaml").write_text(
        "notes: |\n" + "".join(f"  {line}\n" for line in notes.splitlines()))
    return run_helm("template", RELEASE, str(chart), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION,
                    *REQUIRED, *flags, "--show-only", "templates/notes.yaml")


class TestNotes:
    """NOTES.txt gives commands that work as printed."""

    def test_port_forward_runs_in_the_background_before_curl(
        self, run_helm: Callable[..., HelmResult], tmp_path: Path,
    ) -> None:
        """`port-forward` blocks: `port-forward ... && curl` never reaches curl."""
        result = render_notes(run_helm, tmp_path)
        assert result.returncode == 0, result.stderr
        forward = next(line for line in result.stdout.splitlines() if "port-forward" in line)
        assert forward.rstrip().endswith(f"port-forward deploy/{WORKERS} 9108:9108 &")
        assert "&&" not in result.stdout
        assert "curl -s localhost:9108/metrics" in result.stdout
        assert "helm test" in result.stdout

    def test_a_network_policy_without_metrics_peers_is_pointed_out(
        self, run_helm: Callable[..., HelmResult], tmp_path: Path,
    ) -> None:
        """Only helm test may reach the metrics port then: scraping would fail silently, so the notes say it."""
        result = render_notes(run_helm, tmp_path, "--set", "networkPolicy.enabled=true")
        assert result.returncode == 0, result.stderr
        assert "list your Prometheus in networkPolicy.metricsFrom" in result.stdout
        (tmp_path / "again").mkdir()
        result = render_notes(run_helm, tmp_path / "again", "--set", "networkPolicy.enabled=true",
                              "--set", "networkPolicy.metricsFrom[0].podSelector.matchLabels.app=prometheus")
        assert result.returncode == 0, result.stderr
        assert "metricsFrom" not in result.stdout
