"""The exceptions of stock-ledger.

    StockLedgerError                 base: fatal for the process (exit 1, one log line saying what to do)
    ├── ConfigError                  bad configuration: exit code 2, one line naming the variable
    ├── ConnectionSecurityError      wrong credentials or an unverifiable certificate: fatal at once, one line
    ├── DatabaseError                the database refused us for a reason a retry cannot fix (unknown database,
    │                                missing privilege, planted objects): fatal at once, one line (dberrors.py)
    ├── DatabaseUnreachableError     PostgreSQL did not answer (refused, unresolvable, timeout); also an OSError,
    │                                so the worker retries it like any transient fault
    ├── FencedError                  another worker claimed the partition since we did: stop writing it
    ├── OffsetMismatchError          the stored offset is not where this worker expects it (the database went back
    │                                in time, or someone moved it): claim again and re-apply from Kafka
    ├── LedgerIntegrityError         the ledger refused a write that would break it: fatal, loud
    │   └── CoordinateConflictError  the unique constraint on Kafka coordinates fired (the backstop)
    ├── OperatorError                an operator command refused (one line on stderr: why, and what to do instead)
    ├── RegistryUnavailableError     the schema registry did not answer (refused, timeout, 5xx): transient, retried
    │   └── SchemaPendingError       a schema id the registry does not know yet: retried for a bounded time
    └── RetryDeadlineExceeded        a transient fault lasted longer than STOCK_LEDGER_RETRY_DEADLINE_SECONDS

None of these is retried but DatabaseUnreachableError and RegistryUnavailableError. Other transient database and
broker faults are the libraries' own exceptions; `worker.retry.transient_cause` classifies them and
`worker.retry.Retrier` is the one path that retries them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping


class StockLedgerError(Exception):
    pass


class ConfigError(StockLedgerError):
    pass


class ConnectionSecurityError(StockLedgerError):
    """Authentication or certificate verification failed: retrying cannot help, so never retried."""


class DatabaseError(StockLedgerError):
    """Retrying cannot help: the message (dberrors.explain) says what to change."""


class DatabaseUnreachableError(StockLedgerError, OSError):
    """Transient for the worker (retry.transient_cause sees an OSError); a command reports it and exits 1."""


class FencedError(StockLedgerError):
    def __init__(self, partitions: Mapping[int, tuple[int, int | None]]) -> None:
        # partition -> (the epoch we hold, the epoch the database holds)
        self.partitions = partitions
        detail = ", ".join(f"partition {p}: ours {ours}, stored {stored}" for p, (ours, stored) in partitions.items())
        super().__init__(f"fenced: a newer claim owns these partitions ({detail}); batch rolled back")


class LedgerIntegrityError(StockLedgerError):
    pass


@dataclass(frozen=True, slots=True)
class Mismatch:
    expected: int       # the next offset this worker believes the ledger holds
    epoch: int | None   # the epoch stored now (None: no row, the database went back to before the claim)
    stored: int | None  # the next offset stored now (None: nothing stored)

    @property
    def direction(self) -> str:
        """`behind`: the database lost what was committed (a failover to a standby that lost commits, a restore);
        `ahead`: someone else moved the offset (an operator, a worker that should not have)."""
        return "ahead" if self.stored is not None and self.stored > self.expected else "behind"

    def describe(self) -> str:
        if self.direction == "ahead":
            return f"stored next_offset {self.stored} is ahead of the expected {self.expected}: moved by someone else"
        lost = f"{'' if self.stored is None else self.stored}..{self.expected - 1}"
        return (f"stored next_offset {self.stored} is behind the expected {self.expected}: the database lost the "
                f"commits of records {lost} (a failover or a restore); re-applied from Kafka")


class OffsetMismatchError(StockLedgerError):
    def __init__(self, partitions: dict[int, Mismatch]) -> None:
        self.partitions = partitions
        detail = "; ".join(f"partition {p}: {m.describe()}" for p, m in sorted(partitions.items()))
        super().__init__(f"stored offsets moved under this worker ({detail}); batch rolled back")


class CoordinateConflictError(LedgerIntegrityError):
    pass


class OperatorError(StockLedgerError):
    """A refused operator command: the message says why and what to do instead."""


class RegistryUnavailableError(StockLedgerError):
    """The schema registry is down, slow or failing (refused, timeout, 5xx): the records wait, none is quarantined;
    `worker.retry.transient_cause` calls it `schema_registry`."""


class SchemaPendingError(RegistryUnavailableError):
    """Schema ids the registry answered 404 for, within STOCK_LEDGER_SCHEMA_UNKNOWN_SECONDS of the first answer (a
    producer may have registered them a moment ago): retried like an outage, then quarantined naming the id."""

    def __init__(self, ids: list[int], message: str) -> None:
        self.ids = ids
        super().__init__(message)


class RetryDeadlineExceeded(StockLedgerError):
    pass
