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
import weakref
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

from stock_ledger import schemaguard
from stock_ledger.config import SSLMODES, url_sslmode
from stock_ledger.dberrors import connect_error
from stock_ledger.errors import ConfigError, ConnectionSecurityError, StockLedgerError

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


def session_settings(settings: Settings) -> dict[str, str]:
    """Settings of a worker session: timeouts that keep a frozen peer from blocking the group forever."""
    return {
        # A claim waiting on a zombie's row lock gives up (and retries) instead of stalling the rebalance.
        "lock_timeout": str(settings.lock_timeout_ms),
        # A worker frozen inside its transaction loses its session, so its row locks are released.
        "idle_in_transaction_session_timeout": str(settings.idle_in_transaction_timeout_ms),
        # Detect a peer that vanished without a FIN (a node lost) within about a minute.
        "tcp_keepalives_idle": "30", "tcp_keepalives_interval": "10", "tcp_keepalives_count": "3",
    }


# Session settings are SET after connecting, never sent as startup parameters: PgBouncer (1.18, by default) refuses
# every startup parameter but a few it tracks itself, application_name among them, and with
# ignore_startup_parameters it accepts the others only to drop them silently. One round trip sets them all and asks
# for the backend's own process id, which behind a pooler is not the one the server's BackendKeyData gave the
# client (`Connection.get_server_pid()` is then a number the pooler made up).
_SET_SESSION: Final = """
SELECT pg_backend_pid(), count(set_config(name, value, false)) FROM unnest($1::text[], $2::text[]) AS s(name, value)
"""
_PID: Final = "SELECT pg_backend_pid()"
_backend_pids: weakref.WeakKeyDictionary[asyncpg.Connection, int] = weakref.WeakKeyDictionary()


async def connect_database(  # noqa: PLR0913 - every caller sets a different one of these
    settings: Settings, *, application_name: str = "stock-ledger", connect_timeout: float = 10,
    session: Mapping[str, str] | None = None, statement_cache_size: int = 100, guard: bool = True,
) -> asyncpg.Connection:
    """One session with the worker's timeouts (or `session`'s settings); a failed connect, and a pooler refusing a
    startup parameter, raise one clear line (dberrors.explain).

    Its search_path is pinned, and unless `guard` is off (the worker's own sessions) it refuses a schema a
    less-privileged role could have planted objects in (schemaguard.py)."""
    url = check_sslmode(settings)
    values = session_settings(settings) if session is None else session
    try:
        conn = await asyncpg.connect(url, timeout=connect_timeout, statement_cache_size=statement_cache_size,
                                     server_settings={"application_name": application_name})
    except Exception as exc:
        problem = _database_problem(exc, url)
        if problem is None:
            raise
        raise problem from None
    try:
        row = await conn.fetchrow(_SET_SESSION, list(values), list(values.values()))
        await (schemaguard.secure(conn) if guard else schemaguard.pin(conn))
    except BaseException:
        conn.terminate()
        raise
    assert row is not None  # noqa: S101 - an aggregate without GROUP BY returns one row
    _backend_pids[conn] = row[0]
    return conn


async def backend_pid(conn: asyncpg.Connection) -> int:
    """The process id of the server backend this session runs on (as pg_stat_activity and pg_blocking_pids name it),
    asked once per session: connect_database already knows it."""
    pid = _backend_pids.get(conn)
    if pid is None:
        pid = _backend_pids[conn] = int(await conn.fetchval(_PID))
    return pid


async def create_database_pool(settings: Settings, *, application_name: str, max_size: int = 1) -> asyncpg.Pool:
    """A small pool (metrics, checks) under the same sslmode rule; connections open lazily."""
    # setup, not init: a released connection is RESET ALL, which would undo the pinned search_path.
    return await asyncpg.create_pool(check_sslmode(settings), min_size=0, max_size=max_size, timeout=5,
                                     server_settings={"application_name": application_name}, setup=schemaguard.pin)


def refused_startup_parameter(exc: BaseException) -> ConfigError | None:
    """A pooler (PgBouncer) refusing a startup parameter, as the configuration error it is; None for anything else.

    The refusal arrives as ProtocolViolationError (SQLSTATE 08P01, a connection exception), which would otherwise be
    retried as a lost connection: forever with STOCK_LEDGER_RETRY_DEADLINE_SECONDS=0."""
    if not isinstance(exc, asyncpg.ProtocolViolationError) or "unsupported startup parameter" not in str(exc):
        return None
    return ConfigError(
        f"the server refused a startup parameter ({exc}): DATABASE_URL leads to a connection pooler (PgBouncer) "
        "that accepts only the parameters it knows. stock-ledger sends application_name only; a parameter in "
        "DATABASE_URL's query string is sent as one too. Remove it from DATABASE_URL, or set "
        "ignore_startup_parameters = <that parameter> in pgbouncer.ini, or connect to PostgreSQL directly")


def _database_problem(exc: BaseException, url: str) -> StockLedgerError | None:
    """A failed connect as one clear line; None for anything else (a pooler's refusal, else dberrors.connect_error)."""
    return refused_startup_parameter(exc) or connect_error(exc, url)


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
    return await connect_database(settings, application_name=session_name(settings.group_id), guard=False)


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
