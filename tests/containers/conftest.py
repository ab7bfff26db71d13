"""Fixtures for the container tests: the image that ships (`make image`), run by podman against the real services.

Every container a test starts carries the label stock-ledger.test=true and is removed when the test ends; the
databases and topics are the test's own, like in tests/integration.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import asyncpg
import pytest
import pytest_asyncio
from aiokafka.admin import AIOKafkaAdminClient

from tests.helpers import Env, Services

from .support import Containers, require_image

WORKER_PASSWORD = "stock_ledger_worker"  # noqa: S105 - the local test role of tests/conftest.py


@pytest.fixture(scope="session")
def image() -> str:
    return require_image()


@pytest.fixture
def containers(image: str) -> Iterator[Containers]:
    pool = Containers()
    yield pool
    pool.remove_all()


@pytest_asyncio.fixture
async def blank_database(services: Services, worker_role: str) -> AsyncIterator[Env]:
    """A fresh database with no schema: the image's `migrate` creates it."""
    name = f"sl_test_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(services.admin_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    yield Env(owner_url=services.url_for(name),
              worker_url=services.url_for(name, user=worker_role, password=WORKER_PASSWORD), name=name)
    admin = await asyncpg.connect(services.admin_url)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@pytest_asyncio.fixture
async def topic_name(services: Services) -> AsyncIterator[str]:
    """A unique topic name; the image's `create-topic` creates it, the fixture deletes it."""
    name = f"warehouse.movements.test-{uuid.uuid4().hex[:10]}"
    yield name
    admin = AIOKafkaAdminClient(bootstrap_servers=services.kafka)
    await admin.start()
    try:
        await admin.delete_topics([name])
    except Exception:  # noqa: S110 - cleanup of a test topic is best effort
        pass
    finally:
        await admin.close()
