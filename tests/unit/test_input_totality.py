"""No property of one record can fail its batch: `parse` and `build_batch` are total over everything Kafka can
deliver, and every value they pass on is one PostgreSQL can store (checked against the real database by
tests/integration/test_fuzz_batch.py)."""

from __future__ import annotations

import json
import sys
import time
import uuid
from datetime import UTC
from typing import Any

import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stock_ledger.domain import MAX_DEPTH, Movement, RejectCode, Rejection, nests_deeper_than, parse, pg_text
from stock_ledger.ledger.batch import MAX_TIMESTAMP_MS, MOVEMENT_COLUMNS, REJECT_COLUMNS, Record, build_batch
from stock_ledger.ledger.movements import refusal
from tests.fuzz import any_record, batches, encode_with, near_valid

KEY = b"SKU-1"


def fields(**overrides: Any) -> dict[str, Any]:
    return {"movement_id": str(uuid.uuid4()), "warehouse_id": "WH-1", "sku": "SKU-1", "qty": 5, "kind": "receipt",
            "occurred_at": "2026-11-29T10:00:00+01:00", **overrides}


def nested(depth: int) -> bytes:
    """A movement (1 level) whose ignored field `extra` brings the total nesting to `depth`."""
    return encode_with(fields(), {"extra": b"[" * (depth - 1) + b"]" * (depth - 1)})


def pg_safe(text: str) -> bool:
    """What PostgreSQL text holds: valid UTF-8 (no lone surrogates), no NUL."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return "\x00" not in text


def storable(m: Movement) -> bool:
    m.occurred_at.astimezone(UTC)  # raises if the driver could not convert it
    return (pg_safe(m.warehouse_id) and pg_safe(m.sku) and 1 <= len(m.sku) <= 64 and 1 <= len(m.warehouse_id) <= 64
            and m.qty != 0 and abs(m.qty) <= 1_000_000_000)


class TestDepth:
    """Nesting: msgspec raises RecursionError past ~1,000 levels even in ignored fields; the parser stops at 64."""

    def test_a_movement_nesting_exactly_the_limit_is_accepted(self) -> None:
        """64 levels in all (the object plus 63 in an ignored field): still a movement."""
        assert isinstance(parse(KEY, nested(MAX_DEPTH)), Movement)

    @pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 1_000, 5_000, 100_000])
    def test_deeper_nesting_in_an_ignored_field_is_too_deep(self, depth: int) -> None:
        """One level more, or the issue's 5,000 (which crash-looped every worker): too_deep, with the limit named."""
        r = parse(KEY, nested(depth))
        assert isinstance(r, Rejection)
        assert r.code is RejectCode.TOO_DEEP
        assert str(MAX_DEPTH) in r.reason

    def test_brackets_inside_strings_do_not_nest(self) -> None:
        """Only structure counts: a string full of brackets (and escaped quotes) is a plain value."""
        raw = encode_with(fields(), {"note": json.dumps('\\"' + "[{" * 500).encode()})
        assert isinstance(parse(KEY, raw), Movement)
        assert not nests_deeper_than(raw, MAX_DEPTH)

    def test_a_deep_record_does_not_fail_build_batch_and_has_no_movement_id(self) -> None:
        """The batch builder reads the movement_id of a quarantined record again: never of a too-deep one."""
        batch = build_batch("t", {0: [Record(0, 0, 1, KEY, nested(50_000)), Record(0, 1, 1, KEY, nested(2))]}, {0: 1})
        assert len(batch.movements) == 1
        (reject,) = batch.rejects
        assert dict(zip(REJECT_COLUMNS, reject, strict=True))["reason_code"] == "too_deep"

    def test_a_nearly_exhausted_stack_is_still_a_rejection(self) -> None:
        """Belt and braces: if msgspec's RecursionError comes earlier (a deep caller stack), the record is still
        too_deep, never an exception."""
        limit = sys.getrecursionlimit()

        def deep(n: int) -> Movement | Rejection:
            return deep(n - 1) if n else parse(KEY, nested(MAX_DEPTH))

        sys.setrecursionlimit(200)
        try:
            r = deep(150)
        finally:
            sys.setrecursionlimit(limit)
        assert isinstance(r, Movement) or r.code is RejectCode.TOO_DEEP


    @pytest.mark.parametrize("value", [
        b'{"a":"' + b'\\"' * 300_000 + b"[" * 100, b'{"a":' + b'"' * 1_000_000 + b"[" * 100,
        b"{" + (b"[" * 64 + b"]" * 64) * 7_000 + b"}", b"{" + b"[" * 500_000 + b"]" * 500_000 + b"}",
        b'{"a":"' + b"\\" * 500_000 + b"[" * 100,
    ], ids=["escaped-quotes", "bare-quotes", "many-64-deep", "one-deep", "backslashes"])
    def test_a_megabyte_built_to_be_slow_is_decided_in_well_under_seconds(self, value: bytes) -> None:
        """The depth check is linear: no 1 MB value stalls the partition (a backtracking scan took minutes)."""
        started = time.perf_counter()
        parse(KEY, value)
        assert time.perf_counter() - started < 5

    @settings(max_examples=300, deadline=None)
    @given(st.recursive(st.none() | st.integers() | st.text(alphabet='[]{}"\\ab', max_size=6),
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                            st.text(alphabet='[]{}"\\a', max_size=3), inner, max_size=3), max_leaves=30))
    def test_the_depth_check_agrees_with_the_json_structure(self, document: object) -> None:
        """For any JSON document (strings full of brackets, quotes and backslashes included), the check says
        'deeper' exactly when the document's real nesting exceeds the limit, for every limit."""
        raw = json.dumps(document).encode()

        def depth(v: object) -> int:
            if isinstance(v, list):
                return 1 + max(map(depth, v), default=0)
            if isinstance(v, dict):
                return 1 + max(map(depth, v.values()), default=0)
            return 0

        for limit in range(5):
            assert nests_deeper_than(raw, limit) == (depth(document) > limit), (raw, limit)


