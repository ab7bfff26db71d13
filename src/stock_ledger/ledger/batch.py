"""A batch: the rows one transaction writes, parsed from the records of several partitions.

Rows are plain tuples in COPY column order (the hot path builds ~5,000 per batch and COPY takes tuples as they
are); code reads them by the named indexes below, derived from the column lists, never by bare numbers. Their
timestamps are in PostgreSQL's binary form (`pgtime`: exact, and cheap for the transaction to send).
`build_batch` is pure: the same records always give the same rows.
"""

from __future__ import annotations

import base64
import json
import uuid
from bisect import bisect_left, bisect_right
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from itertools import chain
from typing import TYPE_CHECKING, Any, Final, Protocol

import msgspec

from stock_ledger.domain import Movement, RejectCode, Rejection, parse, pg_text
from stock_ledger.ledger.pgtime import PG_EPOCH_MS, UNIX_EPOCH, Micros, micros

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

MOVEMENT_COLUMNS: Final = (
    "movement_id", "warehouse_id", "sku", "qty", "kind", "occurred_at",
    "kafka_topic", "kafka_partition", "kafka_offset", "kafka_timestamp",
)
REJECT_COLUMNS: Final = (
    "kafka_topic", "kafka_partition", "kafka_offset", "kafka_timestamp",
    "key", "value", "reason_code", "reason", "movement_id", "headers",
)
# Named positions in a movement row (M_*) and a quarantine row (R_*).
M_ID, M_WAREHOUSE, M_SKU, M_QTY, M_KIND, M_OCCURRED_AT, M_TOPIC, M_PARTITION, M_OFFSET, M_KAFKA_TS = (
    MOVEMENT_COLUMNS.index(c) for c in MOVEMENT_COLUMNS)
R_TOPIC, R_PARTITION, R_OFFSET, R_KAFKA_TS, R_KEY, R_VALUE, R_CODE, R_REASON, R_MOVEMENT_ID, R_HEADERS = (
    REJECT_COLUMNS.index(c) for c in REJECT_COLUMNS)


def quarantined(m: tuple[Any, ...], key: bytes | None, value: bytes | None, code: RejectCode,
                reason: str) -> tuple[Any, ...]:
    """The quarantine row of a movement row that is not applied after all (a resend, a database refusal); its
    headers are not kept (it decoded, so no mapping needs them again)."""
    return (m[M_TOPIC], m[M_PARTITION], m[M_OFFSET], m[M_KAFKA_TS], key, value, code.value, pg_text(reason), m[M_ID],
            None)


def headers_json(headers: Sequence[tuple[str, bytes | None]]) -> str | None:
    """A record's headers as the quarantine keeps them (migration 0013): [[name, base64 value or null], ...]."""
    if not headers:
        return None
    return json.dumps([[name, None if value is None else base64.b64encode(value).decode()]
                       for name, value in headers])


def headers_of(stored: str | None) -> list[tuple[str, bytes | None]]:
    """`headers_json` undone (a NULL column: no headers)."""
    if not stored:
        return []
    return [(name, None if value is None else base64.b64decode(value)) for name, value in json.loads(stored)]



@dataclass(frozen=True, slots=True)
class Levels:
    """Stock level deltas: the summed qty of movements per (warehouse_id, sku), in key order (the order the upsert
    locks stock_levels rows in), as the three arrays the upsert takes."""

    warehouses: list[str]
    skus: list[str]
    deltas: list[int]


def level_deltas(movements: Iterable[tuple[Any, ...]]) -> Levels:
    deltas: defaultdict[tuple[str, str], int] = defaultdict(int)
    for m in movements:
        deltas[m[M_WAREHOUSE], m[M_SKU]] += m[M_QTY]
    keys = sorted(deltas)
    return Levels([k[0] for k in keys], [k[1] for k in keys], [deltas[k] for k in keys])


@dataclass(frozen=True, slots=True)
class PartitionSlice:
    partition: int
    epoch: int
    first_offset: int  # the first record's offset (`expected` when the slice holds no record)
    # Where the stored offset moves: past the last record, and past the offsets after it that held no data record
    # (transaction markers, aborted records) when the consumer's position had already passed them.
    next_offset: int
    # The next offset the worker believes the ledger holds, which this slice continues: the batch guard moves the
    # stored offset only from exactly here. The first record may lie past it (transaction markers, aborted records).
    expected: int
    # Each record's Kafka timestamp, for the latency metric; not part of what identifies the slice.
    timestamps_ms: list[int] = field(default_factory=list, compare=False)
    # The offsets of [expected, next_offset) that held no data record (transaction markers, aborted records), as
    # runs (first, last): the consumer read past them. Empty on a topic without transactional producers.
    non_records: list[tuple[int, int]] = field(default_factory=list, compare=False)


