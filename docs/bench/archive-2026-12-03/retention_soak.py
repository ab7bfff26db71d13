"""A soak under retention: does the online ledger stay flat while movements keep coming?

A scratch ledger (all migrations, segments of --segment offsets) and a 4-partition topic; one worker (`stock-ledger
run`) drains what `stock-ledger produce` sends at --rate for --seconds. Every --every seconds Kafka's retention is
played by deleting each partition's records more than --keep offsets behind its log end, then `stock-ledger archive
run` (retention 0 days) archives what may leave. One line per round: produced, stored, movements online, archived,
and the online sizes (stock_movements' segments; the id registry, which keeps every id by design). At the end
`stock-ledger verify --expect <produced>` must pass.

  python docs/bench/archive-2026-12-03/retention_soak.py --seconds 600 --rate 2000
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

import asyncpg
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic, RecordsToDelete

from stock_ledger.migrate import find_migrations_dir, migrate

ADMIN = "postgresql://stock_ledger:stock_ledger@127.0.0.1:5432/stock_ledger"
KAFKA = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")
SIZES = """
SELECT (SELECT coalesce(sum(pg_total_relation_size(relid)), 0) FROM pg_partition_tree('stock_movements')),
       pg_total_relation_size('movement_ids'),
       (SELECT count(*) FROM stock_movements),
       (SELECT coalesce(sum(rows), 0)::bigint FROM ledger_archives),
       (SELECT coalesce(sum(next_offset), 0)::bigint FROM consumer_offsets)
"""


async def _cli(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "stock_ledger", *args, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    return proc.returncode or 0, out.decode(), err.decode()


async def _trim(admin: AIOKafkaAdminClient, topic: str, keep: int) -> None:
    from aiokafka import AIOKafkaConsumer  # noqa: PLC0415 - only here

    consumer = AIOKafkaConsumer(bootstrap_servers=KAFKA)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(4)]
        ends = await consumer.end_offsets(tps)
    finally:
        await consumer.stop()
    cut = {tp: RecordsToDelete(before_offset=e - keep) for tp, e in ends.items() if e > keep}
    if cut:
        await admin.delete_records(cut, timeout_ms=30_000)


async def main(a: argparse.Namespace) -> None:
    name, topic, group = f"soak_{int(time.time())}", f"soak.{int(time.time())}", f"soak-{int(time.time())}"
    admin_db = await asyncpg.connect(ADMIN)
    await admin_db.execute(f"CREATE DATABASE {name}")
    url = ADMIN.rsplit("/", 1)[0] + f"/{name}"
    admin = AIOKafkaAdminClient(bootstrap_servers=KAFKA)
    await admin.start()
    await admin.create_topics([NewTopic(topic, 4, 1)])
    directory = tempfile.mkdtemp(prefix="soak-archive-")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STOCK_LEDGER_", "DATABASE_URL"))} | {
        "KAFKA_BOOTSTRAP_SERVERS": KAFKA, "DATABASE_URL": url, "STOCK_LEDGER_TOPIC": topic,
        "STOCK_LEDGER_GROUP_ID": group, "STOCK_LEDGER_LOG_FORMAT": "json", "STOCK_LEDGER_METRICS_PORT": "0",
        "STOCK_LEDGER_ARCHIVE_DIR": directory, "STOCK_LEDGER_RETENTION_DAYS": "0"}
    worker = None
    try:
        await migrate(url, find_migrations_dir(None))
        conn = await asyncpg.connect(url)
        await conn.execute("UPDATE ledger_layout SET segment_offsets = $1", a.segment)
        worker = await asyncio.create_subprocess_exec(sys.executable, "-m", "stock_ledger", "run", env=env,
                                                      stdout=asyncio.subprocess.DEVNULL,
                                                      stderr=asyncio.subprocess.DEVNULL)
        count = int(a.rate * a.seconds)
        producer = asyncio.create_task(_cli(env, "produce", "--count", str(count), "--rate", str(a.rate),
                                            "--skus", "5000", "--seed", "7"))
        started = time.monotonic()
        print("t_s produced_stored online_rows archived_rows online_MB registry_MB archive_s", flush=True)
        while not producer.done() or time.monotonic() - started < a.seconds + 30:
            await asyncio.sleep(a.every)
            await _trim(admin, topic, a.keep)
            t = time.monotonic()
            code, _, err = await _cli(env, "archive", "run")
            took = time.monotonic() - t
            if code != 0:
                print(f"archive run exit {code}: {err.strip()[-400:]}", flush=True)
            online_b, registry_b, online, archived, stored = await conn.fetchrow(SIZES)
            print(f"{time.monotonic() - started:5.0f} {stored:>9} {online:>9} {archived:>9} "
                  f"{online_b / 2**20:8.1f} {registry_b / 2**20:8.1f} {took:6.1f}", flush=True)
            if producer.done() and stored >= count:
                break
        code, out, err = await _cli(env, "verify", "--expect", str(count))
        print(json.dumps({"verify_exit": code, "tail": (out or err).strip().splitlines()[-14:]}, indent=1))
        await conn.close()
    finally:
        if worker is not None and worker.returncode is None:
            worker.terminate()
            await worker.wait()
        await admin.delete_topics([topic])
        await admin.close()
        await admin_db.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await admin_db.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--rate", type=float, default=2000)
    parser.add_argument("--segment", type=int, default=50_000, help="offsets per segment")
    parser.add_argument("--keep", type=int, default=60_000, help="records Kafka keeps per partition")
    parser.add_argument("--every", type=float, default=30)
    asyncio.run(main(parser.parse_args()))