class TestDates:
    """occurred_at must stay inside Python's datetime once converted to UTC (the driver converts inside COPY)."""

    @pytest.mark.parametrize("stamp", ["0001-01-01T00:30:00+01:00", "9999-12-31T23:30:00-01:00",
                                       "0001-01-01T00:00:00+00:01", "9999-12-31T00:01:00-23:59"])
    def test_an_occurred_at_whose_utc_value_leaves_the_range_is_out_of_range(self, stamp: str) -> None:
        """The issue's two dates (OverflowError inside COPY) and the extreme offsets: out_of_range, named."""
        r = parse(KEY, json.dumps(fields(occurred_at=stamp)).encode())
        assert isinstance(r, Rejection)
        assert r.code is RejectCode.OUT_OF_RANGE
        assert "occurred_at" in r.reason

    @pytest.mark.parametrize("stamp", ["0001-01-01T00:00:00Z", "0001-01-01T01:00:00+01:00",
                                       "9999-12-31T23:59:59.999999Z", "9999-12-31T22:30:00-01:00",
                                       "0001-01-01T00:00:00-23:59"])
    def test_the_range_ends_themselves_are_accepted(self, stamp: str) -> None:
        """Exactly the first and last representable UTC instants, reached with or without an offset: movements."""
        m = parse(KEY, json.dumps(fields(occurred_at=stamp)).encode())
        assert isinstance(m, Movement)
        assert storable(m)