@dataclass(frozen=True, slots=True)
class Record:
    """The parts of a Kafka record the ledger needs (aiokafka's ConsumerRecord satisfies this shape)."""

    partition: int
    offset: int
    timestamp: int  # ms since the epoch, or -1
    key: bytes | None
    value: bytes | None
    headers: Sequence[tuple[str, bytes | None]] = ()


class Decode(Protocol):
    """A declared format's pure decoder (formats.decode.RecordDecoder), its schemas already resolved."""

    def __call__(self, key: bytes | None, value: bytes | None,
                 headers: Sequence[tuple[str, bytes | None]] = ()) -> Movement | Rejection: ...


@dataclass(slots=True)
class Batch:
    topic: str
    slices: list[PartitionSlice]
    movements: list[tuple[Any, ...]]
    rejects: list[tuple[Any, ...]]
    # The raw (key, value) of each movement, parallel to `movements`: kept if the row is quarantined later.
    raw: list[tuple[bytes | None, bytes | None]] = field(default_factory=list)
    # `level_deltas(movements)`, summed while the batch is built, so the transaction does not wait for it; None when
    # not computed. The sink uses it only for this very `movements` list (see sink.add_levels).
    levels: Levels | None = None
    fetched_at: float | None = None  # wall-clock time the records were taken from the consumer (for the bench)

    @property
    def size(self) -> int:
        return len(self.movements) + len(self.rejects)

    # These three run once per batch over every record: list operations in C, no Python step per record.
    @property
    def timestamps_ms(self) -> list[int]:
        """Every record's Kafka timestamp as it came (-1: none)."""
        return list(chain.from_iterable(x.timestamps_ms for x in self.slices))

    @property
    def times_ms(self) -> list[int]:
        """The Kafka timestamps that are times (the latency metric's input), in ascending order."""
        ordered = sorted(self.timestamps_ms)
        return ordered[bisect_left(ordered, 0):bisect_right(ordered, MAX_TIMESTAMP_MS)]

    @property
    def bad_timestamps(self) -> int:
        """Records whose Kafka timestamp is neither -1 (none) nor a time PostgreSQL and Python can hold (a producer
        that sends microseconds, a negative value): stored as NULL kafka_timestamp, counted for the metric."""
        every = self.timestamps_ms
        return len(every) - len(self.times_ms) - every.count(-1)

    def without(self, partitions: set[int]) -> Batch | None:
        """The same batch without these partitions (from the rows we hold, no re-fetch); None if nothing is left.
        Its level deltas are left to the sink to sum again from the rows that remain."""
        slices = [x for x in self.slices if x.partition not in partitions]
        if not slices:
            return None
        keep = [i for i, m in enumerate(self.movements) if m[M_PARTITION] not in partitions]
        return Batch(self.topic, slices, [self.movements[i] for i in keep],
                     [r for r in self.rejects if r[R_PARTITION] not in partitions], [self.raw[i] for i in keep],
                     fetched_at=self.fetched_at)


# The last millisecond Python's datetime can hold (9999-12-31T23:59:59.999Z); timestamptz reaches further.
MAX_TIMESTAMP_MS: Final = (datetime(9999, 12, 31, 23, 59, 59, 999_000, tzinfo=UTC) - UNIX_EPOCH) // timedelta(
    milliseconds=1)


def _ts(ms: int) -> Micros | None:
    """A Kafka record timestamp in the wire form; None for -1 (no timestamp) and anything out of range. Integer
    arithmetic: exact, and a fraction of the cost of going through a datetime (this runs once per record)."""
    if not 0 <= ms <= MAX_TIMESTAMP_MS:
        return None
    return ((ms - PG_EPOCH_MS) * 1000,)


def build_batch(topic: str, records: Mapping[int, Sequence[Record]], epochs: Mapping[int, int],
                expected: Mapping[int, int] | None = None, decode: Decode | None = None) -> Batch:
    """Parse records into COPY-ready rows. Pure. `records` holds each partition's records in offset order;
    `expected`, each partition's stored next offset that they continue (default: their first record's offset);
    `decode`, a declared format's decoder (None: the contract's plain JSON, `domain.parse`)."""
    builder = BatchBuilder(topic, epochs, expected, decode)
    for partition in sorted(records):
        builder.add(partition, records[partition])
    return builder.batch()


