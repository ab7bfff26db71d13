"""Records in: a batch's worth taken from the consumer, then parsed into a `Batch`, both in chunks with the event loop
turning in between, so that the batch transaction in flight (commit.BatchWriter) moves on meanwhile."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
from aiokafka import TopicPartition
from aiokafka.errors import IllegalStateError, NoOffsetForPartitionError, OffsetOutOfRangeError

from stock_ledger.formats.decode import schema_ids
from stock_ledger.ledger.batch import BatchBuilder

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from aiokafka import AIOKafkaConsumer

    from stock_ledger.config import Settings
    from stock_ledger.consumer.assignment import Assignment
    from stock_ledger.consumer.claims import Claimer
    from stock_ledger.formats.decode import RecordDecoder
    from stock_ledger.formats.resolver import SchemaResolver
    from stock_ledger.ledger.batch import Batch
    from stock_ledger.worker.retry import Retrier

# One logger name for the worker's events, whichever of its modules logs them.
log = structlog.get_logger("stock_ledger.worker")

# Records parsed between two turns of the event loop while a batch is built (~4 ms of CPU here).
_BUILD_CHUNK = 500
# Records taken from the consumer between two turns of the event loop (see `Intake.fetch`).
_FETCH_CHUNK = 500


@dataclass(frozen=True, slots=True)
class Fetched:
    """What one fetch took: records, and for each claimed partition whose consumer position passed where the
    partition stands, that position, read right after the getmany that last moved it (`Assignment.accept`: how far
    a batch may move past offsets that held no data record)."""

    records: dict[TopicPartition, list[Any]] = field(default_factory=dict)
    positions: dict[int, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        """Anything to write: records, or a position past offsets that held no data record."""
        return bool(self.records) or bool(self.positions)


@dataclass(frozen=True, slots=True)
class Intake:
    settings: Settings
    consumer: AIOKafkaConsumer
    assignment: Assignment
    claimer: Claimer
    retry: Retrier
    # A declared format (settings.mapping; None: plain JSON): its decoder, and the registry's schemas it reads.
    decoder: RecordDecoder | None = None
    resolver: SchemaResolver | None = None

    async def fetch(self) -> Fetched:
        """Up to a batch of records, taken in chunks with the event loop turning in between: aiokafka makes a
        Python object of every record inside `getmany`, and the batch in flight must not wait that long to send its
        next statement (docs/performance.md, "What made it fast").

        Records once taken are never dropped (a partition's next fetch would start past them): an error ends the
        loop with what was taken before it (aiokafka raises only from a call that took nothing), and a chunk that
        a seek in between moved back is given back by seeking to its first record.

        After each getmany, before anything else runs, the claimed partitions' positions are read (`_positions`).
        A fetch that returned no record of a partition may still have moved its position past a transaction's
        marker (or an aborted transaction): a batch then moves the stored offset there too."""
        s = self.settings
        fetched = Fetched()
        wanted, timeout_ms = s.batch_max_records, s.batch_max_wait_ms
        try:
            while wanted > 0:
                got = await self.retry("fetching from Kafka", functools.partial(
                    self.consumer.getmany, timeout_ms=timeout_ms, max_records=min(_FETCH_CHUNK, wanted)),
                    "kafka.fetch_failed")
                await self._positions(fetched.positions)
                back = take(fetched.records, got)
                for tp, offset in back.items():
                    log.info("fetch.give_back", partition=tp.partition, offset=offset,
                             reason="sought back while the batch was being fetched")
                    fetched.positions.pop(tp.partition, None)
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

    async def _positions(self, found: dict[int, int]) -> None:
        """Each claimed partition's consumer position, where it passed where the partition stands. Run right after a
        getmany returned, before anything else runs: only our getmany moves a position forward (a seek made
        meanwhile by the batch in flight only moves one back). aiokafka's `position` answers a partition with a
        valid position without waiting, and every claimed partition has one (its claim sought it); it is past every
        record returned, and short of every record not yet returned (consumer/fetcher.py: `getall` moves it to the
        last record returned + 1, or, once a fetched batch is used up, past the control and aborted batches that
        ended it)."""
        stands = self.assignment.positions
        assigned = self.consumer.assignment()
        for p, at in stands.items():
            tp = TopicPartition(self.settings.topic, p)
            if tp not in assigned:
                continue
            try:
                position = await self.consumer.position(tp)
            except IllegalStateError:
                continue
            if position > at:
                found[p] = position
            else:
                found.pop(p, None)

    async def build(self, fetched: Fetched) -> Batch | None:
        accepted = self.assignment.accept({tp.partition: records for tp, records in fetched.records.items()},
                                          fetched.positions)
        for p, offset in accepted.reseek.items():
            tp = TopicPartition(self.settings.topic, p)
            # Fetched before our seek took effect (or past transaction markers): seek once more to be sure.
            log.info("batch.reseek", partition=p, expected=offset, got=fetched.records[tp][0].offset)
            self.consumer.seek(tp, offset)
        if not accepted.records and not accepted.tails:
            return None
        if self.resolver is not None:
            # Every schema id the batch names, before the pure build: a registry that is down keeps these records
            # waiting (retried, /readyz says why), never quarantined; an unknown id waits its bounded time.
            ids = schema_ids(self.settings.mapping, (r for rs in accepted.records.values() for r in rs))
            await self.retry("fetching schemas from the registry", functools.partial(self.resolver.resolve, ids),
                             "registry.retry")
        # Built in chunks so the transaction in flight moves on between them (parsing is most of the worker's CPU:
        # docs/performance.md, "What made it fast"). A rebalance or fence meanwhile is what `BatchWriter.write`
        # checks anyway (`Assignment.stale`), under the batch lock, with the epochs taken here.
        builder = BatchBuilder(self.settings.topic, self.assignment.epochs, self.assignment.positions, self.decoder)
        for p in sorted({*accepted.records, *accepted.tails}):
            records = accepted.records.get(p, [])
            for i in range(0, len(records), _BUILD_CHUNK):
                builder.add(p, records[i:i + _BUILD_CHUNK])
                await asyncio.sleep(0)
            if p in accepted.tails:
                builder.end(p, accepted.tails[p])
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
