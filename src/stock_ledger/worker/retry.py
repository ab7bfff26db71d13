"""Which faults are transient, and the one retry path for them: count, log, back off, give up at the deadline."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, TypeVar

import asyncpg
import structlog
from aiokafka.errors import KafkaError, KafkaTimeoutError

from stock_ledger.clients.database import refused_startup_parameter
from stock_ledger.errors import RegistryUnavailableError, RetryDeadlineExceeded

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

log = structlog.get_logger(__name__)
_T = TypeVar("_T")

_PG_TRANSIENT: Final = (
    asyncpg.PostgresConnectionError,   # connection lost or refused
    asyncpg.InterfaceError,            # connection closed under us
    asyncpg.InternalClientError,       # protocol state confused by a session killed mid-statement
    asyncpg.OperatorInterventionError,  # pg_terminate_backend, shutdown, cannot connect now, query canceled
    asyncpg.InsufficientResourcesError,  # too many connections, disk full
    asyncpg.TransactionRollbackError,  # deadlock, serialization failure
    asyncpg.LockNotAvailableError,     # lock_timeout: a (possibly frozen) peer holds the row
    asyncpg.IdleInTransactionSessionTimeoutError,  # we were frozen mid-transaction and the server gave up on us
    asyncpg.ReadOnlySQLTransactionError,  # 25006: a standby or a read-only server; a new session finds the primary
    asyncpg.UniqueViolationError,      # movement_id raced in from another partition: the retry quarantines it
)


# asyncpg's client-side misuse errors subclass InterfaceError, but retrying the same batch repeats them.
_PG_PERMANENT: Final = (
    asyncpg.exceptions._base.DataError,  # noqa: SLF001 - a value the driver cannot encode; not exported elsewhere
    asyncpg.exceptions.ClientConfigurationError,
    asyncpg.exceptions.UnsupportedClientFeatureError,
    asyncpg.exceptions._base.UnsupportedServerFeatureError,  # noqa: SLF001
)
# (exception types, cause label), first match wins.
_CAUSES: Final[tuple[tuple[tuple[type[BaseException], ...], str | None], ...]] = (
    (_PG_PERMANENT, None),
    # The schema registry down, slow or failing, or a schema id not registered yet (for a bounded time).
    ((RegistryUnavailableError,), "schema_registry"),
    ((asyncpg.LockNotAvailableError,), "lock"),
    ((asyncpg.UniqueViolationError,), "movement_id_race"),
    (_PG_TRANSIENT, "database"),
    # aiokafka marks its request timeouts non-retriable, but for us a broker that did not answer in time
    # (e.g. ListOffsets during a restart) is exactly the kind of fault to retry.
    ((KafkaTimeoutError,), "kafka"),
    ((ConnectionError, OSError, TimeoutError), "database"),
)


def transient_cause(exc: BaseException) -> str | None:
    """A low-cardinality cause label if `exc` may succeed on retry, else None."""
    if refused_startup_parameter(exc) is not None:
        return None  # a pooler's configuration: retrying cannot change it
    for types, cause in _CAUSES:
        if isinstance(exc, types):
            return cause
    if isinstance(exc, KafkaError) and getattr(exc, "retriable", False):
        return "kafka"
    return None


class Backoff:
    """Exponential backoff with full jitter, giving up once `deadline` seconds have passed since the first fault;
    a deadline of 0 never gives up (Kubernetes then sees a live, NotReady pod instead of a crash loop)."""

    def __init__(self, deadline: float, first: float = 0.1, cap: float = 5.0) -> None:
        self._deadline, self._first, self._cap = deadline, first, cap
        self._started: float | None = None
        self.attempt = 0

    def reset(self) -> None:
        self._started, self.attempt = None, 0

    async def wait(self, what: str, exc: BaseException) -> None:
        now = time.monotonic()
        if self._started is None:
            self._started = now
        if self._deadline > 0 and now - self._started > self._deadline:
            raise RetryDeadlineExceeded(
                f"{what} kept failing for {now - self._started:.0f}s (limit STOCK_LEDGER_RETRY_DEADLINE_SECONDS="
                f"{self._deadline:g}): last error {type(exc).__name__}: {exc}; exiting so the pod is restarted"
            ) from exc
        self.attempt += 1
        # The exponent is bounded: retrying forever must not overflow a float after ~1,000 attempts.
        bound = min(self._cap, self._first * 2 ** min(self.attempt, 32))
        await asyncio.sleep(random.uniform(0, bound))  # noqa: S311


class Abandoned(Exception):
    def __init__(self, what: str, cause: str) -> None:
        super().__init__(f"{what}: abandoned on shutdown during a transient fault ({cause})")
        self.cause = cause


@dataclass(frozen=True, slots=True)
class Retrier:
    """The one retry path: `await retrier(what, op, event)` runs `op` until it succeeds.

    A transient fault is reported to `on_fault(cause, exc)` (count it, drop a broken session), logged once as
    `event`, and backed off; the deadline counts from this operation's first fault, so nothing that succeeds inside
    `op` (a reconnect) can restart it. A permanent fault is raised as it is; a transient one after shutdown was
    requested raises `Abandoned` (whatever `op` did was rolled back, or is harmless to repeat)."""

    deadline: float
    stopping: asyncio.Event
    on_fault: Callable[[str, Exception], None]

    async def __call__(self, what: str, op: Callable[[], Awaitable[_T]], event: str) -> _T:
        backoff = Backoff(self.deadline)
        while True:
            try:
                return await op()
            except Exception as exc:
                cause = transient_cause(exc)
                if cause is None:
                    raise
                if self.stopping.is_set():
                    raise Abandoned(what, cause) from exc
                self.on_fault(cause, exc)
                log.warning(event, what=what, cause=cause, attempt=backoff.attempt + 1,
                            error=f"{type(exc).__name__}: {exc}")
                await backoff.wait(what, exc)
