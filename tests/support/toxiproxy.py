"""toxiproxy (Shopify's TCP fault proxy) for the network-fault tests: the server scripts/tools.sh builds, run on a
free port, and a proxy in front of a TCP service whose toxics the tests add and remove through its HTTP API.

The toxics the tests use (toxiproxy's README; `toxics/*.go` of v2.12.0 for what removing one does):
    timeout, timeout=0  every byte dropped, connections left open: a blackhole. Unlike a real one, a close from
                        either end still passes through (a server that ends a blackholed session closes the client's
                        side too), and removing it CLOSES every connection that went through it (its Cleanup): a
                        client that never noticed the blackhole is rescued by its end.
    reset_peer          the connection is reset (RST) on the next data through it.
    latency             each chunk delayed by `latency` ms.
and the proxy disabled: its listener closed and its connections with it (connect: refused).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from tests.support.services import free_port

Stream = Literal["upstream", "downstream"]  # client -> server, server -> client


def find_server() -> str | None:
    """toxiproxy-server on PATH or where scripts/tools.sh installs it (None: not installed)."""
    cache = Path(os.environ.get("STOCK_LEDGER_CACHE", Path.home() / ".cache" / "stock-ledger"))
    return shutil.which("toxiproxy-server", path=os.pathsep.join([os.environ.get("PATH", ""), str(cache / "bin")]))


class ToxiproxyError(RuntimeError):
    pass


@dataclass(frozen=True)
class Api:
    """toxiproxy's HTTP API at `url`."""

    url: str

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}{path}", data=data, method=method,  # noqa: S310 - http only
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10) as r:  # noqa: S310 - our own server on 127.0.0.1
                text = r.read().decode()
        except urllib.error.HTTPError as e:
            raise ToxiproxyError(f"toxiproxy {method} {path}: HTTP {e.code} {e.read().decode()}") from e
        return json.loads(text) if text.strip() else None


@dataclass(frozen=True)
class Proxy:
    """One proxy: clients connect to 127.0.0.1:`port`, toxiproxy connects on to `upstream`."""

    api: Api
    name: str
    port: int
    upstream: str

    def route(self, url: str) -> str:
        """`url` (postgresql://user:pass@host:port/db?...) through this proxy."""
        parts = urlsplit(url)
        userinfo = parts.netloc.rpartition("@")[0]
        return urlunsplit(parts._replace(netloc=f"{userinfo}@127.0.0.1:{self.port}" if userinfo
                                         else f"127.0.0.1:{self.port}"))

    def add(self, toxic: str, kind: str, stream: Stream, **attributes: int) -> None:
        """Add the toxic `toxic` (a name of ours) of type `kind` on `stream`; it applies at once to every open
        connection and to every new one."""
        self.api.call("POST", f"/proxies/{self.name}/toxics",
                      {"name": toxic, "type": kind, "stream": stream, "toxicity": 1.0, "attributes": attributes})

    def remove(self, toxic: str) -> None:
        self.api.call("DELETE", f"/proxies/{self.name}/toxics/{toxic}")

    def toxics(self) -> list[str]:
        return [t["name"] for t in self.api.call("GET", f"/proxies/{self.name}/toxics")]

    def enable(self, *, enabled: bool) -> None:
        """Disabled: the listener is closed (a connect is refused) and every connection through it closed."""
        self.api.call("PATCH", f"/proxies/{self.name}", {"enabled": enabled})

    def heal(self) -> None:
        """No toxic, enabled: the path as it was."""
        for toxic in self.toxics():
            self.remove(toxic)
        self.enable(enabled=True)


class Toxiproxy:
    """`toxiproxy-server` on a free port of 127.0.0.1, its log in `log`; `stop()` ends it (and every proxy)."""

    def __init__(self, binary: str, log: Path) -> None:
        self.port = free_port()
        self.api = Api(f"http://127.0.0.1:{self.port}")
        self.log = log
        with log.open("wb") as out:
            self._proc = subprocess.Popen([binary, "-host", "127.0.0.1", "-port", str(self.port)],
                                          stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while not self._answers():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                msg = f"toxiproxy-server did not start on port {self.port}:\n{log.read_text(errors='replace')}"
                raise ToxiproxyError(msg)
            time.sleep(0.05)

    def _answers(self) -> bool:
        try:
            self.api.call("GET", "/version")
        except (OSError, ToxiproxyError):
            return False
        return True

    def proxy(self, name: str, upstream: str) -> Proxy:
        """A new, enabled proxy to `upstream` (host:port) on a port the system picks."""
        made = self.api.call("POST", "/proxies",
                             {"name": name, "listen": "127.0.0.1:0", "upstream": upstream, "enabled": True})
        return Proxy(self.api, name, int(made["listen"].rpartition(":")[2]), upstream)

    def delete(self, proxy: Proxy) -> None:
        """The proxy gone: its listener and every connection through it closed."""
        self.api.call("DELETE", f"/proxies/{proxy.name}")

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
