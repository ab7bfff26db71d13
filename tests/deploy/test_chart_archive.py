"""The archive CronJob (archive.enabled): `stock-ledger archive run` on a schedule, never two at once, as the owner
role the migration Job uses, with the workers' Kafka settings and files, writing to a volume whose claim outlives
the release (Helm's resource-policy keep, Argo CD's Prune=false,Delete=false).

The CronJob is rendered and read as a cluster would run it; tests/deploy/values-all.yaml turns it on, so the
properties every pod of the chart must have (test_chart_properties, test_chart_keys) cover its pods too.
"""

from __future__ import annotations

from pathlib import Path
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
    VALUES_ALL,
    HelmResult,
    Manifest,
    Rendered,
    env_by_name,
    kn,
    pod_labels,
    pod_spec,
)
from .test_chart_properties import SELECTOR, WORKERS, render_notes

if TYPE_CHECKING:
    from collections.abc import Callable

pytestmark = pytest.mark.deploy

ENABLED = ("--set", "archive.enabled=true")
ARCHIVE = f"{WORKERS}-archive"
ARCHIVE_DIR = "/var/lib/stock-ledger/archive"
VALUES_SECURE = Path(__file__).resolve().parent / "values-secure.yaml"
# What the worker gets to reach Kafka (and PostgreSQL over TLS), which the archiver must get identically.
KAFKA_NAMES = ("KAFKA_BOOTSTRAP_SERVERS", "STOCK_LEDGER_TOPIC", "STOCK_LEDGER_GROUP_ID")
SECURITY_FILES = ("kafka-sasl", "kafka-ca", "kafka-client", "database-ca")


@pytest.fixture(scope="module")
def archive_render(render: Callable[..., Rendered]) -> Rendered:
    return render(*REQUIRED, *ENABLED)


@pytest.fixture(scope="module")
def secure_render(render: Callable[..., Rendered]) -> Rendered:
    """values-secure.yaml (SASL_SSL, mutual TLS, the brokers' CA, PostgreSQL verify-full) with the archive on."""
    return render("--values", str(VALUES_SECURE), *ENABLED)


def _container(manifest: Manifest) -> dict[str, Any]:
    container: dict[str, Any] = pod_spec(manifest)["containers"][0]
    return container


def _archive(rendered: Rendered) -> dict[str, Any]:
    return _container(rendered.one("CronJob", "-archive"))


def _job_spec(rendered: Rendered) -> dict[str, Any]:
    spec: dict[str, Any] = rendered.one("CronJob", "-archive")["spec"]["jobTemplate"]["spec"]
    return spec


def test_off_by_default(default_render: Rendered) -> None:
    assert not default_render.kinds() & {"CronJob", "PersistentVolumeClaim"}


