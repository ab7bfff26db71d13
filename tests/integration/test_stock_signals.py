"""Warehouse signals on the real services: negative stock as a metric, `stock show` now and as of a time,
`movements` with running on-hand and Kafka coordinates, all under the read-only role.

Every expectation is computed in the test from the movements it sent (not read back from the ledger), so a bug in
the ledger's arithmetic and the same bug in its reports cannot cancel out.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import uuid
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest
import pytest_asyncio
from aiokafka import AIOKafkaConsumer, TopicPartition

from tests.support.helpers import Env, Services, WorkerPool, eventually, movement, send_raw, wait_drained
from tests.support.services import ensure_login_role

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

READER = "stock_ledger_reader_test"
READER_PASSWORD = "stock_ledger_reader_test"  # noqa: S105 - a local test role
BASE = datetime(2026, 11, 29, 6, 0, tzinfo=UTC)
AT = BASE + timedelta(minutes=300)


@dataclass(frozen=True)
class Sent:
    movement_id: str
    warehouse: str
    sku: str
    qty: int
    occurred_at: datetime


def _script(seed: int) -> list[Sent]:
    """12 (warehouse, sku) pairs, 8 movements each, business times shuffled against send order (late receipts);
    two pairs end well below zero, one movement occurs exactly at AT."""
    rng = random.Random(seed)
    sent: list[Sent] = []
    for sku in (f"SKU-{i}" for i in range(6)):
        for warehouse in ("WH-A", "WH-B"):
            for _ in range(8):
                qty = rng.choice((5, 8, 12, 20, -1, -4, -7, -15))
                sent.append(Sent(str(uuid.uuid4()), warehouse, sku, qty, BASE + timedelta(minutes=rng.randrange(600))))
    sent.append(Sent(str(uuid.uuid4()), "WH-A", "SKU-0", -200, AT))  # exactly at AT: counted by --at AT
    sent.append(Sent(str(uuid.uuid4()), "WH-B", "SKU-1", -150, BASE + timedelta(minutes=900)))
    return sent


async def _send(services: Services, topic: str, sent: list[Sent]) -> None:
    await send_raw(services.kafka, topic, [
        (s.sku.encode(), json.dumps(movement(s.sku, qty=s.qty, kind="receipt" if s.qty > 0 else "pick",
                                             warehouse=s.warehouse, movement_id=s.movement_id,
                                             occurred_at=s.occurred_at.isoformat())).encode())
        for s in sent
    ])


def _on_hand(sent: list[Sent], *, at: datetime | None = None) -> dict[tuple[str, str], int]:
    totals: dict[tuple[str, str], int] = defaultdict(int)
    for s in sent:
        if at is None or s.occurred_at <= at:
            totals[s.warehouse, s.sku] += s.qty
    return dict(totals)


@pytest_asyncio.fixture
async def reader_url(services: Services, database: Env) -> str:
    """A LOGIN member of the migration's NOLOGIN role stock_ledger_reader, on this test's database."""
    await ensure_login_role(services.admin_url, READER, READER_PASSWORD, "stock_ledger_reader")
    return services.url_for(database.name, user=READER, password=READER_PASSWORD)


def _cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STOCK_LEDGER_")}
    env["DATABASE_URL"] = url
    return subprocess.run([sys.executable, "-m", "stock_ledger", *args], env=env, capture_output=True, text=True,
                          timeout=60, check=False)


def _json(url: str, *args: str) -> Any:
    done = _cli(url, *args, "--json")
    assert done.returncode == 0, f"{args} exited {done.returncode}: {done.stderr}"
    return json.loads(done.stdout)


async def test_negative_stock_metric_equals_the_ledger_after_a_real_drain_and_follows_recovery(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """Picks exceed receipts for some pairs. After a real worker drains the topic, the scraped
    stock_ledger_negative_stock_levels / _units equal both the count and deficit from SQL and the ones computed
    from what was sent; went_negative_at is set on exactly the negative levels. A receipt that brings one pair back
    to zero clears its went_negative_at and the metrics follow."""
    sent = _script(seed=16)
    await _send(services, topic, sent)
    w = workers.start()
    await wait_drained(services, database, topic, workers.group, 60, workers)

    expected = {k: v for k, v in _on_hand(sent).items() if v < 0}
    assert len(expected) >= 2, "the scenario must drive some levels below zero"
    conn = await asyncpg.connect(database.owner_url)
    try:
        count, deficit = await conn.fetchrow(
            "SELECT count(*), coalesce(-sum(on_hand), 0) FROM stock_levels WHERE on_hand < 0")
        assert (count, deficit) == (len(expected), -sum(expected.values()))
        flagged = {(r[0], r[1]) for r in await conn.fetch(
            "SELECT warehouse_id, sku FROM stock_levels WHERE went_negative_at IS NOT NULL")}
        assert flagged == set(expected)
        await eventually(lambda: w.metric("stock_ledger_negative_stock_levels") == count
                         and w.metric("stock_ledger_negative_stock_units") == deficit, 20,
                         f"negative stock metrics = {count} levels, {deficit} units", workers)

        # Recovery: exactly the deficit of one pair is received; it leaves the metric, the other stays.
        (warehouse, sku), short = min(expected.items())
        top_up = Sent(str(uuid.uuid4()), warehouse, sku, -short, BASE + timedelta(minutes=1000))
        await _send(services, topic, [top_up])
        await wait_drained(services, database, topic, workers.group, 60, workers)
        on_hand, since = await conn.fetchrow(
            "SELECT on_hand, went_negative_at FROM stock_levels WHERE warehouse_id = $1 AND sku = $2", warehouse, sku)
        assert (on_hand, since) == (0, None)
        remaining = {k: v for k, v in _on_hand([*sent, top_up]).items() if v < 0}
        await eventually(lambda: w.metric("stock_ledger_negative_stock_levels") == len(remaining)
                         and w.metric("stock_ledger_negative_stock_units") == -sum(remaining.values()), 20,
                         "negative stock metrics after the top-up", workers)
    finally:
        await conn.close()
    workers.assert_no_tracebacks()


async def _drained(services: Services, database: Env, topic: str, workers: WorkerPool, seed: int) -> list[Sent]:
    sent = _script(seed)
    await _send(services, topic, sent)
    workers.start()
    await wait_drained(services, database, topic, workers.group, 60, workers)
    return sent


async def test_stock_show_now_and_as_of_a_time_agree_with_the_sum_of_what_was_sent(
    services: Services, database: Env, topic: str, workers: WorkerPool, reader_url: str,
) -> None:
    """Run as a member of stock_ledger_reader: `stock show` now equals Σ qty per (warehouse, sku); `--at T` equals
    Σ qty of the movements that occurred at or before T (business time; a movement exactly at T counts), which
    differs from now; `--negative` lists exactly the pairs below zero, each with when it went negative."""
    sent = await _drained(services, database, topic, workers, seed=61)

    now, at = _on_hand(sent), _on_hand(sent, at=AT)
    assert now != at
    for warehouse in ("WH-A", "WH-B"):
        shown = _json(reader_url, "stock", "show", "--warehouse", warehouse)
        assert shown["basis"] == "stock_levels"
        assert {x["sku"]: x["on_hand"] for x in shown["levels"]} == {s: v for (wh, s), v in now.items()
                                                                       if wh == warehouse}
        as_of = _json(reader_url, "stock", "show", "--warehouse", warehouse, "--at", "2026-11-29T12:00:00+01:00")
        assert datetime.fromisoformat(as_of["as_of"]) == AT
        assert {x["sku"]: x["on_hand"] for x in as_of["levels"]} == {s: v for (wh, s), v in at.items()
                                                                       if wh == warehouse}
        negative = _json(reader_url, "stock", "show", "--warehouse", warehouse, "--negative")
        assert {x["sku"]: x["on_hand"] for x in negative["levels"]} == {s: v for (wh, s), v in now.items()
                                                                          if wh == warehouse and v < 0}
        assert all(x["went_negative_at"] for x in negative["levels"])

    one = _json(reader_url, "stock", "show", "--warehouse", "WH-B", "--sku", "SKU-3", "--at", AT.isoformat())
    assert one["levels"] == [{"warehouse_id": "WH-B", "sku": "SKU-3", "on_hand": at.get(("WH-B", "SKU-3"), 0),
                              "went_negative_at": None}]
    table = _cli(reader_url, "stock", "show", "--warehouse", "WH-A", "--sku", "SKU-0")
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines()[3].split()[:2] == ["SKU-0", str(now["WH-A", "SKU-0"])]



async def test_movements_list_a_skus_history_with_running_on_hand_and_the_kafka_record_of_each_row(
    services: Services, database: Env, topic: str, workers: WorkerPool, reader_url: str,
) -> None:
    """Run as a member of stock_ledger_reader: `movements` lists a SKU's movements in send (= offset) order with
    the running on-hand per warehouse (which --limit does not restart), --since keeps those that occurred at or
    after T, and each row's Kafka coordinates lead to the very record that carried it."""
    sent = await _drained(services, database, topic, workers, seed=62)
    now = _on_hand(sent)
    history = _json(reader_url, "movements", "--sku", "SKU-0", "--limit", "1000")
    mine = [s for s in sent if s.sku == "SKU-0"]
    assert [m["movement_id"] for m in history["movements"]] == [s.movement_id for s in mine]
    running: dict[str, int] = defaultdict(int)
    expected_on_hand = []
    for s in mine:
        running[s.warehouse] += s.qty
        expected_on_hand.append(running[s.warehouse])
    assert [m["on_hand"] for m in history["movements"]] == expected_on_hand
    assert history["matching"] == len(mine)
    assert {m["kafka"]["topic"] for m in history["movements"]} == {topic}
    offsets = [m["kafka"]["offset"] for m in history["movements"]]
    assert offsets == sorted(offsets)
    assert len({m["kafka"]["partition"] for m in history["movements"]}) == 1

    in_a = _json(reader_url, "movements", "--sku", "SKU-0", "--warehouse", "WH-A", "--limit", "2")
    mine_a = [s for s in mine if s.warehouse == "WH-A"]
    assert [m["movement_id"] for m in in_a["movements"]] == [s.movement_id for s in mine_a[-2:]]
    assert in_a["movements"][-1]["on_hand"] == now["WH-A", "SKU-0"]  # the running sum did not restart at the cut
    assert in_a["matching"] == len(mine_a)
    since = _json(reader_url, "movements", "--sku", "SKU-0", "--since", AT.isoformat(), "--limit", "1000")
    assert [m["movement_id"] for m in since["movements"]] == [s.movement_id for s in mine if s.occurred_at >= AT]

    # Each row's coordinates lead to the Kafka record that carried exactly that movement.
    consumer = AIOKafkaConsumer(bootstrap_servers=services.kafka, enable_auto_commit=False)
    await consumer.start()
    try:
        for row in history["movements"][:5]:
            tp = TopicPartition(row["kafka"]["topic"], row["kafka"]["partition"])
            consumer.assign([tp])
            consumer.seek(tp, row["kafka"]["offset"])
            record = (await consumer.getmany(tp, timeout_ms=5000, max_records=1))[tp][0]
            assert record.offset == row["kafka"]["offset"]
            assert json.loads(record.value)["movement_id"] == row["movement_id"]
    finally:
        await consumer.stop()


