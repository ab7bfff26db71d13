"""Every Kafka client the project makes, with the security settings applied here and nowhere else.

aiokafka reports a failed bootstrap only as "Unable to bootstrap from [...]" and logs the cause; `check_kafka`
connects once itself to name it. A wrong password, a certificate no CA we trust signed and a hostname mismatch
cannot heal by retrying, so they raise `ConnectionSecurityError` (exit 1 at once, one line saying which); an
unreachable broker stays a transient `KafkaConnectionError` that the caller retries up to its deadline.
"""

from __future__ import annotations

import socket
import ssl
from typing import TYPE_CHECKING, Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.conn import collect_hosts, create_conn
from aiokafka.errors import (
    IllegalSaslStateError,
    KafkaConnectionError,
    KafkaError,
    SaslAuthenticationFailed,
    UnsupportedSaslMechanismError,
)

from stock_ledger.clients.tls import certificate_problem
from stock_ledger.errors import ConfigError, ConnectionSecurityError

if TYPE_CHECKING:
    from stock_ledger.config import Settings


def kafka_options(settings: Settings) -> dict[str, Any]:
    """The security keyword arguments every client below is built with."""
    s = settings
    options: dict[str, Any] = {"security_protocol": s.kafka_security_protocol}
    if s.kafka_security_protocol in {"SSL", "SASL_SSL"}:
        options["ssl_context"] = kafka_ssl_context(s)
    if s.kafka_security_protocol.startswith("SASL_"):
        options |= {"sasl_mechanism": s.kafka_sasl_mechanism, "sasl_plain_username": s.kafka_sasl_username,
                    "sasl_plain_password": s.kafka_sasl_password}
    return options


def kafka_ssl_context(settings: Settings) -> ssl.SSLContext:
    """Verify the broker against KAFKA_SSL_CA_FILE (else the system CAs); present a client certificate if set.

    Built afresh for each client, so rotated certificate files are picked up by the next connection.
    """
    s = settings
    try:
        context = ssl.create_default_context(cafile=s.kafka_ssl_ca_file)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"KAFKA_SSL_CA_FILE={s.kafka_ssl_ca_file!r} holds no usable PEM certificate: {exc}") from None
    context.check_hostname = s.kafka_ssl_check_hostname
    if s.kafka_ssl_cert_file:
        try:
            context.load_cert_chain(s.kafka_ssl_cert_file, s.kafka_ssl_key_file)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(
                f"KAFKA_SSL_CERT_FILE / KAFKA_SSL_KEY_FILE ({s.kafka_ssl_cert_file!r}, {s.kafka_ssl_key_file!r}) are "
                f"not a matching PEM certificate and unencrypted key: {type(exc).__name__}"
            ) from None
    return context


def group_consumer(settings: Settings) -> AIOKafkaConsumer:
    """The worker's member of the consumer group (not yet subscribed)."""
    s = settings
    return AIOKafkaConsumer(
        bootstrap_servers=s.kafka_bootstrap_servers,
        group_id=s.group_id,
        group_instance_id=s.group_instance_id,
        client_id=f"stock-ledger-{socket.gethostname()}",
        enable_auto_commit=False,  # offsets live in PostgreSQL, committed with the rows
        # Never reset a position silently: a fetch below the log start (retention) or past its end (topic
        # recreated) raises, and the claim decides (STOCK_LEDGER_ON_GAP). The reset policy applies only to
        # partitions with no stored offset, resolved by the claim.
        auto_offset_reset="none",
        isolation_level="read_committed",  # never apply a movement from an aborted producer transaction
        session_timeout_ms=s.session_timeout_ms,
        heartbeat_interval_ms=max(100, s.session_timeout_ms // 3),
        rebalance_timeout_ms=s.rebalance_timeout_ms,
        max_poll_interval_ms=max(300_000, s.rebalance_timeout_ms),
        fetch_max_wait_ms=min(500, s.batch_max_wait_ms),
        metadata_max_age_ms=s.metadata_max_age_ms,
        **kafka_options(s),
    )


def reader(settings: Settings, **tuning: int | str) -> AIOKafkaConsumer:
    """A consumer outside the group (assigned partitions by hand, never commits) that reads committed records
    only, as the worker does: transaction markers and aborted records are skipped. Not yet started."""
    return AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap_servers, enable_auto_commit=False,
                            isolation_level="read_committed", **tuning, **kafka_options(settings))


def admin(settings: Settings) -> AIOKafkaAdminClient:
    """An admin client (topic metadata and configuration, the group's members and committed offsets)."""
    return AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap_servers, **kafka_options(settings))


def producer(settings: Settings) -> AIOKafkaProducer:
    """The load generator's producer (`stock-ledger produce`)."""
    return AIOKafkaProducer(
        bootstrap_servers=settings.kafka_bootstrap_servers,
        enable_idempotence=True,  # broker-side dedup of producer retries: no duplicate offsets from us
        acks="all",
        linger_ms=5,
        max_batch_size=512 * 1024,
        request_timeout_ms=30_000,
        **kafka_options(settings),
    )


async def check_kafka(settings: Settings, timeout_ms: int = 10_000) -> None:
    """Connect (and authenticate) to one bootstrap server; raise what a retry cannot fix, with its cause."""
    s = settings
    options = kafka_options(s)
    last: BaseException | None = None
    for host, port, _ in collect_hosts(s.kafka_bootstrap_servers):
        where = f"{host}:{port}"
        try:
            conn = await create_conn(host, port, request_timeout_ms=timeout_ms, **options)
        except (SaslAuthenticationFailed, UnsupportedSaslMechanismError, IllegalSaslStateError) as exc:
            raise ConnectionSecurityError(
                f"Kafka at {where} rejected the SASL login of user {s.kafka_sasl_username!r} "
                f"({s.kafka_sasl_mechanism}): {type(exc).__name__}. Check KAFKA_SASL_USERNAME, KAFKA_SASL_PASSWORD "
                "(or KAFKA_SASL_PASSWORD_FILE) and KAFKA_SASL_MECHANISM"
            ) from None
        except ssl.SSLCertVerificationError as exc:
            raise ConnectionSecurityError(certificate_problem("Kafka", where, exc, "KAFKA_SSL_CA_FILE",
                                                              "set KAFKA_SSL_CHECK_HOSTNAME=false")) from None
        except ssl.SSLError as exc:
            raise ConnectionSecurityError(
                f"TLS handshake with Kafka at {where} failed ({exc.reason or exc}): is it a TLS listener? "
                f"KAFKA_SECURITY_PROTOCOL={s.kafka_security_protocol}"
            ) from None
        except (OSError, KafkaError, TimeoutError) as exc:
            last = exc
            continue
        conn.close()
        return
    detail = f"{type(last).__name__}: {last}" if last is not None else "no address to try"
    raise KafkaConnectionError(f"no Kafka bootstrap server of {s.kafka_bootstrap_servers} answered ({detail})")
