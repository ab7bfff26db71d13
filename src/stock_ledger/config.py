"""The one settings object, built from the environment by a pure function.

Every variable is documented in README.md ("Configuration"). A bad value fails at start with the variable's name
(`ConfigError`, exit code 2), never later in the hot path.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypeVar

from stock_ledger.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

OffsetReset = Literal["earliest", "latest", "none"]
LogFormat = Literal["auto", "json", "console"]

_T = TypeVar("_T")


def _mask(url: str | None) -> str | None:
    """Hide the password of a connection URL so settings can be logged."""
    if url is None:
        return None
    url = re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", url)
    return re.sub(r"([?&]password=)[^&]*", r"\1***", url)


@dataclass(frozen=True, slots=True)
class Settings:
    kafka_bootstrap_servers: str = "localhost:9092"
    database_url: str | None = field(default=None, repr=False)
    topic: str = "warehouse.movements"
    group_id: str = "stock-ledger"
    group_instance_id: str | None = None
    metrics_port: int = 9108
    session_timeout_ms: int = 10_000
    rebalance_timeout_ms: int = 30_000
    batch_max_records: int = 5_000
    batch_max_wait_ms: int = 200
    auto_offset_reset: OffsetReset = "earliest"
    retry_deadline_seconds: float = 60.0
    lock_timeout_ms: int = 5_000
    idle_in_transaction_timeout_ms: int = 15_000
    shutdown_grace_seconds: float = 8.0
    stall_seconds: float = 60.0
    position_refresh_seconds: float = 5.0
    invariant_refresh_seconds: float = 60.0
    # The full pass of the invariants (a scan of stock_movements); the checks in between cost what changed.
    invariant_full_scan_seconds: float = 21_600.0
    log_level: str = "info"
    log_format: LogFormat = "auto"
    migrations_dir: str | None = None
    # Test-only crash points, see faults.py. Never set in production.
    fault: str | None = None

    @property
    def database_url_masked(self) -> str | None:
        return _mask(self.database_url)

    def require_database_url(self) -> str:
        if not self.database_url:
            raise ConfigError(
                "DATABASE_URL is required for this command, e.g. postgresql://user:pass@host:5432/stock_ledger"
            )
        return self.database_url

    def loggable(self) -> dict[str, object]:
        values = dataclasses.asdict(self)
        values["database_url"] = self.database_url_masked
        return values


def _parse_int(name: str, raw: str, low: int, high: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if not low <= value <= high:
        raise ConfigError(f"{name}={value} is out of range [{low}, {high}]")
    return value


def _parse_float(name: str, raw: str, low: float, high: float) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if not low <= value <= high:
        raise ConfigError(f"{name}={value} is out of range [{low}, {high}]")
    return value


def _parse_choice(name: str, raw: str, choices: tuple[str, ...]) -> str:
    value = raw.strip().lower()
    if value not in choices:
        raise ConfigError(f"{name}={raw!r} must be one of {', '.join(choices)}")
    return value


def load_settings(environ: Mapping[str, str]) -> Settings:
    """Build `Settings` from an environment mapping; raise `ConfigError` naming the first bad variable."""
    values: dict[str, object] = {}

    def take(name: str, attr: str, parse: Callable[[str, str], _T]) -> None:
        raw = environ.get(name)
        if raw is not None and raw.strip() != "":
            values[attr] = parse(name, raw.strip())

    def text(name: str, raw: str) -> str:
        if len(raw) > 1024:
            raise ConfigError(f"{name} is longer than 1024 characters")
        return raw

    def ints(low: int, high: int) -> Callable[[str, str], int]:
        return lambda name, raw: _parse_int(name, raw, low, high)

    def floats(low: float, high: float) -> Callable[[str, str], float]:
        return lambda name, raw: _parse_float(name, raw, low, high)

    def choice(*choices: str) -> Callable[[str, str], str]:
        return lambda name, raw: _parse_choice(name, raw, choices)

    take("KAFKA_BOOTSTRAP_SERVERS", "kafka_bootstrap_servers", text)
    take("DATABASE_URL", "database_url", _parse_database_url)
    take("STOCK_LEDGER_TOPIC", "topic", _parse_topic)
    take("STOCK_LEDGER_GROUP_ID", "group_id", text)
    take("STOCK_LEDGER_GROUP_INSTANCE_ID", "group_instance_id", text)
    take("STOCK_LEDGER_METRICS_PORT", "metrics_port", ints(0, 65535))
    take("STOCK_LEDGER_SESSION_TIMEOUT_MS", "session_timeout_ms", ints(1_000, 300_000))
    take("STOCK_LEDGER_REBALANCE_TIMEOUT_MS", "rebalance_timeout_ms", ints(1_000, 600_000))
    take("STOCK_LEDGER_BATCH_MAX_RECORDS", "batch_max_records", ints(1, 100_000))
    take("STOCK_LEDGER_BATCH_MAX_WAIT_MS", "batch_max_wait_ms", ints(1, 60_000))
    take("STOCK_LEDGER_AUTO_OFFSET_RESET", "auto_offset_reset", choice("earliest", "latest", "none"))
    take("STOCK_LEDGER_RETRY_DEADLINE_SECONDS", "retry_deadline_seconds", floats(1, 86_400))
    take("STOCK_LEDGER_LOCK_TIMEOUT_MS", "lock_timeout_ms", ints(100, 600_000))
    take("STOCK_LEDGER_IDLE_IN_TRANSACTION_TIMEOUT_MS", "idle_in_transaction_timeout_ms", ints(1_000, 3_600_000))
    take("STOCK_LEDGER_SHUTDOWN_GRACE_SECONDS", "shutdown_grace_seconds", floats(0.1, 600))
    take("STOCK_LEDGER_STALL_SECONDS", "stall_seconds", floats(1, 3_600))
    take("STOCK_LEDGER_POSITION_REFRESH_SECONDS", "position_refresh_seconds", floats(0.1, 3_600))
    take("STOCK_LEDGER_INVARIANT_REFRESH_SECONDS", "invariant_refresh_seconds", floats(0.1, 86_400))
    take("STOCK_LEDGER_INVARIANT_FULL_SCAN_SECONDS", "invariant_full_scan_seconds", floats(1, 2_592_000))
    take("STOCK_LEDGER_LOG_LEVEL", "log_level", choice("debug", "info", "warning", "error"))
    take("STOCK_LEDGER_LOG_FORMAT", "log_format", choice("auto", "json", "console"))
    take("STOCK_LEDGER_MIGRATIONS_DIR", "migrations_dir", text)
    take("STOCK_LEDGER_FAULT", "fault", text)

    settings = Settings(**values)  # type: ignore[arg-type]
    if settings.rebalance_timeout_ms < settings.session_timeout_ms:
        raise ConfigError(
            "STOCK_LEDGER_REBALANCE_TIMEOUT_MS must be >= STOCK_LEDGER_SESSION_TIMEOUT_MS "
            f"({settings.rebalance_timeout_ms} < {settings.session_timeout_ms})"
        )
    return settings


def _parse_database_url(name: str, raw: str) -> str:
    if not raw.startswith(("postgresql://", "postgres://")):
        raise ConfigError(f"{name} must start with postgresql:// (got {_mask(raw)!r})")
    return raw


_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")


def _parse_topic(name: str, raw: str) -> str:
    if not _TOPIC.match(raw):
        raise ConfigError(f"{name}={raw!r} is not a valid Kafka topic name ([A-Za-z0-9._-], 1-249 chars)")
    return raw
