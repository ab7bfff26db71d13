"""The HTTP server: /metrics for Prometheus, /healthz and /readyz for Kubernetes; no client can break it."""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest
import pytest_asyncio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from stock_ledger.domain import RejectCode
from stock_ledger.health import HttpServer
from stock_ledger.metrics import Metrics

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

# The codes themselves are pinned as the contract in test_domain; here: every one of them is exported.
REASONS = tuple(c.value for c in RejectCode)


@dataclass
class Probe:
    """A check whose answer the test sets; counts how often the server asked."""

    ok: bool
    detail: str
    calls: int = 0

    async def __call__(self) -> tuple[bool, str]:
        self.calls += 1
        return self.ok, self.detail


@dataclass
class Served:
    server: HttpServer
    registry: CollectorRegistry
    metrics: Metrics
    liveness: Probe
    readiness: Probe


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes


@pytest_asyncio.fixture
async def served() -> AsyncIterator[Served]:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    liveness, readiness = (
        Probe(ok=True, detail="last progress 0.1s ago"),
        Probe(ok=False, detail="claiming 3 partitions"),
    )
    server = HttpServer("127.0.0.1", 0, registry, liveness, readiness)
    await server.start()
    try:
        yield Served(server, registry, metrics, liveness, readiness)
    finally:
        await server.close()


async def exchange(port: int, raw: bytes) -> bytes:
    """Send raw bytes, read until the server closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def request(port: int, method: str, path: str) -> Response:
    data = await exchange(
        port, f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nUser-Agent: test\r\n\r\n".encode()
    )
    head, sep, body = data.partition(b"\r\n\r\n")
    assert sep, f"no complete response: {data!r}"
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    version, status, _ = status_line.split(" ", 2)
    assert version == "HTTP/1.1"
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    assert int(headers["content-length"]) == len(body)
    return Response(int(status), headers, body)


pytestmark = pytest.mark.asyncio


class TestMetrics:
    """GET /metrics is the Prometheus text exposition of the injected registry."""

    async def test_metrics_is_200_and_parses_as_prometheus_text(self, served: Served) -> None:
        """Prometheus can scrape it: the right content type, and the official parser reads every family."""
        r = await request(served.server.port, "GET", "/metrics")
        assert r.status == 200
        assert r.headers["content-type"] == CONTENT_TYPE_LATEST
        families = {f.name: f for f in text_string_to_metric_families(r.body.decode())}
        assert families, "no metric families"
        # Ours, plus client_python's standard process_* and python_* collectors (the operations issue asks for them).
        assert all(name.startswith(("stock_ledger_", "process_", "python_")) for name in families)
        assert any(name.startswith("stock_ledger_") for name in families)

    async def test_build_info_is_exported_as_1_with_versions(self, served: Served) -> None:
        """stock_ledger_build_info{version,python,aiokafka,asyncpg} = 1, so dashboards show what runs."""
        r = await request(served.server.port, "GET", "/metrics")
        families = {f.name: f for f in text_string_to_metric_families(r.body.decode())}
        [sample] = families["stock_ledger_build_info"].samples
        assert sample.value == 1
        assert set(sample.labels) == {"version", "python", "aiokafka", "asyncpg"}
        assert all(sample.labels.values())

    async def test_every_rejection_reason_is_exported_as_zero_before_any_traffic(
        self, served: Served
    ) -> None:
        """rate() and alerts need a 0, not an absent series: every reason exists at start."""
        r = await request(served.server.port, "GET", "/metrics")
        families = {f.name: f for f in text_string_to_metric_families(r.body.decode())}
        rejected = families["stock_ledger_movements_rejected"]
        assert rejected.type == "counter"
        values = {s.labels["reason"]: s.value for s in rejected.samples if s.name.endswith("_total")}
        assert values == dict.fromkeys(REASONS, 0.0)

    async def test_metrics_reflect_the_registry_at_scrape_time(self, served: Served) -> None:
        """A counter incremented after start shows up in the next scrape."""
        served.metrics.rejected.labels("sign_mismatch").inc(3)
        served.metrics.applied.inc(42)
        r = await request(served.server.port, "GET", "/metrics?debug=1")
        text = r.body.decode()
        assert 'stock_ledger_movements_rejected_total{reason="sign_mismatch"} 3.0' in text
        assert "stock_ledger_movements_applied_total 42.0" in text

    async def test_a_standard_http_client_can_scrape(self, served: Served) -> None:
        """Not only our hand-made requests: urllib (HTTP/1.1, Connection: close) reads the response."""
        url = f"http://127.0.0.1:{served.server.port}/metrics"

        def get() -> tuple[int, bytes]:
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.status, response.read()

        status, body = await asyncio.to_thread(get)
        assert status == 200
        assert b"stock_ledger_build_info" in body


class TestProbes:
    """/healthz and /readyz answer what the injected checks say, asked afresh on every request."""

    @pytest.mark.parametrize(("path", "probe"), [("/healthz", "liveness"), ("/readyz", "readiness")])
    async def test_a_passing_check_is_200_with_its_detail(
        self, served: Served, path: str, probe: str
    ) -> None:
        """200 and the check's detail in the body."""
        check: Probe = getattr(served, probe)
        check.ok, check.detail = True, "all 24 partitions claimed"
        r = await request(served.server.port, "GET", path)
        assert r.status == 200
        assert r.headers["content-type"].startswith("text/plain")
        assert b"all 24 partitions claimed" in r.body

    @pytest.mark.parametrize(("path", "probe"), [("/healthz", "liveness"), ("/readyz", "readiness")])
    async def test_a_failing_check_is_503_with_its_detail(
        self, served: Served, path: str, probe: str
    ) -> None:
        """503 and the detail, so `kubectl describe pod` says why."""
        check: Probe = getattr(served, probe)
        check.ok, check.detail = False, "no batch committed for 75s"
        r = await request(served.server.port, "GET", path)
        assert r.status == 503
        assert b"no batch committed for 75s" in r.body

    async def test_each_probe_asks_its_own_check_every_time(self, served: Served) -> None:
        """Readiness flips from 503 to 200 when the check does; liveness is not consulted for /readyz."""
        port = served.server.port
        assert (await request(port, "GET", "/readyz")).status == 503
        served.readiness.ok = True
        assert (await request(port, "GET", "/readyz")).status == 200
        assert (await request(port, "GET", "/healthz")).status == 200
        assert (served.readiness.calls, served.liveness.calls) == (2, 1)