async def test_the_reader_role_reads_everything_and_writes_nothing(database: Env, reader_url: str) -> None:
    """stock_ledger_reader may SELECT every table and nothing else: no INSERT, UPDATE, DELETE, TRUNCATE or DDL."""
    conn = await asyncpg.connect(reader_url)
    try:
        for table in ("stock_movements", "rejected_movements", "consumer_offsets", "stock_levels",
                      "schema_migrations"):
            await conn.fetchval(f"SELECT count(*) FROM {table}")
        refused = [
            "INSERT INTO stock_levels (warehouse_id, sku, on_hand) VALUES ('WH-1', 'SKU-1', 1)",
            "UPDATE stock_levels SET on_hand = 0",
            "DELETE FROM stock_movements",
            "TRUNCATE rejected_movements",
            "UPDATE consumer_offsets SET next_offset = 0",
            "CREATE TABLE reader_was_here (x int)",
            "ALTER TABLE stock_levels ADD COLUMN reader_was_here int",
        ]
        for statement in refused:
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute(statement)
    finally:
        await conn.close()


async def test_unknown_names_and_bad_times_say_what_to_do(database: Env, reader_url: str) -> None:
    """A warehouse or SKU the ledger has never seen exits 1 naming it and what to check; a time without an
    offset exits 2 with one line showing the expected form."""
    unknown = _cli(reader_url, "stock", "show", "--warehouse", "wh-nope")
    assert unknown.returncode == 1
    assert "no stock for warehouse 'wh-nope': check the id" in unknown.stderr
    no_sku = _cli(reader_url, "movements", "--sku", "SKU-nope")
    assert no_sku.returncode == 1
    assert "no movement of SKU 'SKU-nope'" in no_sku.stderr
    bad = _cli(reader_url, "stock", "show", "--warehouse", "WH-A", "--at", "2026-11-29 10:00")
    assert bad.returncode == 2
    assert "is not an RFC 3339 time with an offset: write it like 2026-11-29T10:00:00+01:00" in bad.stderr