class BatchBuilder:
    """`build_batch` in steps: `add` a partition's records (in offset order, in one or several consecutive chunks,
    partitions one after the other), then take the `batch`. The worker lets its event loop run between chunks, so
    the transaction in flight keeps going while the next batch is built. Same rows as one `build_batch` call."""

    def __init__(self, topic: str, epochs: Mapping[int, int], expected: Mapping[int, int] | None = None,
                 decode: Decode | None = None) -> None:
        self.topic = topic
        self.decode = decode
        self.epochs = epochs
        self.expected = expected or {}
        self.movements: list[tuple[Any, ...]] = []
        self.rejects: list[tuple[Any, ...]] = []
        self.slices: list[PartitionSlice] = []
        self.raw: list[tuple[bytes | None, bytes | None]] = []
        # Keyed by UUID.int: uuid.UUID hashes in Python code, an int in C. This loop runs once per record.
        self.seen_ids: set[int] = set()

    def add(self, partition: int, recs: Sequence[Record]) -> None:
        if not recs:
            return
        last = self.slices[-1] if self.slices else None
        if last is not None and last.partition == partition:  # the next chunk of the same partition
            if recs[0].offset < last.next_offset:
                raise ValueError(f"partition {partition}: chunk starts at {recs[0].offset}, before {last.next_offset}")
            last.timestamps_ms.extend(r.timestamp for r in recs)  # our own lists, not shared
            last.non_records.extend(_without_records(last.next_offset, recs))
            self.slices[-1] = PartitionSlice(partition, last.epoch, last.first_offset, recs[-1].offset + 1,
                                             last.expected, last.timestamps_ms, last.non_records)
        else:
            if any(x.partition == partition for x in self.slices):
                raise ValueError(f"partition {partition} added again after another partition")
            expected = self.expected.get(partition, recs[0].offset)
            if recs[0].offset < expected:
                raise ValueError(f"partition {partition}: records start at {recs[0].offset}, before the ledger's "
                                 f"next offset {expected}")
            self.slices.append(PartitionSlice(partition, self.epochs[partition], recs[0].offset,
                                              recs[-1].offset + 1, expected, [r.timestamp for r in recs],
                                              _without_records(expected, recs)))
        topic, movements, rejects, raw, seen_ids = self.topic, self.movements, self.rejects, self.raw, self.seen_ids
        decode = self.decode
        for r in recs:
            kafka_ts = _ts(r.timestamp)
            parsed = parse(r.key, r.value) if decode is None else decode(r.key, r.value, r.headers)
            if isinstance(parsed, Movement):
                mid = parsed.movement_id
                if mid.int not in seen_ids:
                    seen_ids.add(mid.int)
                    movements.append((mid, parsed.warehouse_id, parsed.sku, parsed.qty, parsed.kind,
                                      micros(parsed.occurred_at), topic, partition, r.offset, kafka_ts))
                    raw.append((r.key, r.value))
                    continue
                parsed = Rejection(
                    RejectCode.DUPLICATE_MOVEMENT_ID,
                    f"movement_id {mid} appears earlier in this batch; applied once, this copy kept here",
                )
            rejects.append((
                topic, partition, r.offset, kafka_ts, r.key, r.value, parsed.code.value, pg_text(parsed.reason),
                None if parsed.code is RejectCode.TOO_DEEP else _movement_id_of(r.value), headers_json(r.headers),
            ))

    def end(self, partition: int, offset: int) -> None:
        """The partition's part of the batch ends at `offset`, past its last record (or, with no record, past where
        it stands): the offsets between held no data record (transaction markers, aborted records), and the stored
        offset moves past them. Called after the partition's records, before the next partition's."""
        last = self.slices[-1] if self.slices else None
        if last is not None and last.partition == partition:
            if offset < last.next_offset:
                raise ValueError(f"partition {partition}: ends at {offset}, before {last.next_offset}")
            if offset > last.next_offset:
                last.non_records.append((last.next_offset, offset - 1))
            self.slices[-1] = PartitionSlice(partition, last.epoch, last.first_offset, offset, last.expected,
                                             last.timestamps_ms, last.non_records)
            return
        if any(x.partition == partition for x in self.slices):
            raise ValueError(f"partition {partition} ended after another partition")
        expected = self.expected[partition]
        if offset <= expected:
            raise ValueError(f"partition {partition}: ends at {offset}, not past the ledger's next offset {expected}")
        self.slices.append(PartitionSlice(partition, self.epochs[partition], expected, offset, expected, [],
                                          [(expected, offset - 1)]))

    def batch(self) -> Batch:
        return Batch(self.topic, self.slices, self.movements, self.rejects, self.raw, level_deltas(self.movements))


def _without_records(start: int, recs: Sequence[Record]) -> list[tuple[int, int]]:
    """The offsets of [start, last record] that hold none of `recs` (increasing offsets), as runs. One comparison
    per chunk where there are none, as on every topic without transactional producers."""
    if recs[0].offset == start and recs[-1].offset - start + 1 == len(recs):
        return []
    runs = []
    previous = start - 1
    for r in recs:
        if r.offset > previous + 1:
            runs.append((previous + 1, r.offset - 1))
        previous = r.offset
    return runs


class _JustTheId(msgspec.Struct):
    movement_id: uuid.UUID


def _movement_id_of(value: bytes | None) -> uuid.UUID | None:
    """Best effort, so quarantine can be searched by movement_id; bad input may have none."""
    if value is None:
        return None
    try:
        return msgspec.json.decode(value, type=_JustTheId).movement_id
    except (msgspec.DecodeError, RecursionError):
        return None
