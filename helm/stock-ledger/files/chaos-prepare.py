"""Chaos drill, step 2: a fresh database and topic of the drill's own (never the release's).

Drops and re-creates the database named in DATABASE_URL (its name must contain "chaos"; the role needs
CREATEDB), applies the migrations, deletes STOCK_LEDGER_TOPIC (and the per-revision topics of charts before 0.2.0,
STOCK_LEDGER_TOPIC-r*) and creates it anew: the topic's name is the same at every render (Argo CD), its records are
this drill's only. Runs with the app image's Python (`python -c`).
"""

import asyncio
import os
import sys
import time
from urllib.parse import urlsplit, urlunsplit

import asyncpg
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

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


async def recreate_topic(bootstrap, topic, partitions, replication):
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        doomed = [t for t in await admin.list_topics() if t == topic or t.startswith(f"{topic}-r")]
        if doomed:
            await admin.delete_topics(doomed)
            print(f"chaos-prepare: deleting {', '.join(sorted(doomed))}", flush=True)
        # Deletion is asynchronous: creating the name again fails until the brokers have forgotten it.
        deadline = time.monotonic() + 120
        while True:
            try:
                await admin.create_topics([NewTopic(topic, partitions, replication)])
                break
            except TopicAlreadyExistsError:
                if time.monotonic() > deadline:
                    sys.exit(f"chaos-prepare: topic {topic} still exists 120 s after its deletion: check the brokers' "
                             "delete.topic.enable and the controller's logs")
                await asyncio.sleep(1)
        print(f"chaos-prepare: topic {topic} ({partitions} partitions) created empty", flush=True)
    finally:
        await admin.close()


async def main():
    url = os.environ["DATABASE_URL"]
    await recreate_database(url)
    await migrate(url, find_migrations_dir(os.environ.get("STOCK_LEDGER_MIGRATIONS_DIR")))
    print("chaos-prepare: migrations applied", flush=True)
    await recreate_topic(os.environ["KAFKA_BOOTSTRAP_SERVERS"], os.environ["STOCK_LEDGER_TOPIC"],
                         int(os.environ["CHAOS_PARTITIONS"]), int(os.environ["CHAOS_REPLICATION_FACTOR"]))


asyncio.run(main())