class TestSchedule:
    """One archiver at a time, on schedule; a failed run is left to the next one, a configuration error not retried."""

    def test_never_two_runs_at_once(self, archive_render: Rendered, all_render: Rendered) -> None:
        for rendered in (archive_render, all_render):
            cronjob = rendered.one("CronJob")
            assert cronjob["metadata"]["name"] == ARCHIVE
            assert cronjob["spec"]["concurrencyPolicy"] == "Forbid", "two archivers must never run at once"

    def test_schedule_and_history_from_values(self, archive_render: Rendered, all_render: Rendered) -> None:
        spec = archive_render.one("CronJob")["spec"]
        assert (spec["schedule"], spec["suspend"]) == ("30 2 * * *", False)
        assert "timeZone" not in spec, "empty timeZone: the controller manager's"
        assert (spec["successfulJobsHistoryLimit"], spec["failedJobsHistoryLimit"]) == (3, 3)
        spec = all_render.one("CronJob")["spec"]
        assert (spec["schedule"], spec["timeZone"]) == ("15 3 * * *", "Europe/Berlin")
        assert (spec["successfulJobsHistoryLimit"], spec["failedJobsHistoryLimit"]) == (1, 5)

    def test_suspend(self, render: Callable[..., Rendered]) -> None:
        assert render(*REQUIRED, *ENABLED, "--set", "archive.suspend=true").one("CronJob")["spec"]["suspend"] is True

    def test_a_run_fails_fast_and_the_next_one_resumes(self, archive_render: Rendered) -> None:
        """restartPolicy Never and a small backoffLimit; exit 2 (a configuration error) fails the Job at once, an
        evicted pod does not count; the deadline is generous (a run may archive many segments)."""
        job = _job_spec(archive_render)
        assert pod_spec(archive_render.one("CronJob"))["restartPolicy"] == "Never"
        assert job["backoffLimit"] == 2
        assert job["activeDeadlineSeconds"] == 21600
        fail, ignore = job["podFailurePolicy"]["rules"]
        assert fail == {"action": "FailJob",
                        "onExitCodes": {"containerName": "archive", "operator": "In", "values": [2]}}
        assert ignore == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
        assert _archive(archive_render)["name"] == "archive"
        assert _archive(archive_render)["terminationMessagePolicy"] == "FallbackToLogsOnError"

    def test_the_name_leaves_room_for_the_job_suffix(self, render: Callable[..., Rendered]) -> None:
        """The controller names each Job <cronjob>-<11 characters>: a CronJob name is 52 characters at most."""
        rendered = render(*REQUIRED, *ENABLED, "--set", "fullnameOverride=" + "x" * 63)
        name = rendered.one("CronJob")["metadata"]["name"]
        assert len(name) <= 52, name
        assert pod_spec(rendered.one("CronJob"))["volumes"][1]["persistentVolumeClaim"]["claimName"] == (
            rendered.one("PersistentVolumeClaim")["metadata"]["name"])


class TestContainer:
    """`stock-ledger archive run` from the archive image (the app image with pyarrow, tagged <tag>-archive), called
    the way the migration Job calls `migrate`."""

    def test_runs_archive_run_through_the_images_entrypoint(self, archive_render: Rendered,
                                                           all_render: Rendered) -> None:
        for rendered in (archive_render, all_render):
            archive, migrate = _archive(rendered), _container(rendered.one("Job", "-migrate"))
            assert archive["args"] == ["archive", "run"]
            assert migrate["args"] == ["migrate"]
            assert "command" not in archive
            assert "command" not in migrate

    def test_the_archive_image_is_the_app_images_archive_variant(self, archive_render: Rendered,
                                                               render: Callable[..., Rendered]) -> None:
        """By default the app image's repository, registry and tag with -archive (what `make release` pushes);
        never the worker's image itself, which has no pyarrow."""
        archive, migrate = _archive(archive_render), _container(archive_render.one("Job", "-migrate"))
        assert archive["image"] == f"{migrate['image']}-archive"
        assert archive["imagePullPolicy"] == "IfNotPresent"
        app = ("--set", "image.registry=registry.example.com:5000", "--set", "image.repository=team/stock-ledger",
               "--set", "image.tag=1.4.2")
        assert _archive(render(*REQUIRED, *ENABLED, *app))["image"] == (
            "registry.example.com:5000/team/stock-ledger:1.4.2-archive")
        # the worker pinned by digest: that digest is not the archive image's, so its tag is used
        pinned = ("--set", "image.digest=sha256:" + "a" * 64)
        assert _archive(render(*REQUIRED, *ENABLED, *app, *pinned))["image"] == (
            "registry.example.com:5000/team/stock-ledger:1.4.2-archive")
        glob = ("--set", "global.imageRegistry=mirror.internal")
        assert _archive(render(*REQUIRED, *ENABLED, *app, *glob))["image"] == (
            "mirror.internal/team/stock-ledger:1.4.2-archive")

    def test_each_part_of_the_archive_image_can_be_set(self, render: Callable[..., Rendered]) -> None:
        own = ("--set", "archive.image.registry=other.example.com", "--set", "archive.image.repository=ops/archiver",
               "--set", "archive.image.tag=7.1", "--set", "archive.image.pullPolicy=Always")
        archive = _archive(render(*REQUIRED, *ENABLED, *own))
        assert (archive["image"], archive["imagePullPolicy"]) == ("other.example.com/ops/archiver:7.1", "Always")
        digest = "sha256:" + "b" * 64
        archive = _archive(render(*REQUIRED, *ENABLED, *own, "--set", f"archive.image.digest={digest}"))
        assert archive["image"] == f"other.example.com/ops/archiver@{digest}"

    def test_archive_dir_and_retention(self, archive_render: Rendered, all_render: Rendered) -> None:
        for rendered, days in ((archive_render, "90"), (all_render, "30")):
            env = env_by_name(_archive(rendered))
            assert env["STOCK_LEDGER_ARCHIVE_DIR"] == {"name": "STOCK_LEDGER_ARCHIVE_DIR", "value": ARCHIVE_DIR}
            assert env["STOCK_LEDGER_RETENTION_DAYS"] == {"name": "STOCK_LEDGER_RETENTION_DAYS", "value": days}

    @pytest.mark.parametrize(("days", "expected"), [("0", "0"), ("36500", "36500")])
    def test_retention_renders_as_an_integer(self, render: Callable[..., Rendered], tmp_path: Path, days: str,
                                             expected: str) -> None:
        """0 (archive everything older than today) is a value, not an absence; the largest the command accepts
        (36500) comes from a values file (Helm's float64) as a plain integer."""
        values = tmp_path / "archive.yaml"
        values.write_text(f"archive:\n  enabled: true\n  retentionDays: {days}\n")
        env = env_by_name(_archive(render(*REQUIRED, "--values", str(values))))
        assert env["STOCK_LEDGER_RETENTION_DAYS"]["value"] == expected

    def test_no_duplicate_variables(self, all_render: Rendered, secure_render: Rendered) -> None:
        for rendered in (all_render, secure_render):
            names = [e["name"] for e in _archive(rendered)["env"]]
            assert len(names) == len(set(names)), names


