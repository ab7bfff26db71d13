"""Retention and archival (issue 39), on the real broker and database, through the CLI: a segment leaves the database
only when nothing still needs it, its Parquet file holds exactly its movements, and every answer the ledger gives
(stock_levels, `stock show --at`, `movements`, `verify`) is the same after it left as before."""

from __future__ import annotations

import json
import os
import signal
import uuid
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import asyncpg
import pyarrow.parquet as pq
import pytest

from stock_ledger.archive import run as archival
from stock_ledger.config import load_settings
from stock_ledger.ledger import archives
from tests.integration.test_operate import Result, cli
from tests.integration.test_repair import send_to_partition
from tests.support.helpers import Env, Services, WorkerPool, assert_exact, delete_records_below, movement, wait_drained
from tests.support.services import ensure_login_role

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(300)]

P = 3
T0 = datetime(2026, 1, 5, 8, 0, tzinfo=UTC)
SEGMENT = f"stock_movements_p{P}_o0"
READER = "stock_ledger_archive_reader_test"  # a local LOGIN member of stock_ledger_reader; its password the same
_ROWS = ("SELECT movement_id, warehouse_id, sku, qty, kind, occurred_at, kafka_topic, kafka_partition, kafka_offset, "
         "kafka_timestamp, applied_at FROM stock_movements WHERE kafka_partition = $1 AND kafka_offset < $2 "
         "ORDER BY kafka_offset")


def _records() -> list[tuple[bytes, bytes]]:
    """70 records for partition P: movements of two SKUs in two warehouses an hour apart (picks take stock below
    zero on the way), a bad record at offset 10 (quarantined, stays online), and at offset 65 a movement that
    occurred back at T0 + 5h, inside the range that will be archived."""
    records = []
    for i in range(70):
        sku = "SKU-A" if i % 3 else "SKU-B"
        warehouse = "WH-1" if i % 2 else "WH-2"
        kind, qty = ("pick", -(i % 7) - 1) if i % 4 == 0 else ("receipt", i % 5 + 1)
        occurred = T0 + timedelta(hours=5 if i == 65 else i)
        m = movement(sku, qty=qty, kind=kind, warehouse=warehouse, occurred_at=occurred.isoformat(),
                     movement_id=str(uuid.uuid5(uuid.NAMESPACE_URL, f"archive-test/{i}")))
        records.append((sku.encode(), b"{not json" if i == 10 else json.dumps(m).encode()))
    return records


async def _sql(url: str, query: str, *args: object) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(url)
    try:
        return list(await conn.fetch(query, *args))
    finally:
        await conn.close()


async def _answers(workers: WorkerPool, env: dict[str, str]) -> dict[str, Any]:
    """Everything the ledger says about the two SKUs: on-hand now and as of 13 times (some inside the archived
    range, one at each end), and the movements with their running on-hand."""
    found: dict[str, Any] = {}
    for warehouse in ("WH-1", "WH-2"):
        now = await cli(workers, "stock", "show", "--warehouse", warehouse, "--json", **env)
        assert now.code == 0, now.err
        found[f"{warehouse} now"] = json.loads(now.out)["levels"]
        for hours in (-1, 0, 4, 5, 17, 29, 30, 37, 38, 39, 45, 64, 80):
            at = (T0 + timedelta(hours=hours, minutes=30 if hours in (17, 29) else 0)).isoformat()
            r = await cli(workers, "stock", "show", "--warehouse", warehouse, "--at", at, "--json", **env)
            assert r.code == 0, r.err
            found[f"{warehouse} at {at}"] = [(x["sku"], x["on_hand"]) for x in json.loads(r.out)["levels"]]
    for sku in ("SKU-A", "SKU-B"):
        r = await cli(workers, "movements", "--sku", sku, "--limit", "1000", "--json", **env)
        assert r.code == 0, r.err
        found[f"{sku} movements"] = {m["kafka"]["offset"]: m["on_hand"] for m in json.loads(r.out)["movements"]}
    return found


async def _archive(workers: WorkerPool, *args: str, url: str | None = None, **env: str) -> Result:
    return await cli(workers, "archive", *args, url=url, **env)


