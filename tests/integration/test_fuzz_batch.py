"""Fuzz through the real batch transaction: arbitrary and near-valid records, `build_batch` + `Ledger.apply` on a
real, migrated PostgreSQL. Every record lands in exactly one table, the batch commits, stock levels equal the sum
of the applied movements, and the parser left nothing for the database to refuse (no `database_rejected`)."""

from __future__ import annotations

import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings

from stock_ledger.domain import Movement, Rejection, parse
from stock_ledger.faults import Faults
from stock_ledger.ledger.batch import Record, build_batch
from stock_ledger.ledger.transaction import Ledger
from tests.fuzz import batches, new_topic
from tests.support.helpers import FROM_ZERO, Env, claims_of

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(records=batches(max_size=40))
async def test_every_record_lands_in_exactly_one_table_and_the_batch_commits(
    database: Env, records: dict[int, list[Record]],
) -> None:
    """Each example is one batch of up to 40 records over up to 3 partitions of a fresh topic name in one shared
    database: it commits on the first call (no exception), each partition's offset stands at its last record + 1,
    each record is in exactly one of stock_movements / rejected_movements, a movement the parser accepted is
    applied unless its movement_id was applied before (then duplicate_movement_id), a rejected one keeps the
    parser's code, nothing is database_rejected, no bisection was needed, and stock_levels equal the sum of all
    movements applied so far."""
    topic = new_topic()
    conn = await asyncpg.connect(database.worker_url)
    try:
        ledger = Ledger("fuzz", Faults(None))
        claimed = await claims_of(ledger).claim(conn, topic, records, None, None, reset=FROM_ZERO)
        claims = {c.partition: c.epoch for c in claimed}
        outcome = await ledger.apply(conn, build_batch(topic, records, claims))
        applied = {(r[0], r[1]) for r in await conn.fetch(
            "SELECT kafka_partition, kafka_offset FROM stock_movements WHERE kafka_topic = $1", topic)}
        rejected = {(r[0], r[1]): r[2] for r in await conn.fetch(
            "SELECT kafka_partition, kafka_offset, reason_code FROM rejected_movements WHERE kafka_topic = $1", topic)}
        offsets = {r[0]: r[1] for r in await conn.fetch(
            "SELECT partition, next_offset FROM consumer_offsets WHERE topic = $1", topic)}
        mismatches = await conn.fetchval("""
            SELECT count(*) FROM (SELECT warehouse_id, sku, sum(qty) AS t FROM stock_movements GROUP BY 1, 2) m
            FULL JOIN stock_levels l USING (warehouse_id, sku) WHERE coalesce(m.t, 0) <> coalesce(l.on_hand, 0)""")
    finally:
        await conn.close()
    assert outcome.bisections == 0
    assert "database_rejected" not in outcome.rejected
    assert offsets == {p: len(recs) for p, recs in records.items()}
    for p, recs in records.items():
        for r in recs:
            here = (p, r.offset)
            assert (here in applied) != (here in rejected), f"record {here} in both or neither table"
            parsed = parse(r.key, r.value)
            if isinstance(parsed, Rejection):
                assert rejected[here] == parsed.code.value
            else:
                assert isinstance(parsed, Movement)
                assert here in applied or rejected[here] == "duplicate_movement_id"
    assert outcome.applied == len(applied)
    assert mismatches == 0
