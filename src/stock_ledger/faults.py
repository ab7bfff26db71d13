"""Test-only crash points, armed by STOCK_LEDGER_FAULT; inert (one dict lookup) when unset.

Syntax: comma-separated `point[@n][:action]`. The n-th time (1-based, default 1) the worker reaches `point`,
it takes `action`:
    kill  SIGKILL itself, exactly like an OOMKill or `kubectl delete --force` (default)
    stop  SIGSTOP itself: frozen mid-step, as in a long GC pause; the test thaws it with SIGCONT
Points, in batch order:
    after_read     records fetched, nothing written
    after_rows     inside the transaction, movements and quarantine rows written
    before_commit  inside the transaction, offsets advanced, COMMIT not yet sent
    after_commit   PostgreSQL committed, Kafka's advisory commit not yet sent
"""

from __future__ import annotations

import os
import signal
from typing import Final

from stock_ledger.errors import ConfigError

POINTS: Final = ("after_read", "after_rows", "before_commit", "after_commit")
_ACTIONS: Final = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


class Faults:
    def __init__(self, spec: str | None) -> None:
        self._armed: dict[str, list[tuple[int, signal.Signals]]] = {}
        self._seen: dict[str, int] = dict.fromkeys(POINTS, 0)
        for item in filter(None, (s.strip() for s in (spec or "").split(","))):
            where, _, action = item.partition(":")
            point, _, nth = where.partition("@")
            if point not in POINTS or (action or "kill") not in _ACTIONS or (nth and not nth.isdigit()):
                raise ConfigError(
                    f"STOCK_LEDGER_FAULT item {item!r} must be point[@n][:kill|stop], point one of {', '.join(POINTS)}"
                )
            self._armed.setdefault(point, []).append((int(nth or 1), _ACTIONS[action or "kill"]))

    def __bool__(self) -> bool:
        return bool(self._armed)

    def reached(self, point: str) -> None:
        plans = self._armed.get(point)
        if not plans:
            return
        self._seen[point] += 1
        for nth, sig in plans:
            if nth == self._seen[point]:
                os.kill(os.getpid(), sig)
