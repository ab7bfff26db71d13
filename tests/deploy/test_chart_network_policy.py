"""The optional NetworkPolicy (networkPolicy.enabled) on the worker pods, read the way a CNI enforces it.

`allows` below evaluates the rendered policy for a connection from a pod (its labels and namespace) to a port of
a worker, with NetworkPolicy's semantics for matchLabels peers: a rule without `from` admits every source, a peer
with only a podSelector means pods of the policy's own namespace, a namespaceSelector alone every pod of the
matching namespaces, both together pods matching both. The chart uses no matchExpressions; a rendered one fails
the evaluation rather than being ignored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from .support import (
    CHART,
    KUBE_VERSION,
    NAMESPACE,
    RELEASE,
    REQUIRED,
    HelmResult,
    Manifest,
    Rendered,
    kn,
    pod_labels,
    pod_spec,
)

if TYPE_CHECKING:
    from collections.abc import Callable

pytestmark = pytest.mark.deploy

WORKERS = f"{RELEASE}-stock-ledger"
ENABLED = ("--set", "networkPolicy.enabled=true")
PEER = "networkPolicy.metricsFrom[0]"
PROMETHEUS = ("--set", f"{PEER}.namespaceSelector.matchLabels.kubernetes\\.io/metadata\\.name=monitoring",
              "--set", f"{PEER}.podSelector.matchLabels.app\\.kubernetes\\.io/name=prometheus")


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"the evaluator reads matchLabels only: {selector}"
    return bool(selector.get("matchLabels", {}).items() <= labels.items())


def _peer_admits(peer: dict[str, Any], labels: dict[str, str], namespace: str) -> bool:
    if "ipBlock" in peer:
        return False  # the sources here are pods
    namespace_labels = {"kubernetes.io/metadata.name": namespace}
    if "namespaceSelector" in peer:
        in_namespace = _matches(peer["namespaceSelector"], namespace_labels)
    else:
        in_namespace = namespace == NAMESPACE
    return in_namespace and _matches(peer.get("podSelector", {}), labels)


def allows(policy: Manifest, labels: dict[str, str], namespace: str, port: int) -> bool:
    """Whether `policy` admits TCP from a pod with `labels` in `namespace` to `port` of a pod it selects."""
    for rule in policy["spec"].get("ingress", []):
        sources = "from" not in rule or any(_peer_admits(p, labels, namespace) for p in rule["from"])
        ports = "ports" not in rule or any(
            p.get("protocol", "TCP") == "TCP" and p["port"] == port for p in rule["ports"])
        if sources and ports:
            return True
    return False


@pytest.fixture(scope="module")
def policy_render(render: Callable[..., Rendered]) -> Rendered:
    return render(*REQUIRED, *ENABLED, *PROMETHEUS)


def test_off_by_default(default_render: Rendered, all_render: Rendered) -> None:
    assert "NetworkPolicy" not in default_render.kinds() | all_render.kinds()


def test_selects_the_worker_pods_and_the_archive_pods_and_nothing_else(render: Callable[..., Rendered]) -> None:
    """The workers' policy selects the worker pods; with archive.enabled a second one selects the archive CronJob's
    pods. Not the hooks, the helm test pod or the drill: even with egress restricted, the migration pods (the owner
    role's DDL) reach PostgreSQL as before, since no policy selects them (a hook runs before the release's policies
    exist on a first install)."""
    rendered = render(*REQUIRED, *ENABLED, "--set", "chaos.enabled=true", "--set", "chaos.database.existingSecret=d",
                      "--set", "archive.enabled=true", "--set", "networkPolicy.egress.restricted=true")
    workers = rendered.one("NetworkPolicy", f"{WORKERS}")
    archive = rendered.one("NetworkPolicy", f"{WORKERS}-archive")
    checked: set[str] = set()
    for manifest in rendered.manifests:
        if manifest["kind"] not in {"Deployment", "Job", "Pod", "CronJob"}:
            continue
        checked.add(manifest["kind"])
        labels = pod_labels(manifest)
        assert _matches(workers["spec"]["podSelector"], labels) is (kn(manifest) == f"Deployment/{WORKERS}")
        assert _matches(archive["spec"]["podSelector"], labels) is (kn(manifest) == f"CronJob/{WORKERS}-archive")
    assert checked == {"Deployment", "Job", "Pod", "CronJob"}
    assert len(rendered.of_kind("NetworkPolicy")) == 2
    assert len(render(*REQUIRED, *ENABLED).of_kind("NetworkPolicy")) == 1, "an archive policy without the archive"


def test_the_archive_pods_admit_nobody_and_leave_as_the_workers_do(render: Callable[..., Rendered]) -> None:
    """They serve nothing: no source reaches any port of them, not even the metrics peers. Their egress is the
    workers' (DNS, Kafka, PostgreSQL, extra) when restricted, open otherwise."""
    for restricted in ("false", "true"):
        rendered = render(*REQUIRED, *ENABLED, *PROMETHEUS, "--set", "archive.enabled=true",
                          "--set", f"networkPolicy.egress.restricted={restricted}")
        archive = rendered.one("NetworkPolicy", f"{WORKERS}-archive")["spec"]
        workers = rendered.one("NetworkPolicy", f"{WORKERS}")["spec"]
        assert archive["ingress"] == []
        for labels, namespace in (({"app.kubernetes.io/name": "prometheus"}, "monitoring"),
                                  ({"app.kubernetes.io/instance": RELEASE, "app.kubernetes.io/component": "test"},
                                   NAMESPACE), ({"app": "curl"}, NAMESPACE)):
            assert not allows({"spec": archive}, labels, namespace, 9108)
        assert archive["policyTypes"] == workers["policyTypes"]
        assert archive.get("egress") == workers.get("egress")
        assert ("egress" in archive) is (restricted == "true")


