"""The crash and zombie guarantees on an Avro topic (issue 40): a declared format changes how a record is read,
never how a batch commits. Focused variants of test_crash.py and test_fencing.py, small enough for CI."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator

import pytest

from tests.chaos.test_fencing import FAST
from tests.support.helpers import (
    Env,
    Services,
    WorkerPool,
    assert_atomic,
    assert_exact,
    eventually,
    process_state,
    wait_drained,
)
from tests.support.registry import (
    CONTRACT_AVRO_MAPPING,
    Writer,
    contract_avro_records,
    registry_url,
    send_with_headers,
)

pytestmark = [pytest.mark.integration, pytest.mark.chaos, pytest.mark.asyncio]


@pytest.fixture
def avro(topic: str) -> Iterator[tuple[Writer, dict[str, str]]]:
    """confluent-kafka's Avro serializer for the topic, and the worker environment that reads it."""
    url = registry_url()
    writer = Writer(url, topic)
    yield writer, {"STOCK_LEDGER_MAPPING": json.dumps(CONTRACT_AVRO_MAPPING), "SCHEMA_REGISTRY_URL": url}
    writer.close()


async def test_a_kill_mid_transaction_on_an_avro_topic_loses_nothing_and_duplicates_nothing(
    services: Services, database: Env, topic: str, workers: WorkerPool, avro: tuple[Writer, dict[str, str]],
) -> None:
    """3,000 Avro records; the worker SIGKILLs itself after writing the rows of its third batch, before the commit.
    The ledger is atomic at that instant, and a restarted worker completes it exactly."""
    writer, env = avro
    await send_with_headers(services.kafka, topic, contract_avro_records(writer, 3_000))
    crashing = workers.start(**env, STOCK_LEDGER_FAULT="after_rows@3", STOCK_LEDGER_BATCH_MAX_RECORDS="500")
    assert crashing.wait(60) == -signal.SIGKILL, workers.logs_tail()
    rows, stored = await assert_atomic(database, topic, workers.group)
    assert rows == stored
    assert 0 < rows < 3_000
    workers.start(**env, STOCK_LEDGER_BATCH_MAX_RECORDS="500")
    await wait_drained(services, database, topic, workers.group, 90, workers)
    await assert_exact(services, database, topic, workers.group, rows=3_000, pool=workers)
    workers.assert_no_tracebacks()


async def test_a_frozen_worker_on_an_avro_topic_is_fenced_when_it_wakes(
    services: Services, database: Env, topic: str, workers: WorkerPool, avro: tuple[Writer, dict[str, str]],
) -> None:
    """Two workers on 8,000 Avro records. A freezes itself (SIGSTOP) inside its fifth batch transaction, holding
    row locks; its session expires, B claims every partition and takes over from A's last commit; A is thawed and
    its batch is refused by the epoch compare-and-set. Exact at the end."""
    writer, env = avro
    await send_with_headers(services.kafka, topic, contract_avro_records(writer, 8_000))
    a = workers.start(**env, **FAST, STOCK_LEDGER_FAULT="after_rows@5:stop", STOCK_LEDGER_BATCH_MAX_RECORDS="500")
    await eventually(lambda: process_state(a.pid) == "T", 60, "worker A to freeze inside its transaction", workers)
    b = workers.start(**env, **FAST, STOCK_LEDGER_BATCH_MAX_RECORDS="500")
    await eventually(lambda: b.metric("stock_ledger_assigned_partitions") == 24, 60, "B to claim all 24", workers)
    a.signal(signal.SIGCONT)
    await eventually(lambda: (a.metric("stock_ledger_batches_fenced_total") or 0) >= 1 or not a.alive(), 60,
                     "A's batch to be fenced after it woke", workers)
    await wait_drained(services, database, topic, workers.group, 120, workers)
    await assert_exact(services, database, topic, workers.group, rows=8_000, pool=workers)
    assert '"batch.fenced"' in a.log_text()
    workers.assert_no_tracebacks()
