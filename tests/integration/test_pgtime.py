"""Timestamps on a real PostgreSQL. Batch rows carry them in PostgreSQL's binary form (`pgtime`): the ledger stores
exactly the instant a record carries, the two ends of a movement's range included (asyncpg's own codec writes those
as -infinity and infinity); a session the sink has set up still takes and returns datetimes as asyncpg does.

The oracle is the server: `extract(epoch FROM t)` is exact (numeric) in PostgreSQL 14 and later."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal

import asyncpg
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stock_ledger.faults import Faults
from stock_ledger.ledger import pgtime
from stock_ledger.ledger.batch import MAX_TIMESTAMP_MS, MOVEMENT_COLUMNS, Record, build_batch
from stock_ledger.ledger.transaction import Ledger
from tests.fuzz import new_topic
from tests.support.helpers import FROM_ZERO, Env, claims_of, movement

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]
TOPIC = "warehouse.movements"
UNIX = datetime(1970, 1, 1, tzinfo=UTC)

# (occurred_at as the producer wrote it, the instant in UTC)
OCCURRED = [
    ("0001-01-01T00:00:00Z", datetime(1, 1, 1, tzinfo=UTC)),
    ("0001-01-01T23:59:00+23:59", datetime(1, 1, 1, tzinfo=UTC)),
    ("9999-12-31T23:59:59.999999Z", datetime(9999, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC)),
    ("9999-12-31T00:00:00.000001-23:59", datetime(9999, 12, 31, 23, 59, 0, 1, tzinfo=UTC)),
    ("1999-12-31T23:59:59.999999Z", datetime(1999, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC)),
    ("2000-01-01T00:00:00Z", datetime(2000, 1, 1, tzinfo=UTC)),
    ("1969-12-31T23:59:59.999999Z", datetime(1969, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC)),
    ("2026-11-29T10:15:30.123456+01:00", datetime(2026, 11, 29, 9, 15, 30, 123_456, tzinfo=UTC)),
]
KAFKA_MS = [0, 1, 946_684_799_999, 946_684_800_000, 1_764_411_330_250, MAX_TIMESTAMP_MS, -1, MAX_TIMESTAMP_MS + 1]


def since_unix_us(moment: datetime) -> Decimal:
    return Decimal((moment - UNIX) // timedelta(microseconds=1))


@pytest_asyncio.fixture
async def plain(database: Env) -> AsyncIterator[asyncpg.Connection]:
    """A session as asyncpg opens it: nothing installed."""
    c = await asyncpg.connect(database.worker_url)
    yield c
    await c.close()


async def test_the_ledger_stores_each_record_s_exact_instants_at_both_ends_of_the_range(
    plain: asyncpg.Connection, database: Env,
) -> None:
    """Movements at the first and last microsecond a movement may carry (and around 1970 and 2000), with Kafka
    timestamps from 0 to the last millisecond Python holds: through `Ledger.apply` on a plain session, every stored
    time is finite and exactly the instant sent; out-of-range Kafka timestamps are NULL."""
    ledger = Ledger("g", Faults(None))
    (claim,) = await claims_of(ledger).claim(plain, TOPIC, [0], None, None, reset=FROM_ZERO)
    records = [Record(0, i, ms, b"SKU-1", json.dumps(movement("SKU-1", occurred_at=sent)).encode())
               for i, ((sent, _), ms) in enumerate(zip(OCCURRED, KAFKA_MS, strict=True))]
    outcome = await ledger.apply(plain, build_batch(TOPIC, {0: records}, {0: claim.epoch}))
    assert (outcome.applied, outcome.rejected) == (len(records), {})
    owner = await asyncpg.connect(database.owner_url)
    try:
        rows = await owner.fetch(
            "SELECT kafka_offset, isfinite(occurred_at) AS finite, extract(epoch FROM occurred_at) * 1000000 AS occ, "
            "extract(epoch FROM kafka_timestamp) * 1000000 AS kts, occurred_at, kafka_timestamp "
            "FROM stock_movements ORDER BY kafka_offset")
    finally:
        await owner.close()
    assert [r["kafka_offset"] for r in rows] == list(range(len(records)))
    for r, (sent, instant), ms in zip(rows, OCCURRED, KAFKA_MS, strict=True):
        assert r["finite"], sent
        assert r["occ"] == since_unix_us(instant), sent
        assert r["occurred_at"] == instant  # and a plain reader gets it back as the same datetime
        if 0 <= ms <= MAX_TIMESTAMP_MS:
            assert r["kts"] == Decimal(ms * 1000), ms
            assert r["kafka_timestamp"] == UNIX + timedelta(milliseconds=ms)
        else:
            assert r["kts"] is None, ms


def _wall(*fields: int) -> datetime:
    """A wall-clock time, no offset yet (the fuzz adds one): naive on purpose."""
    return datetime(*fields, tzinfo=UTC).replace(tzinfo=None)


_LOCAL = st.one_of(
    st.sampled_from([_wall(1, 1, 1), _wall(1, 1, 1, 23, 59), _wall(9999, 12, 31, 23, 59, 59, 999_999),
                     _wall(9999, 12, 31), _wall(2000, 1, 1), _wall(1970, 1, 1)]),
    st.datetimes(min_value=_wall(1, 1, 1), max_value=_wall(9999, 12, 31, 23, 59, 59, 999_999)),
)


def _stamp(local: datetime, offset_minutes: int) -> str:
    sign, minutes = "-" if offset_minutes < 0 else "+", abs(offset_minutes)
    return f"{local.isoformat(timespec='microseconds')}{sign}{minutes // 60:02d}:{minutes % 60:02d}"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(items=st.lists(st.tuples(_LOCAL, st.integers(-1439, 1439), st.integers(-2, MAX_TIMESTAMP_MS + 2)),
                      min_size=1, max_size=30))
async def test_any_time_a_record_carries_is_stored_exactly_or_quarantined(
    database: Env, items: list[tuple[datetime, int, int]],
) -> None:
    """Fuzz: any local time with any offset up to ±23:59 and any Kafka timestamp, through `build_batch` and
    `Ledger.apply`: a movement whose instant lies in 0001-01-01T00:00:00Z..9999-12-31T23:59:59.999999Z is stored
    exactly (the server's `extract(epoch …)` against the instant Python's own parser reads from the string), any
    other is quarantined as out_of_range; a Kafka timestamp is stored exactly or NULL."""
    topic = new_topic()
    sent = [_stamp(local, offset) for local, offset, _ in items]
    records = [Record(0, i, ms, b"SKU-1", json.dumps(movement("SKU-1", occurred_at=stamp)).encode())
               for i, (stamp, (_, _, ms)) in enumerate(zip(sent, items, strict=True))]
    conn = await asyncpg.connect(database.worker_url)
    try:
        ledger = Ledger("fuzz", Faults(None))
        (claim,) = await claims_of(ledger).claim(conn, topic, [0], None, None, reset=FROM_ZERO)
        await ledger.apply(conn, build_batch(topic, {0: records}, {0: claim.epoch}))
        stored = {r["kafka_offset"]: (r["occ"], r["kts"]) for r in await conn.fetch(
            "SELECT kafka_offset, extract(epoch FROM occurred_at) * 1000000 AS occ, "
            "extract(epoch FROM kafka_timestamp) * 1000000 AS kts FROM stock_movements WHERE kafka_topic = $1", topic)}
        quarantined = {r["kafka_offset"]: r["reason_code"] for r in await conn.fetch(
            "SELECT kafka_offset, reason_code FROM rejected_movements WHERE kafka_topic = $1", topic)}
    finally:
        await conn.close()
    for i, (stamp, (_, _, ms)) in enumerate(zip(sent, items, strict=True)):
        try:
            instant = datetime.fromisoformat(stamp).astimezone(UTC)
        except OverflowError:
            assert quarantined.get(i) == "out_of_range", stamp
            continue
        assert i in stored, (stamp, quarantined.get(i))
        occ, kts = stored[i]
        assert occ == since_unix_us(instant), stamp
        assert kts == (Decimal(ms * 1000) if 0 <= ms <= MAX_TIMESTAMP_MS else None), ms


async def test_a_wire_value_out_of_range_is_a_refusal_and_is_quarantined(
    plain: asyncpg.Connection, database: Env,
) -> None:
    """The parser lets no such instant through; if one got into a row anyway (a bug of ours), the session refuses it
    as asyncpg refuses a datetime it cannot convert, and the sink quarantines that row as database_rejected."""
    ledger = Ledger("g", Faults(None))
    (claim,) = await claims_of(ledger).claim(plain, TOPIC, [0], None, None, reset=FROM_ZERO)
    batch = build_batch(TOPIC, {0: [Record(0, i, 1_700_000_000_000, b"SKU-1", json.dumps(movement("SKU-1")).encode())
                                     for i in range(4)]}, {0: claim.epoch})
    occurred = MOVEMENT_COLUMNS.index("occurred_at")
    for index, bad in ((1, pgtime.HIGHEST + 1), (2, pgtime.LOWEST - 1)):
        row = list(batch.movements[index])
        row[occurred] = (bad,)
        batch.movements[index] = tuple(row)
    outcome = await ledger.apply(plain, batch)
    assert (outcome.applied, outcome.rejected) == (2, {"database_rejected": 2})
    reasons = [r["reason"] for r in await plain.fetch(
        "SELECT reason FROM rejected_movements ORDER BY kafka_offset")]
    assert len(reasons) == 2
    assert all("OverflowError" in r and "0001-01-01T00:00:00Z..9999-12-31T23:59:59.999999Z" in r for r in reasons)
    # The level deltas summed at build time covered all four rows: the two the sink wrote count, no more.
    assert await plain.fetchval("SELECT on_hand FROM stock_levels WHERE sku = 'SKU-1'") == 2 * 5


async def test_an_installed_session_takes_and_returns_datetimes_as_asyncpg_does(database: Env) -> None:
    """What other statements send and read on a session the sink set up (the operator's replay, a claim): aware and
    naive datetimes, a date, asyncpg's infinity sentinels, as scalars and in arrays, are stored as on a plain
    session, and read back as the same values. Only the two instants asyncpg confuses with its sentinels differ."""
    installed = await asyncpg.connect(database.owner_url)
    owner = await asyncpg.connect(database.owner_url)
    try:
        await pgtime.install(installed)
        await owner.execute("CREATE TABLE t (session text, k int, a timestamptz, arr timestamptz[])")
        values: list[datetime | date] = [
            datetime(2026, 11, 29, 10, 15, 30, 123_456, tzinfo=timezone(timedelta(hours=-5))),
            datetime(1999, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC),
            datetime(1, 1, 2, 12, tzinfo=UTC),
            datetime(2026, 6, 1, 12, 0),  # noqa: DTZ001 - naive: local time, as asyncpg takes it
            date(2026, 3, 29),
            datetime.max,  # noqa: DTZ901 - asyncpg's sentinel for infinity is naive
            datetime.min,  # noqa: DTZ901
        ]
        for session, c in (("installed", installed), ("plain", owner)):
            for k, v in enumerate(values):
                await c.execute("INSERT INTO t VALUES ($1, $2, $3, $4)", session, k, v, [v, v])
        stored = {(r["session"], r["k"]): (r["a"], r["arr"]) for r in await owner.fetch(
            "SELECT session, k, a::text AS a, arr::text AS arr FROM t")}
        for k in range(len(values)):
            assert stored["installed", k] == stored["plain", k], values[k]
        read_plain = await owner.fetch("SELECT a, arr FROM t WHERE session = 'plain' ORDER BY k")
        read_installed = await installed.fetch("SELECT a, arr FROM t WHERE session = 'plain' ORDER BY k")
        assert [tuple(r) for r in read_installed] == [tuple(r) for r in read_plain]
        # The two instants asyncpg's own codec turns into infinities are stored as themselves.
        ends = [datetime(1, 1, 1, tzinfo=UTC), datetime(9999, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC)]
        await installed.execute("INSERT INTO t VALUES ('ends', 0, $1, $2)", ends[0], ends)
        await owner.execute("INSERT INTO t VALUES ('ends-plain', 0, $1, $2)", ends[0], ends)
        got = {r["session"]: (r["a"], r["arr"]) for r in await owner.fetch(
            "SELECT session, a::text AS a, arr::text AS arr FROM t WHERE session LIKE 'ends%'")}
        assert got["ends-plain"] == ("-infinity", "{-infinity,infinity}")  # what this module exists to avoid
        assert "infinity" not in "".join(got["ends"]), got["ends"]
        assert tuple(await installed.fetchrow("SELECT a, arr FROM t WHERE session = 'ends'")) == (ends[0], ends)
    finally:
        await installed.close()
        await owner.close()
