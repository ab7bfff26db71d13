"""`build_batch`: Kafka records to COPY-ready rows, quarantine rows and per-partition offset slices. Pure."""

from __future__ import annotations

import calendar
import itertools
import json
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stock_ledger.domain import RejectCode
from stock_ledger.ledger.batch import (
    MOVEMENT_COLUMNS,
    REJECT_COLUMNS,
    BatchBuilder,
    PartitionSlice,
    Record,
    build_batch,
)

TOPIC = "warehouse.movements"
TS = 1_764_411_330_250  # 2025-11-29T10:15:30.250Z


def wire(*utc: int, us: int = 0, offset_minutes: int = 0) -> tuple[int]:
    """The wire form rows carry (microseconds since 2000-01-01T00:00:00Z), from calendar fields: an oracle apart from
    the datetime arithmetic the builder uses."""
    seconds = calendar.timegm((*utc, 0, 0, 0)) - offset_minutes * 60 - calendar.timegm((2000, 1, 1, 0, 0, 0, 0, 0, 0))
    return (seconds * 1_000_000 + us,)


def movement(
    sku: str = "SKU-1", qty: int = 3, kind: str = "receipt", movement_id: str | None = None
) -> bytes:
    return json.dumps(
        {
            "movement_id": movement_id or str(uuid.uuid4()),
            "warehouse_id": "WH-1",
            "sku": sku,
            "qty": qty,
            "kind": kind,
            "occurred_at": "2026-11-29T10:15:30+01:00",
        }
    ).encode()


def record(
    partition: int, offset: int, value: bytes | None = None, key: bytes | None = b"SKU-1", timestamp: int = TS
) -> Record:
    return Record(partition, offset, timestamp, key, movement() if value is None else value)


def as_dict(columns: tuple[str, ...], row: tuple[Any, ...]) -> dict[str, Any]:
    assert len(row) == len(columns)
    return dict(zip(columns, row, strict=True))


class TestSlices:
    """Each partition in the batch gets one slice: the offsets the batch transaction advances."""

    def test_one_slice_per_partition_sorted_with_first_and_next_offset_and_epoch(self) -> None:
        """Partitions 3 and 0 (given out of order): slices come sorted by partition (the lock order), each with the
        first offset, the last offset + 1, and the epoch this worker claimed."""
        batch = build_batch(
            TOPIC, {3: [record(3, 10), record(3, 11), record(3, 12)], 0: [record(0, 5)]}, {0: 7, 3: 2, 9: 1}
        )
        assert batch.topic == TOPIC
        assert batch.slices == [PartitionSlice(0, 7, 5, 6, 5), PartitionSlice(3, 2, 10, 13, 10)]

    def test_offsets_with_holes_end_after_the_last_record(self) -> None:
        """Transaction markers and compaction leave holes: next_offset is last + 1, not first + count."""
        batch = build_batch(TOPIC, {1: [record(1, 10), record(1, 12), record(1, 15)]}, {1: 4})
        assert batch.slices == [PartitionSlice(1, 4, 10, 16, 10)]

    def test_a_partition_with_no_records_gets_no_slice(self) -> None:
        """An empty list (getmany returns those) does not move that partition's offset."""
        batch = build_batch(TOPIC, {0: [], 1: [record(1, 0)]}, {0: 1, 1: 1})
        assert [s.partition for s in batch.slices] == [1]

    def test_an_empty_batch_is_empty(self) -> None:
        """Nothing fetched, nothing to write."""
        batch = build_batch(TOPIC, {}, {})
        assert (batch.slices, batch.movements, batch.rejects, batch.raw, batch.size) == ([], [], [], [], 0)

    def test_a_partition_of_only_bad_records_still_advances(self) -> None:
        """Bad input never blocks a partition: its offsets move although nothing is applied."""
        batch = build_batch(TOPIC, {2: [record(2, 40, b"{"), record(2, 41, key=None)]}, {2: 9})
        assert batch.slices == [PartitionSlice(2, 9, 40, 42, 40)]
        assert batch.movements == []
        assert len(batch.rejects) == 2


