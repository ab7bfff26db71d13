"""The ledger end to end: a real `stock-ledger run` process, a real broker, a real PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import uuid

import asyncpg
import pytest

from stock_ledger.migrate import load_migrations
from tests.conftest import ROOT
from tests.support.helpers import Env, Services, WorkerPool, assert_exact, movement, send_raw, wait_drained
from tests.support.services import produce

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


async def test_drains_a_backlog_exactly_once_and_a_restart_applies_nothing_twice(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """20,000 movements in the topic; a worker drains them, is stopped, restarted with no new data, and stopped:
    the ledger holds each movement once, stock levels equal the sum of movements, offsets sit at the log end."""
    await produce(services.kafka, topic, 20_000, show_progress=False)
    w = workers.start()
    await wait_drained(services, database, topic, workers.group, 60, workers)
    w.signal(signal.SIGTERM)
    assert w.wait(15) == 0
    before = await assert_exact(services, database, topic, workers.group, rows=20_000, pool=workers)

    again = workers.start()
    await asyncio.sleep(6)  # joined, claimed, fetched nothing new
    again.signal(signal.SIGTERM)
    assert again.wait(15) == 0
    after = await assert_exact(services, database, topic, workers.group, rows=20_000, pool=workers)
    assert after.rows == before.rows
    assert '"claim.done"' in again.log_text()


async def test_bad_input_is_quarantined_with_reasons_and_good_input_applied(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """Every class of bad input, mixed with good movements on the same SKUs (so the same partitions): each bad
    record lands in rejected_movements with its raw bytes and an actionable reason, every good one is applied,
    and the partition keeps flowing."""
    resent = str(uuid.uuid4())
    good = [movement("SKU-A", qty=10), movement("SKU-B", qty=-3, kind="pick"),
            movement("SKU-A", qty=7, kind="adjustment"), movement("SKU-A", qty=4, movement_id=resent)]
    bad: list[tuple[bytes | None, bytes | None, str]] = [
        (None, json.dumps(movement("SKU-A")).encode(), "missing_key"),
        (b"SKU-A", b"{not json", "invalid_json"),
        (b"SKU-A", b"\xff\xfe", "invalid_json"),
        (b"SKU-A", None, "invalid_json"),
        (b"SKU-A", json.dumps(movement("SKU-A", qty=0)).encode(), "invalid_field"),
        (b"SKU-A", json.dumps(movement("SKU-A", qty=1.5)).encode(), "invalid_field"),
        (b"SKU-A", json.dumps(movement("SKU-A", qty=1_000_000_001)).encode(), "invalid_field"),
        (b"SKU-A", json.dumps(movement("SKU-A", kind="teleport")).encode(), "invalid_field"),
        (b"SKU-A", json.dumps(movement("SKU-A", movement_id="not-a-uuid")).encode(), "invalid_field"),
        (b"SKU-A", json.dumps({**movement("SKU-A"), "occurred_at": "2026-11-29T10:00:00"}).encode(), "invalid_field"),
        (b"SKU-A", json.dumps({**movement("SKU-A"), "warehouse_id": ""}).encode(), "invalid_field"),
        (b"SKU-A", json.dumps({**movement("SKU-A"), "warehouse_id": "W" * 65}).encode(), "invalid_field"),
        (b"SKU-A", json.dumps({k: v for k, v in movement("SKU-A").items() if k != "sku"}).encode(), "invalid_field"),
        (b"SKU-A", json.dumps(movement("SKU-A", warehouse="W\x00")).encode(), "invalid_field"),
        (b"SKU-A", b"[1, 2]", "invalid_json"),
        (b"SKU-A", json.dumps(movement("SKU-B")).encode(), "key_mismatch"),
        (b"SKU-A", json.dumps(movement("SKU-A", qty=-5, kind="receipt")).encode(), "sign_mismatch"),
        (b"SKU-B", json.dumps(movement("SKU-B", qty=5, kind="pick")).encode(), "sign_mismatch"),
        # An upstream resend: the same movement_id at a new offset.
        (b"SKU-A", json.dumps(movement("SKU-A", qty=4, movement_id=resent)).encode(), "duplicate_movement_id"),
    ]
    records: list[tuple[bytes | None, bytes | None]] = []
    for i, (k, v, _) in enumerate(bad):
        records.append((k, v))
        if i < len(good):
            records.append((str(good[i]["sku"]).encode(), json.dumps(good[i]).encode()))
    await send_raw(services.kafka, topic, records)
    w = workers.start()
    await wait_drained(services, database, topic, workers.group, 60, workers)
    await assert_exact(services, database, topic, workers.group, rows=len(good), rejected=len(bad), pool=workers)

    conn = await asyncpg.connect(database.owner_url)
    try:
        rejected = await conn.fetch("SELECT key, value, reason_code, reason FROM rejected_movements")
        levels = {(r["warehouse_id"], r["sku"]): r["on_hand"] for r in await conn.fetch("SELECT * FROM stock_levels")}
    finally:
        await conn.close()
    assert sorted(r["reason_code"] for r in rejected) == sorted(code for *_, code in bad)
    assert sorted(((r["key"], r["value"]) for r in rejected), key=repr) == sorted(
        ((k, v) for k, v, _ in bad), key=repr), "raw key and value bytes are kept as they were sent"
    assert all(len(r["reason"]) > 15 for r in rejected)
    by_code = {r["reason_code"]: r["reason"] for r in rejected}
    assert resent in by_code["duplicate_movement_id"]
    assert "qty" in by_code["sign_mismatch"]
    assert levels == {("WH-1", "SKU-A"): 10 + 7 + 4, ("WH-1", "SKU-B"): -3}
    # The rejection counters reach /metrics with the same classes.
    assert w.metric("stock_ledger_movements_rejected_total", {"reason": "invalid_field"}) == 10
    assert w.metric("stock_ledger_movements_rejected_total", {"reason": "duplicate_movement_id"}) == 1
    assert w.metric("stock_ledger_movements_applied_total") == len(good)

    # The same resend again, in a later batch: caught against the ledger itself, not only within a batch.
    resend = json.dumps(movement("SKU-A", qty=4, movement_id=resent)).encode()
    await send_raw(services.kafka, topic, [(b"SKU-A", resend)])
    await wait_drained(services, database, topic, workers.group, 60, workers)
    await assert_exact(services, database, topic, workers.group, rows=len(good), rejected=len(bad) + 1, pool=workers)
    conn = await asyncpg.connect(database.owner_url)
    try:
        reasons = await conn.fetch("SELECT reason FROM rejected_movements WHERE reason_code = 'duplicate_movement_id'")
        on_hand = await conn.fetchval("SELECT on_hand FROM stock_levels WHERE sku = 'SKU-A'")
    finally:
        await conn.close()
    assert any("already in the ledger" in r["reason"] for r in reasons)
    assert on_hand == 21


async def test_worker_role_cannot_delete_or_truncate_the_ledger(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """Least privilege: the role the worker runs as can append, but not DELETE, TRUNCATE or alter the ledger."""
    await send_raw(services.kafka, topic, [(b"SKU-A", json.dumps(movement("SKU-A")).encode())])
    workers.start()
    await wait_drained(services, database, topic, workers.group, 60, workers)
    conn = await asyncpg.connect(database.worker_url)
    try:
        assert await conn.fetchval("SELECT count(*) FROM stock_movements") == 1
        for statement in ("DELETE FROM stock_movements", "TRUNCATE stock_movements", "DELETE FROM consumer_offsets",
                          "DROP TABLE stock_levels",
                          "ALTER TABLE stock_movements DROP CONSTRAINT stock_movements_coordinates_key",
                          "UPDATE stock_movements SET qty = 1"):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute(statement)
    finally:
        await conn.close()


async def test_migrate_is_idempotent_and_safe_when_run_concurrently(services: Services, worker_role: str) -> None:
    """Two `stock-ledger migrate` processes at once on an empty database both succeed; the schema is applied once."""
    name = f"sl_test_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(services.admin_url)
    await admin.execute(f'CREATE DATABASE "{name}"')
    try:
        env = {"DATABASE_URL": services.url_for(name), "PATH": ""}
        procs = [subprocess.Popen([sys.executable, "-m", "stock_ledger", "migrate"], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT) for _ in range(3)]
        outputs = [p.communicate(60)[0].decode() for p in procs]
        assert [p.returncode for p in procs] == [0, 0, 0], outputs
        conn = await asyncpg.connect(services.url_for(name))
        try:
            # Every migration file exactly once (the count follows the migrations/ folder as migrations are added).
            applied = [r[0] for r in await conn.fetch("SELECT version FROM schema_migrations ORDER BY version")]
            assert applied == [m.version for m in load_migrations(ROOT / "migrations")]
        finally:
            await conn.close()
        assert sum("already up to date" in o for o in outputs) == 2
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


async def test_the_worker_refuses_an_unmigrated_database(services: Services, worker_role: str, topic: str) -> None:
    """Pointed at an empty database, the worker exits 1 and says to run `stock-ledger migrate`."""
    name = f"sl_test_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(services.admin_url)
    await admin.execute(f'CREATE DATABASE "{name}"')
    try:
        env = {"DATABASE_URL": services.url_for(name), "KAFKA_BOOTSTRAP_SERVERS": services.kafka,
               "STOCK_LEDGER_TOPIC": topic, "STOCK_LEDGER_METRICS_PORT": "0", "PATH": ""}
        done = subprocess.run([sys.executable, "-m", "stock_ledger", "run"], env=env, capture_output=True,
                              timeout=60, check=False)
        assert done.returncode == 2
        assert b"stock-ledger migrate" in done.stderr + done.stdout
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
