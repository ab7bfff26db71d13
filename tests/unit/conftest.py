"""Fixtures shared by the unit tests of the worker."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import pytest_asyncio
from prometheus_client import CollectorRegistry

from stock_ledger.config import Settings
from stock_ledger.consumer.claims import Claimer

if TYPE_CHECKING:
    import pytest
from stock_ledger.worker import Worker
from stock_ledger.worker import worker as worker_module


async def _nothing(_self: object, _conn: object) -> None:
    pass


class _Session:
    """A database session that answers nothing: enough for the worker's health and session bookkeeping."""

    def is_closed(self) -> bool:
        return False

    def terminate(self) -> None:
        pass

    async def close(self, timeout: float = 0) -> None:
        pass


async def _never_connects(_settings: Settings) -> _Session:
    return _Session()


@pytest_asyncio.fixture
async def make(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Callable[..., Worker]]:
    """Workers that never connect (a session is a stand-in that answers nothing, checked by nobody); their
    (unstarted) Kafka consumers are closed afterwards."""
    made: list[Worker] = []
    monkeypatch.setattr(worker_module, "worker_session", _never_connects)
    monkeypatch.setattr(Claimer, "check_session", _nothing)

    def build(**overrides: object) -> Worker:
        settings = replace(Settings(database_url="postgresql://u:p@127.0.0.1:1/x"), **overrides)
        made.append(Worker(settings, CollectorRegistry()))
        return made[-1]

    yield build
    for w in made:
        if w._main is not None and not w._main.done():
            w._main.cancel()
        await w.consumer.stop()