class TestEnds:
    """`BatchBuilder.end`: a partition's part of the batch ends past offsets that held no data record."""

    def test_a_slice_ends_past_its_last_record(self) -> None:
        builder = BatchBuilder(TOPIC, {0: 1}, {0: 10})
        builder.add(0, [Record(0, 10, TS, b"k", movement()), Record(0, 11, TS, b"k", movement())])
        builder.end(0, 13)
        assert builder.batch().slices == [PartitionSlice(0, 1, 10, 13, 10)]

    def test_a_partition_of_markers_only_gets_a_slice_without_rows(self) -> None:
        builder = BatchBuilder(TOPIC, {0: 1, 1: 4}, {0: 10, 1: 7})
        builder.add(0, [Record(0, 10, TS, b"k", movement())])
        builder.end(1, 8)
        batch = builder.batch()
        assert batch.slices == [PartitionSlice(0, 1, 10, 11, 10), PartitionSlice(1, 4, 7, 8, 7)]
        assert (batch.size, batch.slices[1].non_records) == (1, [(7, 7)])

    def test_offsets_without_a_record_are_named_as_runs(self) -> None:
        """Expected 10; records 12, 13, 16 in two chunks; the partition ends at 19: 10-11 (before the first record),
        14-15 (between chunks), 17-18 (after the last) held no data record. A partition of consecutive records from
        where it stands names none."""
        builder = BatchBuilder(TOPIC, {0: 1, 1: 1}, {0: 10, 1: 0})
        builder.add(0, [Record(0, 12, TS, b"k", movement()), Record(0, 13, TS, b"k", movement())])
        builder.add(0, [Record(0, 16, TS, b"k", movement())])
        builder.end(0, 19)
        builder.add(1, [Record(1, o, TS, b"k", movement()) for o in range(5)])
        first, second = builder.batch().slices
        assert first.non_records == [(10, 11), (14, 15), (17, 18)]
        assert (second.non_records, second.next_offset) == ([], 5)

    def test_an_end_before_the_last_record_or_where_it_stands_is_refused(self) -> None:
        builder = BatchBuilder(TOPIC, {0: 1, 1: 1}, {0: 10, 1: 5})
        builder.add(0, [Record(0, 10, TS, b"k", movement()), Record(0, 11, TS, b"k", movement())])
        with pytest.raises(ValueError, match="ends at 11, before 12"):
            builder.end(0, 11)
        with pytest.raises(ValueError, match="not past the ledger's next offset 5"):
            builder.end(1, 5)


