"""The exceptions of stock-ledger.

    StockLedgerError                 base: fatal for the process (exit 1, one log line saying what to do)
    ├── ConfigError                  bad configuration: exit code 2, one line naming the variable
    ├── ConnectionSecurityError      wrong credentials or an unverifiable certificate: fatal at once, one line
    ├── FencedError                  another worker claimed the partition since we did: stop writing it
    ├── LedgerIntegrityError         the ledger refused a write that would break it: fatal, loud
    │   ├── OffsetRegressionError    a batch starts before the stored offset under our own epoch (a replay)
    │   └── CoordinateConflictError  the unique constraint on Kafka coordinates fired (the backstop)
    └── RetryDeadlineExceeded        a transient fault lasted longer than STOCK_LEDGER_RETRY_DEADLINE_SECONDS

None of these is retried. Transient database and broker faults are the libraries' own exceptions;
`retry.transient_cause` classifies them and `retry.Retrier` is the one path that retries them.
"""

from __future__ import annotations


class StockLedgerError(Exception):
    pass


class ConfigError(StockLedgerError):
    pass


class ConnectionSecurityError(StockLedgerError):
    """Authentication or certificate verification failed: retrying cannot help, so never retried."""


class FencedError(StockLedgerError):
    def __init__(self, partitions: dict[int, tuple[int, int | None]]) -> None:
        # partition -> (the epoch we hold, the epoch the database holds)
        self.partitions = partitions
        detail = ", ".join(f"partition {p}: ours {ours}, stored {stored}" for p, (ours, stored) in partitions.items())
        super().__init__(f"fenced: a newer claim owns these partitions ({detail}); batch rolled back")


class LedgerIntegrityError(StockLedgerError):
    pass


class OffsetRegressionError(LedgerIntegrityError):
    pass


class CoordinateConflictError(LedgerIntegrityError):
    pass


class RetryDeadlineExceeded(StockLedgerError):
    pass
