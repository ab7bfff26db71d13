"""stock-ledger: an effectively-once Kafka -> PostgreSQL stock ledger.

The rooms (docs/design.md#layout): `ledger` (the database half: THE batch transaction in ledger/transaction.py),
`consumer` (the consumer half), `worker` (one process's life around them), `audit` (verify, repair, the invariant
checks), `cli` (every command), `clients` (every connection), over a flat foundation (config, domain, errors, ...).
"""

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
