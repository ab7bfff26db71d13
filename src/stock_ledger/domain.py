"""Movements, and the pure function that turns a Kafka record's bytes into one or into a rejection."""

from __future__ import annotations

import enum
import uuid
from datetime import UTC, datetime
from typing import Annotated, Final, Literal

import msgspec

MAX_ABS_QTY: Final = 1_000_000_000
# A movement nests 1 level deep; 64 leaves unknown fields room. msgspec raises RecursionError (not a DecodeError)
# past about 1,000 levels, even inside ignored fields, and where exactly depends on the caller's stack: an explicit,
# smaller limit keeps `parse` total and pure.
MAX_DEPTH: Final = 64
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
    TOO_DEEP = "too_deep"
    OUT_OF_RANGE = "out_of_range"
    # Set by the sink, never by `parse`: the last line of defence when PostgreSQL refuses a row the parser let pass.
    DATABASE_REJECTED = "database_rejected"
    # Records in a declared format (formats/, docs/formats.md): bytes that are not that format or do not decode with
    # their schema; a schema id the registry does not know (after STOCK_LEDGER_SCHEMA_UNKNOWN_SECONDS); a schema the
    # ledger cannot read as the contract (the reason names the schema id and the field).
    INVALID_ENCODING = "invalid_encoding"
    UNKNOWN_SCHEMA = "unknown_schema"
    INCOMPATIBLE_SCHEMA = "incompatible_schema"


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
    decoded = _decode(value)
    return decoded if isinstance(decoded, Rejection) else _check(key, decoded)


def validate(key: bytes, fields: dict[str, object]) -> Movement | Rejection:
    """The contract's rules on the fields a declared format produced (formats/): the same checks `parse` makes once
    it has decoded JSON. `key` is the record's key as UTF-8 text (its declared format already undone). Pure."""
    try:
        movement = msgspec.convert(fields, Movement)
    except msgspec.ValidationError as exc:
        return Rejection(RejectCode.INVALID_FIELD, f"invalid movement: {exc} ({_CONTRACT})")
    return _check(key, movement)


def _decode(value: bytes) -> Movement | Rejection:
    if nests_deeper_than(value, MAX_DEPTH):
        return _TOO_DEEP
    try:
        return _decoder.decode(value)
    except msgspec.ValidationError as exc:
        return Rejection(RejectCode.INVALID_FIELD, f"invalid movement: {exc} ({_CONTRACT})")
    except msgspec.DecodeError as exc:
        return Rejection(RejectCode.INVALID_JSON, f"value is not UTF-8 JSON: {exc}")
    except RecursionError:  # only if the caller's own stack is nearly exhausted: still bad input, not a crash
        return _TOO_DEEP


_TOO_DEEP: Final = Rejection(
    RejectCode.TOO_DEEP, f"value nests JSON arrays/objects more than {MAX_DEPTH} levels deep; a movement is a flat "
    f"object ({_CONTRACT})",
)
_NOT_BRACKETS: Final = bytes(b for b in range(256) if b not in b"[]{}")
_AS_PARENS: Final = bytes.maketrans(b"[]{}", b"()()")


def nests_deeper_than(value: bytes, limit: int) -> bool:
    """Whether JSON `value` nests arrays/objects deeper than `limit` (malformed JSON: an upper bound of it).

    Everything runs in C (count, replace, split, translate), so even a 1 MB value built to be slow costs a fraction
    of a second; a movement costs two `count`s."""
    if value.count(b"[") + value.count(b"{") <= limit:
        return False
    # Without escaped backslashes, then escaped quotes (left to right, as a JSON parser reads them), every quote
    # opens or closes a string: the even pieces between quotes are outside strings, where brackets nest.
    unescaped = value.replace(b"\\\\", b"").replace(b'\\"', b"")
    shape = b"".join(unescaped.split(b'"')[::2]).translate(_AS_PARENS, _NOT_BRACKETS)
    if b"(" * (limit + 1) in shape:
        return True
    # Each pass removes the innermost level everywhere: at most limit + 1 passes.
    for depth in range(limit + 1):
        if b"()" not in shape:
            return depth + shape.count(b"(") > limit  # what is left is ")))(((": unmatched, still open
        shape = shape.replace(b"()", b"")
    return True


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
    if m.occurred_at.year in {1, 9999} and not _storable(m.occurred_at):
        return Rejection(
            RejectCode.OUT_OF_RANGE,
            f"occurred_at {m.occurred_at.isoformat()} is outside 0001-01-01T00:00:00Z..9999-12-31T23:59:59.999999Z "
            "once converted to UTC, the range the ledger can store",
        )
    if m.qty == 0:
        return Rejection(RejectCode.INVALID_FIELD, "qty must be non-zero")
    if m.kind in _INBOUND and m.qty < 0:
        return Rejection(RejectCode.SIGN_MISMATCH, f"kind {m.kind!r} adds stock, so qty must be > 0 (got {m.qty})")
    if m.kind in _OUTBOUND and m.qty > 0:
        return Rejection(RejectCode.SIGN_MISMATCH, f"kind {m.kind!r} removes stock, so qty must be < 0 (got {m.qty})")
    return m


def _storable(moment: datetime) -> bool:
    """Python's datetime (years 1-9999) binds tighter than PostgreSQL's timestamptz (4713 BC-294276 AD), but the
    driver converts to UTC inside COPY: an offset can push a value at either end out of range there."""
    try:
        moment.astimezone(UTC)
    except OverflowError:
        return False
    return True


def pg_text(text: str, limit: int = 2000) -> str:
    """`text` as PostgreSQL text can hold it: NUL and lone surrogates escaped, at most `limit` characters."""
    safe = text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")
    return safe if len(safe) <= limit else safe[: limit - 1] + "…"


def encode(movement: Movement) -> bytes:
    """The wire form the producer sends (the inverse of `parse` for a valid movement)."""
    return msgspec.json.encode(movement)
