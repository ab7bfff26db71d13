"""Connections to Kafka and PostgreSQL, with the security settings applied in one place.

Every aiokafka client the project creates takes `**kafka_options(settings)`; every database session comes from
`connect_database` (or `create_database_pool`), which refuses a URL weaker than STOCK_LEDGER_DATABASE_SSLMODE_MIN.

aiokafka reports a failed bootstrap only as "Unable to bootstrap from [...]" and logs the cause; `check_kafka`
connects once itself to name it. A wrong password, a certificate no CA we trust signed and a hostname mismatch
cannot heal by retrying, so they raise `ConnectionSecurityError` (exit 1 at once, one line saying which); an
unreachable broker stays a transient `KafkaConnectionError` that the caller retries up to its deadline.
"""

from __future__ import annotations

import hashlib
import os
import socket
import ssl
from typing import TYPE_CHECKING, Any, Final

import asyncpg
import structlog
from aiokafka import AIOKafkaConsumer
from aiokafka.conn import collect_hosts, create_conn
from aiokafka.errors import (
    IllegalSaslStateError,
    KafkaConnectionError,
    KafkaError,
    SaslAuthenticationFailed,
    UnsupportedSaslMechanismError,
)

from stock_ledger.config import SSLMODES, url_sslmode
from stock_ledger.errors import ConfigError, ConnectionSecurityError

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Mapping

    from stock_ledger.config import Settings

log = structlog.get_logger(__name__)

# OpenSSL's X509_V_ERR_HOSTNAME_MISMATCH, as reported in SSLCertVerificationError.verify_code.
_HOSTNAME_MISMATCH: Final = 62


def kafka_options(settings: Settings) -> dict[str, Any]:
    """The security keyword arguments of every AIOKafkaConsumer/Producer/AdminClient we create."""
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
            raise ConnectionSecurityError(_certificate_problem("Kafka", where, exc, "KAFKA_SSL_CA_FILE",
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


def _certificate_problem(service: str, where: str, exc: ssl.SSLCertVerificationError, ca_var: str,
                         skip_hostname: str) -> str:
    if exc.verify_code == _HOSTNAME_MISMATCH:
        return (f"TLS hostname mismatch: the certificate of {service} at {where} is not valid for that name "
                f"({exc.verify_message}). Connect by a name the certificate lists, or (not recommended) "
                f"{skip_hostname}")
    return (f"untrusted certificate: {service} at {where} presented a certificate that no CA in {ca_var} signed "
            f"({exc.verify_message}). Point {ca_var} at the CA that issued the server's certificate")


# ------------------------------------------------------------------------------------------ PostgreSQL


def check_sslmode(settings: Settings, environ: Mapping[str, str] = os.environ) -> str:
    """DATABASE_URL, after refusing one whose effective sslmode is below STOCK_LEDGER_DATABASE_SSLMODE_MIN."""
    url = settings.require_database_url()
    mode = url_sslmode(url, environ)
    if SSLMODES.index(mode) < SSLMODES.index(settings.database_sslmode_min):
        raise ConfigError(f"DATABASE_URL uses sslmode={mode}, weaker than STOCK_LEDGER_DATABASE_SSLMODE_MIN="
                          f"{settings.database_sslmode_min}")
    return url


def session_settings(settings: Settings, application_name: str) -> dict[str, str]:
    """Server settings of a worker session: timeouts that keep a frozen peer from blocking the group forever."""
    return {
        "application_name": application_name,
        # A claim waiting on a zombie's row lock gives up (and retries) instead of stalling the rebalance.
        "lock_timeout": str(settings.lock_timeout_ms),
        # A worker frozen inside its transaction loses its session, so its row locks are released.
        "idle_in_transaction_session_timeout": str(settings.idle_in_transaction_timeout_ms),
        # Detect a peer that vanished without a FIN (a node lost) within about a minute.
        "tcp_keepalives_idle": "30", "tcp_keepalives_interval": "10", "tcp_keepalives_count": "3",
    }


async def connect_database(settings: Settings, *, application_name: str = "stock-ledger",
                           connect_timeout: float = 10) -> asyncpg.Connection:
    """One session with the worker's timeouts; certificate and password failures raise one clear line."""
    url = check_sslmode(settings)
    try:
        return await asyncpg.connect(url, timeout=connect_timeout,
                                     server_settings=session_settings(settings, application_name))
    except Exception as exc:
        problem = _database_problem(exc)
        if problem is None:
            raise
        raise problem from None


async def create_database_pool(settings: Settings, *, application_name: str, max_size: int = 1) -> asyncpg.Pool:
    """A small pool (metrics, checks) under the same sslmode rule; connections open lazily."""
    return await asyncpg.create_pool(check_sslmode(settings), min_size=0, max_size=max_size, timeout=5,
                                     server_settings={"application_name": application_name})


def _database_problem(exc: BaseException) -> ConnectionSecurityError | None:
    """A failed connect that a retry cannot fix, as one clear line; None for anything else."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return ConnectionSecurityError(_certificate_problem("PostgreSQL", "DATABASE_URL's host", exc,
                                                            "the URL's sslrootcert", "use sslmode=verify-ca"))
    if isinstance(exc, asyncpg.InvalidAuthorizationSpecificationError):
        # Covers a wrong password (28P01) and a pg_hba rejection (28000); the server's message names the user only.
        return ConnectionSecurityError(f"PostgreSQL refused the login: {exc}. Check the user and password in "
                                       "DATABASE_URL (or DATABASE_URL_FILE)")
    return None


def make_consumer(settings: Settings) -> AIOKafkaConsumer:
    """The worker's group consumer (not yet subscribed)."""
    s = settings
    return AIOKafkaConsumer(
        bootstrap_servers=s.kafka_bootstrap_servers,
        group_id=s.group_id,
        group_instance_id=s.group_instance_id,
        client_id=f"stock-ledger-{socket.gethostname()}",
        enable_auto_commit=False,  # offsets live in PostgreSQL, committed with the rows
        # Never reset a position silently: a fetch below the log start (retention) or past its end (topic
        # recreated) raises, and claims.py decides (STOCK_LEDGER_ON_GAP). The reset policy applies only to
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


async def connect_worker(settings: Settings) -> asyncpg.Connection:
    """The worker's session; its application_name names the group, so a claim can tell a zombie of its own group
    among the sessions that block it (sink.Unblock)."""
    return await connect_database(settings, application_name=session_name(settings.group_id))


def session_name(group_id: str) -> str:
    """The application_name of this group's sessions (PostgreSQL keeps 63 bytes of it)."""
    name = f"stock-ledger/{group_id}"
    if len(name.encode()) > 63:
        name = f"stock-ledger/{hashlib.sha256(group_id.encode()).hexdigest()[:32]}"
    return name


def quiet_lost_session_replies(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Event-loop exception handler: one line, no stack trace, for the reply future asyncpg orphans when the server
    ends a session in the middle of a statement (we were frozen and a claim terminated us, or the server
    restarted). The statement that waited on it already failed and was retried on a fresh session; asyncpg then
    fails the orphan with ConnectionDoesNotExistError and asyncio reports it as "never retrieved". Everything
    else goes to asyncio's default handler."""
    exc = context.get("exception")
    if isinstance(exc, asyncpg.ConnectionDoesNotExistError) and "future" in context and "task" not in context:
        log.info("db.orphaned_reply", error=f"{type(exc).__name__}: {exc}",
                 detail="a session the server closed mid-statement; that statement was already retried")
        return
    loop.default_exception_handler(context)