def test_helm_test_reaches_every_worker_readyz_through_the_headless_service(policy_render: Rendered) -> None:
    """The readiness check resolves the headless Service (one address per pod the Service selects) and connects to
    WORKERS_PORT of each: those pods are the policy's, and the test pod is admitted on that port."""
    policy = policy_render.one("NetworkPolicy")
    pod = policy_render.one("Pod", "-test")
    ready = next(c for c in pod_spec(pod)["initContainers"] if c["name"] == "ready")
    env = {e["name"]: e["value"] for e in ready["env"]}
    service = policy_render.one("Service", "-workers")
    assert env["WORKERS_HOST"] == f"{service['metadata']['name']}.{NAMESPACE}.svc"
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == policy["spec"]["podSelector"]["matchLabels"]
    assert allows(policy, pod_labels(pod), NAMESPACE, int(env["WORKERS_PORT"]))


def test_metrics_port_admits_the_configured_prometheus_only(policy_render: Rendered) -> None:
    policy = policy_render.one("NetworkPolicy")
    prometheus = {"app.kubernetes.io/name": "prometheus"}
    assert allows(policy, prometheus, "monitoring", 9108)
    assert not allows(policy, prometheus, "monitoring", 5432), "only the metrics port"
    assert not allows(policy, prometheus, "default", 9108), "Prometheus of another namespace"
    assert not allows(policy, {"app": "curl"}, NAMESPACE, 9108), "any pod of the release's namespace"
    other_test = {"app.kubernetes.io/instance": "other", "app.kubernetes.io/component": "test"}
    assert not allows(policy, other_test, NAMESPACE, 9108), "another release's helm test"


def test_no_metrics_peers_admits_nobody_else(render: Callable[..., Rendered]) -> None:
    """An empty metricsFrom must not render `from: []`, which would admit every source."""
    policy = render(*REQUIRED, *ENABLED).one("NetworkPolicy")
    assert all(rule.get("from") for rule in policy["spec"]["ingress"])
    assert not allows(policy, {"app.kubernetes.io/name": "prometheus"}, "monitoring", 9108)
    assert not allows(policy, {"app": "curl"}, NAMESPACE, 9108)


def test_egress_is_open_by_default(policy_render: Rendered) -> None:
    spec = policy_render.one("NetworkPolicy")["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    assert "egress" not in spec


def test_restricted_egress_allows_dns_kafka_postgres_and_extra_only(render: Callable[..., Rendered]) -> None:
    rendered = render(*REQUIRED, *ENABLED, "--set", "networkPolicy.egress.restricted=true",
                      "--set", "networkPolicy.egress.kafka.to[0].ipBlock.cidr=10.20.0.0/16",
                      "--set", "networkPolicy.egress.kafka.ports={9092,9094}",
                      "--set", "networkPolicy.egress.extra[0].ports[0].port=443")
    spec = rendered.one("NetworkPolicy")["spec"]
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    assert spec["egress"] == [
        {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]},
        {"ports": [{"protocol": "TCP", "port": 9092}, {"protocol": "TCP", "port": 9094}],
         "to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}]},
        {"ports": [{"protocol": "TCP", "port": 5432}]},
        {"ports": [{"port": 443}]},
    ]


def test_policies_validate_strictly(render: Callable[..., Rendered]) -> None:
    import kubernetes_validate  # noqa: PLC0415 - the deploy extras; test_chart_validation fails clearly without

    for flags in ((), ("--set", "networkPolicy.egress.restricted=true",
                       "--set", "networkPolicy.egress.database.to[0].podSelector.matchLabels.app=pgbouncer")):
        for policy in render(*REQUIRED, *ENABLED, *PROMETHEUS, "--set", "archive.enabled=true",
                             *flags).of_kind("NetworkPolicy"):
            kubernetes_validate.validate(policy, KUBE_VERSION, strict=True)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        pytest.param(("--set", "networkPolicy.egress.kafka.ports=null"), "/networkPolicy/egress/kafka",
                     id="kafka-without-ports"),
        pytest.param(("--set", "networkPolicy.egress.database.ports={70000}"), "/networkPolicy/egress/database",
                     id="port-out-of-range"),
        pytest.param(("--set", "networkPolicy.ingress=x"), "/networkPolicy", id="unknown-key"),
    ],
)
def test_the_schema_refuses(run_helm: Callable[..., HelmResult], flags: tuple[str, ...], expected: str) -> None:
    result = run_helm("template", RELEASE, str(CHART), "--kube-version", KUBE_VERSION, *REQUIRED, *ENABLED, *flags)
    assert result.returncode != 0, f"accepted {flags}"
    assert "values don't meet the specifications of the schema" in result.stderr, result.stderr
    assert expected in result.stderr, result.stderr
