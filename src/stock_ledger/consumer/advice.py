"""Kafka's committed offsets, told after PostgreSQL's, for lag dashboards and kafka-consumer-groups.sh only.

Never fatal and never a source of truth: a worker seeks to the offsets stored in PostgreSQL. Two rules keep the
told offsets honest: Kafka hears only offsets PostgreSQL has committed (drift >= 0), and commits reach it in
order, one at a time, so an older one never lands after a newer one.

A commit is never cancelled. aiokafka sends it under `asyncio.shield`; cancelling the caller (a timeout, our
shutdown) orphans the request, and its later failure (the broker restarting: NotCoordinatorForGroupError) then
surfaces as asyncio's "Task exception was never retrieved" with a stack trace. So we stop waiting instead, and
whatever the commit ends in is logged by its own callback, in one line.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import structlog
from aiokafka import TopicPartition
from aiokafka.errors import IllegalStateError, KafkaError
from aiokafka.structs import OffsetAndMetadata

if TYPE_CHECKING:
    from aiokafka import AIOKafkaConsumer

log = structlog.get_logger(__name__)

# Committing after every batch put a broker round trip into every cycle (at 5,000/s it halved the batches per
# second and doubled the latency); lag dashboards need no more than once a second.
EVERY_SECONDS = 1.0
# How long a caller waits for the broker's answer before it stops waiting (the commit itself goes on).
PATIENCE_SECONDS = 5.0
_HARMLESS = "harmless: PostgreSQL holds the offsets"


class KafkaAdvice:
    def __init__(self, consumer: AIOKafkaConsumer, topic: str) -> None:
        self._consumer = consumer
        self._topic = topic
        self._pending: dict[int, int] = {}  # committed next offsets not yet told to Kafka
        self._lock = asyncio.Lock()
        self._inflight: asyncio.Task[None] | None = None

    def note(self, committed: dict[int, int]) -> None:
        """Next offsets PostgreSQL has just committed."""
        self._pending.update(committed)

    async def run(self) -> None:
        """Tell Kafka once a second, off the batch path, until cancelled. While the broker has not answered the
        last commit (it is restarting), the offsets wait: one commit in flight at a time."""
        while True:
            await asyncio.sleep(EVERY_SECONDS)
            if self._inflight is None or self._inflight.done():
                await self.tell()

    async def tell(self, patience: float = PATIENCE_SECONDS) -> None:
        """Send what is pending, after any earlier commit has ended; wait at most `patience` seconds in all."""
        try:
            async with asyncio.timeout(patience):
                await self._tell()
        except TimeoutError:
            log.info("kafka.advisory_commit_slow", waited_seconds=patience,
                     detail=f"the broker has not answered; the commit goes on without us ({_HARMLESS})")

    async def _tell(self) -> None:
        async with self._lock:
            if self._inflight is not None and not self._inflight.done():
                await asyncio.wait({self._inflight})  # never cancels it: see the module's docstring
            assigned = self._consumer.assignment()
            offsets, self._pending = self._pending, {}
            tps = {tp: OffsetAndMetadata(o, "") for p, o in offsets.items()
                   if (tp := TopicPartition(self._topic, p)) in assigned}
            if not tps:
                return
            self._inflight = asyncio.ensure_future(self._consumer.commit(tps))
            self._inflight.add_done_callback(_report)
            await asyncio.wait({self._inflight})


def _report(commit: asyncio.Future[None]) -> None:
    """The one place a commit's outcome is read, whoever stopped waiting for it."""
    if commit.cancelled():
        return
    exc = commit.exception()
    if isinstance(exc, (KafkaError, IllegalStateError)):
        log.info("kafka.advisory_commit_failed", error=f"{type(exc).__name__}: {exc}", detail=_HARMLESS)
    elif exc is not None:
        log.error("kafka.advisory_commit_failed", error=f"{type(exc).__name__}: {exc}", detail=_HARMLESS,
                  exc_info=exc)
