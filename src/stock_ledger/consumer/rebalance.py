"""What happens when Kafka moves partitions; called in aiokafka's coordination task, not the main loop.

On assignment the partitions are paused synchronously, before any await: the fetcher would otherwise start from
Kafka's committed offsets, and the main loop claims them (claims.py) and seeks to the stored offsets first.
On revocation the in-flight batch is waited for, bounded well inside the rebalance timeout; if it still runs after
that, the database fences it anyway once the new owner claims: the wait only avoids pointless rollbacks.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import structlog
from aiokafka import ConsumerRebalanceListener

if TYPE_CHECKING:
    from collections.abc import Sequence

    from aiokafka import AIOKafkaConsumer, TopicPartition

    from stock_ledger.consumer.assignment import Assignment
    from stock_ledger.metrics import Metrics

log = structlog.get_logger(__name__)


class Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(
        self, consumer: AIOKafkaConsumer, assignment: Assignment, batch_lock: asyncio.Lock, metrics: Metrics,
        wait_seconds: float,
    ) -> None:
        self._consumer = consumer
        self._assignment = assignment
        self._batch_lock = batch_lock
        self._metrics = metrics
        self._wait_seconds = wait_seconds

    async def on_partitions_assigned(self, assigned: Sequence[TopicPartition]) -> None:
        self._consumer.pause(*assigned)  # no await before this line
        self._assignment.assigned(tp.partition for tp in assigned)
        self._metrics.rebalances.inc()
        # aiokafka's protocol is eager: `assigned` is this worker's whole assignment, after all was revoked.
        self._metrics.partitions_owned({(tp.topic, tp.partition) for tp in assigned})
        log.info("rebalance.assigned", partitions=sorted(tp.partition for tp in assigned),
                 generation=getattr(getattr(self._consumer, "_coordinator", None), "generation", None))

    async def on_partitions_revoked(self, revoked: Sequence[TopicPartition]) -> None:
        started = time.monotonic()
        partitions = [tp.partition for tp in revoked]
        try:
            await asyncio.wait_for(self._batch_lock.acquire(), self._wait_seconds)
        except TimeoutError:
            log.warning("rebalance.revoke_without_waiting", waited_seconds=round(time.monotonic() - started, 1))
            self._assignment.revoked(partitions)
        else:
            try:
                self._assignment.revoked(partitions)
            finally:
                self._batch_lock.release()
        self._metrics.assigned_partitions.set(len(self._assignment.epochs))
        log.info("rebalance.revoked", partitions=sorted(partitions),
                 waited_seconds=round(time.monotonic() - started, 3))
