"""Movements, and the pure function that turns a Kafka record's bytes into one or into a rejection."""

from __future__ import annotations

import enum
import uuid
from datetime import datetime
from typing import Annotated, Final, Literal

import msgspec

MAX_ABS_QTY: Final = 1_000_000_000
_Text = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]

Kind = Literal["receipt", "return", "transfer_in", "pick", "transfer_out", "adjustment"]
_INBOUND: Final = frozenset({"receipt", "return", "transfer_in"})
_OUTBOUND: Final = frozenset({"pick", "transfer_out"})


class Movement(msgspec.Struct, frozen=True):
    """One stock movement as the message contract defines it; unknown fields are ignored."""

    movement_id: uuid.UUID
    warehouse_id: _Text
    sku: _Text
    qty: Annotated[int, msgspec.Meta(ge=-MAX_ABS_QTY, le=MAX_ABS_QTY)]
    kind: Kind
    # tz=True: a timestamp without an offset is ambiguous across warehouses, so it is bad input.
    occurred_at: Annotated[datetime, msgspec.Meta(tz=True)]


class RejectCode(enum.StrEnum):
    """Low-cardinality rejection classes (a metrics label); the row's `reason` says the specifics."""

    MISSING_KEY = "missing_key"
    INVALID_JSON = "invalid_json"
    INVALID_FIELD = "invalid_field"
    KEY_MISMATCH = "key_mismatch"
    SIGN_MISMATCH = "sign_mismatch"
    DUPLICATE_MOVEMENT_ID = "duplicate_movement_id"


class Rejection(msgspec.Struct, frozen=True):
    code: RejectCode
    reason: str


_decoder: Final = msgspec.json.Decoder(Movement)
_CONTRACT: Final = "see 'Message format' in README.md"


def parse(key: bytes | None, value: bytes | None) -> Movement | Rejection:
    """Decode and validate one record. Pure: the same bytes always give the same answer."""
    if not key:
        return Rejection(RejectCode.MISSING_KEY, f"record has no key; the key must be the SKU as UTF-8 ({_CONTRACT})")
    if value is None:
        return Rejection(RejectCode.INVALID_JSON, "record has no value (a tombstone); a movement is a JSON object")
    if value.lstrip()[:1] != b"{":
        return Rejection(RejectCode.INVALID_JSON, f"value is not a JSON object (starts with {value[:16]!r})")
    try:
        movement = _decoder.decode(value)
    except msgspec.ValidationError as exc:
        return Rejection(RejectCode.INVALID_FIELD, f"invalid movement: {exc} ({_CONTRACT})")
    except msgspec.DecodeError as exc:
        return Rejection(RejectCode.INVALID_JSON, f"value is not UTF-8 JSON: {exc}")
    return _check(key, movement)


def _check(key: bytes, m: Movement) -> Movement | Rejection:  # noqa: PLR0911 - one flat rule list reads best
    if "\x00" in m.warehouse_id or "\x00" in m.sku:
        # PostgreSQL text cannot hold NUL: letting it through would fail the whole batch, again and again.
        return Rejection(RejectCode.INVALID_FIELD, "warehouse_id and sku must not contain NUL characters")
    try:
        key_text = key.decode()
    except UnicodeDecodeError:
        return Rejection(RejectCode.KEY_MISMATCH, f"key is not valid UTF-8 (bytes {key[:64]!r})")
    if key_text != m.sku:
        return Rejection(
            RejectCode.KEY_MISMATCH,
            f"key {key_text[:80]!r} differs from sku {m.sku!r}: the producer must key by SKU so one SKU stays "
            "on one partition, in order",
        )
    if m.qty == 0:
        return Rejection(RejectCode.INVALID_FIELD, "qty must be non-zero")
    if m.kind in _INBOUND and m.qty < 0:
        return Rejection(RejectCode.SIGN_MISMATCH, f"kind {m.kind!r} adds stock, so qty must be > 0 (got {m.qty})")
    if m.kind in _OUTBOUND and m.qty > 0:
        return Rejection(RejectCode.SIGN_MISMATCH, f"kind {m.kind!r} removes stock, so qty must be < 0 (got {m.qty})")
    return m


def encode(movement: Movement) -> bytes:
    """The wire form the producer sends (the inverse of `parse` for a valid movement)."""
    return msgspec.json.encode(movement)