class TestRouting:
    """Anything but GET of the three paths gets a clear refusal."""

    @pytest.mark.parametrize("path", ["/", "/metric", "/health", "/readyz/extra", "/../etc/passwd"])
    async def test_an_unknown_path_is_404(self, served: Served, path: str) -> None:
        """404 with a hint of the paths that exist."""
        r = await request(served.server.port, "GET", path)
        assert r.status == 404
        assert b"/metrics" in r.body

    @pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "HEAD"])
    @pytest.mark.parametrize("path", ["/metrics", "/readyz", "/nowhere"])
    async def test_other_methods_are_405(self, served: Served, method: str, path: str) -> None:
        """Read-only endpoints: other methods are refused without running any check."""
        r = await request(served.server.port, method, path)
        assert r.status == 405
        assert served.readiness.calls == 0


class TestRobustness:
    """A scraper that misbehaves must not take the probes down with it: a later request still works."""

    @pytest.mark.parametrize(
        "raw",
        [
            b"garbage\r\n\r\n",
            b"\r\n\r\n",
            b"GET\r\n\r\n",
            b"\x00\xff\xfe binary \x80\r\n\r\n",
            b"GET /metr",  # then the client goes away mid-request
            b"",  # connect and close at once
        ],
        ids=["garbage", "empty-request-line", "no-path", "binary", "partial", "nothing"],
    )
    async def test_garbage_then_disconnect_leaves_the_server_serving(
        self, served: Served, raw: bytes
    ) -> None:
        """The bad client gets no response (or a refusal); the next client gets its answer."""
        reader, writer = await asyncio.open_connection("127.0.0.1", served.server.port)
        writer.write(raw)
        await writer.drain()
        if raw.endswith(b"\r\n\r\n"):
            answer = await asyncio.wait_for(reader.read(), 10)
            assert answer == b"" or answer.startswith(b"HTTP/1.1 4")
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
        assert (await request(served.server.port, "GET", "/metrics")).status == 200

    async def test_an_oversized_request_head_is_dropped(self, served: Served) -> None:
        """A request head larger than the stream limit (64 KiB) is dropped; the server keeps serving."""
        with contextlib.suppress(ConnectionError):
            await exchange(served.server.port, b"GET /" + b"a" * 200_000 + b" HTTP/1.1\r\n\r\n")
        assert (await request(served.server.port, "GET", "/healthz")).status == 200

    async def test_a_silent_client_does_not_block_others(self, served: Served) -> None:
        """A connection that sends nothing (a stuck scraper) does not delay other requests."""
        _, idle = await asyncio.open_connection("127.0.0.1", served.server.port)
        try:
            r = await asyncio.wait_for(request(served.server.port, "GET", "/readyz"), 2)
            assert r.status == 503
        finally:
            idle.close()
            with contextlib.suppress(ConnectionError):
                await idle.wait_closed()

    async def test_many_concurrent_scrapes_all_succeed(self, served: Served) -> None:
        """Prometheus replicas and kubelet probes at once: every request is answered."""
        responses = await asyncio.gather(
            *(request(served.server.port, "GET", path) for path in ["/metrics", "/healthz", "/readyz"] * 10)
        )
        assert [r.status for r in responses] == [200, 200, 503] * 10


async def test_close_stops_listening_and_is_idempotent() -> None:
    """After close() the port refuses connections; a second close() is harmless."""
    server = HttpServer(
        "127.0.0.1", 0, CollectorRegistry(), Probe(ok=True, detail=""), Probe(ok=True, detail="")
    )
    await server.start()
    port = server.port
    assert (await request(port, "GET", "/healthz")).status == 200
    await server.close()
    await server.close()
    with pytest.raises(OSError):  # noqa: PT012 - the connection attempt is the refused step
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.close()
