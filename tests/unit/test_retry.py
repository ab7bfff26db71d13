"""Which faults are worth retrying, and the bounded backoff that gives up so Kubernetes restarts the pod."""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace

import asyncpg
import pytest
from aiokafka import errors as kafka_errors
from asyncpg import exceptions as pg

from stock_ledger.clients.servers import ReadOnlyServerError
from stock_ledger.errors import ConfigError, FencedError, Mismatch, OffsetMismatchError, RetryDeadlineExceeded
from stock_ledger.worker import retry
from stock_ledger.worker.retry import Backoff, transient_cause


class TestTransientCause:
    """A low-cardinality cause label for faults that may pass on retry; None for faults that will not."""

    @pytest.mark.parametrize(
        "exc",
        [
            pg.AdminShutdownError("terminating connection due to administrator command"),
            pg.CrashShutdownError("crash"),
            pg.CannotConnectNowError("the database system is starting up"),
            pg.QueryCanceledError("canceling statement due to statement timeout"),
            pg.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
            pg.ConnectionFailureError("x"),
            pg.PostgresConnectionError("x"),
            asyncpg.InterfaceError("connection is closed"),
            pg.TooManyConnectionsError("sorry, too many clients already"),
            pg.DiskFullError("could not extend file"),
            pg.DeadlockDetectedError("deadlock detected"),
            pg.SerializationError("could not serialize access"),
            pg.IdleInTransactionSessionTimeoutError(
                "terminating connection due to idle-in-transaction timeout"
            ),
            # A standby promoted away from, or default_transaction_read_only: a new session finds the primary.
            pg.ReadOnlySQLTransactionError("cannot execute INSERT in a read-only transaction"),
            ReadOnlyServerError("the PostgreSQL server at 127.0.0.1:5433 is a standby"),
            ConnectionResetError("reset by peer"),
            ConnectionRefusedError("refused"),
            TimeoutError(),
            OSError("Network is unreachable"),
        ],
        ids=lambda e: type(e).__name__,
    )
    def test_connection_and_server_side_transients_are_database(self, exc: BaseException) -> None:
        """Lost connections, restarts, overload, deadlocks and timeouts: retry the whole batch."""
        assert transient_cause(exc) == "database"

    def test_a_lock_timeout_is_lock(self) -> None:
        """lock_timeout: a (possibly frozen) peer holds the offset row; its own label, for the fencing dashboard."""
        assert transient_cause(pg.LockNotAvailableError("canceling statement due to lock timeout")) == "lock"

    def test_a_unique_violation_is_a_movement_id_race(self) -> None:
        """movement_id raced in from another partition's batch: the retry quarantines it."""
        assert transient_cause(pg.UniqueViolationError("duplicate key value")) == "movement_id_race"

    @pytest.mark.parametrize(
        "exc",
        [
            kafka_errors.KafkaConnectionError("Unable to connect"),
            kafka_errors.RequestTimedOutError(),
            kafka_errors.NodeNotReadyError(),
            kafka_errors.NotLeaderForPartitionError(),
            kafka_errors.GroupCoordinatorNotAvailableError(),
            kafka_errors.NotCoordinatorForGroupError(),
        ],
        ids=lambda e: type(e).__name__,
    )
    def test_retriable_kafka_errors_are_kafka(self, exc: BaseException) -> None:
        """aiokafka marks its retriable errors; those are worth waiting for."""
        assert transient_cause(exc) == "kafka"

    def test_a_kafka_timeout_is_kafka(self) -> None:
        """aiokafka raises KafkaTimeoutError (whose class flag says retriable=False) from beginning_offsets() and
        end_offsets() when the broker does not answer within request_timeout_ms: a broker blip while claiming
        partitions with no stored offset. That is as transient as any timeout and must be retried, not fatal."""
        exc = kafka_errors.KafkaTimeoutError("Failed to get offsets by times in 40000 ms")
        exc.__cause__ = TimeoutError()
        assert transient_cause(exc) == "kafka"

    @pytest.mark.parametrize(
        "exc",
        [
            pg.ForeignKeyViolationError("x"),
            pg.CheckViolationError("x"),
            pg.UndefinedTableError('relation "stock_movements" does not exist'),
            pg.InsufficientPrivilegeError("permission denied for table stock_movements"),
            pg.PostgresSyntaxError("syntax error"),
            pg.NumericValueOutOfRangeError("bigint out of range"),
            pg.CharacterNotInRepertoireError("invalid byte sequence"),
            pg.InvalidPasswordError("password authentication failed"),
            kafka_errors.TopicAuthorizationFailedError(),
            kafka_errors.IllegalStateError("x"),
            kafka_errors.UnknownMemberIdError(),
            ValueError("x"),
            KeyError("x"),
            ConfigError("STOCK_LEDGER_X"),
            FencedError({0: (1, 2)}),
            OffsetMismatchError({0: Mismatch(20, 1, 10)}),
            asyncio.CancelledError(),
            KeyboardInterrupt(),
        ],
        ids=lambda e: type(e).__name__,
    )
    def test_deterministic_faults_are_not_transient(self, exc: BaseException) -> None:
        """Schema, privilege, data and programming errors fail again on retry: None, so the worker exits loudly.
        Cancellation is never swallowed as a fault."""
        assert transient_cause(exc) is None

    @pytest.mark.parametrize(
        "exc",
        [
            pg._base.DataError(
                "invalid input for query argument $3: 'x' ('str' object cannot be interpreted as an integer)"
            ),
            pg.ClientConfigurationError("x"),
            pg.UnsupportedClientFeatureError("x"),
        ],
        ids=lambda e: type(e).__name__,
    )
    def test_client_side_misuse_is_not_transient(self, exc: BaseException) -> None:
        """asyncpg's client-side DataError (a value the driver cannot encode) and configuration errors subclass
        InterfaceError, which is otherwise 'connection is closed'; retrying the same batch encodes the same value
        and fails the same way, so they are not transient."""
        assert isinstance(exc, asyncpg.InterfaceError)
        assert transient_cause(exc) is None


