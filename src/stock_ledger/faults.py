"""Test-only crash points, armed by STOCK_LEDGER_FAULT; inert (one dict lookup) when unset.

Syntax: comma-separated `point[@n][:action]`. The n-th time (1-based, default 1) the worker reaches `point`,
it takes `action`:
    kill  SIGKILL itself, exactly like an OOMKill or `kubectl delete --force` (default)
    stop  SIGSTOP itself: frozen mid-step, as in a long GC pause; the test thaws it with SIGCONT
    hang  (after_read only) the main loop waits for shutdown while the event loop and HTTP server live on: a
          stalled worker, as seen by /healthz
Points, in order:
    before_claim   the claim's Kafka generation read, the claim not yet sent (a claim delayed across a rebalance)
    after_read     records fetched, nothing written
    during_copy    inside the transaction, the server waiting for data in the middle of the movements' COPY
                   (where it ignores statement_timeout and idle_in_transaction_session_timeout)
    after_rows     inside the transaction, movements and quarantine rows written
    before_commit  inside the transaction, offsets advanced, COMMIT not yet sent
    after_commit   PostgreSQL committed, Kafka's advisory commit not yet sent
and, in the monitor's leader:
    during_closing inside a closing's transaction, its balances copied, COMMIT not yet sent
"""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING, Final, TypeVar

from stock_ledger.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

_T = TypeVar("_T")

POINTS: Final = ("before_claim", "after_read", "during_copy", "after_rows", "before_commit", "after_commit",
                  "during_closing")
_ACTIONS: Final = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "hang": None}


class Faults:
    def __init__(self, spec: str | None) -> None:
        self._armed: dict[str, list[tuple[int, signal.Signals | None]]] = {}
        self._seen: dict[str, int] = dict.fromkeys(POINTS, 0)
        for item in filter(None, (s.strip() for s in (spec or "").split(","))):
            where, _, action = item.partition(":")
            point, _, nth = where.partition("@")
            action = action or "kill"
            valid_nth = not nth or (nth.isascii() and nth.isdigit() and int(nth) >= 1)
            if (point not in POINTS or action not in _ACTIONS or not valid_nth
                    or (action == "hang" and point != "after_read")):
                raise ConfigError(
                    f"STOCK_LEDGER_FAULT item {item!r} must be point[@n][:kill|stop|hang] (n >= 1), point one of "
                    f"{', '.join(POINTS)} (hang: after_read only)"
                )
            self._armed.setdefault(point, []).append((int(nth or 1), _ACTIONS[action]))

    def __bool__(self) -> bool:
        return bool(self._armed)

    def armed(self, point: str) -> bool:
        return point in self._armed

    async def midway(self, point: str, rows: Sequence[_T]) -> AsyncIterator[_T]:
        """Yield `rows`, reaching `point` halfway through (COPY consumes them as the server waits for data)."""
        half = len(rows) // 2
        for i, row in enumerate(rows):
            if i == half:
                self.reached(point)
            yield row

    def reached(self, point: str) -> bool:
        """Count a visit to `point` and act if armed; True means: hang here."""
        plans = self._armed.get(point)
        if not plans:
            return False
        self._seen[point] += 1
        for nth, sig in plans:
            if nth == self._seen[point]:
                if sig is None:
                    return True
                os.kill(os.getpid(), sig)
        return False