class TestDatabase:
    """The owner role's URL, from exactly the Secret and key the migration Job reads; never the worker's."""

    def test_the_migration_jobs_owner_url(self, archive_render: Rendered, all_render: Rendered) -> None:
        expected = {id(archive_render): {"name": MIGRATION_SECRET, "key": "DATABASE_URL"},
                    id(all_render): {"name": "stock-ledger-db-owner", "key": "owner-url"}}
        for rendered in (archive_render, all_render):
            archive = env_by_name(_archive(rendered))["DATABASE_URL"]
            assert archive == env_by_name(_container(rendered.one("Job", "-migrate")))["DATABASE_URL"]
            assert archive["valueFrom"]["secretKeyRef"] == expected[id(rendered)]
            assert archive != env_by_name(_container(rendered.one("Deployment", WORKERS)))["DATABASE_URL"]

    def test_without_migrations_it_still_reads_the_owner_secret(self, render: Callable[..., Rendered]) -> None:
        rendered = render(*REQUIRED, *ENABLED, "--set", "migrations.enabled=false")
        assert not rendered.of_kind("Job")
        assert env_by_name(_archive(rendered))["DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {
            "name": MIGRATION_SECRET, "key": "DATABASE_URL"}

    def test_a_missing_owner_secret_fails_naming_it(self, run_helm: Callable[..., HelmResult]) -> None:
        result = run_helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION,
                          "--set", f"database.existingSecret={SECRET}", "--set", "migrations.enabled=false", *ENABLED)
        assert result.returncode != 0, "rendered an archiver without the owner's Secret"
        message = " ".join(result.stderr.split())
        for fragment in ("database.migrationSecret is required while archive.enabled is true", "OWNER role",
                         f"kubectl -n {NAMESPACE} create secret generic stock-ledger-db-owner"):
            assert fragment in message, f"{fragment!r} not in:\n{result.stderr}"

    def test_the_worker_secret_and_key_are_refused(self, run_helm: Callable[..., HelmResult]) -> None:
        result = run_helm("template", RELEASE, str(CHART), "--kube-version", KUBE_VERSION, *ENABLED,
                          "--set", "migrations.enabled=false", "--set", f"database.existingSecret={SECRET}",
                          "--set", f"database.migrationSecret={SECRET}")
        assert result.returncode != 0
        assert "is the worker's Secret and key" in result.stderr, result.stderr

    def test_roles_and_tls_as_the_migration_job_and_no_pooling(self, render: Callable[..., Rendered]) -> None:
        """The ledger's role names and the sslmode floor, as the migration Job gets them; the workers' pooling
        (a transaction pooler behind their URL) is not the owner URL's."""
        rendered = render(*REQUIRED, *ENABLED, "--set", "database.roles.app=staging_app",
                          "--set", "database.roles.reader=staging_reader", "--set", "database.sslmodeMin=require",
                          "--set", "database.pooling=transaction")
        archive = env_by_name(_archive(rendered))
        migrate = env_by_name(_container(rendered.one("Job", "-migrate")))
        for name in ("STOCK_LEDGER_APP_ROLE", "STOCK_LEDGER_READER_ROLE", "STOCK_LEDGER_DATABASE_SSLMODE_MIN"):
            assert archive[name] == migrate[name], name
        assert "STOCK_LEDGER_DATABASE_POOLING" not in archive