class FakeTime:
    """A clock that only moves when the code under test sleeps (or the test says so)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    """Backoff on a fake clock, with the jitter pinned to its upper bound so the delays are exact."""
    fake = FakeTime()
    monkeypatch.setattr(retry, "time", SimpleNamespace(monotonic=fake.monotonic))
    monkeypatch.setattr(retry, "asyncio", SimpleNamespace(sleep=fake.sleep))
    monkeypatch.setattr(retry, "random", SimpleNamespace(uniform=lambda _low, high: high))
    return fake


async def fail_until_it_gives_up(backoff: Backoff, what: str, exc: BaseException) -> None:
    """The retry loop of the worker, reduced to a fault that never clears."""
    for _ in range(10_000):
        await backoff.wait(what, exc)
    pytest.fail("the backoff never gave up")


class TestBackoff:
    """Exponential backoff with full jitter, bounded by a deadline counted from the first fault."""

    @pytest.mark.asyncio
    async def test_it_gives_up_once_the_deadline_has_passed(self, clock: FakeTime) -> None:
        """deadline 10 s: keeps sleeping while under 10 s since the first fault, then raises RetryDeadlineExceeded
        naming the operation, the setting and the last error, chained to it."""
        backoff = Backoff(deadline=10, first=0.5, cap=2)
        last = pg.AdminShutdownError("terminating connection")
        with pytest.raises(RetryDeadlineExceeded) as caught:
            await fail_until_it_gives_up(backoff, "the batch transaction", last)
        elapsed = clock.now - 1000.0
        assert 10 <= elapsed <= 10 + 2  # at most one capped sleep past the deadline
        message = str(caught.value)
        assert "the batch transaction" in message
        assert "STOCK_LEDGER_RETRY_DEADLINE_SECONDS" in message
        assert "AdminShutdownError" in message
        assert caught.value.__cause__ is last

    @pytest.mark.asyncio
    async def test_the_delays_double_up_to_the_cap(self, clock: FakeTime) -> None:
        """Upper bounds of the jitter grow by 2x per attempt and never exceed the cap."""
        backoff = Backoff(deadline=1000, first=0.1, cap=1.0)
        for _ in range(8):
            await backoff.wait("x", TimeoutError())
        assert backoff.attempt == 8
        assert max(clock.sleeps) == 1.0
        growing = [s for s in clock.sleeps if s < 1.0]
        assert growing[0] <= 0.2
        assert all(b == pytest.approx(2 * a) for a, b in itertools.pairwise(growing))
        assert clock.sleeps[len(growing) :] == [1.0] * (8 - len(growing))

    @pytest.mark.asyncio
    async def test_reset_starts_the_deadline_and_the_delays_afresh(self, clock: FakeTime) -> None:
        """After a success (reset), a new fault gets the full deadline again and short delays again."""
        backoff = Backoff(deadline=5, first=0.1, cap=1.0)
        while clock.now - 1000.0 < 4.5:
            await backoff.wait("x", TimeoutError())
        backoff.reset()
        assert backoff.attempt == 0
        clock.sleeps.clear()
        for _ in range(3):
            await backoff.wait("x", TimeoutError())  # would raise without the reset: 4.5 s + 3 s > 5 s
        assert clock.sleeps[0] <= 0.2

    @pytest.mark.asyncio
    async def test_a_deadline_of_zero_never_gives_up(self, clock: FakeTime) -> None:
        """STOCK_LEDGER_RETRY_DEADLINE_SECONDS=0: a fault that lasts a day is still retried, at the capped delay
        (the pod stays live and NotReady instead of crash-looping)."""
        backoff = Backoff(deadline=0, first=0.1, cap=5.0)
        while clock.now - 1000.0 < 86_400:
            await backoff.wait("the batch transaction", TimeoutError())
        assert clock.sleeps[-1] == 5.0

    @pytest.mark.asyncio
    async def test_the_first_fault_never_raises(self, clock: FakeTime) -> None:
        """The deadline counts from the first fault, so a fault after a long healthy run is retried."""
        clock.now = 10**9
        await Backoff(deadline=1).wait("x", TimeoutError())
        assert len(clock.sleeps) == 1

    @pytest.mark.asyncio
    async def test_jitter_is_full_jitter_between_zero_and_the_bound(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Real randomness: each sleep lies in [0, bound]; workers that failed together do not retry together."""
        sleeps: list[float] = []

        async def record(seconds: float) -> None:
            sleeps.append(seconds)

        monkeypatch.setattr(retry, "asyncio", SimpleNamespace(sleep=record))
        backoff = Backoff(deadline=1000, first=0.1, cap=5.0)
        for _ in range(200):
            await backoff.wait("x", TimeoutError())
        assert all(0 <= s <= 5.0 for s in sleeps)
        assert len(set(sleeps)) > 150


@pytest.mark.asyncio
async def test_a_tiny_real_deadline_raises_quickly() -> None:
    """No fakes: deadline 50 ms, delays of at most 20 ms; a persistent fault ends in RetryDeadlineExceeded fast."""
    backoff = Backoff(deadline=0.05, first=0.005, cap=0.02)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(RetryDeadlineExceeded):
        await fail_until_it_gives_up(backoff, "reconnect to PostgreSQL", ConnectionRefusedError())
    assert loop.time() - started < 1