class TestKafkaTimestamps:
    """Kafka metadata out of range never stops a movement: NULL kafka_timestamp, counted in `bad_timestamps`."""

    @pytest.mark.parametrize(
        ("ms", "stored", "bad"),
        [
            (-1, None, 0),
            (0, (-946_684_800 * 10**6,), 0),  # 1970-01-01T00:00:00Z, in microseconds since 2000
            (MAX_TIMESTAMP_MS, (252_455_615_999_999_000,), 0),  # 9999-12-31T23:59:59.999Z
            (MAX_TIMESTAMP_MS + 1, None, 1),
            (1_764_411_330_250_000, None, 1),  # microseconds sent as milliseconds: year 57868
            (2**63 - 1, None, 1),
            (-2, None, 1),
            (-(2**63), None, 1),
        ],
        ids=["none", "epoch", "last-ms", "past-9999", "micros-as-ms", "int64-max", "minus-2", "int64-min"],
    )
    def test_a_record_timestamp_is_stored_or_nulled_and_counted(self, ms: int, stored: tuple[int] | None,
                                                                 bad: int) -> None:
        """Each timestamp on a good movement and on a quarantined record: the movement is still applied."""
        batch = build_batch("t", {0: [Record(0, 0, ms, KEY, json.dumps(fields()).encode()),
                                      Record(0, 1, ms, KEY, b"{")]}, {0: 1})
        assert len(batch.movements) == 1
        assert dict(zip(MOVEMENT_COLUMNS, batch.movements[0], strict=True))["kafka_timestamp"] == stored
        assert dict(zip(REJECT_COLUMNS, batch.rejects[0], strict=True))["kafka_timestamp"] == stored
        assert batch.bad_timestamps == 2 * bad


class TestText:
    def test_pg_text_escapes_nul_and_lone_surrogates_and_bounds_length(self) -> None:
        """Anything copied into a text column (a reason, a server message) is storable: escaped, not dropped."""
        assert pg_text("a\x00b\ud800c") == "a\\x00b\\ud800c"
        assert pg_safe(pg_text("\udfff" * 5000))
        assert len(pg_text("x" * 5000)) == 2000

    @pytest.mark.parametrize("raw", [b'"\\ud800"', b'"\\udfff"', b'"a\\ud800b"'])
    def test_a_lone_surrogate_in_any_string_is_invalid_json(self, raw: bytes) -> None:
        """A lone surrogate escape is valid JSON syntax but no Unicode string PostgreSQL can hold: rejected
        wherever it appears, even in an ignored field."""
        for target in ("warehouse_id", "sku", "extra"):
            r = parse(KEY, encode_with(fields(), {target: raw}))
            assert isinstance(r, Rejection)
            assert r.code is RejectCode.INVALID_JSON


# ---------------------------------------------------------------------------------------------- properties

@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(record=near_valid())
def test_parse_is_total_over_near_valid_movements(record: tuple[bytes, bytes]) -> None:
    """Any movement with one field mutated to an edge value (dates at the range ends with odd offsets, huge and
    float and bool numbers, deep nesting, surrogates, NUL, empty, 64/65-character strings, a missing field):
    parse never raises; a Movement is storable in PostgreSQL, a Rejection's reason is storable text."""
    r = parse(*record)
    if isinstance(r, Movement):
        assert storable(r)
    else:
        assert isinstance(r.code, RejectCode)
        assert r.code is not RejectCode.DATABASE_REJECTED
        assert pg_safe(r.reason)
    assert parse(*record) == r  # pure


@settings(max_examples=400, deadline=None)
@given(key=st.one_of(st.none(), st.binary(max_size=80)), value=st.one_of(st.none(), st.binary(max_size=400)))
def test_parse_is_total_over_arbitrary_bytes(key: bytes | None, value: bytes | None) -> None:
    """Arbitrary key and value bytes (or none): a Movement or a Rejection, never an exception."""
    r = parse(key, value)
    assert isinstance(r, Movement | Rejection)
    if isinstance(r, Rejection):
        assert pg_safe(r.reason)


