"""The topic and the group as Kafka sees them: creating the topic (explicitly: the brokers run with
auto.create.topics.enable=false), its partitions, its cleanup.policy (refused at start and watched while running:
compaction deletes movements before they are applied), the group's live members and its committed offsets."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import structlog
from aiokafka import TopicPartition
from aiokafka.admin import NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaConnectionError, KafkaError, TopicAlreadyExistsError

from stock_ledger.clients import kafka
from stock_ledger.errors import StockLedgerError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from aiokafka.admin import AIOKafkaAdminClient

    from stock_ledger.config import Settings

log = structlog.get_logger(__name__)


async def ensure_topic(settings: Settings, partitions: int = 24, replication: int = 1, attempts: int = 30) -> bool:
    """Create the topic if absent; return True if created. Retries while the broker is still starting."""
    topic, bootstrap = settings.topic, settings.kafka_bootstrap_servers
    for attempt in range(1, attempts + 1):
        client = kafka.admin(settings)
        try:
            await client.start()
            if topic in await client.list_topics():
                return False
            await client.create_topics([NewTopic(topic, partitions, replication)])
        except TopicAlreadyExistsError:
            return False
        except KafkaConnectionError as exc:
            if attempt == attempts:
                raise
            log.info("topic.waiting_for_broker", bootstrap=bootstrap, attempt=attempt, error=str(exc))
            await asyncio.sleep(1)
            continue
        finally:
            await client.close()
        log.info("topic.created", topic=topic, partitions=partitions)
        return True
    return False


async def _describe(settings: Settings) -> list[dict[str, Any]]:
    """A fresh DescribeTopics (metadata) answer for the topic, on an admin client of its own."""
    client = kafka.admin(settings)
    await client.start()
    try:
        described: list[dict[str, Any]] = await client.describe_topics([settings.topic])
    finally:
        await client.close()
    return described


async def partitions_of(settings: Settings) -> list[int]:
    """The topic's partition numbers, from a fresh metadata request (empty if the topic does not exist)."""
    described = await _describe(settings)
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


async def require_topic(settings: Settings) -> None:
    """Raise TopicUnavailable, naming the topic, STOCK_LEDGER_TOPIC and the bootstrap servers, unless the topic
    exists with partitions this client can describe."""
    topic, bootstrap = settings.topic, settings.kafka_bootstrap_servers
    described = await _describe(settings)
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


async def cleanup_policy(settings: Settings) -> str | None:
    """The topic's cleanup.policy (None if the topic does not exist)."""
    topic = settings.topic
    client = kafka.admin(settings)
    try:
        await client.start()
        responses = await client.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, topic, {"cleanup.policy": None})])
    finally:
        await client.close()
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


async def refuse_compacted(settings: Settings) -> None:
    """Compaction deletes movements of a SKU before they are applied (only the key's last record survives): a
    ledger over a compacted topic silently loses movements, so the worker refuses to start on one."""
    if error := _compacted(settings.topic, await cleanup_policy(settings)):
        raise error


async def watch_compaction(settings: Settings, interval_seconds: float) -> NoReturn:
    """Read the topic's cleanup.policy now and every `interval_seconds`; raise StockLedgerError (the worker halts)
    as soon as it contains compact: compaction switched on while the worker runs deletes movements it has not
    applied yet, as it would have at start (refuse_compacted). A failed read (the broker unreachable, a timeout) is
    logged and tried again at the next interval: it says nothing about the policy. A topic that no longer exists is
    not compacted; the worker's fetches say what is wrong with it."""
    topic = settings.topic
    while True:
        try:
            policy = await asyncio.wait_for(cleanup_policy(settings),
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


@dataclass(frozen=True, slots=True)
class Group:
    state: str
    members: list[str]


async def describe_group(settings: Settings) -> Group:
    """The Kafka group's state and live members (client id / host), from DescribeGroups."""
    client = kafka.admin(settings)
    await client.start()
    try:
        responses = await client.describe_consumer_groups([settings.group_id])
    finally:
        await client.close()
    for response in responses:
        for group in response.to_object()["groups"]:
            if group["group"] == settings.group_id:
                members = [f"{m['member_id']} ({m['client_host'].lstrip('/')})" for m in group["members"]]
                return Group(str(group["state"]), members)
    return Group("Dead", [])


async def committed_offsets(settings: Settings, client: AIOKafkaAdminClient | None = None) -> dict[int, int]:
    """The group's committed offsets on the topic (advisory: the worker tells them after PostgreSQL commits), on
    `client` if given (started), else on an admin client of its own."""
    own = client is None
    client = client or kafka.admin(settings)
    if own:
        await client.start()
    try:
        found = await client.list_consumer_group_offsets(settings.group_id)
    finally:
        if own:
            await client.close()
    return {tp.partition: meta.offset for tp, meta in found.items() if tp.topic == settings.topic and meta.offset >= 0}


@dataclass(frozen=True, slots=True)
class LogBounds:
    start: int
    end: int


async def log_bounds(settings: Settings, partitions: Sequence[int], timestamp_ms: int | None = None,
                     ) -> tuple[dict[int, LogBounds], dict[int, int | None]]:
    """Log start/end per partition, and (if asked) the first offset at or after `timestamp_ms`."""
    consumer = kafka.reader(settings)
    await consumer.start()
    try:
        tps = [TopicPartition(settings.topic, p) for p in partitions]
        starts = await consumer.beginning_offsets(tps)
        ends = await consumer.end_offsets(tps)
        at: dict[int, int | None] = {}
        if timestamp_ms is not None:
            found = await consumer.offsets_for_times(dict.fromkeys(tps, timestamp_ms))
            at = {tp.partition: (meta.offset if meta is not None else None) for tp, meta in found.items()}
    finally:
        await consumer.stop()
    return {tp.partition: LogBounds(int(starts[tp]), int(ends[tp])) for tp in tps}, at
