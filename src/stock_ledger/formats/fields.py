"""What every format shares once its bytes are decoded: a schema the ledger cannot read, and the mapping's value
conversions (epoch times, decimals, kinds) on the way to the contract's fields."""

from __future__ import annotations

import datetime as dt
import decimal
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from stock_ledger.domain import RejectCode, Rejection

if TYPE_CHECKING:
    from stock_ledger.mapping import MessageMapping

_UNIX_EPOCH: Final = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_PER_UNIT: Final = {"epoch_seconds": 1_000_000, "epoch_millis": 1_000, "epoch_micros": 1}


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A schema the ledger cannot read as the contract (every record written with it is quarantined with this
    reason, which names the schema id and the field); `rejected replay` tries again with the schemas of then."""

    reason: str


def epoch_time(value: object, unit: str) -> object:
    """An integer count of `unit` since 1970-01-01T00:00:00Z as an aware datetime; a value outside the datetime
    range as an out_of_range `Rejection`; anything else unchanged (the contract's check names its type)."""
    if type(value) is not int or unit not in _PER_UNIT:
        return value
    try:
        return _UNIX_EPOCH + dt.timedelta(microseconds=value * _PER_UNIT[unit])
    except OverflowError:
        return Rejection(RejectCode.OUT_OF_RANGE, f"occurred_at {value} ({unit}) is outside "
                         "0001-01-01T00:00:00Z..9999-12-31T23:59:59.999999Z, the range the ledger can store")


def whole(value: object) -> object:
    """qty declared "decimal": a decimal, float or numeric string that is a whole number, as an int; anything else
    unchanged (the contract's check refuses it, naming its type)."""
    if isinstance(value, str):
        try:
            value = decimal.Decimal(value)
        except decimal.InvalidOperation:
            return value
    if isinstance(value, decimal.Decimal):
        return int(value) if value.is_finite() and value == value.to_integral_value() else value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def convert(fields: dict[str, object], mapping: MessageMapping) -> dict[str, object]:
    """The mapping's conversions of qty, occurred_at (epoch units) and kind, in place; returns `fields`."""
    if mapping.qty == "decimal" and "qty" in fields:
        fields["qty"] = whole(fields["qty"])
    if mapping.occurred_at in _PER_UNIT and "occurred_at" in fields:
        fields["occurred_at"] = epoch_time(fields["occurred_at"], mapping.occurred_at)
    if mapping.kind:
        kind = fields.get("kind")
        if isinstance(kind, str):
            fields["kind"] = mapping.kind.get(kind, kind)
    return fields