class TestKafka:
    """The topic's log start offsets, read with the workers' connection settings and mounted secrets."""

    @pytest.mark.parametrize("which", ["archive_render", "all_render", "secure_render"])
    def test_the_workers_kafka_environment(self, request: pytest.FixtureRequest, which: str) -> None:
        rendered: Rendered = request.getfixturevalue(which)
        worker = env_by_name(_container(rendered.one("Deployment", WORKERS)))
        archive = env_by_name(_archive(rendered))
        names = [n for n in worker if n in KAFKA_NAMES or n.startswith("KAFKA_")]
        assert set(KAFKA_NAMES) | {"KAFKA_SECURITY_PROTOCOL"} <= set(names)
        assert {n: archive.get(n) for n in names} == {n: worker[n] for n in names}

    def test_the_workers_secret_files(self, secure_render: Rendered) -> None:
        """SASL password, client certificate, the brokers' and PostgreSQL's CAs: the same volumes, mounted at the
        same read-only paths, and the same variables naming them."""
        worker = secure_render.one("Deployment", WORKERS)
        archive = secure_render.one("CronJob")
        env = env_by_name(_archive(secure_render))
        assert env["KAFKA_SECURITY_PROTOCOL"]["value"] == "SASL_SSL"
        assert env["KAFKA_SASL_PASSWORD_FILE"]["value"] == "/etc/stock-ledger/kafka-sasl/password"
        assert "KAFKA_SASL_PASSWORD" not in env, "the password is a mounted file, never an environment variable"

        def files(manifest: Manifest) -> tuple[list[Any], list[Any]]:
            volumes = [v for v in pod_spec(manifest)["volumes"] if v["name"] in SECURITY_FILES]
            mounts = [m for m in _container(manifest)["volumeMounts"] if m["name"] in SECURITY_FILES]
            return volumes, mounts

        assert files(archive) == files(worker)
        assert [v["name"] for v in files(archive)[0]] == list(SECURITY_FILES)
        assert all(m["readOnly"] is True for m in files(archive)[1])


