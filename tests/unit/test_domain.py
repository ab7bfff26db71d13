"""The message contract: `parse(key, value)` turns a record's bytes into a Movement or a Rejection, never raises."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stock_ledger.domain import MAX_ABS_QTY, Movement, RejectCode, Rejection, encode, parse

SKU = "SKU-000042"
KEY = SKU.encode()
INBOUND = ("receipt", "return", "transfer_in")
OUTBOUND = ("pick", "transfer_out")
KINDS = (*INBOUND, *OUTBOUND, "adjustment")
FIELDS = ("movement_id", "warehouse_id", "sku", "qty", "kind", "occurred_at")

# Enough examples to matter, no per-example deadline (shared CI machines stall), no example database on disk.
PROPERTY = settings(max_examples=300, deadline=None, database=None)


def fields(**overrides: Any) -> dict[str, Any]:
    """A valid movement as a JSON-ready dict; `overrides` replace (or add) fields."""
    base: dict[str, Any] = {
        "movement_id": "0b6a2f1e-5c1d-4f7a-9d0e-3a2b1c4d5e6f",
        "warehouse_id": "WH-BER-1",
        "sku": SKU,
        "qty": 12,
        "kind": "receipt",
        "occurred_at": "2026-11-29T10:15:30.250+01:00",
    }
    base.update(overrides)
    return base


def value(**overrides: Any) -> bytes:
    return json.dumps(fields(**overrides)).encode()


def without(name: str) -> bytes:
    d = fields()
    del d[name]
    return json.dumps(d).encode()


def rejected(key: bytes | None, raw: bytes | None) -> Rejection:
    result = parse(key, raw)
    assert isinstance(result, Rejection), f"expected a rejection, got {result!r}"
    assert result.reason.strip(), "a rejection must carry a reason a person can act on"
    return result


class TestValidMovements:
    """A value that follows the contract becomes a frozen Movement with typed fields."""

    def test_a_receipt_is_decoded_with_typed_fields(self) -> None:
        """The reference movement: every field arrives typed, the timestamp keeps its offset."""
        m = parse(KEY, value())
        assert m == Movement(
            movement_id=uuid.UUID("0b6a2f1e-5c1d-4f7a-9d0e-3a2b1c4d5e6f"),
            warehouse_id="WH-BER-1",
            sku=SKU,
            qty=12,
            kind="receipt",
            occurred_at=datetime(2026, 11, 29, 10, 15, 30, 250_000, tzinfo=timezone(timedelta(hours=1))),
        )
        assert isinstance(m, Movement)
        assert m.occurred_at.utcoffset() == timedelta(hours=1)

    @pytest.mark.parametrize("kind", INBOUND)
    def test_inbound_kinds_take_a_positive_qty(self, kind: str) -> None:
        """receipt, return and transfer_in add stock: qty > 0 is accepted."""
        m = parse(KEY, value(kind=kind, qty=5))
        assert isinstance(m, Movement)
        assert (m.kind, m.qty) == (kind, 5)

    @pytest.mark.parametrize("kind", OUTBOUND)
    def test_outbound_kinds_take_a_negative_qty(self, kind: str) -> None:
        """pick and transfer_out remove stock: qty < 0 is accepted."""
        m = parse(KEY, value(kind=kind, qty=-5))
        assert isinstance(m, Movement)
        assert (m.kind, m.qty) == (kind, -5)

    @pytest.mark.parametrize("qty", [7, -7])
    def test_an_adjustment_takes_either_sign(self, qty: int) -> None:
        """adjustment corrects a count in either direction."""
        m = parse(KEY, value(kind="adjustment", qty=qty))
        assert isinstance(m, Movement)
        assert m.qty == qty

    @pytest.mark.parametrize(
        ("kind", "qty"),
        [
            ("receipt", MAX_ABS_QTY),
            ("pick", -MAX_ABS_QTY),
            ("adjustment", MAX_ABS_QTY),
            ("adjustment", -MAX_ABS_QTY),
        ],
    )
    def test_qty_of_exactly_one_billion_is_accepted(self, kind: str, qty: int) -> None:
        """|qty| <= 1,000,000,000: the bound itself is inside."""
        assert MAX_ABS_QTY == 1_000_000_000
        m = parse(KEY, value(kind=kind, qty=qty))
        assert isinstance(m, Movement)
        assert m.qty == qty

    def test_unknown_extra_fields_are_ignored(self) -> None:
        """Producers may add fields (schema evolution): they are ignored, not rejected."""
        raw = value(note="pallet 7", qty_unit="each", nested={"a": [1, 2, {"b": None}]}, version=3)
        assert parse(KEY, raw) == parse(KEY, value())

    @pytest.mark.parametrize("length", [1, 64])
    def test_warehouse_id_and_sku_of_1_and_64_characters_are_accepted(self, length: int) -> None:
        """The string bounds are inclusive: 1 and 64 characters (not bytes: 64 multi-byte characters pass)."""
        for text in ("W" * length, "é" * length):
            m = parse(text.encode(), value(warehouse_id=text, sku=text))
            assert isinstance(m, Movement)
            assert (m.warehouse_id, m.sku) == (text, text)

    @pytest.mark.parametrize(
        "stamp",
        [
            "2026-11-29T10:15:30Z",
            "2026-11-29T10:15:30+00:00",
            "2026-11-29T10:15:30.123456-07:00",
            "2026-11-29T23:59:59+14:00",
        ],
    )
    def test_rfc3339_timestamps_with_an_offset_are_accepted(self, stamp: str) -> None:
        """occurred_at is RFC 3339 with an offset; Z and numeric offsets, with or without fractions."""
        m = parse(KEY, value(occurred_at=stamp))
        assert isinstance(m, Movement)
        assert m.occurred_at.tzinfo is not None

    def test_a_multibyte_utf8_key_matches_its_sku(self) -> None:
        """The key is the SKU as UTF-8, so non-ASCII SKUs work."""
        sku = "Ärmel-Größe-42-😀"
        m = parse(sku.encode(), value(sku=sku))
        assert isinstance(m, Movement)
        assert m.sku == sku


class TestMissingKeyAndValue:
    """A record without a key or without a value cannot be a movement."""

    @pytest.mark.parametrize("key", [None, b""], ids=["none", "empty"])
    def test_a_record_without_a_key_is_missing_key(self, key: bytes | None) -> None:
        """No key (None) and an empty key both mean the producer did not key by SKU."""
        r = rejected(key, value())
        assert r.code is RejectCode.MISSING_KEY
        assert "key" in r.reason

    def test_a_missing_key_wins_over_a_bad_value(self) -> None:
        """Both wrong: the key is reported first (it is the cheaper check and the likelier producer bug)."""
        assert rejected(None, b"{oops").code is RejectCode.MISSING_KEY

    def test_a_tombstone_is_invalid_json(self) -> None:
        """A tombstone (value None) is not a movement; the reason says it was a tombstone."""
        r = rejected(KEY, None)
        assert r.code is RejectCode.INVALID_JSON
        assert "tombstone" in r.reason


class TestInvalidJson:
    """A value that is not a UTF-8 JSON object is invalid_json."""

    @pytest.mark.parametrize(
        "raw",
        [
            b"",
            b"{",
            b"{not json}",
            b'{"qty": 1,}',
            b"\x00",
            b"SKU-1",
            value() + b" trailing",
            value() + value(),
        ],
        ids=[
            "empty",
            "truncated",
            "garbage",
            "trailing-comma",
            "nul",
            "bare-word",
            "trailing-data",
            "two-objects",
        ],
    )
    def test_malformed_json_is_invalid_json(self, raw: bytes) -> None:
        """Bytes that do not parse as JSON."""
        r = rejected(KEY, raw)
        assert r.code is RejectCode.INVALID_JSON
        assert "JSON" in r.reason

    @pytest.mark.parametrize(
        "raw",
        [b"\xff\xfe{}", value(warehouse_id="WH").replace(b"WH", b"W\xc3\x28"), b'{"sku": "\xed\xa0\x80"}'],
        ids=["bom-like", "broken-2-byte", "encoded-surrogate"],
    )
    def test_invalid_utf8_is_invalid_json(self, raw: bytes) -> None:
        """The value must be UTF-8; an invalid sequence anywhere is invalid_json."""
        r = rejected(KEY, raw)
        assert r.code is RejectCode.INVALID_JSON
        assert "UTF-8" in r.reason or "JSON" in r.reason

    def test_a_lone_surrogate_escape_is_rejected(self) -> None:
        """'\\ud800' is valid JSON syntax but not a Unicode string PostgreSQL could store: rejected, not applied."""
        raw = value(warehouse_id="WH").replace(b'"WH"', b'"\\ud800"')
        assert isinstance(parse(KEY, raw), Rejection)

    @pytest.mark.parametrize(
        "raw",
        [b"[]", b"[1, 2]", b'"a string"', b"42", b"null", b"true", json.dumps([fields()]).encode()],
        ids=["empty-array", "array", "string", "number", "null", "bool", "movement-in-array"],
    )
    def test_json_that_is_not_an_object_is_invalid_json(self, raw: bytes) -> None:
        """Valid JSON but not an object: the value is not the JSON object the contract requires, exactly like a
        tombstone, so the class is invalid_json (there is no field to blame), and the reason says 'object'."""
        r = rejected(KEY, raw)
        assert r.code is RejectCode.INVALID_JSON
        assert "object" in r.reason


class TestInvalidFields:
    """A JSON object whose fields break the contract is invalid_field, and the reason names the field."""

    @pytest.mark.parametrize("name", FIELDS)
    def test_each_missing_field_is_named(self, name: str) -> None:
        """Every field is required."""
        r = rejected(KEY, without(name))
        assert r.code is RejectCode.INVALID_FIELD
        assert name in r.reason

    @pytest.mark.parametrize("name", FIELDS)
    def test_each_null_field_is_named(self, name: str) -> None:
        """null is not a value for any field."""
        r = rejected(KEY, value(**{name: None}))
        assert r.code is RejectCode.INVALID_FIELD
        assert name in r.reason

    @pytest.mark.parametrize(
        "qty",
        [5.0, 5.5, 1e9, True, False, "5", [5], {"n": 5}],
        ids=["float-integral", "float", "float-1e9", "true", "false", "string", "list", "object"],
    )
    def test_qty_must_be_a_json_integer(self, qty: object) -> None:
        """qty is an integer: floats (even 5.0), booleans and strings are not coerced."""
        r = rejected(KEY, value(qty=qty))
        assert r.code is RejectCode.INVALID_FIELD
        assert "qty" in r.reason

    @pytest.mark.parametrize(
        "qty",
        [MAX_ABS_QTY + 1, -MAX_ABS_QTY - 1, 10**30, -(10**30), 2**63, 2**64],
        ids=["1e9+1", "-1e9-1", "1e30", "-1e30", "2^63", "2^64"],
    )
    def test_qty_beyond_one_billion_is_rejected(self, qty: int) -> None:
        """|qty| > 1,000,000,000 is out of range, however large."""
        r = rejected(KEY, value(kind="adjustment", qty=qty))
        assert r.code is RejectCode.INVALID_FIELD
        assert "qty" in r.reason

    @pytest.mark.parametrize("kind", KINDS)
    def test_qty_zero_is_rejected_for_every_kind(self, kind: str) -> None:
        """A movement of nothing is not a movement."""
        r = rejected(KEY, value(kind=kind, qty=0))
        assert r.code is RejectCode.INVALID_FIELD
        assert "qty" in r.reason

    @pytest.mark.parametrize(
        "movement_id",
        [
            "not-a-uuid",
            "",
            "0b6a2f1e-5c1d-4f7a-9d0e",
            "{0b6a2f1e-5c1d-4f7a-9d0e-3a2b1c4d5e6f}",
            "zb6a2f1e-5c1d-4f7a-9d0e-3a2b1c4d5e6f",
            42,
            ["x"],
        ],
        ids=["word", "empty", "short", "braces", "non-hex", "int", "list"],
    )
    def test_movement_id_must_be_a_uuid(self, movement_id: object) -> None:
        """movement_id is a UUID string."""
        r = rejected(KEY, value(movement_id=movement_id))
        assert r.code is RejectCode.INVALID_FIELD
        assert "movement_id" in r.reason

    @pytest.mark.parametrize("kind", ["teleport", "Receipt", "RECEIPT", " receipt", "", 1, None])
    def test_kind_must_be_one_of_the_six(self, kind: object) -> None:
        """kind is exactly one of receipt, return, transfer_in, pick, transfer_out, adjustment (case matters)."""
        r = rejected(KEY, value(kind=kind))
        assert r.code is RejectCode.INVALID_FIELD
        assert "kind" in r.reason

    @pytest.mark.parametrize(
        "stamp",
        ["2026-11-29T10:15:30", "2026-11-29T10:15:30.5", "2026-11-29 10:15:30"],
        ids=["naive", "naive-fraction", "naive-space"],
    )
    def test_occurred_at_without_an_offset_is_rejected(self, stamp: str) -> None:
        """A timestamp without an offset is ambiguous across warehouses."""
        r = rejected(KEY, value(occurred_at=stamp))
        assert r.code is RejectCode.INVALID_FIELD
        assert "occurred_at" in r.reason

    @pytest.mark.parametrize(
        "stamp",
        [
            "2026-11-29",
            "2026-11-29T10:15+01:00",
            "29/11/2026 10:15:30 +01:00",
            "yesterday",
            "2026-13-01T00:00:00Z",
            "2026-02-30T00:00:00Z",
            "2026-11-29T25:00:00Z",
            "",
            1764411330,
            1764411330.5,
        ],
        ids=[
            "date-only",
            "no-seconds",
            "dmy",
            "word",
            "month-13",
            "feb-30",
            "hour-25",
            "empty",
            "epoch-int",
            "epoch-float",
        ],
    )
    def test_occurred_at_that_is_not_rfc3339_is_rejected(self, stamp: object) -> None:
        """occurred_at must be an RFC 3339 string: no dates alone, no epoch numbers, no impossible dates."""
        r = rejected(KEY, value(occurred_at=stamp))
        assert r.code is RejectCode.INVALID_FIELD
        assert "occurred_at" in r.reason

    @pytest.mark.parametrize("name", ["warehouse_id", "sku"])
    @pytest.mark.parametrize("text", ["", "X" * 65, "é" * 65], ids=["empty", "65-ascii", "65-multibyte"])
    def test_warehouse_id_and_sku_hold_1_to_64_characters(self, name: str, text: str) -> None:
        """Empty and 65-character identifiers are rejected, naming the field."""
        key = text.encode() if name == "sku" and text else KEY
        r = rejected(key, value(**{name: text}))
        assert r.code is RejectCode.INVALID_FIELD
        assert name in r.reason

    @pytest.mark.parametrize("name", ["warehouse_id", "sku"])
    @pytest.mark.parametrize("text", [1, ["WH"], {"id": "WH"}, True])
    def test_warehouse_id_and_sku_must_be_strings(self, name: str, text: object) -> None:
        """Identifiers are strings; numbers are not coerced."""
        r = rejected(KEY, value(**{name: text}))
        assert r.code is RejectCode.INVALID_FIELD
        assert name in r.reason

    @pytest.mark.parametrize("name", ["warehouse_id", "sku"])
    def test_nul_characters_are_rejected(self, name: str) -> None:
        """PostgreSQL text cannot hold NUL: it must be quarantined here, not fail the batch transaction forever."""
        text = "AB\x00CD"
        key = text.encode() if name == "sku" else KEY
        r = rejected(key, value(**{name: text}))
        assert r.code is RejectCode.INVALID_FIELD
        assert name in r.reason
        assert "NUL" in r.reason


class TestKeyMismatch:
    """The key must be the SKU as UTF-8: that keeps one SKU on one partition, in order."""

    @pytest.mark.parametrize("key", [b"SKU-000043", b"sku-000042", b"SKU-000042 ", b"WH-BER-1"])
    def test_a_key_that_differs_from_the_sku_is_key_mismatch(self, key: bytes) -> None:
        """Any difference, even case or a trailing space, and the reason names both the key and the sku."""
        r = rejected(key, value())
        assert r.code is RejectCode.KEY_MISMATCH
        assert "key" in r.reason
        assert "sku" in r.reason
        assert SKU in r.reason

    @pytest.mark.parametrize("key", [b"\xff", b"SKU-\xc3\x28", b"\xed\xa0\x80"])
    def test_a_key_that_is_not_utf8_is_key_mismatch(self, key: bytes) -> None:
        """A key that is not UTF-8 cannot equal any SKU; the reason shows the bytes."""
        r = rejected(key, value())
        assert r.code is RejectCode.KEY_MISMATCH
        assert "UTF-8" in r.reason
        assert "key" in r.reason


class TestSignMismatch:
    """The sign of qty must agree with the kind."""

    @pytest.mark.parametrize("kind", INBOUND)
    def test_an_inbound_kind_with_a_negative_qty_is_sign_mismatch(self, kind: str) -> None:
        """receipt/return/transfer_in with qty < 0."""
        r = rejected(KEY, value(kind=kind, qty=-3))
        assert r.code is RejectCode.SIGN_MISMATCH
        assert kind in r.reason
        assert "qty" in r.reason
        assert "-3" in r.reason

    @pytest.mark.parametrize("kind", OUTBOUND)
    def test_an_outbound_kind_with_a_positive_qty_is_sign_mismatch(self, kind: str) -> None:
        """pick/transfer_out with qty > 0."""
        r = rejected(KEY, value(kind=kind, qty=3))
        assert r.code is RejectCode.SIGN_MISMATCH
        assert kind in r.reason
        assert "qty" in r.reason


def test_parse_is_pure() -> None:
    """The same bytes always give the same answer (replays after a crash must classify records identically)."""
    for raw in (value(), value(qty=0), b"[1]", b"{", None):
        assert parse(KEY, raw) == parse(KEY, raw)


def test_the_reject_codes_are_the_contract_label_values() -> None:
    """The rejection reasons are exactly the metric label values the contract lists."""
    assert {c.value for c in RejectCode} == {
        "invalid_json",
        "invalid_field",
        "key_mismatch",
        "sign_mismatch",
        "duplicate_movement_id",
        "missing_key",
        "too_deep",
        "out_of_range",
        "database_rejected",
        # Registry-framed formats (docs/formats.md): bytes the declared format cannot read, a schema id the registry
        # does not know (after its wait), a writer schema the ledger's reader schema cannot resolve.
        "invalid_encoding",
        "unknown_schema",
        "incompatible_schema",
    }


# ---------------------------------------------------------------------------------------------- properties

_TEXT_CHARS = st.characters(exclude_categories=("Cs",), exclude_characters="\x00")
identifiers = st.text(_TEXT_CHARS, min_size=1, max_size=64)
offsets = st.integers(min_value=-(23 * 60 + 59), max_value=23 * 60 + 59).map(
    lambda minutes: timezone(timedelta(minutes=minutes))
)
# Hypothesis takes naive bounds; the offset is drawn separately.
instants = st.datetimes(
    min_value=datetime(1900, 1, 1),  # noqa: DTZ001
    max_value=datetime(2200, 1, 1),  # noqa: DTZ001
    timezones=offsets,
)


@st.composite
def movements(draw: st.DrawFn) -> Movement:
    kind = draw(st.sampled_from(KINDS))
    positive = st.integers(1, MAX_ABS_QTY)
    negative = st.integers(-MAX_ABS_QTY, -1)
    qty = draw(
        {"pick": negative, "transfer_out": negative, "adjustment": positive | negative}.get(kind, positive)
    )
    return Movement(
        movement_id=draw(st.uuids()),
        warehouse_id=draw(identifiers),
        sku=draw(identifiers),
        qty=qty,
        kind=kind,
        occurred_at=draw(instants),
    )


json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=70)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
# For each field a valid and an invalid strategy, so that the fuzzer also reaches the checks after decoding.
field_values: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    "movement_id": (st.uuids().map(str), st.text(max_size=40) | json_values),
    "warehouse_id": (identifiers, st.sampled_from(["", "W" * 65, "W\x00"]) | json_values),
    "sku": (
        identifiers | st.sampled_from([SKU, "A" * 64]),
        st.sampled_from(["", "A" * 65, "AB\x00"]) | json_values,
    ),
    "qty": (
        st.integers(-MAX_ABS_QTY, MAX_ABS_QTY) | st.sampled_from([0, MAX_ABS_QTY, -MAX_ABS_QTY]),
        st.sampled_from([MAX_ABS_QTY + 1, -MAX_ABS_QTY - 1, 2**64, 1.0]) | json_values,
    ),
    "kind": (st.sampled_from(KINDS), st.sampled_from(["Receipt", "teleport", ""]) | json_values),
    "occurred_at": (
        instants.map(datetime.isoformat),
        instants.map(lambda d: d.replace(tzinfo=None).isoformat()) | json_values,
    ),
}


@st.composite
def near_movements(draw: st.DrawFn) -> tuple[bytes | None, bytes]:
    """Records shaped like movements: each field valid (mostly), invalid or absent, plus stray extras; keyed
    mostly by their own sku (so the checks after the key comparison are reached), sometimes by anything."""
    obj: dict[str, Any] = {}
    for name, (valid, invalid) in field_values.items():
        roll = draw(
            st.integers(0, 19)
        )  # low rolls (Hypothesis's favourites, and what it shrinks to) are valid
        if roll < 19:  # absent one time in twenty
            obj[name] = draw(valid if roll < 16 else invalid)
    obj.update(
        draw(st.dictionaries(st.text(max_size=8).filter(lambda k: k not in FIELDS), json_values, max_size=2))
    )
    sku = obj.get("sku")
    own = sku.encode("utf-8", "surrogatepass") if isinstance(sku, str) else None
    key = own if own is not None and draw(st.integers(0, 4)) < 4 else draw(keys)
    return key, json.dumps(obj).encode()


keys = st.none() | st.binary(max_size=80) | st.just(KEY) | identifiers.map(str.encode)
values = st.none() | st.binary(max_size=300) | movements().map(encode)
records = st.one_of(st.tuples(keys, values), near_movements(), near_movements(), near_movements())


class TestProperties:
    """Properties over generated inputs."""

    @PROPERTY
    @given(movements())
    def test_every_valid_movement_round_trips_through_encode_and_parse(self, m: Movement) -> None:
        """encode (what the producer sends) then parse (what the worker reads) gives the same movement back,
        to the microsecond and with the same UTC offset."""
        back = parse(m.sku.encode(), encode(m))
        assert back == m
        assert isinstance(back, Movement)
        assert back.occurred_at.utcoffset() == m.occurred_at.utcoffset()

    @PROPERTY
    @given(records)
    def test_parse_never_raises_whatever_the_bytes(self, record: tuple[bytes | None, bytes | None]) -> None:
        """A poison record must be quarantined, never crash the worker: parse is total over bytes."""
        result = parse(*record)
        assert isinstance(result, Movement | Rejection)
        if isinstance(result, Rejection):
            assert isinstance(result.code, RejectCode)
            assert result.reason

    @PROPERTY
    @given(records)
    def test_whatever_parse_accepts_satisfies_every_contract_rule(
        self, record: tuple[bytes | None, bytes | None]
    ) -> None:
        """Anything returned as a Movement is safe to apply: sign agrees with kind, qty is bounded and non-zero,
        identifiers are 1-64 characters without NUL and storable as UTF-8, the timestamp is aware, sku == key."""
        key, raw = record
        m = parse(key, raw)
        if not isinstance(m, Movement):
            return
        assert_contract(key, m)

    @PROPERTY
    @given(
        movements(),
        st.dictionaries(st.text(max_size=10).filter(lambda k: k not in FIELDS), json_values, max_size=4),
    )
    def test_extra_fields_never_change_the_result(self, m: Movement, extra: dict[str, Any]) -> None:
        """Unknown fields are ignored, whatever they hold."""
        obj = {**json.loads(encode(m)), **extra}
        assert parse(m.sku.encode(), json.dumps(obj).encode()) == m


def assert_contract(key: bytes | None, m: Movement) -> None:
    assert key is not None
    assert key.decode() == m.sku
    assert isinstance(m.movement_id, uuid.UUID)
    assert type(m.qty) is int
    assert m.qty != 0
    assert abs(m.qty) <= MAX_ABS_QTY
    assert m.kind in KINDS
    if m.kind in INBOUND:
        assert m.qty > 0
    if m.kind in OUTBOUND:
        assert m.qty < 0
    for text in (m.warehouse_id, m.sku):
        assert isinstance(text, str)
        assert 1 <= len(text) <= 64
        assert "\x00" not in text
        text.encode("utf-8")  # no lone surrogates: PostgreSQL must be able to store it
    assert m.occurred_at.tzinfo is not None
    assert m.occurred_at.utcoffset() is not None
    assert m.occurred_at.astimezone(UTC).tzinfo is UTC
