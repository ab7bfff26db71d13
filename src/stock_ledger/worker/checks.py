"""What the worker checks before its first batch, each retried (`startup.retry`) until
STOCK_LEDGER_RETRY_DEADLINE_SECONDS: how PostgreSQL sessions are pooled, before the worker's own session; then Kafka:
the cluster, the topic, the group and the topic's configuration. A cause that no retry can help (a bad password, a
compacted topic) fails at once."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import structlog

from stock_ledger.clients.database import connect_database
from stock_ledger.clients.kafka import check_kafka
from stock_ledger.clients.servers import check_pooling
from stock_ledger.topics import TopicUnavailable, refuse_compacted, require_topic

if TYPE_CHECKING:
    from aiokafka import AIOKafkaConsumer

    from stock_ledger.config import Settings
    from stock_ledger.worker.retry import Retrier

# One logger name for the worker's events, whichever of its modules logs them.
log = structlog.get_logger("stock_ledger.worker")


class Checks:
    def __init__(self, settings: Settings, retry: Retrier, consumer: AIOKafkaConsumer) -> None:
        self._s = settings
        self._retry = retry
        self._consumer = consumer
        self.topic_problem: str | None = None  # why the topic cannot be read, until it can (readiness says it)

    async def check_pooling(self) -> None:
        # Before any session of ours prepares a named statement a shared server connection would keep. The probe's
        # sessions set nothing: it reads process ids only, perhaps on server connections other clients share.
        await self._retry("check how PostgreSQL sessions are pooled", functools.partial(
            check_pooling, functools.partial(
                connect_database, self._s, application_name="stock-ledger-pool-check", statement_cache_size=0,
                session={}, guard=False, reply_timeout=self._s.database_reply_timeout_ms / 1000),
                self._s.database_pooling),
            "startup.retry")

    async def join_kafka(self) -> None:
        s = self._s
        # One plain connection first: aiokafka reports a bad password or certificate only as "Unable to
        # bootstrap"; this names the cause and fails fast, where a retry cannot help.
        await self._retry("join the Kafka cluster", functools.partial(check_kafka, s), "startup.retry")
        # Before the consumer starts: on a missing topic it would wait for ever, saying nothing of ours.
        await self._retry("find the topic", self._find_topic, "startup.retry")
        await self._retry("join the Kafka cluster", self._consumer.start, "startup.retry")
        await self._retry("read the topic's configuration", functools.partial(refuse_compacted, s), "startup.retry")

    async def _find_topic(self) -> None:
        s = self._s
        try:
            await require_topic(s)
        except TopicUnavailable as exc:
            if self.topic_problem is None:  # once: the retries that follow are logged as startup.retry
                deadline = s.retry_deadline_seconds
                log.error("topic.unavailable", topic=s.topic, bootstrap_servers=s.kafka_bootstrap_servers,
                          detail=f"{exc}: create it, grant access, or fix STOCK_LEDGER_TOPIC / "
                                 "KAFKA_BOOTSTRAP_SERVERS",
                          retrying=f"until STOCK_LEDGER_RETRY_DEADLINE_SECONDS={deadline:g}, then exit 1" if deadline
                          else "for ever (STOCK_LEDGER_RETRY_DEADLINE_SECONDS=0); /readyz says why")
            self.topic_problem = str(exc)
            raise
        self.topic_problem = None
