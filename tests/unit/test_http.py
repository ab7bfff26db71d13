"""The HTTP server: /metrics for Prometheus (the format and compression the scraper asks for), /healthz and /readyz
for Kubernetes, on both IP families; no client can break it."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gzip
import socket
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest
import pytest_asyncio
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from stock_ledger.domain import RejectCode
from stock_ledger.metrics import Metrics
from stock_ledger.worker import health
from stock_ledger.worker.health import HttpServer

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


async def exchange(port: int, raw: bytes, host: str = "127.0.0.1") -> bytes:
    """Send raw bytes, read until the server closes the connection."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(raw)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def request(port: int, method: str, path: str, *, host: str = "127.0.0.1", **headers: str) -> Response:
    """One request; `headers` as keyword arguments (accept_encoding= is Accept-Encoding)."""
    fields = "".join(f"{name.replace('_', '-').title()}: {value}\r\n" for name, value in headers.items())
    data = await exchange(
        port, f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nUser-Agent: test\r\n{fields}\r\n".encode(), host
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
        """A client that names no format (curl) gets the classic text format, uncompressed, and the official
        parser reads every family."""
        r = await request(served.server.port, "GET", "/metrics")
        assert r.status == 200
        assert r.headers["content-type"] == CONTENT_TYPE_PLAIN_0_0_4
        assert "content-encoding" not in r.headers
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


# What Prometheus 2.42 (Debian's, tests/containers/test_prometheus.py) sends when it scrapes.
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


class TestNegotiation:
    """/metrics answers in the format and encoding the scraper asks for (prometheus-client's own negotiation)."""

    async def test_prometheus_gets_openmetrics(self, served: Served) -> None:
        """Prometheus' Accept header prefers OpenMetrics: the body is OpenMetrics (ends in `# EOF`, counters as
        counter families) and the OpenMetrics parser reads every family the text format has."""
        served.metrics.applied.inc(7)
        r = await request(served.server.port, "GET", "/metrics", accept=PROMETHEUS_ACCEPT)
        assert r.status == 200
        assert r.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
        assert r.body.endswith(b"# EOF\n")
        families = {f.name: f for f in openmetrics_families(r.body.decode())}
        assert families["stock_ledger_movements_applied"].type == "counter"
        [applied] = [s for s in families["stock_ledger_movements_applied"].samples if s.name.endswith("_total")]
        assert applied.value == 7
        plain = await request(served.server.port, "GET", "/metrics")
        # The text format shows a counter's creation time as a family of its own (`*_created`); OpenMetrics keeps it
        # inside the counter's family.
        assert set(families) >= {f.name for f in text_string_to_metric_families(plain.body.decode())
                                 if f.name.startswith("stock_ledger_") and not f.name.endswith("_created")}
        assert "accept" in r.headers["vary"].lower()

    async def test_text_format_when_openmetrics_is_not_asked_for(self, served: Served) -> None:
        """Asking for text/plain only gets text, never OpenMetrics."""
        r = await request(served.server.port, "GET", "/metrics", accept="text/plain;version=0.0.4")
        assert r.headers["content-type"] == CONTENT_TYPE_PLAIN_0_0_4
        assert b"# EOF" not in r.body

    @pytest.mark.parametrize("accept", ["", PROMETHEUS_ACCEPT], ids=["text", "openmetrics"])
    async def test_gzip_when_accepted(self, served: Served, accept: str) -> None:
        """`Accept-Encoding: gzip` gets a gzip body (Content-Encoding, Content-Length of the compressed bytes) that
        decompresses to exactly what an uncompressed scrape of the same format returns, apart from the sample
        values (the process collector moves between scrapes): same lines, same families."""
        zipped = await request(served.server.port, "GET", "/metrics", accept=accept, accept_encoding="deflate, gzip")
        plain = await request(served.server.port, "GET", "/metrics", accept=accept)
        assert zipped.headers["content-encoding"] == "gzip"
        assert zipped.headers["content-type"] == plain.headers["content-type"]
        unzipped = gzip.decompress(zipped.body)
        assert len(zipped.body) < len(unzipped)

        def names(body: bytes) -> list[str]:
            return [line.rsplit(" ", 1)[0] for line in body.decode().splitlines() if not line.startswith("process_")]

        assert names(unzipped) == names(plain.body)

    async def test_no_gzip_unless_accepted(self, served: Served) -> None:
        for encoding in ("identity", "br", "x-gzip"):
            r = await request(served.server.port, "GET", "/metrics", accept_encoding=encoding)
            assert "content-encoding" not in r.headers, encoding
            assert r.body.startswith(b"# HELP")

    async def test_urllib_with_gzip(self, served: Served) -> None:
        """A standard client that asks for gzip decompresses the body itself."""
        url = f"http://127.0.0.1:{served.server.port}/metrics"

        def get() -> tuple[str | None, bytes]:
            wanted = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"})
            with urllib.request.urlopen(wanted, timeout=5) as response:  # noqa: S310 - local URL
                return response.headers["Content-Encoding"], response.read()

        encoding, body = await asyncio.to_thread(get)
        assert encoding == "gzip"
        assert b"stock_ledger_build_info" in gzip.decompress(body)


class TestDualStack:
    """The worker's server (host None) listens on both families through one port: IPv4-only, dual-stack and
    IPv6-only clusters can all probe and scrape it."""

    async def test_ipv4_and_ipv6_reach_the_same_port(self) -> None:
        server = HttpServer(None, 0, CollectorRegistry(), Probe(ok=True, detail="v4 and v6"), Probe(ok=True, detail=""))
        await server.start()
        try:
            for host in ("127.0.0.1", "::1"):
                r = await request(server.port, "GET", "/healthz", host=host)
                assert (r.status, r.body) == (200, b"ok: v4 and v6\n"), host
        finally:
            await server.close()

    async def test_a_kernel_without_ipv6_gets_an_ipv4_socket(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Where an IPv6 socket cannot be made (ipv6.disable=1), the server still listens, on IPv4."""
        real = socket.socket

        def no_ipv6(family: int = socket.AF_INET, *args: object) -> socket.socket:
            if family == socket.AF_INET6:
                raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
            return real(family, *args)  # type: ignore[arg-type]

        monkeypatch.setattr(health.socket, "socket", no_ipv6)
        sock = health.dual_stack_socket(0)
        try:
            assert sock.family == socket.AF_INET
            assert sock.getsockname()[0] == "0.0.0.0"  # noqa: S104 - what is being checked
        finally:
            sock.close()

    async def test_other_socket_errors_are_not_hidden(self) -> None:
        """A port in use is an error to report, not a reason to fall back to IPv4."""
        taken = health.dual_stack_socket(0)
        try:
            taken.listen()
            with pytest.raises(OSError) as caught:
                health.dual_stack_socket(taken.getsockname()[1])
            assert caught.value.errno == errno.EADDRINUSE
        finally:
            taken.close()


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