class TestRows:
    """Good records become movement rows, bad ones quarantine rows, every record exactly once."""

    def test_good_rows_carry_the_movement_and_its_kafka_coordinates(self) -> None:
        """A movement row holds the parsed fields, then topic, partition, offset and the record timestamp."""
        mid = str(uuid.uuid4())
        batch = build_batch(TOPIC, {4: [record(4, 77, movement("SKU-1", 9, "receipt", mid))]}, {4: 1})
        assert batch.rejects == []
        row = as_dict(MOVEMENT_COLUMNS, batch.movements[0])
        assert row == {
            "movement_id": uuid.UUID(mid),
            "warehouse_id": "WH-1",
            "sku": "SKU-1",
            "qty": 9,
            "kind": "receipt",
            "occurred_at": wire(2026, 11, 29, 10, 15, 30, offset_minutes=60),  # 2026-11-29T10:15:30+01:00
            "kafka_topic": TOPIC,
            "kafka_partition": 4,
            "kafka_offset": 77,
            "kafka_timestamp": wire(2025, 11, 29, 10, 15, 30, us=250_000),
        }

    def test_good_and_bad_records_are_split_in_offset_order(self) -> None:
        """Five records, two bad: three movement rows and two quarantine rows, each record exactly once."""
        recs = [record(0, 0), record(0, 1, b"{"), record(0, 2), record(0, 3, movement(qty=-1)), record(0, 4)]
        batch = build_batch(TOPIC, {0: recs}, {0: 1})
        assert [as_dict(MOVEMENT_COLUMNS, m)["kafka_offset"] for m in batch.movements] == [0, 2, 4]
        assert [as_dict(REJECT_COLUMNS, r)["kafka_offset"] for r in batch.rejects] == [1, 3]
        assert [as_dict(REJECT_COLUMNS, r)["reason_code"] for r in batch.rejects] == [
            "invalid_json",
            "sign_mismatch",
        ]
        assert batch.size == 5

    def test_a_quarantine_row_keeps_the_raw_bytes_coordinates_and_reason(self) -> None:
        """The operator can replay or fix bad input from rejected_movements: raw key and value, exact bytes."""
        key, raw = b"SKU-\xff", b'{"almost": "json"\xfe'
        batch = build_batch(TOPIC, {6: [record(6, 123, raw, key=key)]}, {6: 3})
        row = as_dict(REJECT_COLUMNS, batch.rejects[0])
        assert row["kafka_topic"] == TOPIC
        assert (row["kafka_partition"], row["kafka_offset"]) == (6, 123)
        assert row["kafka_timestamp"] == wire(2025, 11, 29, 10, 15, 30, us=250_000)
        assert (row["key"], row["value"]) == (key, raw)
        assert row["reason_code"] == RejectCode.INVALID_JSON.value
        assert isinstance(row["reason_code"], str)
        assert row["reason"]
        assert row["movement_id"] is None

    def test_a_missing_key_and_a_tombstone_keep_their_nones(self) -> None:
        """No key / no value is stored as NULL, not as an empty string."""
        batch = build_batch(
            TOPIC, {0: [Record(0, 0, TS, None, movement()), Record(0, 1, TS, b"SKU-1", None)]}, {0: 1}
        )
        rows = [as_dict(REJECT_COLUMNS, r) for r in batch.rejects]
        assert [(r["key"], r["reason_code"]) for r in rows] == [
            (None, "missing_key"),
            (b"SKU-1", "invalid_json"),
        ]
        assert rows[1]["value"] is None

    def test_a_quarantine_row_carries_the_movement_id_when_one_can_be_read(self) -> None:
        """Bad input is searchable by movement_id when the value has a readable one (best effort)."""
        mid = str(uuid.uuid4())
        batch = build_batch(
            TOPIC,
            {
                0: [
                    record(0, 0, movement(qty=-2, movement_id=mid)),
                    record(0, 1, b"[1]"),
                    record(0, 2, b'{"movement_id": "nope"}'),
                ]
            },
            {0: 1},
        )
        assert [as_dict(REJECT_COLUMNS, r)["movement_id"] for r in batch.rejects] == [
            uuid.UUID(mid),
            None,
            None,
        ]

    def test_raw_is_parallel_to_movements(self) -> None:
        """batch.raw[i] is the (key, value) of movements[i], so a row quarantined later keeps its bytes."""
        values = [movement("SKU-1", qty) for qty in (1, 2, 3)]
        recs = [
            record(0, 0, values[0]),
            record(0, 1, b"bad"),
            record(0, 2, values[1]),
            record(1, 0, values[2]),
        ]
        batch = build_batch(TOPIC, {0: recs[:3], 1: recs[3:]}, {0: 1, 1: 1})
        assert len(batch.raw) == len(batch.movements) == 3
        assert batch.raw == [(b"SKU-1", v) for v in values]
        for (_, raw), row in zip(batch.raw, batch.movements, strict=True):
            assert as_dict(MOVEMENT_COLUMNS, row)["qty"] == json.loads(raw)["qty"]

    def test_timestamp_minus_one_is_stored_as_null(self) -> None:
        """Kafka reports -1 when a record has no timestamp: kafka_timestamp is NULL, not 1969-12-31."""
        batch = build_batch(
            TOPIC, {0: [record(0, 0, timestamp=-1), record(0, 1, b"{", timestamp=-1)]}, {0: 1}
        )
        assert as_dict(MOVEMENT_COLUMNS, batch.movements[0])["kafka_timestamp"] is None
        assert as_dict(REJECT_COLUMNS, batch.rejects[0])["kafka_timestamp"] is None
        assert batch.timestamps_ms == [-1, -1]

    def test_timestamps_ms_lists_every_record(self) -> None:
        """The end-to-end latency histogram observes every record, good or bad, in batch order."""
        batch = build_batch(
            TOPIC,
            {
                1: [record(1, 0, timestamp=30)],
                0: [record(0, 0, timestamp=10), record(0, 1, b"{", timestamp=20)],
            },
            {0: 1, 1: 1},
        )
        assert batch.timestamps_ms == [10, 20, 30]


