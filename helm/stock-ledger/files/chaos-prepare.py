"""Chaos drill, step 2: a fresh database and topic of the drill's own (never the release's).

Drops and re-creates the database named in DATABASE_URL (its name must contain "chaos"; the role needs
CREATEDB), applies the migrations, deletes the older drill topics (CHAOS_TOPIC_PREFIX-r*) and creates
STOCK_LEDGER_TOPIC. Runs with the app image's Python (`python -c`).
"""

import asyncio
import os
import sys
from urllib.parse import urlsplit, urlunsplit

import asyncpg
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from stock_ledger.migrate import find_migrations_dir, migrate


async def recreate_database(url):
    parts = urlsplit(url)
    database = parts.path.lstrip("/")
    if "chaos" not in database:
        sys.exit(f"chaos-prepare: refusing to drop database {database!r}: the drill's database name must contain "
                 "'chaos' (chaos.database.existingSecret must point at a database of the drill's own)")
    maintenance = urlunsplit((parts.scheme, parts.netloc, "/postgres", parts.query, parts.fragment))
    conn = await asyncpg.connect(maintenance, timeout=30)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        await conn.execute(f'CREATE DATABASE "{database}"')
    finally:
        await conn.close()
    print(f"chaos-prepare: database {database} re-created", flush=True)


async def recreate_topic(bootstrap, topic, prefix, partitions, replication):
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        older = [t for t in await admin.list_topics() if t.startswith(f"{prefix}-r") and t != topic]
        if older:
            await admin.delete_topics(older)
            print(f"chaos-prepare: deleted older drill topics {', '.join(sorted(older))}", flush=True)
        if topic not in await admin.list_topics():
            await admin.create_topics([NewTopic(topic, partitions, replication)])
        print(f"chaos-prepare: topic {topic} ({partitions} partitions) ready", flush=True)
    finally:
        await admin.close()


async def main():
    url = os.environ["DATABASE_URL"]
    await recreate_database(url)
    await migrate(url, find_migrations_dir(os.environ.get("STOCK_LEDGER_MIGRATIONS_DIR")))
    print("chaos-prepare: migrations applied", flush=True)
    await recreate_topic(os.environ["KAFKA_BOOTSTRAP_SERVERS"], os.environ["STOCK_LEDGER_TOPIC"],
                         os.environ["CHAOS_TOPIC_PREFIX"], int(os.environ["CHAOS_PARTITIONS"]),
                         int(os.environ["CHAOS_REPLICATION_FACTOR"]))


asyncio.run(main())
