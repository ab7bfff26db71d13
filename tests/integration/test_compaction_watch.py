"""Compaction switched on while the worker runs (issue 30, item 6b): `topics.watch_compaction` on a real broker."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import pytest
from structlog.testing import capture_logs

from stock_ledger.config import Settings, load_settings
from stock_ledger.errors import StockLedgerError
from stock_ledger.topics import watch_compaction
from tests.support.helpers import scratch_topic
from tests.support.services import free_port, kafka_admin, set_topic_config

if TYPE_CHECKING:
    from tests.support.helpers import Services

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

INTERVAL = 1.0


def _settings(kafka: str, topic: str) -> Settings:
    return load_settings({"KAFKA_BOOTSTRAP_SERVERS": kafka, "STOCK_LEDGER_TOPIC": topic})


async def test_compaction_switched_on_while_watching_raises_within_the_interval(services: Services) -> None:
    """A topic with cleanup.policy=delete is watched every second: nothing happens for three intervals. Then the
    policy is altered to compact (as an operator would, with the admin API): the watcher raises StockLedgerError,
    naming the topic, the policy and the fix, within one interval (plus the read itself)."""
    async with scratch_topic(services, partitions=3, configs={"cleanup.policy": "delete"}) as topic:
        watch = asyncio.create_task(watch_compaction(_settings(services.kafka, topic), INTERVAL))
        try:
            await asyncio.sleep(3 * INTERVAL)
            assert not watch.done()
            async with kafka_admin(services.kafka) as admin:
                await set_topic_config(admin, topic, {"cleanup.policy": "compact"})
            altered = time.monotonic()
            with pytest.raises(StockLedgerError, match=rf"topic {topic} has cleanup.policy=compact") as raised:
                await asyncio.wait_for(watch, timeout=INTERVAL + 5)
            assert time.monotonic() - altered < INTERVAL + 5
            assert "cleanup.policy=delete" in str(raised.value)  # the fix
            assert "stock-ledger verify" in str(raised.value)
        finally:
            watch.cancel()


async def test_an_unreachable_broker_is_logged_and_retried_not_fatal(services: Services) -> None:
    """Nothing listens on the bootstrap address: each interval's read fails, is logged as
    topic.policy_check_failed and retried; the watcher never raises for it (a failed read says nothing about the
    policy), and cancelling it stops it."""
    with capture_logs() as logs:
        watch = asyncio.create_task(watch_compaction(_settings(f"127.0.0.1:{free_port()}", "warehouse.movements"),
                                                     0.2))
        try:
            deadline = time.monotonic() + 20
            while sum(e["event"] == "topic.policy_check_failed" for e in logs) < 2 and time.monotonic() < deadline:
                assert not watch.done(), watch
                await asyncio.sleep(0.1)
        finally:
            watch.cancel()
            with pytest.raises(asyncio.CancelledError):
                await watch
    assert sum(e["event"] == "topic.policy_check_failed" for e in logs) >= 2
