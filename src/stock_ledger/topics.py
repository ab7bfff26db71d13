"""The topic: creating it (explicitly: the brokers run with auto.create.topics.enable=false), its partitions, and
its cleanup.policy, refused at start and watched while running (compaction deletes movements before they are
applied)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, NoReturn

import structlog
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaConnectionError, KafkaError, TopicAlreadyExistsError

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


async def _describe(bootstrap: str, topic: str, options: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """A fresh DescribeTopics (metadata) answer for the topic, on an admin client of its own."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **(options or {}))
    await admin.start()
    try:
        described: list[dict[str, Any]] = await admin.describe_topics([topic])
    finally:
        await admin.close()
    return described


async def partitions_of(bootstrap: str, topic: str, *, options: Mapping[str, Any] | None = None) -> list[int]:
    """The topic's partition numbers, from a fresh metadata request (empty if the topic does not exist)."""
    described = await _describe(bootstrap, topic, options)
    return sorted(p["partition"] for t in described if t["error_code"] == 0 for p in t["partitions"])


class TopicUnavailable(KafkaError):  # type: ignore[misc]
    """The topic does not exist, or this client may not describe it. Retried like any transient fault (an operator
    may create it, or grant access) until STOCK_LEDGER_RETRY_DEADLINE_SECONDS; never left to aiokafka, whose
    consumer would wait for it forever, logging only its own metadata errors."""

    retriable = True

    def __str__(self) -> str:
        return str(self.args[0])  # the message alone: the retry log line adds the class name


# Kafka error codes of a DescribeTopics (Metadata) answer for one topic.
_UNKNOWN_TOPIC, _NOT_AUTHORIZED = 3, 29


async def require_topic(bootstrap: str, topic: str, *, options: Mapping[str, Any] | None = None) -> None:
    """Raise TopicUnavailable, naming the topic, STOCK_LEDGER_TOPIC and the bootstrap servers, unless the topic
    exists with partitions this client can describe."""
    described = await _describe(bootstrap, topic, options)
    found = next((t for t in described if t["topic"] == topic), None)
    code = _UNKNOWN_TOPIC if found is None else int(found["error_code"])
    if code == 0 and found is not None and found["partitions"]:
        return
    why = {
        _UNKNOWN_TOPIC: "does not exist",
        _NOT_AUTHORIZED: "is not readable with these credentials (TopicAuthorizationFailed: grant Describe and "
                         "Read on it, and Read on the consumer group)",
    }.get(code, f"cannot be described (Kafka error code {code})")
    raise TopicUnavailable(f"topic {topic!r} (STOCK_LEDGER_TOPIC) {why} on {bootstrap} (KAFKA_BOOTSTRAP_SERVERS)")


async def cleanup_policy(bootstrap: str, topic: str, *, options: Mapping[str, Any] | None = None) -> str | None:
    """The topic's cleanup.policy (None if the topic does not exist)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **(options or {}))
    try:
        await admin.start()
        responses = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, topic, {"cleanup.policy": None})])
    finally:
        await admin.close()
    for response in responses:
        for error_code, _message, _type, name, entries, *_ in response.resources:
            if name == topic and error_code == 0:
                return next((str(e[1]) for e in entries if e[0] == "cleanup.policy"), None)
    return None


def _compacted(topic: str, policy: str | None) -> StockLedgerError | None:
    if policy is None or "compact" not in policy:
        return None
    return StockLedgerError(
        f"topic {topic} has cleanup.policy={policy}: compaction deletes movements before they are applied. "
        "Set cleanup.policy=delete on the topic (kafka-configs --alter --add-config cleanup.policy=delete)"
    )


async def refuse_compacted(bootstrap: str, topic: str, *, options: Mapping[str, Any] | None = None) -> None:
    """Compaction deletes movements of a SKU before they are applied (only the key's last record survives): a
    ledger over a compacted topic silently loses movements, so the worker refuses to start on one."""
    if error := _compacted(topic, await cleanup_policy(bootstrap, topic, options=options)):
        raise error


async def watch_compaction(bootstrap: str, topic: str, *, options: Mapping[str, Any] | None = None,
                           interval_seconds: float) -> NoReturn:
    """Read the topic's cleanup.policy now and every `interval_seconds`; raise StockLedgerError (the worker halts)
    as soon as it contains compact: compaction switched on while the worker runs deletes movements it has not
    applied yet, as it would have at start (refuse_compacted). A failed read (the broker unreachable, a timeout) is
    logged and tried again at the next interval: it says nothing about the policy. A topic that no longer exists is
    not compacted; the worker's fetches say what is wrong with it."""
    while True:
        try:
            policy = await asyncio.wait_for(cleanup_policy(bootstrap, topic, options=options),
                                            timeout=max(5.0, interval_seconds))
        except asyncio.CancelledError:
            raise
        except (KafkaError, OSError, TimeoutError) as exc:
            log.warning("topic.policy_check_failed", topic=topic, error=f"{type(exc).__name__}: {exc}",
                        retry_in_seconds=interval_seconds)
        else:
            if error := _compacted(topic, policy):
                log.error("topic.compacted", topic=topic, policy=policy,
                          detail="cleanup.policy changed to compact while the worker runs: it stops. Set "
                                 "cleanup.policy=delete, then run `stock-ledger verify` (records compacted away "
                                 "before they were applied show as holes)")
                raise StockLedgerError(f"{error} (changed while the worker ran: run `stock-ledger verify` after "
                                       "fixing it)")
        await asyncio.sleep(interval_seconds)
