"""Records in: a batch's worth taken from the consumer, then parsed into a `Batch`, both in chunks with the event loop
turning in between, so that the batch transaction in flight (commit.BatchWriter) moves on meanwhile."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
from aiokafka import TopicPartition
from aiokafka.errors import NoOffsetForPartitionError, OffsetOutOfRangeError

from stock_ledger.batch import BatchBuilder

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from aiokafka import AIOKafkaConsumer

    from stock_ledger.assignment import Assignment
    from stock_ledger.batch import Batch
    from stock_ledger.claims import Claimer
    from stock_ledger.config import Settings
    from stock_ledger.retry import Retrier

# One logger name for the worker's events, whichever of its modules logs them.
log = structlog.get_logger("stock_ledger.service")

# Records parsed between two turns of the event loop while a batch is built (~4 ms of CPU here).
_BUILD_CHUNK = 500
# Records taken from the consumer between two turns of the event loop (see `Intake.fetch`).
_FETCH_CHUNK = 500


@dataclass(frozen=True, slots=True)
class Intake:
    settings: Settings
    consumer: AIOKafkaConsumer
    assignment: Assignment
    claimer: Claimer
    retry: Retrier

    async def fetch(self) -> dict[TopicPartition, list[Any]]:
        """Up to a batch of records, taken in chunks with the event loop turning in between. aiokafka makes a
        Python object of every record inside `getmany`: taken in one go, 5,000 buffered records held the loop for
        ~15 ms (docs/bench/fetch-chunks-2026-12-01) while the batch in flight waited to send its next statement.

        Records once taken are never dropped (a partition's next fetch would start past them): an error ends the
        loop with what was taken before it (aiokafka raises only from a call that took nothing), and a chunk that
        a seek in between moved back is given back by seeking to its first record."""
        s = self.settings
        fetched: dict[TopicPartition, list[Any]] = {}
        wanted, timeout_ms = s.batch_max_records, s.batch_max_wait_ms
        try:
            while wanted > 0:
                got = await self.retry("fetching from Kafka", functools.partial(
                    self.consumer.getmany, timeout_ms=timeout_ms, max_records=min(_FETCH_CHUNK, wanted)),
                    "kafka.fetch_failed")
                back = take(fetched, got)
                for tp, offset in back.items():
                    log.info("fetch.give_back", partition=tp.partition, offset=offset,
                             reason="sought back while the batch was being fetched")
                    if tp in self.consumer.assignment():  # else its next owner's claim positions it
                        self.consumer.seek(tp, offset)
                taken = sum(map(len, got.values()))
                if not taken or back:
                    break
                wanted -= taken
                timeout_ms = 0  # only what has arrived: the batch in flight is not kept waiting for more
                await asyncio.sleep(0)
        except OffsetOutOfRangeError as exc:
            # Our position lies outside the log: a hole. The claim path examines it (record or halt).
            out = exc.args[0] if exc.args and isinstance(exc.args[0], dict) else {}
            self.claimer.reexamine([tp.partition for tp in out], reason=f"fetch out of range: {out}")
        except NoOffsetForPartitionError:
            pass  # raised once for a partition still paused for its claim; the claim's seek positions it
        return fetched

    async def build(self, fetched: dict[TopicPartition, list[Any]]) -> Batch | None:
        accepted = self.assignment.accept({tp.partition: records for tp, records in fetched.items()})
        for p, offset in accepted.reseek.items():
            tp = TopicPartition(self.settings.topic, p)
            # Fetched before our seek took effect (or past transaction markers): seek once more to be sure.
            log.info("batch.reseek", partition=p, expected=offset, got=fetched[tp][0].offset)
            self.consumer.seek(tp, offset)
        if not accepted.records:
            return None
        # Parsing is most of the worker's CPU (~40% in a drain). Built in one go, it held the event loop while the
        # batch in flight waited for its next statement to be sent, so the worker and PostgreSQL took turns (their
        # CPU summed to one core). Chunked, the transaction moves on between chunks. A rebalance or fence meanwhile
        # is what `BatchWriter.write` checks anyway (`Assignment.stale`), under the batch lock, with the epochs
        # taken here.
        builder = BatchBuilder(self.settings.topic, self.assignment.epochs, self.assignment.positions)
        for p in sorted(accepted.records):
            records = accepted.records[p]
            for i in range(0, len(records), _BUILD_CHUNK):
                builder.add(p, records[i:i + _BUILD_CHUNK])
                await asyncio.sleep(0)
        batch = builder.batch()
        self.assignment.dispatched({x.partition: x.next_offset for x in batch.slices})
        return batch


def take(fetched: dict[TopicPartition, list[Any]], got: Mapping[TopicPartition, Sequence[Any]],
         ) -> dict[TopicPartition, int]:
    """Append a chunk of records to those `fetched` so far, partition by partition. A partition whose chunk does
    not start past what is already held was sought back in between (a batch in flight found its partitions stale):
    its chunk is left out, and returned as the offset to seek to so that nothing taken is lost."""
    back: dict[TopicPartition, int] = {}
    for tp, records in got.items():
        if not records:
            continue
        held = fetched.get(tp)
        if held and records[0].offset <= held[-1].offset:
            back[tp] = records[0].offset
        elif held:
            held.extend(records)
        else:
            fetched[tp] = list(records)
    return back