async def test_migration_0004_upgrades_a_ledger_that_already_has_negative_levels(services: Services) -> None:
    """A ledger at schema 2 with a negative and a positive level is migrated: the negative one gets
    went_negative_at = its last change (the best bound known), the positive one none, and the CHECK that keeps the
    two in step holds from then on (a write that breaks it is refused)."""
    from stock_ledger.migrate import _BOOKKEEPING, load_migrations, migrate  # noqa: PLC0415
    from tests.conftest import ROOT  # noqa: PLC0415

    name = f"sl_test_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(services.admin_url)
    await admin.execute(f'CREATE DATABASE "{name}"')
    try:
        conn = await asyncpg.connect(services.url_for(name))
        try:
            await conn.execute(_BOOKKEEPING)
            for m in load_migrations(ROOT / "migrations"):
                if m.version <= 2:  # what production runs today
                    await conn.execute(m.sql)
                    await conn.execute("INSERT INTO schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
                                       m.version, m.name, m.checksum)
            await conn.execute("""
                INSERT INTO stock_levels (warehouse_id, sku, on_hand, updated_at) VALUES
                ('WH-1', 'SKU-NEG', -4, '2026-11-28T10:00:00Z'), ('WH-1', 'SKU-POS', 9, '2026-11-28T11:00:00Z')""")
            await migrate(services.url_for(name), ROOT / "migrations")
            rows = {r[0]: r[1] for r in await conn.fetch("SELECT sku, went_negative_at FROM stock_levels")}
            assert rows == {"SKU-NEG": datetime(2026, 11, 28, 10, 0, tzinfo=UTC), "SKU-POS": None}
            with pytest.raises(asyncpg.CheckViolationError):
                await conn.execute("UPDATE stock_levels SET on_hand = -1 WHERE sku = 'SKU-POS'")
        finally:
            await conn.close()
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
