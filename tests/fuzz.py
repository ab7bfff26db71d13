"""Hypothesis strategies for everything Kafka can deliver: valid movements, near-valid ones with one field mutated
to an edge value, and arbitrary bytes (shared by the unit and the database fuzz tests)."""

from __future__ import annotations

import json
import uuid
from typing import Any

from hypothesis import strategies as st

from stock_ledger.ledger.batch import MAX_TIMESTAMP_MS, Record

KINDS = ("receipt", "return", "transfer_in", "pick", "transfer_out", "adjustment")
FIELDS = ("movement_id", "warehouse_id", "sku", "qty", "kind", "occurred_at")
SKUS = ("SKU-1", "SKU-2", "ü-SKU", "SKU-" + "x" * 60)

# Dates at the ends of what Python and PostgreSQL hold, with offsets that push them over (or keep them in).
EDGE_DATES = (
    "0001-01-01T00:30:00+01:00", "0001-01-01T00:00:00+00:01", "0001-01-01T00:00:00-23:59", "0001-01-01T00:00:00Z",
    "0001-01-01T01:00:00+01:00", "9999-12-31T23:30:00-01:00", "9999-12-31T23:59:59.999999Z",
    "9999-12-31T00:00:00-23:59", "9999-12-31T23:59:59+23:59", "9999-12-31T23:59:59.9999996Z",
    "2026-11-29T10:00:00+23:59", "2026-11-29T10:00:00-23:59", "2026-11-29T10:00:00+24:00", "2026-11-29T10:00:00",
    "2026-02-30T10:00:00Z", "2026-11-29T23:59:60Z", "0000-01-01T00:00:00Z", "10000-01-01T00:00:00Z",
    "2026-11-29T10:00:00.123456789Z", "2026-11-29 10:00:00Z", "", "infinity", "-infinity",
)
# Raw JSON fragments that Python's json module would never write, or values at the ends of the number ranges.
RAW_FRAGMENTS = (
    b"1e400", b"-1e400", b"NaN", b"Infinity", b"-0", b"1.0", b"5.5", b"1E3", b"true", b"false", b"null", b"[]", b"{}",
    b"9223372036854775807", b"9223372036854775808", b"-9223372036854775809", b"18446744073709551616",
    b"1" * 400, b"1000000000", b"1000000001", b"-1000000000", b"-1000000001",
    b'"\\u0000"', b'"SKU\\u0000"', b'"\\ud800"', b'"\\udfff"', b'"\\ud800\\udc00"', b'"\\ud83d\\ude00"', b'""',
    b'"\xed\xa0\x80"', b'"\xff"', b'"\xc3"', b'"x' + b"\\u00e9" * 64 + b'"', b'"' + b"x" * 64 + b'"',
    b'"' + b"x" * 65 + b'"', b'"' + "é".encode() * 64 + b'"', b'"' + "😀".encode() * 65 + b'"',
    b"[" * 64 + b"]" * 64, b"[" * 65 + b"]" * 65, b"[" * 5000 + b"]" * 5000, b'{"a":' * 3000 + b"1" + b"}" * 3000,
    b'"' + b"[" * 5000 + b'"', b"[" * 5000,
)
json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=80),
    st.integers(min_value=-(2**70), max_value=2**70),
)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=5), inner, max_size=3), max_leaves=8)
edge_values = st.one_of(
    st.sampled_from(RAW_FRAGMENTS),
    st.sampled_from(EDGE_DATES).map(lambda d: json.dumps(d).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),  # ensure_ascii: lone surrogates become \\udXXX escapes
    st.text(max_size=70).map(lambda t: json.dumps(t).encode()),
)


@st.composite
def valid_fields(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(KINDS))
    magnitude = draw(st.integers(min_value=1, max_value=1_000_000_000))
    sign = 1 if kind in {"receipt", "return", "transfer_in"} else -1 if kind != "adjustment" else draw(
        st.sampled_from([1, -1]))
    return {
        "movement_id": str(draw(st.uuids())), "warehouse_id": draw(st.sampled_from(["WH-1", "WH-2"])),
        "sku": draw(st.sampled_from(SKUS)), "qty": sign * magnitude, "kind": kind,
        "occurred_at": "2026-11-29T10:00:00+01:00",
    }


def encode_with(fields: dict[str, Any], raw: dict[str, bytes]) -> bytes:
    """A JSON object with `fields` as Python values and `raw` as JSON fragments spliced in verbatim."""
    parts = [json.dumps(k).encode() + b":" + json.dumps(v).encode() for k, v in fields.items() if k not in raw]
    parts += [json.dumps(k).encode() + b":" + v for k, v in raw.items()]
    return b"{" + b",".join(parts) + b"}"


@st.composite
def near_valid(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """A valid movement with one field (or an extra, ignored one) replaced by an edge value; key usually the sku."""
    fields = draw(valid_fields())
    target = draw(st.sampled_from((*FIELDS, "extra")))
    value = encode_with(fields, {target: draw(edge_values)})
    if draw(st.integers(0, 4)) == 0:
        value = encode_with({k: v for k, v in fields.items() if k != target}, {})  # a missing field
    key = fields["sku"].encode()
    if draw(st.integers(0, 9)) == 0:
        key = draw(st.sampled_from([b"", b"\x00", b"\xff", b"\xed\xa0\x80", b"SKU-1\x00", b"x" * 1000]))
    return key, value


@st.composite
def any_record(draw: st.DrawFn) -> tuple[bytes | None, bytes | None]:
    choice = draw(st.integers(0, 9))
    if choice < 4:
        fields = draw(valid_fields())
        return fields["sku"].encode(), encode_with(fields, {})
    if choice < 8:
        return draw(near_valid())
    return draw(st.one_of(st.none(), st.binary(max_size=40))), draw(st.one_of(st.none(), st.binary(max_size=200)))


kafka_timestamps = st.one_of(
    st.sampled_from([-1, -2, -(2**63), 0, 1, MAX_TIMESTAMP_MS, MAX_TIMESTAMP_MS + 1, 2**63 - 1,
                     1_764_411_330_250_000, 1_764_411_330_250]),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
)


@st.composite
def batches(draw: st.DrawFn, max_size: int = 30) -> dict[int, list[Record]]:
    """Records of up to three partitions at consecutive offsets, as a fetch returns them."""
    out: dict[int, list[Record]] = {}
    for key, value in draw(st.lists(any_record(), min_size=1, max_size=max_size)):
        partition = draw(st.integers(0, 2))
        recs = out.setdefault(partition, [])
        recs.append(Record(partition, len(recs), draw(kafka_timestamps), key, value))
    return out


def new_topic() -> str:
    return f"fuzz-{uuid.uuid4().hex[:12]}"