class TestPod:
    """The conventions of every pod of the chart: security contexts, image pull, placement, labels."""

    def test_security_contexts_are_the_charts(self, all_render: Rendered) -> None:
        archive, migrate = all_render.one("CronJob"), all_render.one("Job", "-migrate")
        assert pod_spec(archive)["securityContext"] == pod_spec(migrate)["securityContext"]
        assert _archive(all_render)["securityContext"] == _container(migrate)["securityContext"]
        assert _archive(all_render)["securityContext"]["readOnlyRootFilesystem"] is True
        assert pod_spec(archive)["automountServiceAccountToken"] is False
        assert pod_spec(archive)["enableServiceLinks"] is False

    def test_pull_secrets_and_placement_are_the_workers(self, all_render: Rendered) -> None:
        archive, worker = pod_spec(all_render.one("CronJob")), pod_spec(all_render.one("Deployment", WORKERS))
        for key in ("imagePullSecrets", "nodeSelector", "tolerations", "affinity"):
            assert key in worker, key
            assert archive[key] == worker[key], key

    def test_labels(self, all_render: Rendered) -> None:
        """instance + component archive + the chart's and common labels on the CronJob, its Jobs and pods; never
        the worker selector (the Deployment, PDB and monitors would count the pod)."""
        cronjob = all_render.one("CronJob")
        expected = {"app.kubernetes.io/instance": RELEASE, "app.kubernetes.io/component": "archive",
                    "app.kubernetes.io/managed-by": "Helm", "cost-center": "inventory-42"}
        for labels in (cronjob["metadata"]["labels"], cronjob["spec"]["jobTemplate"]["metadata"]["labels"],
                       pod_labels(cronjob), all_render.one("PersistentVolumeClaim")["metadata"]["labels"]):
            assert expected.items() <= labels.items(), labels
            assert not SELECTOR.items() <= labels.items()
        assert cronjob["metadata"]["annotations"] == {"example.com/contact": "inventory-oncall"}


class TestVolume:
    """The archive directory is the claim, writable; the chart's claim is never deleted with the release."""

    def test_mounted_writable_at_the_archive_dir(self, archive_render: Rendered) -> None:
        mounts = {m["name"]: m for m in _archive(archive_render)["volumeMounts"]}
        assert mounts["archive"] == {"name": "archive", "mountPath": ARCHIVE_DIR}
        assert mounts["tmp"]["mountPath"] == "/tmp"  # noqa: S108 - the chart's emptyDir, as in every pod
        volumes = {v["name"]: v for v in pod_spec(archive_render.one("CronJob"))["volumes"]}
        claim = archive_render.one("PersistentVolumeClaim")
        assert volumes["archive"] == {"name": "archive",
                                      "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}}
        assert claim["metadata"]["name"] == ARCHIVE

    def test_the_claim_outlives_the_release(self, archive_render: Rendered, all_render: Rendered) -> None:
        """Helm keeps it on uninstall and when the archive is turned off; Argo CD (which ignores Helm's annotation)
        neither prunes it nor deletes it with the Application. Not a hook: created and kept like any object."""
        for rendered in (archive_render, all_render):
            annotations = rendered.one("PersistentVolumeClaim")["metadata"]["annotations"]
            assert annotations["helm.sh/resource-policy"] == "keep"
            assert set(annotations["argocd.argoproj.io/sync-options"].split(",")) == {"Prune=false", "Delete=false"}
            for manifest in (rendered.one("PersistentVolumeClaim"), rendered.one("CronJob")):
                hooks = [k for k in manifest["metadata"].get("annotations", {})
                         if k in {"helm.sh/hook", "argocd.argoproj.io/hook"}]
                assert not hooks, kn(manifest)

    def test_claim_from_values(self, archive_render: Rendered, all_render: Rendered) -> None:
        spec = archive_render.one("PersistentVolumeClaim")["spec"]
        assert spec == {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "100Gi"}}}
        assert "storageClassName" not in spec, 'storageClass "": the cluster default, so the field is left out'
        spec = all_render.one("PersistentVolumeClaim")["spec"]
        assert (spec["storageClassName"], spec["resources"]["requests"]["storage"]) == ("fast-ssd", "500Gi")

    def test_an_existing_claim_is_used_and_none_created(self, render: Callable[..., Rendered]) -> None:
        rendered = render(*REQUIRED, *ENABLED, "--set", "archive.persistence.existingClaim=ledger-archives")
        assert "PersistentVolumeClaim" not in rendered.kinds()
        volumes = {v["name"]: v for v in pod_spec(rendered.one("CronJob"))["volumes"]}
        assert volumes["archive"]["persistentVolumeClaim"] == {"claimName": "ledger-archives"}


