"""Fixtures for the container tests: the image that ships (`make image`), run by podman against the real services.

Every container a test starts carries the label stock-ledger.test=true and is removed when the test ends; the
databases and topics are the test's own, like in tests/integration.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from tests.support.helpers import Env, Services, scratch_database, scratch_topic
from tests.support.services import WORKER_PASSWORD

from .support import Containers, require_image


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
    async with scratch_database(services) as name:
        yield Env(owner_url=services.url_for(name),
                  worker_url=services.url_for(name, user=worker_role, password=WORKER_PASSWORD), name=name)


@pytest_asyncio.fixture
async def topic_name(services: Services) -> AsyncIterator[str]:
    """A unique topic name; the image's `create-topic` creates it, the fixture deletes it."""
    async with scratch_topic(services, partitions=None) as name:
        yield name
