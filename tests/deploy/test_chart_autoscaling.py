"""autoscaling.enabled: the workers scale on lag, never beside a fixed `replicas`, at most one per partition.

The rendered objects are validated offline: the KEDA ScaledObject and TriggerAuthentication against KEDA's own CRD
schemas (vendored in tests/deploy/schemas/keda from KEDA v2.21.0's Go module by vendor.py there), strictly (a field
the schema does not know is an error, as kubernetes-validate's strict mode does for built-in kinds), and the Kafka
trigger's parameters against those KEDA's Kafka scaler reads (its source's `keda:` tags); the HPA against the
Kubernetes autoscaling/v2 schema (kubernetes-validate).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jsonschema
import pytest

from .support import CHART, KUBE_VERSION, REQUIRED, HelmResult, Manifest, Rendered
from .test_chart_properties import WORKERS

if TYPE_CHECKING:
    from collections.abc import Callable

pytestmark = pytest.mark.deploy

KEDA = Path(__file__).resolve().parent / "schemas" / "keda"
ON = (*REQUIRED, "--set", "autoscaling.enabled=true")
SASL_TLS = ("--set", "kafka.security.protocol=SASL_SSL", "--set", "kafka.security.sasl.mechanism=SCRAM-SHA-512",
            "--set", "kafka.security.sasl.username=ledger", "--set", "kafka.security.sasl.passwordSecret.name=kafka-pw",
            "--set", "kafka.security.tls.ca.configMapName=kafka-ca",
            "--set", "kafka.security.tls.clientCertSecret=kafka-client")


def strict(schema: Any) -> Any:
    """The CRD schema with unknown fields refused: every object schema that lists its properties and neither
    allows additional ones nor preserves unknown fields gets additionalProperties: false."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if (node.get("type") == "object" and "properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def keda_errors(manifest: Manifest) -> list[str]:
    name = {"ScaledObject": "scaledobject", "TriggerAuthentication": "triggerauthentication"}[manifest["kind"]]
    schema = strict(json.loads((KEDA / f"{name}.json").read_text()))
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(manifest)]


def kafka_parameters() -> dict[str, Any]:
    parameters: dict[str, Any] = json.loads((KEDA / "kafka-trigger.json").read_text())["parameters"]
    return parameters


def trigger_errors(scaled: Manifest, auth: Manifest | None) -> list[str]:
    """What KEDA's Kafka scaler would refuse: metadata it does not read from triggerMetadata, a value outside an
    enum, a required parameter missing, an authentication parameter it does not read from authParams."""
    known = kafka_parameters()
    [trigger] = scaled["spec"]["triggers"]
    metadata = trigger["metadata"]
    errors = [f"metadata {key}: not a triggerMetadata parameter" for key in metadata
              if "triggerMetadata" not in known.get(key, {}).get("from", [])]
    errors += [f"metadata {key}={value}: not one of {known[key]['enum']}" for key, value in metadata.items()
               if "enum" in known.get(key, {}) and value not in known[key]["enum"]]
    errors += [f"{key} missing" for key, p in known.items() if p["required"] and key not in metadata]
    if auth is not None:
        spec = auth["spec"]
        given = [r["parameter"] for refs in ("secretTargetRef", "configMapTargetRef", "env")
                 for r in spec.get(refs, [])]
        errors += [f"auth {p}: not an authParams parameter" for p in given
                   if "authParams" not in known.get(p, {}).get("from", [])]
    return errors


@pytest.fixture(scope="module")
def kubernetes_validate() -> Any:
    import kubernetes_validate  # noqa: PLC0415 - test_chart_validation fails clearly without it

    return kubernetes_validate


