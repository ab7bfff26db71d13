"""Kafka's advisory commits (advice.KafkaAdvice): pure logic against a consumer double that commits the way
aiokafka 0.14 does (the request runs under asyncio.shield, GroupCoordinator.commit_offsets). What the offsets mean
to the ledger is tested on the real services (tests/integration/test_metrics.py, tests/chaos)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import pytest
import pytest_asyncio
from aiokafka import TopicPartition
from aiokafka.errors import NotCoordinatorForGroupError
from structlog.testing import capture_logs

from stock_ledger.consumer.advice import KafkaAdvice

if TYPE_CHECKING:
    from aiokafka.structs import OffsetAndMetadata

pytestmark = pytest.mark.asyncio

TOPIC = "warehouse.movements"


class SlowBroker:
    """Each commit takes `delay` seconds on the wire and then fails with `error` (or succeeds)."""

    def __init__(self, delay: float, error: BaseException | None = None, partitions: range = range(4)) -> None:
        self.delay = delay
        self.error = error
        self.partitions = {TopicPartition(TOPIC, p) for p in partitions}
        self.landed: list[dict[int, int]] = []
        self.on_wire = 0
        self.most_on_wire = 0

    def assignment(self) -> set[TopicPartition]:
        return self.partitions

    async def commit(self, offsets: dict[TopicPartition, OffsetAndMetadata]) -> None:
        await asyncio.shield(self._request({tp.partition: o.offset for tp, o in offsets.items()}))

    async def _request(self, offsets: dict[int, int]) -> None:
        self.on_wire += 1
        self.most_on_wire = max(self.most_on_wire, self.on_wire)
        try:
            await asyncio.sleep(self.delay)
            if self.error is not None:
                raise self.error
            self.landed.append(offsets)
        finally:
            self.on_wire -= 1


@pytest_asyncio.fixture
async def unretrieved() -> AsyncIterator[list[dict[str, object]]]:
    """What asyncio's exception handler is given: "Task exception was never retrieved" and the like."""
    loop = asyncio.get_running_loop()
    reported: list[dict[str, object]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    yield reported
    loop.set_exception_handler(previous)


def advice(broker: SlowBroker) -> KafkaAdvice:
    return KafkaAdvice(broker, TOPIC)  # type: ignore[arg-type]  # the double has the two methods used


async def settle(seconds: float) -> None:
    await asyncio.sleep(seconds)
    gc.collect()  # an orphaned task's error is reported when the task is collected
    await asyncio.sleep(0)


async def test_a_commit_that_outlasts_our_patience_then_fails_is_two_lines_not_a_stack_trace(
        unretrieved: list[dict[str, object]]) -> None:
    """The broker restarts mid-commit: we stop waiting after the patience, the request fails later with
    NotCoordinatorForGroupError. Before the fix the request was orphaned by a cancellation and asyncio reported it
    as "Task exception was never retrieved" with a stack trace (CI, tests/chaos/test_faults.py)."""
    broker = SlowBroker(delay=0.3, error=NotCoordinatorForGroupError())
    a = advice(broker)
    a.note({0: 10})
    with capture_logs() as logs:
        await a.tell(patience=0.05)
        await settle(0.5)
    assert [e["event"] for e in logs] == ["kafka.advisory_commit_slow", "kafka.advisory_commit_failed"]
    assert "NotCoordinatorForGroupError" in str(logs[1]["error"])
    assert all("exc_info" not in e for e in logs)
    assert unretrieved == []


async def test_a_shutdown_that_stops_waiting_leaves_no_orphan(unretrieved: list[dict[str, object]]) -> None:
    """Cancelling the caller (the advisor task at shutdown) does not cancel the request; its error is still read."""
    broker = SlowBroker(delay=0.2, error=NotCoordinatorForGroupError())
    a = advice(broker)
    a.note({1: 7})
    with capture_logs() as logs:
        caller = asyncio.create_task(a.tell())
        await asyncio.sleep(0.05)
        caller.cancel()
        await asyncio.gather(caller, return_exceptions=True)
        await settle(0.4)
    assert [e["event"] for e in logs] == ["kafka.advisory_commit_failed"]
    assert unretrieved == []


async def test_commits_land_one_at_a_time_in_order() -> None:
    """A newer commit waits for an older one still on the wire, so Kafka never goes back to an older offset."""
    broker = SlowBroker(delay=0.1)
    a = advice(broker)
    a.note({0: 10, 1: 5})
    with capture_logs():
        await a.tell(patience=0.01)  # stops waiting; the commit of 10 is still on the wire
        a.note({0: 20})
        await a.tell()
    assert broker.landed == [{0: 10, 1: 5}, {0: 20}]
    assert broker.most_on_wire == 1


async def test_offsets_wait_while_the_broker_is_away_and_none_are_lost() -> None:
    """While a commit is unanswered, the once-a-second loop sends nothing new; the offsets noted meanwhile go in
    the next commit, the newest per partition."""
    broker = SlowBroker(delay=0.25)
    a = advice(broker)
    a.note({0: 1})
    with pytest.MonkeyPatch.context() as mp, capture_logs():
        mp.setattr("stock_ledger.consumer.advice.EVERY_SECONDS", 0.05)
        mp.setattr("stock_ledger.consumer.advice.PATIENCE_SECONDS", 0.05)
        loop = asyncio.create_task(a.run())
        await asyncio.sleep(0.1)
        a.note({0: 2})
        a.note({0: 3, 2: 9})
        await asyncio.sleep(0.6)
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
    assert broker.landed == [{0: 1}, {0: 3, 2: 9}]
    assert broker.most_on_wire == 1


async def test_only_partitions_still_ours_are_told() -> None:
    """After a revocation, offsets of partitions now owned elsewhere are not sent (the new owner's are newer)."""
    broker = SlowBroker(delay=0, partitions=range(2))
    a = advice(broker)
    a.note({0: 4, 5: 99})
    await a.tell()
    assert broker.landed == [{0: 4}]
