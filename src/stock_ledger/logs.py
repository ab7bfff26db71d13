"""structlog setup: JSON lines off a terminal, readable console on one; stdlib loggers share the pipeline.

The Kafka client's own records are summarised (`ClientLogSummary`): while a broker is down aiokafka logs the same
few errors many times a second (25-40 lines a second between two workers, issue 31), enough to trip log-based
alerting and to bury the lines that say what is wrong.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, TextIO

import structlog

if TYPE_CHECKING:
    from collections.abc import Callable

# The loggers of the Kafka client (aiokafka, and kafka-python's namespace, which aiokafka's code descends from).
CLIENT_LOGGERS: Final = ("aiokafka", "kafka")
# How long repeats of one cause are counted before their summary line; the first occurrence always shows.
REPEAT_INTERVAL_SECONDS: Final = 30.0
# What varies between two records of one cause: UUIDs, hex ids, numbers (node ids, ports, addresses, counts).
_VARYING: Final = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
                             r"|0x[0-9a-fA-F]+|\d+")
# Client records that mean a broker cannot be reached (aiokafka's client.py, conn.py, fetcher.py, coordinator).
_UNREACHABLE: Final = re.compile(r"Unable (to )?connect|Unable to (update metadata|bootstrap)|Connect call failed"
                                 r"|Connection (refused|reset|closed)|KafkaConnectionError|NodeNotReady"
                                 r"|Heartbeat send request failed|Coordinator.*dead")


def _template(record: logging.LogRecord) -> str:
    """The record's message without what varies between repeats: its format string when it has arguments."""
    text = str(record.msg) if record.args else record.getMessage()
    return _VARYING.sub("#", text)


@dataclass
class _Window:
    started: float
    level: int
    logger: str
    template: str
    repeats: int = 0


class ClientLogSummary(logging.Filter):
    """A handler filter for the Kafka client's records: the first record of each cause passes; its repeats within
    `interval` seconds are counted, not shown, and `flush()` turns each expired window with repeats into one line
    at the cause's own level ("... repeated 312 times in the last 30 s"), opening the next window (a cause that
    keeps failing shows one line per interval). A cause (logger, level, message template) that stays quiet for a
    whole window shows again from its next occurrence.

    A record that says a broker cannot be reached also makes the worker say, once per outage (until the client
    has been free of such records for an interval), what is happening and why the ledger is safe.

    `clock` and `emit` are injectable for tests; in the service a daemon thread calls `flush()` every second.
    """

    def __init__(self, interval: float = REPEAT_INTERVAL_SECONDS, clock: Callable[[], float] = time.monotonic,
                 emit: Callable[..., None] | None = None) -> None:
        super().__init__()
        self.interval, self.clock, self.emit = interval, clock, emit
        self._windows: dict[tuple[str, int, str], _Window] = {}
        self._unreachable_since: float | None = None
        self._unreachable_last = 0.0
        self._lock = threading.Lock()  # records come from any thread; flush() from its own

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.split(".", 1)[0] not in CLIENT_LOGGERS:
            return True
        template = _template(record)
        now = self.clock()
        key = (record.name, record.levelno, template)
        with self._lock:
            announce = self._note_unreachable(record, template, now)
            window = self._windows.get(key)
            if window is None or (now - window.started >= self.interval and not window.repeats):
                self._windows[key] = _Window(now, record.levelno, record.name, template)
                shown = True
            else:
                window.repeats += 1
                shown = False
        if announce:
            self._say("warning", "kafka.unreachable", client_says=record.getMessage()[:300],
                      detail="a Kafka broker cannot be reached; the client keeps retrying and the worker resumes on "
                             "its own when the broker is back. The ledger is safe: nothing is applied or committed "
                             "without records from Kafka, and each partition's position is in PostgreSQL, committed "
                             "with its rows. The client's repeated errors are summarised once per "
                             f"{self.interval:g} s")
        return shown

    def _note_unreachable(self, record: logging.LogRecord, template: str, now: float) -> bool:
        """Whether this record opens an outage (the first "cannot reach a broker" record in an interval)."""
        causes = [template, *(type(a).__name__ for a in (record.args if isinstance(record.args, tuple) else ()))]
        if not any(_UNREACHABLE.search(c) for c in causes):
            return False
        opened = self._unreachable_since is None
        if opened:
            self._unreachable_since = now
        self._unreachable_last = now
        return opened

    def flush(self) -> None:
        """Summarise every window that has expired with repeats; drop quiet ones; close a quiet outage."""
        now = self.clock()
        summaries: list[_Window] = []
        ended: float | None = None
        with self._lock:
            for key, window in list(self._windows.items()):
                if now - window.started < self.interval:
                    continue
                if window.repeats:
                    summaries.append(window)
                    self._windows[key] = _Window(now, window.level, window.logger, window.template)
                else:
                    del self._windows[key]
            if self._unreachable_since is not None and now - self._unreachable_last >= self.interval:
                ended, self._unreachable_since = self._unreachable_since, None
        for w in summaries:
            seconds = now - w.started
            self._say(logging.getLevelName(w.level).lower(), "log.repeated", source=w.logger, message=w.template,
                      repeated=w.repeats, seconds=round(seconds),
                      summary=f"{w.logger}: {w.template[:200]!r} repeated {w.repeats} times in the last "
                              f"{seconds:.0f} s")
        if ended is not None:
            self._say("info", "kafka.errors_ceased", seconds=round(self._unreachable_last - ended),
                      detail=f"no connection error from the Kafka client for {self.interval:g} s")

    def _say(self, level: str, event: str, **fields: object) -> None:
        if self.emit is not None:
            self.emit(level, event, **fields)
        else:
            getattr(structlog.get_logger("stock_ledger.logs"), level)(event, **fields)

    def run_flusher(self, every: float = 1.0) -> threading.Thread:
        """A daemon thread calling `flush()` every `every` seconds (summaries appear even when the repeats stop)."""

        def loop() -> None:
            while True:
                time.sleep(every)
                self.flush()

        thread = threading.Thread(target=loop, name="log-summary", daemon=True)
        thread.start()
        return thread


_summary: ClientLogSummary | None = None


def configure(level: str = "info", fmt: str = "auto", stream: TextIO | None = None) -> None:
    """Logs go to stdout (a pod's log), or to `stream`: stderr for a command whose stdout is a JSON document."""
    global _summary  # noqa: PLW0603 - one filter and one flusher thread per process, however often this runs
    stream = sys.stdout if stream is None else stream
    json_output = fmt == "json" or (fmt == "auto" and not stream.isatty())
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,  # topic, partition, epoch, batch offsets bound per batch
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.types.Processor
    if json_output:
        # Locals are never rendered: they would carry connection strings and passwords into the logs.
        shared.append(structlog.processors.ExceptionRenderer(
            structlog.tracebacks.ExceptionDictTransformer(show_locals=False)))
        renderer = structlog.processors.JSONRenderer()
    else:
        # https://no-color.org: NO_COLOR set to any non-empty value turns colour off.
        renderer = structlog.dev.ConsoleRenderer(colors=not os.environ.get("NO_COLOR"))
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(foreign_pre_chain=shared, processors=[
        structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer,
    ]))
    if _summary is None:
        _summary = ClientLogSummary()
        _summary.run_flusher()
    handler.addFilter(_summary)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiokafka logs every routine rebalance step at INFO and retries at ERROR with tracebacks; our own lines
    # already say what happened, so keep theirs to warnings.
    for noisy in CLIENT_LOGGERS:
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
