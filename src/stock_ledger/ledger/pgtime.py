"""timestamptz in PostgreSQL's own binary form: whole microseconds since 2000-01-01T00:00:00Z.

Batch rows carry their two timestamps (occurred_at, kafka_timestamp) in this form, as the 1-tuple asyncpg's "tuple"
codec format takes, and `install` makes a session accept it. Two reasons:
- exact: asyncpg's own encoder writes 0001-01-01T00:00:00Z and 9999-12-31T23:59:59.999999Z, the two ends of the
  range a movement may carry, as -infinity and infinity (they equal its sentinels for datetime.min and max): the
  ledger would hold a time the movement never said, and `stock --at` would miss it.
- cheap: that encoder converts each datetime to UTC and subtracts through Python objects, 1-1.6 µs a value, and
  it runs inside the batch transaction (the server waits for it); the builder computes the integer while the batch
  before commits.
An installed session still takes datetimes and still returns datetimes, exactly as asyncpg's codec does, apart from
those two instants, which it writes as themselves.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta, timezone
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    import asyncpg

Micros = tuple[int]  # the wire form: (microseconds since 2000-01-01T00:00:00Z,)

PG_EPOCH: Final = datetime(2000, 1, 1, tzinfo=UTC)
UNIX_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
MICROSECOND: Final = timedelta(microseconds=1)
# PG_EPOCH in ms since the Unix epoch: a Kafka record timestamp (ms) in the wire form is ((ms - this) * 1000,).
PG_EPOCH_MS: Final = (PG_EPOCH - UNIX_EPOCH) // timedelta(milliseconds=1)
# PostgreSQL's binary infinities, and the naive datetimes asyncpg maps them to (and back).
_INFINITY: Final = 2**63 - 1
_NEGATIVE_INFINITY: Final = -(2**63)
# The instants Python's datetime holds in UTC: what any reader of the ledger can turn back into a datetime.
LOWEST: Final = -63_082_281_600_000_000  # 0001-01-01T00:00:00Z
HIGHEST: Final = 252_455_615_999_999_999  # 9999-12-31T23:59:59.999999Z
_RANGE: Final = "0001-01-01T00:00:00Z..9999-12-31T23:59:59.999999Z"
_MAX: Final = datetime.max  # noqa: DTZ901 - asyncpg's sentinel is naive
_MIN: Final = datetime.min  # noqa: DTZ901 - asyncpg's sentinel is naive


def micros(moment: datetime) -> Micros:
    """An aware datetime in the wire form. Exact: integer arithmetic on the instant, whatever its offset."""
    return ((moment - PG_EPOCH) // MICROSECOND,)


def _encode(value: Micros | datetime | date) -> Micros:
    if type(value) is tuple:  # a batch row's value, already in the wire form: the hot path
        if not LOWEST <= value[0] <= HIGHEST:
            # The parser lets no such instant through; if one came anyway, the driver refuses it (the sink then
            # quarantines the row as database_rejected), as asyncpg does with a datetime it cannot convert.
            raise OverflowError(f"timestamp {value[0]} µs from 2000-01-01Z is outside {_RANGE}")
        return value
    if not isinstance(value, datetime):
        if not isinstance(value, date):
            raise TypeError(f"expected a datetime.date or datetime.datetime instance, got {type(value).__name__!r}")
        # asyncpg: midnight at the local UTC offset of now.
        value = datetime(value.year, value.month, value.day, tzinfo=timezone(datetime.now(UTC).astimezone().utcoffset()
                                                                             or timedelta()))
    # What asyncpg's own codec does with what other statements send: its infinity sentinels (naive datetime.max and
    # min; an aware datetime never equals them), a naive datetime taken as local time, OverflowError for an instant
    # that leaves Python's range in UTC.
    if value == _MAX:
        return (_INFINITY,)
    if value == _MIN:
        return (_NEGATIVE_INFINITY,)
    return micros(value.astimezone(UTC))


def _decode(wire: Micros) -> datetime:
    (us,) = wire
    if us == _INFINITY:
        return _MAX
    if us == _NEGATIVE_INFINITY:
        return _MIN
    return PG_EPOCH + timedelta(microseconds=us)


async def install(conn: asyncpg.Connection) -> None:
    """Make `conn` take timestamptz values in the wire form (and datetimes, and return datetimes)."""
    await conn.set_type_codec("timestamptz", schema="pg_catalog", encoder=_encode, decoder=_decode, format="tuple")
