"""Fixtures shared by the unit tests of the worker."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import pytest_asyncio
from prometheus_client import CollectorRegistry

from stock_ledger.config import Settings
from stock_ledger.service import Worker


@pytest_asyncio.fixture
async def make() -> AsyncIterator[Callable[..., Worker]]:
    """Workers that never connect; their (unstarted) Kafka consumers are closed afterwards."""
    made: list[Worker] = []

    def build(**overrides: object) -> Worker:
        settings = replace(Settings(database_url="postgresql://u:p@127.0.0.1:1/x"), **overrides)
        made.append(Worker(settings, CollectorRegistry()))
        return made[-1]

    yield build
    for w in made:
        if w._main is not None and not w._main.done():
            w._main.cancel()
        await w.consumer.stop()
