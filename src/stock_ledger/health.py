"""One small asyncio HTTP server: /metrics, /healthz (liveness), /readyz (readiness)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = structlog.get_logger(__name__)

Check = Callable[[], Awaitable[tuple[bool, str]]]
_STATUS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}


class HttpServer:
    def __init__(self, host: str, port: int, registry: CollectorRegistry, liveness: Check, readiness: Check) -> None:
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
        self._server = await asyncio.start_server(self._handle, self._host, self._port)
        log.info("http.listening", port=self.port, paths=["/metrics", "/healthz", "/readyz"])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            method, path, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            status, ctype, body = await self._respond(method, path.split("?", 1)[0])
            writer.write(
                f"HTTP/1.1 {status} {_STATUS[status]}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body
            )
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, ConnectionError):
            pass  # a client that goes away or speaks nonsense gets nothing
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _respond(self, method: str, path: str) -> tuple[int, str, bytes]:
        if method != "GET":
            return 405, "text/plain", b"GET only\n"
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(self._registry)
        check = self._routes.get(path)
        if check is None:
            return 404, "text/plain", b"try /metrics, /healthz or /readyz\n"
        ok, detail = await check()
        body = f"{'ok' if ok else 'unavailable'}: {detail}\n".encode()
        return (200 if ok else 503), "text/plain; charset=utf-8", body