class TestDuplicatesInOneBatch:
    """A movement_id seen twice in one batch is applied once; the copy is quarantined with its own reason."""

    def test_the_first_occurrence_is_applied_and_the_copy_quarantined(self) -> None:
        """An upstream resend within the batch: offset 0 applied, offset 2 a duplicate_movement_id reject whose
        reason names the id, with its raw bytes and its movement_id."""
        mid = str(uuid.uuid4())
        first, copy = movement(qty=5, movement_id=mid), movement(qty=5, movement_id=mid)
        batch = build_batch(TOPIC, {0: [record(0, 0, first), record(0, 1), record(0, 2, copy)]}, {0: 1})
        assert [as_dict(MOVEMENT_COLUMNS, m)["kafka_offset"] for m in batch.movements] == [0, 1]
        row = as_dict(REJECT_COLUMNS, batch.rejects[0])
        assert len(batch.rejects) == 1
        assert row["kafka_offset"] == 2
        assert row["reason_code"] == RejectCode.DUPLICATE_MOVEMENT_ID.value
        assert mid in row["reason"]
        assert (row["key"], row["value"]) == (b"SKU-1", copy)
        assert row["movement_id"] == uuid.UUID(mid)

    def test_a_duplicate_across_partitions_is_applied_once(self) -> None:
        """The same movement_id in two partitions of one batch: one movement row, one duplicate reject."""
        mid = str(uuid.uuid4())
        batch = build_batch(
            TOPIC,
            {
                0: [Record(0, 0, TS, b"SKU-1", movement("SKU-1", movement_id=mid))],
                1: [Record(1, 0, TS, b"SKU-2", movement("SKU-2", movement_id=mid))],
            },
            {0: 1, 1: 1},
        )
        assert [as_dict(MOVEMENT_COLUMNS, m)["movement_id"] for m in batch.movements] == [uuid.UUID(mid)]
        assert [as_dict(REJECT_COLUMNS, r)["reason_code"] for r in batch.rejects] == ["duplicate_movement_id"]

    def test_a_corrected_resend_after_a_rejected_record_is_applied(self) -> None:
        """A rejected record does not reserve its movement_id: the corrected resend is applied."""
        mid = str(uuid.uuid4())
        batch = build_batch(
            TOPIC,
            {
                0: [
                    record(0, 0, movement(qty=-5, movement_id=mid)),
                    record(0, 1, movement(qty=5, movement_id=mid)),
                ]
            },
            {0: 1},
        )
        assert [as_dict(MOVEMENT_COLUMNS, m)["kafka_offset"] for m in batch.movements] == [1]
        assert [as_dict(REJECT_COLUMNS, r)["reason_code"] for r in batch.rejects] == ["sign_mismatch"]


_payloads = st.one_of(
    st.sampled_from([b"{", b"[1]", b"null"]),
    st.builds(
        lambda i, q: movement(qty=q, movement_id=str(uuid.UUID(int=i))),
        st.integers(0, 5),
        st.sampled_from([-1, 1, 2]),
    ),
    st.none(),
)


@settings(max_examples=200, deadline=None, database=None)
@given(
    st.dictionaries(
        st.integers(0, 23), st.lists(st.tuples(st.integers(1, 3), _payloads), max_size=6), max_size=4
    )
)
def test_every_record_lands_exactly_once_and_no_movement_id_twice(
    layout: dict[int, list[tuple[int, Any]]],
) -> None:
    """Whatever the mix: every record is either a movement row or a quarantine row (never both, never neither),
    no movement_id appears twice among the rows to apply, and the slices cover exactly the non-empty partitions."""
    records: dict[int, list[Record]] = {}
    for partition, items in layout.items():
        offset, recs = 0, []
        for gap, payload in items:
            offset += gap
            recs.append(Record(partition, offset, TS, b"SKU-1", payload))
        records[partition] = recs
    batch = build_batch(TOPIC, records, dict.fromkeys(records, 1))

    coordinates = [(m[7], m[8]) for m in batch.movements] + [(r[1], r[2]) for r in batch.rejects]
    assert sorted(coordinates) == sorted((p, r.offset) for p, recs in records.items() for r in recs)
    ids = [m[0] for m in batch.movements]
    assert len(ids) == len(set(ids))
    assert len(batch.raw) == len(batch.movements)
    assert [s.partition for s in batch.slices] == sorted(p for p, recs in records.items() if recs)
    for s in batch.slices:
        assert (s.first_offset, s.next_offset) == (
            records[s.partition][0].offset,
            records[s.partition][-1].offset + 1,
        )


