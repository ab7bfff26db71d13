"""One small asyncio HTTP server: /metrics, /healthz (liveness), /readyz (readiness).

It listens on every address of both IP families through one socket (an IPv6 socket that also accepts IPv4, as
IPv4-mapped addresses), so the kubelet's probes and Prometheus reach it in IPv4-only, dual-stack and IPv6-only
clusters alike; a kernel without IPv6 gets an IPv4 socket. /metrics speaks what the scraper asks for, through
prometheus-client's own negotiation: OpenMetrics for `Accept: application/openmetrics-text`, else the Prometheus
text format; gzip when `Accept-Encoding` allows it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gzip
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import structlog
from prometheus_client.exposition import choose_encoder, gzip_accepted

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = structlog.get_logger(__name__)

Check = Callable[[], Awaitable[tuple[bool, str]]]
_STATUS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}
# The kernel has no IPv6 at all (ipv6.disable=1, some minimal sandboxes): listen on IPv4 only.
_NO_IPV6 = frozenset({errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL, errno.EPROTONOSUPPORT})


def dual_stack_socket(port: int) -> socket.socket:
    """A listening TCP socket on every address of both families (`::` with IPV6_V6ONLY off: one port, one
    socket), or on 0.0.0.0 where the kernel has no IPv6."""
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    except OSError as exc:
        if exc.errno not in _NO_IPV6:
            raise
        return _bound(socket.socket(socket.AF_INET, socket.SOCK_STREAM), ("0.0.0.0", port))  # noqa: S104
    try:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        return _bound(sock, ("::", port))
    except OSError as exc:
        sock.close()
        if exc.errno not in _NO_IPV6:
            raise
        return _bound(socket.socket(socket.AF_INET, socket.SOCK_STREAM), ("0.0.0.0", port))  # noqa: S104


def _bound(sock: socket.socket, address: tuple[str, int]) -> socket.socket:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)  # noqa: FBT003 - the standard library's signature
    return sock


class HttpServer:
    def __init__(self, host: str | None, port: int, registry: CollectorRegistry, liveness: Check,
                 readiness: Check) -> None:
        """`host` None: every address of both families (the worker); a host: that address only (tests)."""
        self._host, self._port = host, port
        self._registry = registry
        self._routes: dict[str, Check] = {"/healthz": liveness, "/readyz": readiness}
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        """The bound port (useful when configured as 0)."""
        assert self._server is not None  # noqa: S101 - a programming error, not a runtime condition
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        if self._host is None:
            sock = dual_stack_socket(self._port)
            family = "IPv4 and IPv6" if sock.family == socket.AF_INET6 else "IPv4 only (no IPv6 in this kernel)"
            self._server = await asyncio.start_server(self._handle, sock=sock)
        else:
            family = self._host
            self._server = await asyncio.start_server(self._handle, self._host, self._port)
        log.info("http.listening", port=self.port, on=family, paths=["/metrics", "/healthz", "/readyz"])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            request_line, *header_lines = head.decode("latin-1").split("\r\n")
            method, path, *_ = request_line.split(" ")
            headers = {name.strip().lower(): value.strip()
                       for name, sep, value in (line.partition(":") for line in header_lines) if sep}
            status, extra, body = await self._respond(method, path.split("?", 1)[0], headers)
            fields = "".join(f"{name}: {value}\r\n" for name, value in extra)
            writer.write(
                f"HTTP/1.1 {status} {_STATUS[status]}\r\n{fields}"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body
            )
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, ConnectionError):
            pass  # a client that goes away or speaks nonsense gets nothing
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _respond(self, method: str, path: str,
                       headers: dict[str, str]) -> tuple[int, list[tuple[str, str]], bytes]:
        if method != "GET":
            return 405, [("Content-Type", "text/plain")], b"GET only\n"
        if path == "/metrics":
            encoder, content_type = choose_encoder(headers.get("accept", ""))
            body = encoder(self._registry)
            fields = [("Content-Type", content_type), ("Vary", "Accept, Accept-Encoding")]
            if gzip_accepted(headers.get("accept-encoding", "")):
                return 200, [*fields, ("Content-Encoding", "gzip")], gzip.compress(body)
            return 200, fields, body
        check = self._routes.get(path)
        if check is None:
            return 404, [("Content-Type", "text/plain")], b"try /metrics, /healthz or /readyz\n"
        ok, detail = await check()
        body = f"{'ok' if ok else 'unavailable'}: {detail}\n".encode()
        return (200 if ok else 503), [("Content-Type", "text/plain; charset=utf-8")], body