async def test_a_segment_leaves_only_when_nothing_needs_it_and_every_answer_stays_the_same(  # noqa: PLR0915 - one story
    services: Services, database: Env, topic: str, workers: WorkerPool, tmp_path: Path,
) -> None:
    await _sql(database.owner_url, "UPDATE ledger_layout SET segment_offsets = 20")
    await send_to_partition(services.kafka, topic, P, _records())
    worker = workers.start(STOCK_LEDGER_BATCH_MAX_RECORDS="7")
    await wait_drained(services, database, topic, workers.group, 60, workers)
    await assert_exact(services, database, topic, workers.group, rows=69, rejected=1, pool=workers)
    first, end = (await _sql(database.owner_url, "SELECT first_offset, end_offset FROM ledger_segments "
                                                 "WHERE table_name = $1", SEGMENT))[0]
    assert (first, end) == (0, 40)
    rows = [tuple(r) for r in await _sql(database.owner_url, _ROWS, P, end)]
    levels = await _sql(database.owner_url, "SELECT * FROM stock_levels ORDER BY 1, 2")
    directory = tmp_path / "archive"
    directory.mkdir()
    env = {"STOCK_LEDGER_ARCHIVE_DIR": str(directory), "STOCK_LEDGER_RETENTION_DAYS": "0"}
    before = await _answers(workers, env)

    # 1. Kafka still holds every offset: nothing leaves (verify still compares them with the topic).
    r = await _archive(workers, "run", **env)
    assert r.code == 0, r.err
    assert f"kept {SEGMENT} (p{P} [0, 40)): Kafka still holds offsets of it (log start 0)" in r.out, r.out
    await delete_records_below(services.kafka, topic, P, 45)

    # 2. A gap in its range awaiting acknowledgement keeps it; so does the retention.
    (gap,) = await _sql(database.owner_url, "INSERT INTO ledger_gaps (group_id, topic, partition, first_offset, "
                        "last_offset, reason) VALUES ($1, $2, $3, 12, 13, 'test') RETURNING id",
                        workers.group, topic, P)
    r = await _archive(workers, "run", **env)
    assert r.code == 0, r.err
    assert f"kept {SEGMENT} (p{P} [0, 40)): gap(s) {gap[0]} in its range wait for an acknowledgement" in r.out, r.out
    await _sql(database.owner_url, "DELETE FROM ledger_gaps WHERE id = $1", gap[0])
    r = await _archive(workers, "run", **(env | {"STOCK_LEDGER_RETENTION_DAYS": "1"}))
    assert r.code == 0, r.err
    assert "within the retention" in r.out, r.out
    assert not list(directory.iterdir())

    # 3. A dry run says what would leave and changes nothing; then it leaves. The next segment stays: Kafka holds
    #    offsets 45-59 of it.
    r = await _archive(workers, "run", "--dry-run", **env)
    assert r.code == 0, r.err
    assert f"would archive {SEGMENT} (p{P} [0, 40))" in r.out, r.out
    assert not list(directory.iterdir())
    r = await _archive(workers, "run", "--json", **env)
    assert r.code == 0, r.err
    report = json.loads(r.out)
    assert [a["segment"] for a in report["archived"]] == [SEGMENT]
    assert [(d["segment"], d["archive"]) for d in report["decisions"] if d["partition"] == P] == [
        (SEGMENT, True), (f"stock_movements_p{P}_o40", False)]
    assert await _sql(database.owner_url, "SELECT to_regclass($1)", SEGMENT) == [(None,)]

    # The file holds exactly the segment's movements, every column, in offset order (read by pyarrow, not by us).
    table = pq.read_table(directory / f"{SEGMENT}.parquet")
    archived = [tuple(r.values()) for r in table.to_pylist()]
    assert [(str(r[0]), *r[1:]) for r in rows] == archived
    manifest = json.loads((directory / f"{SEGMENT}.manifest.json").read_text())
    assert manifest["rows"] == len(rows) == 39
    assert manifest["kafka"] == [{"topic": topic, "partition": P, "rows": 39, "first_offset": 0, "last_offset": 39}]
    assert {(w, s): q for w, s, _, q, _, _ in manifest["sums"]} == {
        (w, s): sum(r[3] for r in rows if (r[1], r[2]) == (w, s)) for _, w, s, *_ in rows}

    # 4. Every answer is the same: levels, stock as of each time (inside the archived range too), movements'
    #    running on-hand; verify passes and counts the archived movements.
    assert await _sql(database.owner_url, "SELECT * FROM stock_levels ORDER BY 1, 2") == levels
    after = await _answers(workers, env)
    for key, value in before.items():
        if key.endswith("movements"):
            assert after[key] == {o: h for o, h in value.items() if o >= end}, key
        else:
            assert after[key] == value, key
    no_dir = await cli(workers, "stock", "show", "--warehouse", "WH-1", "--at", (T0 + timedelta(hours=17)).isoformat())
    assert no_dir.code == 2, no_dir.out + no_dir.err
    assert SEGMENT in no_dir.err, no_dir.err
    assert "STOCK_LEDGER_ARCHIVE_DIR" in no_dir.err, no_dir.err
    check = await cli(workers, "verify", "--expect", "69")
    assert check.code == 0, check.out + check.err
    assert f"39 movements in 1 archived segments: p{P} [0, 40)" in check.out, check.out

    # 5. A resend of an archived movement is still recognised; a write below the archive is refused loudly.
    await send_to_partition(services.kafka, topic, P, [_records()[3]])
    await wait_drained(services, database, topic, workers.group, 60, workers)
    assert await _sql(database.owner_url, "SELECT kafka_offset, reason_code FROM rejected_movements "
                                          "WHERE kafka_offset = 70") == [(70, "duplicate_movement_id")]
    with pytest.raises(asyncpg.PostgresError, match="is in an archived segment"):
        await _sql(database.worker_url, "SELECT * FROM stock_ledger_ensure_segments(ARRAY[$1::int], ARRAY[10::bigint])",
                   P)
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0

    # 6. The archive verifies, for an auditor too (a member of stock_ledger_reader: list and verify only read); a
    #    changed byte is named; a restore brings back exactly its rows for an audit.
    await ensure_login_role(services.admin_url, READER, READER, "stock_ledger_reader")
    reader = services.url_for(database.name, user=READER, password=READER)
    for url in (database.owner_url, reader):
        r = await _archive(workers, "verify", url=url, **env)
        assert r.code == 0, r.out + r.err
        assert f"{SEGMENT}: ok (39 movements)" in r.out
        listing = await _archive(workers, "list", "--json", url=url, **env)
        assert listing.code == 0, listing.out + listing.err
        assert [a["segment"] for a in json.loads(listing.out)["archives"]] == [SEGMENT]
    path = directory / f"{SEGMENT}.parquet"
    good = path.read_bytes()
    path.write_bytes(good[:100] + bytes([good[100] ^ 1]) + good[101:])
    r = await _archive(workers, "verify", SEGMENT, **env)
    assert r.code == 1, r.out + r.err
    assert "the file was changed or replaced" in r.out, r.out
    r = await _archive(workers, "restore", SEGMENT, **env)
    assert r.code == 1, r.out + r.err
    assert "does not verify" in r.err, r.err
    path.write_bytes(good)
    r = await _archive(workers, "restore", SEGMENT, **env)
    assert r.code == 0, r.out + r.err
    restored = await _sql(database.owner_url, f"SELECT * FROM restored_{SEGMENT} ORDER BY kafka_offset")
    assert [tuple(x) for x in restored] == rows
    assert await _sql(database.owner_url, "SELECT has_table_privilege('stock_ledger_reader', $1, 'SELECT')",
                      f"restored_{SEGMENT}") == [(True,)]


