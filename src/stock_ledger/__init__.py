"""stock-ledger: an effectively-once Kafka -> PostgreSQL stock ledger."""

from stock_ledger.config import Settings, load_settings
from stock_ledger.domain import Movement, RejectCode, Rejection, parse
from stock_ledger.errors import (
    ConfigError,
    CoordinateConflictError,
    FencedError,
    LedgerIntegrityError,
    OffsetMismatchError,
    RetryDeadlineExceeded,
    StockLedgerError,
)

__all__ = [
    "ConfigError", "CoordinateConflictError", "FencedError", "LedgerIntegrityError", "Movement",
    "OffsetMismatchError", "RejectCode", "Rejection", "RetryDeadlineExceeded", "Settings", "StockLedgerError",
    "load_settings", "parse",
]
