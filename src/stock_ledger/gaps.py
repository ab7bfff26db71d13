"""Holes in the log: offsets the ledger can never apply because Kafka no longer has them.

A hole is a stored offset below the partition's log start (retention, deleted records) or above its log end (the
topic was recreated or truncated). Offsets that read_committed skips (transaction markers, aborted records) are not
holes: the consumer's position passes them without ever falling outside the log. A hole is never crossed silently:
the worker halts the partition (STOCK_LEDGER_ON_GAP=halt) or records the range in `ledger_gaps` in the transaction
that moves past it (`record`); `stock-ledger verify` fails while a recorded hole is unacknowledged, and
`stock-ledger gaps ack` acknowledges one after stock was reconciled by hand. The table's statements live in
ledger/offsets.py; this module says what a hole is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

BELOW_LOG_START: Final = "below_log_start"
BEYOND_LOG_END: Final = "beyond_log_end"


@dataclass(frozen=True, slots=True)
class Gap:
    partition: int
    first_offset: int  # the first offset that cannot be applied
    last_offset: int   # the last one
    reason: str

    @property
    def size(self) -> int:
        return self.last_offset - self.first_offset + 1

    @property
    def skippable(self) -> bool:
        """Only a hole below the log start can be moved past: past the log end the log was replaced, and its new
        records carry coordinates the ledger already holds."""
        return self.reason == BELOW_LOG_START

    def describe(self) -> str:
        if self.reason == BELOW_LOG_START:
            return (f"offsets {self.first_offset}-{self.last_offset} ({self.size} records) were deleted from the log "
                    "(retention or delete-records) before they were applied")
        return (f"the stored offset {self.last_offset + 1} lies {self.size} past the log end {self.first_offset}: "
                "the topic was recreated or truncated")

    def remedy(self) -> str:
        if self.reason == BELOW_LOG_START:
            return ("reconcile the stock those records moved, then restart with STOCK_LEDGER_ON_GAP=record (the hole "
                    "is recorded in ledger_gaps; acknowledge it with `stock-ledger gaps ack`) or move the offset "
                    "with `stock-ledger offsets set`")
        return ("a recreated topic needs a new ledger database (its offsets restart at 0, and the ledger already "
                "holds those coordinates); if the log was truncated on purpose, move the offset by hand")


def find_gap(partition: int, stored: int, log_start: int, log_end: int) -> Gap | None:
    """The hole between the stored offset and the log, if any."""
    if stored < log_start:
        return Gap(partition, stored, log_start - 1, BELOW_LOG_START)
    if stored > log_end:
        return Gap(partition, log_end, stored - 1, BEYOND_LOG_END)
    return None