class TestKeda:
    def test_a_scaled_object_replaces_the_fixed_replicas(self, render: Callable[..., Rendered]) -> None:
        """The Deployment has no replicas (Helm and Argo CD would fight the autoscaler); the ScaledObject targets it,
        scales from minReplicas to kafka.partitions (48: beyond the old cap of 24) on the group's lag, and validates
        against KEDA's schema and its Kafka scaler's parameters; no credentials, no TriggerAuthentication."""
        rendered = render(*ON, "--set", "kafka.partitions=48")
        deployment = rendered.one("Deployment", WORKERS)
        assert "replicas" not in deployment["spec"]
        scaled = rendered.one("ScaledObject")
        assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                    "name": deployment["metadata"]["name"]}
        assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (1, 48)
        metadata = scaled["spec"]["triggers"][0]["metadata"]
        assert metadata | {"lagThreshold": "10000", "allowIdleConsumers": "false"} == metadata
        assert (metadata["consumerGroup"], metadata["topic"]) == ("stock-ledger", "warehouse.movements")
        assert "authenticationRef" not in scaled["spec"]["triggers"][0]
        assert not rendered.of_kind("TriggerAuthentication")
        assert not rendered.of_kind("HorizontalPodAutoscaler")
        assert keda_errors(scaled) == []
        assert trigger_errors(scaled, None) == []

    def test_kafka_credentials_come_from_the_charts_secrets(self, render: Callable[..., Rendered]) -> None:
        """SASL_SSL with a CA ConfigMap and a client certificate: the trigger says scram_sha512 and TLS, and a
        TriggerAuthentication points at the same Secrets, ConfigMap and user name the workers use."""
        rendered = render(*ON, *SASL_TLS)
        scaled, auth = rendered.one("ScaledObject"), rendered.one("TriggerAuthentication")
        trigger = scaled["spec"]["triggers"][0]
        assert (trigger["metadata"]["sasl"], trigger["metadata"]["tls"]) == ("scram_sha512", "enable")
        assert trigger["authenticationRef"] == {"name": auth["metadata"]["name"]}
        refs = {r["parameter"]: (r["name"], r["key"]) for r in auth["spec"]["secretTargetRef"]}
        assert refs == {"password": ("kafka-pw", "password"), "cert": ("kafka-client", "tls.crt"),
                        "key": ("kafka-client", "tls.key")}
        assert auth["spec"]["configMapTargetRef"] == [{"parameter": "ca", "name": "kafka-ca", "key": "ca.crt"}]
        worker = rendered.one("Deployment", WORKERS)["spec"]["template"]["spec"]["containers"][0]
        [env] = auth["spec"]["env"]
        assert env["containerName"] == worker["name"]
        assert {"name": env["name"], "value": "ledger"} in worker["env"]
        assert keda_errors(scaled) == keda_errors(auth) == []
        assert trigger_errors(scaled, auth) == []

    def test_the_checks_are_not_vacuous(self, render: Callable[..., Rendered]) -> None:
        """A misspelt field fails the strict CRD schema; an unknown trigger parameter or enum value fails the
        scaler's."""
        scaled = render(*ON).one("ScaledObject")
        broken = copy.deepcopy(scaled)
        broken["spec"]["maxReplicas"] = 3
        assert any("maxReplicas" in e for e in keda_errors(broken))
        broken = copy.deepcopy(scaled)
        broken["spec"]["triggers"][0]["metadata"] |= {"lagTreshold": "5", "offsetResetPolicy": "none"}
        assert {e.split(":")[0] for e in trigger_errors(broken, None)} == {"metadata lagTreshold",
                                                                           "metadata offsetResetPolicy=none"}


class TestHpa:
    def test_an_hpa_on_the_external_lag_metric(self, render: Callable[..., Rendered], kubernetes_validate: Any) -> None:
        rendered = render(*ON, "--set", "autoscaling.engine=hpa", "--set", "autoscaling.minReplicas=2",
                          "--set", "autoscaling.maxReplicas=12")
        assert "replicas" not in rendered.one("Deployment", WORKERS)["spec"]
        hpa = rendered.one("HorizontalPodAutoscaler")
        kubernetes_validate.validate(hpa, KUBE_VERSION, strict=True)
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 12)
        [metric] = hpa["spec"]["metrics"]
        assert metric["external"]["metric"]["selector"]["matchLabels"] == {
            "app_kubernetes_io_instance": "ledger", "topic": "warehouse.movements"}
        assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "10000"}
        assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
        assert not rendered.of_kind("ScaledObject")


@pytest.mark.parametrize(("flags", "message"), [
    (("--set", "autoscaling.maxReplicas=25"), "autoscaling.maxReplicas 25 exceeds kafka.partitions 24"),
    (("--set", "autoscaling.minReplicas=30", "--set", "kafka.partitions=48", "--set", "autoscaling.maxReplicas=20"),
     "autoscaling.minReplicas 30 exceeds the maximum 20"),
    (("--set", "autoscaling.minReplicas=0"), "/autoscaling/minReplicas"),
    (("--set", "autoscaling.engine=vpa"), "/autoscaling/engine"),
])
def test_bounds_follow_the_partitions(run_helm: Callable[..., HelmResult], flags: tuple[str, ...],
                                      message: str) -> None:
    result = run_helm("template", "ledger", str(CHART), *ON, *flags)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_replicas_follow_the_partitions_without_autoscaling(render: Callable[..., Rendered]) -> None:
    """The schema's old cap of 24 is gone: 48 replicas on 48 partitions render; helm test waits for the replicas,
    or for autoscaling.minReplicas when the count moves."""
    fixed = render(*REQUIRED, "--set", "kafka.partitions=48", "--set", "replicaCount=48")
    assert fixed.one("Deployment", WORKERS)["spec"]["replicas"] == 48

    def expected(rendered: Rendered) -> str:
        ready = rendered.one("Pod", "-test")["spec"]["initContainers"][0]
        return next(e["value"] for e in ready["env"] if e["name"] == "WORKERS_EXPECTED")

    assert expected(fixed) == "48"
    assert expected(render(*ON, "--set", "autoscaling.minReplicas=3")) == "3"