def readable(wire: Any) -> bool:
    """A timestamp in the wire form (microseconds since 2000-01-01Z) within 0001-01-01T00:00:00Z and
    9999-12-31T23:59:59.999999Z: what Python's datetime holds once in UTC."""
    return type(wire) is tuple and len(wire) == 1 and -63_082_281_600_000_000 <= wire[0] <= 252_455_615_999_999_999


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(records=batches())
def test_build_batch_puts_every_record_in_exactly_one_list_with_storable_values(
    records: dict[int, list[Record]],
) -> None:
    """Whatever a fetch returns, every record becomes exactly one movement row or one quarantine row, each text
    field is storable and each timestamp is NULL or an instant any reader can turn back into a datetime."""
    batch = build_batch("t", records, dict.fromkeys(records, 1))
    coordinates = [(m[7], m[8]) for m in batch.movements] + [(r[1], r[2]) for r in batch.rejects]
    assert sorted(coordinates) == sorted((r.partition, r.offset) for recs in records.values() for r in recs)
    for row in batch.movements:
        assert all(pg_safe(v) for v in row if isinstance(v, str))
        assert row[9] is None or readable(row[9])
        assert readable(row[5])
    for row in batch.rejects:
        assert pg_safe(row[7])
        assert row[3] is None or readable(row[3])
    assert batch.bad_timestamps == sum(
        1 for recs in records.values() for r in recs if r.timestamp != -1 and not 0 <= r.timestamp <= MAX_TIMESTAMP_MS)
    assert batch.times_ms == sorted(  # the latency metric's input: every timestamp that is a time, no other
        r.timestamp for recs in records.values() for r in recs if 0 <= r.timestamp <= MAX_TIMESTAMP_MS)


@settings(max_examples=200, deadline=None)
@given(record=any_record())
def test_any_record_parses_without_raising(record: tuple[bytes | None, bytes | None]) -> None:
    """The mix the database fuzz uses (valid, near-valid, arbitrary): parse is total over it too."""
    assert isinstance(parse(*record), Movement | Rejection)


class TestRefusal:
    """Which failures of the batch transaction are a refused value (isolate and quarantine the row), and which are
    not (faults to retry, our own uniqueness backstops, bugs to surface)."""

    @pytest.mark.parametrize("fields", [
        {"C": "22021", "M": 'invalid byte sequence for encoding "UTF8": 0x00'},
        {"C": "22003", "M": "integer out of range"},
        {"C": "22008", "M": "timestamp out of range"},
        {"C": "54000", "M": "row is too big"},
        {"C": "23514", "M": "new row violates check constraint", "n": "stock_movements_qty_check"},
        {"C": "23502", "M": "null value in column violates not-null constraint"},
        {"C": "23505", "M": "duplicate key value", "n": "some_index_someone_added"},
    ], ids=lambda f: f["C"])
    def test_data_errors_are_refusals_with_the_server_message(self, fields: dict[str, str]) -> None:
        why = refusal(asyncpg.PostgresError.new(fields))
        assert why is not None
        assert fields["C"] in why
        assert fields["M"] in why

    @pytest.mark.parametrize("fields", [
        {"C": "23505", "M": "dup", "n": "stock_movements_coordinates_key"},
        {"C": "23505", "M": "dup", "n": "rejected_movements_coordinates_key"},
        {"C": "23505", "M": "dup", "n": "stock_movements_movement_id_key"},
        {"C": "40001", "M": "could not serialize access"},
        {"C": "40P01", "M": "deadlock detected"},
        {"C": "55P03", "M": "lock not available"},
        {"C": "57014", "M": "canceling statement"},
        {"C": "57P01", "M": "terminating connection"},
        {"C": "42P01", "M": "relation does not exist"},
        {"C": "25P02", "M": "current transaction is aborted"},
    ], ids=lambda f: f"{f['C']}-{f.get('n', '')}")
    def test_backstops_faults_and_schema_errors_are_not(self, fields: dict[str, str]) -> None:
        assert refusal(asyncpg.PostgresError.new(fields)) is None

    def test_client_side_encode_errors_are_refusals_and_other_exceptions_are_not(self) -> None:
        """What asyncpg's encoders raise inside COPY is a refusal; connection faults and type bugs are not."""
        surrogate = "\ud800"
        with pytest.raises(UnicodeEncodeError) as encode:
            surrogate.encode()
        for exc in (encode.value, OverflowError("date value out of range"), ValueError("bad value"),
                    asyncpg.exceptions._base.DataError("invalid input")):
            assert refusal(exc) is not None, exc
        for exc in (ConnectionResetError(), OSError(), TypeError("not a str"), asyncpg.InterfaceError("closed"),
                    TimeoutError()):
            assert refusal(exc) is None, exc
