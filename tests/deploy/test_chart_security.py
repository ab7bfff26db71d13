"""A SASL_SSL release of the chart, offline: the kafka.security / database TLS values become the worker's
settings, secrets arrive as read-only files from existing Secrets (never as values or plain environment), the
ServiceAccount carries workload-identity annotations, and the schema refuses combinations that cannot work."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from stock_ledger.config import load_settings

from .support import CHART, KUBE_VERSION, NAMESPACE, REQUIRED, HelmResult, Rendered, env_by_name, kn, pod_spec

if TYPE_CHECKING:
    from collections.abc import Callable

pytestmark = pytest.mark.deploy

VALUES_SECURE = Path(__file__).resolve().parent / "values-secure.yaml"
SASL = ("--set", "kafka.security.protocol=SASL_SSL", "--set", "kafka.security.sasl.mechanism=SCRAM-SHA-512",
        "--set", "kafka.security.sasl.username=svc", "--set", "kafka.security.sasl.passwordSecret.name=kafka-pw")


@pytest.fixture(scope="module")
def secure_render(render: Callable[..., Rendered]) -> Rendered:
    return render("--values", str(VALUES_SECURE))


def _worker(rendered: Rendered) -> dict[str, Any]:
    container: dict[str, Any] = pod_spec(rendered.one("Deployment"))["containers"][0]
    return container


def test_the_secure_release_lints_and_validates_strictly(
    run_helm: Callable[..., HelmResult], secure_render: Rendered,
) -> None:
    """helm lint --strict passes, and every object validates against the Kubernetes 1.30 schema of its kind."""
    import kubernetes_validate  # noqa: PLC0415 - the deploy extras; test_chart_validation fails clearly without

    result = run_helm("lint", "--strict", "--kube-version", KUBE_VERSION, str(CHART), "--values", str(VALUES_SECURE))
    assert result.returncode == 0, result.stdout + result.stderr
    for manifest in secure_render.manifests:
        if manifest["apiVersion"].startswith("monitoring.coreos.com/"):
            continue
        try:
            kubernetes_validate.validate(manifest, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{kn(manifest)}: {'.'.join(map(str, e.path))}: {e.message}")


def test_values_map_to_the_worker_settings(secure_render: Rendered) -> None:
    env = {name: e.get("value") for name, e in env_by_name(_worker(secure_render)).items()}
    assert env["KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL"
    assert env["KAFKA_SASL_MECHANISM"] == "SCRAM-SHA-512"
    assert env["KAFKA_SASL_USERNAME"] == "stock-ledger"
    assert env["KAFKA_SASL_PASSWORD_FILE"] == "/etc/stock-ledger/kafka-sasl/password"  # noqa: S105 - a path
    assert env["KAFKA_SSL_CA_FILE"] == "/etc/stock-ledger/kafka-ca/ca.crt"
    assert env["KAFKA_SSL_CERT_FILE"] == "/etc/stock-ledger/kafka-client/tls.crt"
    assert env["KAFKA_SSL_KEY_FILE"] == "/etc/stock-ledger/kafka-client/tls.key"
    assert env["KAFKA_SSL_CHECK_HOSTNAME"] == "true"
    assert env["STOCK_LEDGER_DATABASE_SSLMODE_MIN"] == "verify-full"
    assert "KAFKA_SASL_PASSWORD" not in env, "the password is a mounted file, never an environment variable"


def test_the_rendered_environment_is_accepted_by_the_worker(secure_render: Rendered, tmp_path: Path) -> None:
    """The contract end to end: the chart's variables, with the mounted files in place, load as Settings."""
    env = {name: e["value"] for name, e in env_by_name(_worker(secure_render)).items() if "value" in e}
    for name, value in list(env.items()):
        if value.startswith("/etc/stock-ledger/"):
            path = tmp_path / value.removeprefix("/etc/stock-ledger/")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("s3cret\n")
            env[name] = str(path)
    env["DATABASE_URL"] = "postgresql://w:p@db/stock_ledger?sslmode=verify-full&sslrootcert=/ca.crt"
    s = load_settings(env)
    assert (s.kafka_security_protocol, s.kafka_sasl_mechanism, s.kafka_sasl_password) == (
        "SASL_SSL", "SCRAM-SHA-512", "s3cret")
    assert s.database_sslmode_min == "verify-full"


def test_secrets_are_read_only_files_from_existing_objects(secure_render: Rendered) -> None:
    """Password, client key and CA bundles: volumes from the named Secret / ConfigMap, mounted read-only, with
    no group or world write (and no world read for Secrets)."""
    spec = pod_spec(secure_render.one("Deployment"))
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["kafka-sasl"]["secret"]["secretName"] == "kafka-credentials"
    assert volumes["kafka-sasl"]["secret"]["items"] == [{"key": "sasl-password", "path": "password"}]
    assert volumes["kafka-ca"]["configMap"]["name"] == "kafka-ca-bundle"
    assert volumes["kafka-ca"]["configMap"]["items"] == [{"key": "ca.pem", "path": "ca.crt"}]
    assert volumes["kafka-client"]["secret"]["secretName"] == "stock-ledger-kafka-client"
    assert volumes["database-ca"]["secret"]["secretName"] == "postgres-ca"
    for name in ("kafka-sasl", "kafka-client", "database-ca"):
        assert volumes[name]["secret"]["defaultMode"] & 0o007 == 0, name
    mounts = {m["name"]: m for m in _worker(secure_render)["volumeMounts"]}
    for name in ("kafka-sasl", "kafka-ca", "kafka-client", "database-ca", "extra"):
        assert mounts[name]["readOnly"] is True, name
    assert mounts["extra"]["mountPath"] == "/extra"
    assert {"name": "extra", "emptyDir": {}} in spec["volumes"]
    assert _worker(secure_render)["envFrom"] == [{"configMapRef": {"name": "stock-ledger-extra"}}]