@settings(max_examples=200, deadline=None, database=None)
@given(
    st.dictionaries(
        st.integers(0, 23), st.lists(st.tuples(st.integers(1, 3), _payloads), max_size=8), max_size=4
    ),
    st.lists(st.integers(1, 4), min_size=1, max_size=8),
)
def test_built_in_chunks_the_batch_is_the_same_as_built_in_one_go(
    layout: dict[int, list[tuple[int, Any]]], chunk_sizes: list[int],
) -> None:
    """The worker builds a batch in chunks (its event loop runs in between): the slices, rows, quarantine rows and
    raw bytes are exactly those of one `build_batch` call, including duplicates found across chunks and
    partitions."""
    records: dict[int, list[Record]] = {}
    for partition, items in layout.items():
        offset, recs = 0, []
        for gap, payload in items:
            offset += gap
            recs.append(Record(partition, offset, TS + offset % 2, b"SKU-1", payload))
        records[partition] = recs
    epochs = {p: p + 1 for p in records}
    builder = BatchBuilder(TOPIC, epochs)
    sizes = itertools.cycle(chunk_sizes)  # as many chunks as the records need (up to 32 of size 1)
    for partition in sorted(records):
        recs, i = records[partition], 0
        while i < len(recs):
            n = next(sizes)
            builder.add(partition, recs[i:i + n])
            i += n
    chunked, whole = builder.batch(), build_batch(TOPIC, records, epochs)
    assert chunked.slices == whole.slices
    assert [s.timestamps_ms for s in chunked.slices] == [s.timestamps_ms for s in whole.slices]
    assert chunked.movements == whole.movements
    assert chunked.rejects == whole.rejects
    assert chunked.raw == whole.raw


def test_a_builder_refuses_chunks_out_of_order() -> None:
    """Chunks of one partition must follow each other, partitions one after the other: anything else is a bug in
    the caller, and the slice would misstate the offsets the transaction advances."""
    builder = BatchBuilder(TOPIC, {0: 1, 1: 1})
    builder.add(0, [record(0, 5), record(0, 6)])
    with pytest.raises(ValueError, match="before 7"):
        builder.add(0, [record(0, 6)])
    builder.add(1, [record(1, 0)])
    with pytest.raises(ValueError, match="added again"):
        builder.add(0, [record(0, 7)])


def _levels_by_hand(batch: Any) -> dict[tuple[str, str], int]:
    """The per-(warehouse, sku) sums, from the rows as named columns: an independent reading of the batch."""
    sums: dict[tuple[str, str], int] = {}
    for row in batch.movements:
        m = as_dict(MOVEMENT_COLUMNS, row)
        sums[m["warehouse_id"], m["sku"]] = sums.get((m["warehouse_id"], m["sku"]), 0) + m["qty"]
    return sums


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["SKU-1", "SKU-2", "SKU-10", "a", "é"]),
                          st.sampled_from(["WH-1", "WH-2", "wh"]), st.integers(1, 5), st.booleans()), max_size=40))
def test_a_built_batch_carries_the_level_deltas_of_its_movements_in_key_order(
    items: list[tuple[int, str, str, int, bool]],
) -> None:
    """The transaction adds the deltas summed while the batch was built: per (warehouse, sku), the sum of the
    applied movements' qty (not of the quarantined records), keys sorted (the lock order of stock_levels)."""
    records: dict[int, list[Record]] = {}
    for partition, sku, warehouse, qty, bad in items:
        value = json.loads(movement(sku, qty))
        value["warehouse_id"] = warehouse
        if bad:
            value["qty"] = -qty  # a receipt with a negative qty: quarantined, no delta
        recs = records.setdefault(partition, [])
        recs.append(Record(partition, len(recs), TS, sku.encode(), json.dumps(value).encode()))
    batch = build_batch(TOPIC, records, dict.fromkeys(records, 1))
    assert batch.levels is not None
    keys = list(zip(batch.levels.warehouses, batch.levels.skus, strict=True))
    assert keys == sorted(keys)
    assert dict(zip(keys, batch.levels.deltas, strict=True)) == _levels_by_hand(batch)
    assert sum(batch.levels.deltas) == sum(qty for _, _, _, qty, bad in items if not bad)


def test_a_batch_without_a_partition_leaves_its_deltas_to_be_summed_again() -> None:
    """A fence or revocation takes partitions out of a built batch: the deltas summed for the whole batch no longer
    hold, so the smaller batch carries none (the sink sums its rows)."""
    batch = build_batch(TOPIC, {0: [record(0, 0)], 1: [record(1, 0, movement("SKU-2", 5), key=b"SKU-2")]},
                        {0: 1, 1: 1})
    assert batch.levels is not None
    assert dict(zip(batch.levels.skus, batch.levels.deltas, strict=True)) == {"SKU-1": 3, "SKU-2": 5}
    smaller = batch.without({1})
    assert smaller is not None
    assert smaller.levels is None
    assert _levels_by_hand(smaller) == {("WH-1", "SKU-1"): 3}
