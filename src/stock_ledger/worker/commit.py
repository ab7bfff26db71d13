"""The batch transaction and its bookkeeping: what a batch built ahead may still write, the transaction retried until
it commits, is fenced away or is abandoned on shutdown, and what a commit moves (positions, metrics, Kafka's
advisory offsets)."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog
from aiokafka import TopicPartition

from stock_ledger.errors import FencedError, OffsetMismatchError
from stock_ledger.worker.retry import Abandoned

if TYPE_CHECKING:
    import asyncio

    from aiokafka import AIOKafkaConsumer

    from stock_ledger.consumer.advice import KafkaAdvice
    from stock_ledger.consumer.assignment import Assignment
    from stock_ledger.consumer.claims import Claimer
    from stock_ledger.ledger.batch import Batch
    from stock_ledger.ledger.transaction import Ledger, Outcome
    from stock_ledger.metrics import Metrics
    from stock_ledger.worker.retry import Retrier
    from stock_ledger.worker.session import Session

# One logger name for the worker's events, whichever of its modules logs them.
log = structlog.get_logger("stock_ledger.worker")


@dataclass(frozen=True, slots=True)
class BatchWriter:
    consumer: AIOKafkaConsumer
    assignment: Assignment
    ledger: Ledger
    claimer: Claimer
    metrics: Metrics
    advice: KafkaAdvice
    retry: Retrier
    lock: asyncio.Lock  # the one a revocation waits for (consumer.rebalance.Rebalance)
    session: Session  # the worker's one session

    async def write(self, batch: Batch) -> dict[int, int] | None:
        """One batch's transaction, under the batch lock. Built while the previous batch was in flight, it first
        leaves out what a fence, revocation or reclaim took away since. Returns the committed next offsets, or None
        if nothing was committed."""
        async with self.lock:
            drop, reseek = self.assignment.stale(batch.slices)
            for p, offset in reseek.items():
                log.info("batch.reseek", partition=p, expected=offset, reason="built ahead of a batch that changed")
                self.consumer.seek(TopicPartition(batch.topic, p), offset)
            current = batch.without(drop) if drop else batch
            committed = await self._apply(current) if current is not None else None
        if committed:
            self.advice.note(committed)
        return committed

    async def _apply(self, batch: Batch) -> dict[int, int] | None:
        """Run the batch transaction until it commits, is fenced away, or the retry deadline passes.

        Returns the committed next offsets, or None if nothing was committed (all fenced, or abandoned on shutdown).
        """
        with structlog.contextvars.bound_contextvars(
            topic=batch.topic,
            batch={x.partition: [x.first_offset, x.next_offset - 1, x.epoch] for x in batch.slices},
        ):
            current: Batch | None = batch
            while current is not None:
                try:
                    outcome, seconds = await self.retry("the batch transaction",
                                                        functools.partial(self._apply_once, current), "batch.retry")
                except FencedError as exc:
                    await self.claimer.fenced(exc, self.session.current)
                    current = current.without(set(exc.partitions))
                    continue
                except OffsetMismatchError as exc:
                    self.claimer.mismatched(exc, {x.partition: x.epoch for x in current.slices})
                    current = current.without(set(exc.partitions))
                    continue
                except Abandoned as exc:
                    # Rolled back, nothing written: the next owner applies it from the stored offset.
                    log.info("batch.abandoned", reason="shutdown during a transient fault", cause=exc.cause)
                    return None
                self._committed(current, outcome, seconds)
                return {x.partition: x.next_offset for x in current.slices}
        return None

    async def _apply_once(self, batch: Batch) -> tuple[Outcome, float]:
        conn = await self.session.get()
        started = time.perf_counter()
        outcome = await self.ledger.apply(conn, batch)
        return outcome, time.perf_counter() - started

    def _committed(self, batch: Batch, outcome: Outcome, seconds: float) -> None:
        self.metrics.count_input_anomalies(batch.bad_timestamps, outcome.bisections)
        if outcome.already_applied:
            log.info("batch.already_applied", detail="an earlier attempt committed; its reply was lost")
        if outcome.present:
            self._coordinates_present(outcome.present)
        self.assignment.committed({x.partition: x.next_offset for x in batch.slices})
        for x in batch.slices:
            if (headroom := self.ledger.segments.headroom(x.partition, x.next_offset)) is not None:
                self.metrics.segment_headroom.labels(self.ledger.group_id, batch.topic, str(x.partition)).set(headroom)
        for code, n in outcome.rejected.items():
            log.warning("batch.rejected", reason=code, records=n)
        self.metrics.batch_committed(outcome.applied, outcome.rejected, batch.size, seconds, batch.times_ms)
        log.debug("batch.committed", applied=outcome.applied, rejected=sum(outcome.rejected.values()),
                  seconds=round(seconds, 4), fetched=batch.fetched_at)

    def _coordinates_present(self, present: dict[int, list[int]]) -> None:
        """Loud, never fatal: records the ledger already held although the guard let the batch through."""
        records = sum(map(len, present.values()))
        self.metrics.coordinate_conflicts.inc(records)
        log.error("batch.coordinates_present", records=records,
                  offsets={p: offsets[:20] for p, offsets in present.items()},
                  detail="these records were already in the ledger although the stored offset was below them: "
                         "something outside the worker's offset guard wrote them (a repair racing an `offsets set`, "
                         "a tool, a restore that kept rows and lost offsets); they were left as found, not written "
                         "again, and the batch's other records applied",
                  action="compare the rows at those coordinates with the records (`stock-ledger verify`); runbook: "
                         "StockLedgerCoordinateConflict")
