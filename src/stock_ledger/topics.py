"""Creating the topic (explicitly: the brokers run with auto.create.topics.enable=false)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import structlog
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaConnectionError, TopicAlreadyExistsError

from stock_ledger.errors import StockLedgerError

if TYPE_CHECKING:
    from collections.abc import Mapping

log = structlog.get_logger(__name__)


async def ensure_topic(bootstrap: str, topic: str, partitions: int = 24, replication: int = 1,  # noqa: PLR0913
                       attempts: int = 30, *, options: Mapping[str, Any] | None = None) -> bool:
    """Create `topic` if absent; return True if created. Retries while the broker is still starting."""
    for attempt in range(1, attempts + 1):
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **(options or {}))
        try:
            await admin.start()
            if topic in await admin.list_topics():
                return False
            await admin.create_topics([NewTopic(topic, partitions, replication)])
        except TopicAlreadyExistsError:
            return False
        except KafkaConnectionError as exc:
            if attempt == attempts:
                raise
            log.info("topic.waiting_for_broker", bootstrap=bootstrap, attempt=attempt, error=str(exc))
            await asyncio.sleep(1)
            continue
        finally:
            await admin.close()
        log.info("topic.created", topic=topic, partitions=partitions)
        return True
    return False


async def partitions_of(bootstrap: str, topic: str, *, options: Mapping[str, Any] | None = None) -> list[int]:
    """The topic's partition numbers, from a fresh metadata request (empty if the topic does not exist)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **(options or {}))
    await admin.start()
    try:
        described = await admin.describe_topics([topic])
    finally:
        await admin.close()
    return sorted(p["partition"] for t in described if t["error_code"] == 0 for p in t["partitions"])


async def cleanup_policy(bootstrap: str, topic: str, *, options: Mapping[str, Any] | None = None) -> str | None:
    """The topic's cleanup.policy (None if the topic does not exist)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **(options or {}))
    await admin.start()
    try:
        responses = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, topic, {"cleanup.policy": None})])
    finally:
        await admin.close()
    for response in responses:
        for error_code, _message, _type, name, entries, *_ in response.resources:
            if name == topic and error_code == 0:
                return next((str(e[1]) for e in entries if e[0] == "cleanup.policy"), None)
    return None


async def refuse_compacted(bootstrap: str, topic: str, *, options: Mapping[str, Any] | None = None) -> None:
    """Compaction deletes movements of a SKU before they are applied (only the key's last record survives): a
    ledger over a compacted topic silently loses movements, so the worker refuses to start on one."""
    policy = await cleanup_policy(bootstrap, topic, options=options)
    if policy is not None and "compact" in policy:
        raise StockLedgerError(
            f"topic {topic} has cleanup.policy={policy}: compaction deletes movements before they are applied. "
            "Set cleanup.policy=delete on the topic (kafka-configs --alter --add-config cleanup.policy=delete)"
        )