def test_secure_release_validates_strictly(secure_render: Rendered, render: Callable[..., Rendered]) -> None:
    """The CronJob and claim against the Kubernetes 1.30 schemas (values-all's render is validated by
    test_chart_validation), with every security file mounted, and with an existing claim and a time zone."""
    import kubernetes_validate  # noqa: PLC0415 - the deploy extras; test_chart_validation fails clearly without

    other = render(*REQUIRED, *ENABLED, "--set", "archive.persistence.existingClaim=ledger-archives",
                   "--set", "archive.timeZone=America/Argentina/Buenos_Aires", "--set", "archive.schedule=@daily",
                   "--set", "archive.persistence.accessModes={ReadWriteOncePod}")
    manifests = [*secure_render.of_kind("CronJob"), *secure_render.of_kind("PersistentVolumeClaim"),
                 *other.of_kind("CronJob")]
    assert len(manifests) == 3
    for manifest in manifests:
        kubernetes_validate.validate(manifest, KUBE_VERSION, strict=True)


def test_two_renders_are_identical(run_helm: Callable[..., HelmResult]) -> None:
    """Argo CD renders at every sync: nothing of the CronJob or the claim may change between renders."""
    args = ("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--values", str(VALUES_ALL),
            "--show-only", "templates/archive-cronjob.yaml", "--show-only", "templates/archive-pvc.yaml")
    first, second = run_helm(*args), run_helm(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout
    assert "kind: CronJob" in first.stdout
    assert "kind: PersistentVolumeClaim" in first.stdout


def test_the_install_notes_name_the_cronjob_and_the_claim(run_helm: Callable[..., HelmResult],
                                                          tmp_path: Path) -> None:
    result = render_notes(run_helm, tmp_path, *ENABLED)
    assert result.returncode == 0, result.stderr
    assert f"cronjob/{ARCHIVE} (30 2 * * *)" in result.stdout
    assert f"PVC {ARCHIVE}; the claim is kept on uninstall" in result.stdout
    assert "Archive:" not in render_notes(run_helm, tmp_path / "off").stdout


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        pytest.param(("archive.retentionDays=-1",), "/archive/retentionDays", id="negative-retention"),
        pytest.param(("archive.retentionDays=1.5",), "/archive/retentionDays", id="fractional-retention"),
        pytest.param(("archive.retentionDays=36501",), "/archive/retentionDays", id="beyond-the-commands-range"),
        pytest.param(("archive.retentionDay=30",), "retentionDay", id="unknown-key"),
        pytest.param(("archive.persistence.class=fast",), "/archive/persistence", id="unknown-persistence-key"),
        pytest.param(("archive.schedule=every night",), "/archive/schedule", id="not-cron"),
        pytest.param(("archive.schedule=CRON_TZ=UTC 30 2 * * *",), "/archive/schedule", id="cron-tz"),
        pytest.param(("archive.persistence.accessModes={ReadOnlyMany}",), "/archive/persistence/accessModes",
                     id="read-only-volume"),
        pytest.param(("archive.persistence.size=lots",), "/archive/persistence/size", id="bad-size"),
        pytest.param(("archive.persistence.existingClaim=Archive_1",), "/archive/persistence/existingClaim",
                     id="bad-claim-name"),
        pytest.param(("archive.resources.limits=null",), "/archive/resources", id="no-memory-limit"),
        pytest.param(("archive.image.tag=latest",), "/archive/image/tag", id="latest-archive-image"),
        pytest.param(("archive.image.digest=sha256:short",), "/archive/image/digest", id="bad-archive-digest"),
        pytest.param(("archive.image.pullPolicy=Sometimes",), "/archive/image/pullPolicy", id="bad-pull-policy"),
        pytest.param(("archive.image.name=x",), "/archive/image", id="unknown-image-key"),
    ],
)
def test_the_schema_refuses(run_helm: Callable[..., HelmResult], flags: tuple[str, ...], expected: str) -> None:
    args = [arg for flag in flags for arg in ("--set", flag)]
    result = run_helm("template", RELEASE, str(CHART), "--kube-version", KUBE_VERSION, *REQUIRED, *ENABLED, *args)
    assert result.returncode != 0, f"accepted {flags}"
    assert "values don't meet the specifications of the schema" in result.stderr, result.stderr
    assert expected in result.stderr, result.stderr