def test_the_migration_job_gets_the_database_tls_settings_only(secure_render: Rendered) -> None:
    job = secure_render.one("Job", "-migrate")
    container = pod_spec(job)["containers"][0]
    env = env_by_name(container)
    assert env["STOCK_LEDGER_DATABASE_SSLMODE_MIN"]["value"] == "verify-full"
    assert not [name for name in env if name.startswith("KAFKA_")]
    assert [v["name"] for v in pod_spec(job)["volumes"]] == ["tmp", "database-ca"]


def test_a_created_service_account_carries_its_annotations(secure_render: Rendered) -> None:
    account = secure_render.one("ServiceAccount")
    assert account["metadata"]["annotations"] == {
        "eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/stock-ledger"}
    assert account["automountServiceAccountToken"] is False
    spec = pod_spec(secure_render.one("Deployment"))
    assert spec["serviceAccountName"] == account["metadata"]["name"]
    assert spec["automountServiceAccountToken"] is False


def test_an_existing_service_account_is_used_by_name(render: Callable[..., Rendered]) -> None:
    rendered = render(*REQUIRED, "--set", "serviceAccount.name=inventory-workers")
    assert "ServiceAccount" not in rendered.kinds()
    assert pod_spec(rendered.one("Deployment"))["serviceAccountName"] == "inventory-workers"


def test_plaintext_defaults_mount_nothing(default_render: Rendered) -> None:
    env = env_by_name(_worker(default_render))
    assert env["KAFKA_SECURITY_PROTOCOL"]["value"] == "PLAINTEXT"
    assert not {"KAFKA_SASL_MECHANISM", "KAFKA_SSL_CA_FILE", "STOCK_LEDGER_DATABASE_SSLMODE_MIN"} & set(env)
    assert [v["name"] for v in pod_spec(default_render.one("Deployment"))["volumes"]] == ["tmp"]


def test_a_sasl_ssl_release_without_a_ca_uses_the_system_cas(render: Callable[..., Rendered]) -> None:
    env = env_by_name(_worker(render(*REQUIRED, *SASL)))
    assert env["KAFKA_SECURITY_PROTOCOL"]["value"] == "SASL_SSL"
    assert "KAFKA_SSL_CA_FILE" not in env


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        pytest.param((*REQUIRED, "--set", "kafka.security.protocol=SASL_SSL"), ["/kafka/security"],
                     id="sasl-without-anything"),
        pytest.param((*REQUIRED, *SASL, "--set", "kafka.security.sasl.mechanism="), ["mechanism"],
                     id="sasl-without-mechanism"),
        pytest.param((*REQUIRED, *SASL, "--set", "kafka.security.sasl.passwordSecret.name="), ["name"],
                     id="sasl-without-password-secret"),
        pytest.param((*REQUIRED, *SASL, "--set", "kafka.security.sasl.username="), ["username"],
                     id="sasl-without-username"),
        pytest.param((*REQUIRED, "--set", "kafka.security.sasl.mechanism=PLAIN"), ["mechanism"],
                     id="sasl-values-with-plaintext"),
        pytest.param((*REQUIRED, "--set", "kafka.security.tls.ca.secretName=ca"), ["secretName"],
                     id="ca-with-plaintext"),
        pytest.param((*REQUIRED, *SASL, "--set", "kafka.security.tls.ca.secretName=a",
                      "--set", "kafka.security.tls.ca.configMapName=b"), ["/kafka/security/tls/ca"],
                     id="ca-from-both"),
        pytest.param((*REQUIRED, "--set", "kafka.security.protocol=TLS"), ["/kafka/security/protocol"],
                     id="unknown-protocol"),
        pytest.param((*REQUIRED, "--set", "database.sslmodeMin=strict"), ["/database/sslmodeMin"],
                     id="unknown-sslmode"),
        pytest.param((*REQUIRED, "--set", "serviceAccount.token=true"), ["/serviceAccount"],
                     id="unknown-service-account-key"),
    ],
)
def test_the_schema_refuses_combinations_that_cannot_work(
    run_helm: Callable[..., HelmResult], flags: tuple[str, ...], expected: list[str],
) -> None:
    result = run_helm("template", "ledger", str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION,
                      *flags)
    assert result.returncode != 0, f"accepted {flags}"
    assert "values don't meet the specifications of the schema" in result.stderr, result.stderr
    for fragment in expected:
        assert fragment in result.stderr, f"{fragment!r} not in:\n{result.stderr}"
