"""structlog setup: JSON lines off a terminal, readable console on one; stdlib loggers share the pipeline."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure(level: str = "info", fmt: str = "auto") -> None:
    json_output = fmt == "json" or (fmt == "auto" and not sys.stdout.isatty())
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
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(foreign_pre_chain=shared, processors=[
        structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer,
    ]))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiokafka logs every routine rebalance step at INFO and retries at ERROR with tracebacks; our own lines
    # already say what happened, so keep theirs to warnings.
    for noisy in ("aiokafka", "kafka"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