async def test_a_run_stopped_after_the_archive_was_recorded_is_finished_by_the_next(
    services: Services, database: Env, topic: str, workers: WorkerPool, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The archiver dies right after the transaction that recorded the archive and detached the segment (its table
    not yet dropped): readers already count the segment once, from its sums; the next run drops the table. With all
    of the partition's movements archived and its offsets row lost, a claim still resumes after them."""
    await _sql(database.owner_url, "UPDATE ledger_layout SET segment_offsets = 20")
    await send_to_partition(services.kafka, topic, P, _records()[:40])
    worker = workers.start(STOCK_LEDGER_BATCH_MAX_RECORDS="7")
    await wait_drained(services, database, topic, workers.group, 60, workers)
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    await delete_records_below(services.kafka, topic, P, 40)
    directory = tmp_path / "archive"
    directory.mkdir()
    env = {"STOCK_LEDGER_ARCHIVE_DIR": str(directory), "STOCK_LEDGER_RETENTION_DAYS": "0"}
    settings = load_settings({k: v for k, v in os.environ.items() if not k.startswith("STOCK_LEDGER_")} | env | {
        "KAFKA_BOOTSTRAP_SERVERS": services.kafka, "DATABASE_URL": database.owner_url, "STOCK_LEDGER_TOPIC": topic,
        "STOCK_LEDGER_GROUP_ID": workers.group})

    async def dies(*_: object) -> None:
        raise SystemExit(137)

    monkeypatch.setattr(archives, "drop", dies)
    conn = await asyncpg.connect(database.owner_url)
    try:
        with pytest.raises(SystemExit):
            await archival.run(settings, conn)
    finally:
        await conn.close()
    monkeypatch.undo()
    state = await _sql(database.owner_url, "SELECT to_regclass($1) IS NOT NULL, (SELECT dropped_at IS NULL FROM "
                       "ledger_archives WHERE segment = $1)", SEGMENT)
    assert state == [(True, True)]
    check = await cli(workers, "verify", "--expect", "39")
    assert check.code == 0, check.out + check.err
    r = await _archive(workers, "run", **env)
    assert r.code == 0, r.err
    assert f"finished an earlier run's {SEGMENT}: detached and dropped" in r.out, r.out
    assert await _sql(database.owner_url, "SELECT to_regclass($1)", SEGMENT) == [(None,)]
    check = await cli(workers, "verify", "--expect", "39")
    assert check.code == 0, check.out + check.err

    # The offsets row lost (a restore from before the first claim): the claim resumes past the archived movements,
    # as it would past rows, and finds no hole where they were.
    await _sql(database.owner_url, "DELETE FROM consumer_offsets WHERE partition = $1", P)
    await send_to_partition(services.kafka, topic, P, [_records()[41]])
    workers.start()
    await wait_drained(services, database, topic, workers.group, 60, workers)
    assert await _sql(database.owner_url, "SELECT count(*) FROM ledger_gaps") == [(0,)]
    assert await _sql(database.owner_url, "SELECT kafka_offset FROM stock_movements WHERE kafka_partition = $1",
                      P) == [(40,)]
    check = await cli(workers, "verify", "--expect", "40")
    assert check.code == 0, check.out + check.err
