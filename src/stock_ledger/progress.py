"""Progress for long operations, on stderr: a live line on a terminal, a line every few seconds elsewhere."""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, what: str, total: int | None, stream: TextIO | None = None, every: float = 2.0) -> None:
        self._what, self._total = what, total
        self._stream = stream or sys.stderr
        # A live line redraws with ANSI escapes; NO_COLOR (https://no-color.org) asks for none: plain lines.
        self._tty = self._stream.isatty() and not os.environ.get("NO_COLOR")
        self._every = 0.2 if self._tty else every
        self._started = self._last = time.monotonic()
        self.done = 0

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if now - self._last >= self._every:
            self._last = now
            self._emit(now, final=False)

    def finish(self) -> None:
        self._emit(time.monotonic(), final=True)

    def _emit(self, now: float, *, final: bool) -> None:
        elapsed = max(now - self._started, 1e-9)
        rate = self.done / elapsed
        if self._total:
            pct = 100 * self.done / self._total
            eta = (self._total - self.done) / rate if rate > 0 else float("inf")
            line = f"{self._what}: {self.done:,}/{self._total:,} ({pct:5.1f}%) {rate:,.0f}/s eta {eta:,.0f}s"
        else:
            line = f"{self._what}: {self.done:,} {rate:,.0f}/s"
        if final:
            line = f"{self._what}: {self.done:,} in {elapsed:.1f}s ({rate:,.0f}/s)"
        if self._tty:
            self._stream.write(f"\r\x1b[K{line}" + ("\n" if final else ""))
        else:
            self._stream.write(line + "\n")
        self._stream.flush()
